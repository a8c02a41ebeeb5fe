"""What the local shop and forum share: sandboxed SQLite databases, log-in sessions, page layout.

Every episode browses its own copy of a site's database (a *sandbox*): ``reset`` copies the seed
database into a fresh in-memory SQLite database with the backup API and the episode's browser
context carries a ``hz_sandbox`` cookie that names it, so concurrent episodes never see each
other's changes and every reset starts from the seed. Requests without the cookie use the
``default`` sandbox.
"""

from __future__ import annotations

import hashlib
import html
import sqlite3
import threading
from typing import Any, Callable

from aiohttp import web

SANDBOX_COOKIE = "hz_sandbox"
DEFAULT_SANDBOX = "default"


def password_hash(username: str, password: str) -> str:
    return hashlib.sha256(f"{username}:{password}".encode()).hexdigest()


def session_token(site: str, username: str) -> str:
    """The seeded log-in token of a user (what the storage-state files carry)."""
    return hashlib.sha256(f"horizonrl-local:{site}:{username}".encode()).hexdigest()[:32]


class SandboxedDB:
    """The seed database of one site and one in-memory copy per sandbox."""

    def __init__(self, seed: Callable[[sqlite3.Connection], None], path: str) -> None:
        self.path = path
        self._seed = sqlite3.connect(path, check_same_thread=False)
        seed(self._seed)
        self._seed.commit()
        self._lock = threading.Lock()
        self._sandboxes: dict[str, sqlite3.Connection] = {}
        self.create(DEFAULT_SANDBOX)

    def create(self, sandbox: str) -> None:
        conn = sqlite3.connect(":memory:", check_same_thread=False)
        with self._lock:
            self._seed.backup(conn)
            old = self._sandboxes.pop(sandbox, None)
            self._sandboxes[sandbox] = conn
        if old is not None:
            old.close()

    def drop(self, sandbox: str) -> None:
        if sandbox == DEFAULT_SANDBOX:
            return
        with self._lock:
            conn = self._sandboxes.pop(sandbox, None)
        if conn is not None:
            conn.close()

    def __len__(self) -> int:
        return len(self._sandboxes)

    def conn(self, request: web.Request) -> sqlite3.Connection:
        name = request.cookies.get(SANDBOX_COOKIE, DEFAULT_SANDBOX)
        with self._lock:
            conn = self._sandboxes.get(name)
        if conn is None:
            raise web.HTTPGone(text=f"sandbox {name!r} is closed")
        conn.row_factory = sqlite3.Row
        return conn

    def close(self) -> None:
        with self._lock:
            for conn in self._sandboxes.values():
                conn.close()
            self._sandboxes.clear()
            self._seed.close()


def current_user(db: sqlite3.Connection, request: web.Request, cookie: str) -> sqlite3.Row | None:
    token = request.cookies.get(cookie)
    if not token:
        return None
    return db.execute("SELECT users.* FROM sessions JOIN users ON users.id = sessions.user_id WHERE token = ?",
                      (token,)).fetchone()


def log_in(db: sqlite3.Connection, site: str, username: str, password: str) -> str | None:
    """A new session token for correct credentials, else None."""
    user = db.execute("SELECT * FROM users WHERE username = ?", (username,)).fetchone()
    if user is None or user["password_hash"] != password_hash(username, password):
        return None
    token = hashlib.sha256(f"{site}:{username}:{db.execute('SELECT COUNT(*) FROM sessions').fetchone()[0]}"
                           .encode()).hexdigest()[:32]
    db.execute("INSERT INTO sessions (token, user_id) VALUES (?, ?)", (token, user["id"]))
    db.commit()
    return token


def e(value: Any) -> str:
    return html.escape(str(value))


def page(title: str, body: str, nav: str = "") -> web.Response:
    return web.Response(
        text=f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>{e(title)}</title>"
             "<style>body{font-family:sans-serif;margin:12px} td,th{padding:2px 8px;text-align:left}"
             "nav a{margin-right:10px}</style></head>"
             f"<body><nav aria-label='Main'>{nav}</nav><main>{body}</main></body></html>",
        content_type="text/html")


def login_form(action: str, message: str = "") -> str:
    note = f"<p role='alert'>{e(message)}</p>" if message else ""
    return (f"<h1>Sign in</h1>{note}<form method='post' action='{action}'>"
            "<label>Username <input name='username' type='text'></label> "
            "<label>Password <input name='password' type='password'></label> "
            "<button type='submit'>Sign In</button></form>")


def money(cents: int) -> str:
    return f"${cents / 100:,.2f}"
