"""The local forum ("Town Square", WebArena's ``reddit`` role): forums, posts, comments, votes and
subscriptions, on SQLite. User ``max`` / ``forum123`` is logged in by ``reddit_state.json``."""

from __future__ import annotations

import sqlite3
from urllib.parse import quote

from aiohttp import web

from horizonrl.envs.webarena.sites.common import (SandboxedDB, current_user, e, log_in, login_form, page,
                                                  password_hash, session_token)

SITE = "reddit"
COOKIE = "forum_session"

USERS = ["max", "nora", "ivan", "lucy", "tom"]
PASSWORDS = {"max": "forum123"}
FORUMS = [("books", "Talk about the books you read."), ("gardening", "Grow things together."),
          ("cooking", "Recipes and kitchen questions."), ("cycling", "Bikes, routes and repairs."),
          ("movies", "Films old and new.")]
# (forum, author, title, body, score, [(author, comment)])
POSTS = [
    ("books", "nora", "What are you reading this month?", "Share your current book.", 42,
     [("ivan", "The Quiet Garden, slowly."), ("lucy", "A history of maps."), ("tom", "Nothing yet.")]),
    ("books", "ivan", "Best mystery novels of the decade", "Looking for recommendations.", 17,
     [("nora", "Anything by Tana French.")]),
    ("books", "lucy", "Library sale this weekend", "Half price on hardbacks.", 8, []),
    ("gardening", "tom", "Tomatoes splitting after rain", "How do I stop this?", 25,
     [("nora", "Water more evenly."), ("max", "Mulch helps a lot.")]),
    ("gardening", "nora", "First harvest of the year", "Radishes are ready!", 31, [("lucy", "Congratulations!")]),
    ("cooking", "lucy", "Easy weeknight curry", "Chickpeas, spinach and coconut milk.", 56,
     [("ivan", "Made it twice already."), ("tom", "Add lime at the end."), ("nora", "Great with rice."),
      ("max", "Saved!")]),
    ("cooking", "max", "Cast iron care tips", "How often do you re-season?", 12, [("lucy", "Rarely, just oil it.")]),
    ("cycling", "ivan", "Route around the lake", "About 40 km, mostly flat.", 19, [("tom", "Windy in spring.")]),
    ("cycling", "tom", "Tubeless tyres worth it?", "Thinking of switching.", 14,
     [("ivan", "Yes, fewer flats."), ("max", "Messy to set up.")]),
    ("movies", "max", "Underrated films from the 90s", "Post your picks.", 37,
     [("nora", "Gattaca."), ("lucy", "The Iron Giant.")]),
    ("movies", "lucy", "Cinema club meeting", "Thursday at 7 pm.", 5, []),
]
SUBSCRIPTIONS = [("max", "movies"), ("max", "cooking")]

SCHEMA = """
CREATE TABLE users (id INTEGER PRIMARY KEY, username TEXT UNIQUE, password_hash TEXT);
CREATE TABLE sessions (token TEXT PRIMARY KEY, user_id INTEGER);
CREATE TABLE forums (id INTEGER PRIMARY KEY, name TEXT UNIQUE, description TEXT);
CREATE TABLE posts (id INTEGER PRIMARY KEY, forum_id INTEGER, author_id INTEGER, title TEXT, body TEXT,
                    score INTEGER);
CREATE TABLE comments (id INTEGER PRIMARY KEY, post_id INTEGER, author_id INTEGER, body TEXT);
CREATE TABLE votes (user_id INTEGER, post_id INTEGER, value INTEGER, PRIMARY KEY (user_id, post_id));
CREATE TABLE subscriptions (user_id INTEGER, forum_id INTEGER, PRIMARY KEY (user_id, forum_id));
"""


def seed(db: sqlite3.Connection) -> None:
    db.executescript(SCHEMA)
    for name in USERS:
        db.execute("INSERT INTO users (username, password_hash) VALUES (?, ?)",
                   (name, password_hash(name, PASSWORDS.get(name, name + "-pw"))))
        db.execute("INSERT INTO sessions (token, user_id) VALUES (?, (SELECT id FROM users WHERE username = ?))",
                   (session_token(SITE, name), name))
    for name, description in FORUMS:
        db.execute("INSERT INTO forums (name, description) VALUES (?, ?)", (name, description))
    for forum, author, title, body, score, comments in POSTS:
        cur = db.execute("INSERT INTO posts (forum_id, author_id, title, body, score) VALUES ((SELECT id FROM forums "
                         "WHERE name = ?), (SELECT id FROM users WHERE username = ?), ?, ?, ?)",
                         (forum, author, title, body, score))
        for commenter, text in comments:
            db.execute("INSERT INTO comments (post_id, author_id, body) VALUES (?, (SELECT id FROM users "
                       "WHERE username = ?), ?)", (cur.lastrowid, commenter, text))
    for user, forum in SUBSCRIPTIONS:
        db.execute("INSERT INTO subscriptions SELECT users.id, forums.id FROM users, forums "
                   "WHERE username = ? AND name = ?", (user, forum))


class ForumApp:
    def __init__(self, db_path: str) -> None:
        self.db = SandboxedDB(seed, db_path)

    def app(self) -> web.Application:
        app = web.Application()
        r = app.router
        r.add_get("/", self.home)
        r.add_get("/forums", self.forums)
        r.add_get("/f/{forum}", self.forum)
        r.add_post("/f/{forum}/subscribe", self.subscribe)
        r.add_get("/f/{forum}/{post:\\d+}", self.post)
        r.add_post("/f/{forum}/{post:\\d+}/comment", self.comment)
        r.add_post("/f/{forum}/{post:\\d+}/vote", self.vote)
        r.add_get("/submit", self.submit_form)
        r.add_post("/submit", self.submit)
        r.add_get("/user/{name}", self.user)
        r.add_get("/login", self.login_page)
        r.add_post("/login", self.login)
        return app

    def _ctx(self, request: web.Request) -> tuple[sqlite3.Connection, sqlite3.Row | None]:
        db = self.db.conn(request)
        return db, current_user(db, request, COOKIE)

    def _require_user(self, request: web.Request) -> tuple[sqlite3.Connection, sqlite3.Row]:
        db, user = self._ctx(request)
        if user is None:
            raise web.HTTPFound("/login?next=" + quote(request.path_qs))
        return db, user

    def _page(self, user: sqlite3.Row | None, title: str, body: str) -> web.Response:
        who = (f"<a href='/user/{user['username']}'>{e(user['username'])}</a><a href='/submit'>Submit</a>"
               if user is not None else "<a href='/login'>Log in</a>")
        return page(f"{title} - Town Square", body, f"<a href='/'>Town Square</a><a href='/forums'>Forums</a>{who}")

    def _forum(self, db: sqlite3.Connection, name: str) -> sqlite3.Row:
        row = db.execute("SELECT * FROM forums WHERE name = ?", (name,)).fetchone()
        if row is None:
            raise web.HTTPNotFound(text="no such forum")
        return row

    def _post(self, db: sqlite3.Connection, request: web.Request) -> sqlite3.Row:
        row = db.execute("SELECT posts.*, forums.name AS forum, users.username AS author FROM posts JOIN forums ON "
                         "forums.id = forum_id JOIN users ON users.id = author_id "
                         "WHERE posts.id = ? AND forums.name = ?",
                         (int(request.match_info["post"]), request.match_info["forum"])).fetchone()
        if row is None:
            raise web.HTTPNotFound(text="no such post")
        return row

    @staticmethod
    def _listing(db: sqlite3.Connection, where: str, args: tuple) -> str:
        posts = db.execute("SELECT posts.*, forums.name AS forum, users.username AS author, (SELECT COUNT(*) FROM "
                           "comments WHERE post_id = posts.id) AS n_comments FROM posts JOIN forums ON forums.id = "
                           f"forum_id JOIN users ON users.id = author_id WHERE {where} ORDER BY score DESC, posts.id",
                           args).fetchall()
        if not posts:
            return "<p>No posts.</p>"
        return "".join(f"<article><h2><a href='/f/{p['forum']}/{p['id']}'>{e(p['title'])}</a></h2><p>Submitted by "
                       f"<a href='/user/{p['author']}'>{e(p['author'])}</a> in f/{p['forum']}, {p['score']} points, "
                       f"{p['n_comments']} comments</p></article>" for p in posts)

    async def home(self, request: web.Request) -> web.Response:
        db, user = self._ctx(request)
        return self._page(user, "Home", "<h1>Hot posts</h1>" + self._listing(db, "score >= 30", ()))

    async def forums(self, request: web.Request) -> web.Response:
        db, user = self._ctx(request)
        rows = db.execute("SELECT forums.*, (SELECT COUNT(*) FROM subscriptions WHERE forum_id = forums.id) AS subs "
                          "FROM forums ORDER BY name").fetchall()
        items = "".join(f"<li><a href='/f/{f['name']}'>f/{f['name']}</a> {e(f['description'])} {f['subs']} "
                        "subscribers</li>" for f in rows)
        return self._page(user, "Forums", f"<h1>All forums</h1><ul>{items}</ul>")

    async def forum(self, request: web.Request) -> web.Response:
        db, user = self._ctx(request)
        forum = self._forum(db, request.match_info["forum"])
        subscribed = user is not None and db.execute(
            "SELECT 1 FROM subscriptions WHERE user_id = ? AND forum_id = ?", (user["id"], forum["id"])).fetchone()
        button = ""
        if user is not None:
            label = "Unsubscribe" if subscribed else "Subscribe"
            button = (f"<form method='post' action='/f/{forum['name']}/subscribe'><button type='submit'>{label}"
                      f"</button></form><a href='/submit?forum={forum['name']}'>Submit a post</a>")
        body = (f"<h1>f/{forum['name']}</h1><p>{e(forum['description'])}</p>{button}"
                + self._listing(db, "forums.id = ?", (forum["id"],)))
        return self._page(user, f"f/{forum['name']}", body)

    async def subscribe(self, request: web.Request) -> web.Response:
        db, user = self._require_user(request)
        forum = self._forum(db, request.match_info["forum"])
        if db.execute("DELETE FROM subscriptions WHERE user_id = ? AND forum_id = ?",
                      (user["id"], forum["id"])).rowcount == 0:
            db.execute("INSERT INTO subscriptions VALUES (?, ?)", (user["id"], forum["id"]))
        db.commit()
        raise web.HTTPFound(f"/f/{forum['name']}")

    async def post(self, request: web.Request) -> web.Response:
        db, user = self._ctx(request)
        p = self._post(db, request)
        comments = db.execute("SELECT comments.*, users.username AS author FROM comments JOIN users ON users.id = "
                              "author_id WHERE post_id = ? ORDER BY comments.id", (p["id"],)).fetchall()
        items = "".join(f"<li><p>{e(c['author'])} wrote:</p><p>{e(c['body'])}</p></li>" for c in comments)
        controls = ""
        if user is not None:
            base = f"/f/{p['forum']}/{p['id']}"
            controls = (f"<form method='post' action='{base}/vote?value=1'><button type='submit'>Upvote</button>"
                        f"</form><form method='post' action='{base}/vote?value=-1'><button type='submit'>Downvote"
                        f"</button></form><form method='post' action='{base}/comment'><input name='body' type='text' "
                        "aria-label='Comment'> <button type='submit'>Post comment</button></form>")
        body = (f"<article id='submission'><h1>{e(p['title'])}</h1><p>Submitted by <a href='/user/{p['author']}'>"
                f"{e(p['author'])}</a> in <a href='/f/{p['forum']}'>f/{p['forum']}</a></p><p>{e(p['body'])}</p>"
                f"<p id='score'>{p['score']} points</p></article>{controls}"
                f"<section aria-label='Comments'><h2>{len(comments)} comments</h2><ul id='comments'>{items}</ul>"
                "</section>")
        return self._page(user, p["title"], body)

    async def comment(self, request: web.Request) -> web.Response:
        db, user = self._require_user(request)
        p = self._post(db, request)
        text = str((await request.post()).get("body", "")).strip()
        if text:
            db.execute("INSERT INTO comments (post_id, author_id, body) VALUES (?, ?, ?)", (p["id"], user["id"], text))
            db.commit()
        raise web.HTTPFound(f"/f/{p['forum']}/{p['id']}")

    async def vote(self, request: web.Request) -> web.Response:
        db, user = self._require_user(request)
        p = self._post(db, request)
        value = 1 if request.query.get("value") == "1" else -1
        old = db.execute("SELECT value FROM votes WHERE user_id = ? AND post_id = ?", (user["id"], p["id"])).fetchone()
        if old is None or old["value"] != value:
            db.execute("INSERT OR REPLACE INTO votes VALUES (?, ?, ?)", (user["id"], p["id"], value))
            change = value - (old["value"] if old else 0)
            db.execute("UPDATE posts SET score = score + ? WHERE id = ?", (change, p["id"]))
            db.commit()
        raise web.HTTPFound(f"/f/{p['forum']}/{p['id']}")

    async def submit_form(self, request: web.Request) -> web.Response:
        db, user = self._require_user(request)
        forum = request.query.get("forum", "")
        body = ("<h1>Create submission</h1><form method='post' action='/submit'>"
                f"<label>Forum <input name='forum' type='text' value='{e(forum)}'></label> "
                "<label>Title <input name='title' type='text'></label> "
                "<label>Body <input name='body' type='text'></label> "
                "<button type='submit'>Create submission</button></form>")
        return self._page(user, "Create submission", body)

    async def submit(self, request: web.Request) -> web.Response:
        db, user = self._require_user(request)
        form = await request.post()
        name, title = str(form.get("forum", "")).strip(), str(form.get("title", "")).strip()
        forum = db.execute("SELECT * FROM forums WHERE name = ?", (name,)).fetchone()
        if forum is None or not title:
            problem = f"There is no forum named '{name}'." if forum is None else "A title is required."
            return self._page(user, "Create submission", f"<h1>Create submission</h1><p role='alert'>{e(problem)}</p>"
                              f"<a href='/submit?forum={quote(name)}'>Try again</a>")
        cur = db.execute("INSERT INTO posts (forum_id, author_id, title, body, score) VALUES (?, ?, ?, ?, 1)",
                         (forum["id"], user["id"], title, str(form.get("body", "")).strip()))
        db.commit()
        raise web.HTTPFound(f"/f/{forum['name']}/{cur.lastrowid}")

    async def user(self, request: web.Request) -> web.Response:
        db, user = self._ctx(request)
        row = db.execute("SELECT * FROM users WHERE username = ?", (request.match_info["name"],)).fetchone()
        if row is None:
            raise web.HTTPNotFound(text="no such user")
        n_comments = db.execute("SELECT COUNT(*) FROM comments WHERE author_id = ?", (row["id"],)).fetchone()[0]
        subs = db.execute("SELECT name FROM forums JOIN subscriptions ON forum_id = forums.id WHERE user_id = ? "
                          "ORDER BY name", (row["id"],)).fetchall()
        sub_text = ", ".join(f"f/{s['name']}" for s in subs) or "none"
        body = (f"<h1>{e(row['username'])}</h1><p>{n_comments} comments</p><p id='subscriptions'>Subscribed to: "
                f"{sub_text}</p><h2>Posts</h2>" + self._listing(db, "users.id = ?", (row["id"],)))
        return self._page(user, row["username"], body)

    async def login_page(self, request: web.Request) -> web.Response:
        db, user = self._ctx(request)
        return self._page(user, "Log in", login_form("/login"))

    async def login(self, request: web.Request) -> web.Response:
        db, _ = self._ctx(request)
        form = await request.post()
        token = log_in(db, SITE, str(form.get("username", "")), str(form.get("password", "")))
        if token is None:
            return self._page(None, "Log in", login_form("/login", "The username or password is wrong."))
        nxt = request.query.get("next", "/")
        response = web.HTTPFound(nxt if nxt.startswith("/") else "/")
        response.set_cookie(COOKIE, token, path="/")
        raise response
