"""The local shop ("Corner Shop", WebArena's ``shopping`` role): catalogue, search, cart, wish
list, reviews, orders and an address book, on SQLite. User ``emma`` / ``shop123`` is logged in by
the storage state ``shopping_state.json``."""

from __future__ import annotations

import sqlite3
from urllib.parse import quote

from aiohttp import web

from horizonrl.envs.webarena.sites.common import (SandboxedDB, current_user, e, log_in, login_form, money, page,
                                                  password_hash, session_token)

SITE = "shopping"
COOKIE = "shop_session"

CATEGORIES = [("Kitchen", "kitchen"), ("Electronics", "electronics"), ("Books", "books"),
              ("Garden", "garden"), ("Toys", "toys")]
# (sku, name, category slug, price in cents, rating 1-5, description)
PRODUCTS = [
    ("KT-100", "Steel Kettle", "kitchen", 3499, 4, "A 1.7 litre stainless steel kettle."),
    ("KT-101", "Bamboo Cutting Board", "kitchen", 1899, 5, "A large bamboo board with a juice groove."),
    ("KT-102", "Cast Iron Skillet", "kitchen", 4250, 5, "A pre-seasoned 10 inch skillet."),
    ("KT-103", "Glass Storage Jars", "kitchen", 2199, 3, "Set of six airtight jars."),
    ("KT-104", "Chef Knife", "kitchen", 5999, 4, "An 8 inch forged chef knife."),
    ("EL-200", "Wireless Headphones", "electronics", 8999, 4, "Over-ear headphones with 30 hours of battery."),
    ("EL-201", "USB-C Charger", "electronics", 2499, 3, "A 65 W charger with two ports."),
    ("EL-202", "Bluetooth Speaker", "electronics", 4999, 5, "A waterproof portable speaker."),
    ("EL-203", "Desk Lamp", "electronics", 3299, 4, "An LED lamp with three colour temperatures."),
    ("EL-204", "Smart Plug", "electronics", 1599, 2, "A Wi-Fi plug with a timer."),
    ("BK-300", "The Quiet Garden", "books", 1499, 5, "A novel about a year in a walled garden."),
    ("BK-301", "Learning SQL", "books", 3999, 4, "An introduction to relational databases."),
    ("BK-302", "Mountain Trails", "books", 2499, 3, "Forty walks in the northern hills."),
    ("BK-303", "Bread at Home", "books", 2899, 5, "Sourdough and yeasted breads step by step."),
    ("GD-400", "Watering Can", "garden", 1999, 4, "A 5 litre galvanised watering can."),
    ("GD-401", "Pruning Shears", "garden", 2799, 5, "Bypass shears for branches up to 2 cm."),
    ("GD-402", "Seed Starter Kit", "garden", 1299, 3, "Trays, lids and 40 peat pots."),
    ("GD-403", "Garden Gloves", "garden", 999, 4, "Breathable gloves, size medium."),
    ("TY-500", "Wooden Puzzle", "toys", 1599, 4, "A 100 piece puzzle of a lighthouse."),
    ("TY-501", "Kite", "toys", 2299, 3, "A delta kite with 30 m of line."),
    ("TY-502", "Building Blocks", "toys", 3499, 5, "120 wooden blocks in a canvas bag."),
]
REVIEWS = [
    ("KT-100", "Sam", 4, "Boils fast", "Quick and quiet."),
    ("KT-100", "Lena", 3, "Lid is stiff", "Works well but the lid is stiff."),
    ("EL-200", "Omar", 5, "Great sound", "Comfortable for long flights."),
    ("EL-200", "Priya", 3, "Tight fit", "Good sound, a bit tight."),
    ("EL-200", "Jon", 4, "Solid", "Battery lasts all week."),
    ("BK-300", "Ruth", 5, "Lovely", "I read it in one sitting."),
    ("GD-401", "Marco", 5, "Sharp", "Cuts cleanly."),
    ("TY-502", "Ada", 5, "Hours of fun", "My kids love them."),
]
# (number, date, status, [(sku, qty)])
ORDERS = [
    ("000101", "2023-01-14", "Complete", [("KT-100", 1), ("BK-301", 1)]),
    ("000102", "2023-03-02", "Complete", [("EL-201", 2)]),
    ("000103", "2023-06-21", "Canceled", [("GD-400", 1), ("GD-403", 2)]),
    ("000104", "2023-09-09", "Complete", [("EL-200", 1)]),
    ("000105", "2024-02-17", "Complete", [("BK-300", 1), ("BK-303", 1), ("TY-500", 1)]),
    ("000106", "2024-05-30", "Pending", [("KT-102", 1), ("GD-401", 1)]),
]
USERS = [("emma", "shop123", "Emma Lopez", "emma.lopez@example.com", "12 Elm Street", "Springfield", "01101")]

SCHEMA = """
CREATE TABLE categories (id INTEGER PRIMARY KEY, name TEXT, slug TEXT UNIQUE);
CREATE TABLE products (id INTEGER PRIMARY KEY, sku TEXT UNIQUE, name TEXT, category_id INTEGER, price INTEGER,
                       rating INTEGER, description TEXT);
CREATE TABLE reviews (id INTEGER PRIMARY KEY, product_id INTEGER, author TEXT, rating INTEGER, title TEXT, body TEXT);
CREATE TABLE users (id INTEGER PRIMARY KEY, username TEXT UNIQUE, password_hash TEXT, full_name TEXT, email TEXT,
                    street TEXT, city TEXT, zip TEXT);
CREATE TABLE sessions (token TEXT PRIMARY KEY, user_id INTEGER);
CREATE TABLE orders (id INTEGER PRIMARY KEY, number TEXT UNIQUE, user_id INTEGER, date TEXT, status TEXT);
CREATE TABLE order_items (order_id INTEGER, product_id INTEGER, qty INTEGER, price INTEGER);
CREATE TABLE cart_items (user_id INTEGER, product_id INTEGER, qty INTEGER, PRIMARY KEY (user_id, product_id));
CREATE TABLE wishlist (user_id INTEGER, product_id INTEGER, PRIMARY KEY (user_id, product_id));
"""


def seed(db: sqlite3.Connection) -> None:
    db.executescript(SCHEMA)
    for name, slug in CATEGORIES:
        db.execute("INSERT INTO categories (name, slug) VALUES (?, ?)", (name, slug))
    for sku, name, cat, price, rating, desc in PRODUCTS:
        db.execute("INSERT INTO products (sku, name, category_id, price, rating, description) "
                   "VALUES (?, ?, (SELECT id FROM categories WHERE slug = ?), ?, ?, ?)",
                   (sku, name, cat, price, rating, desc))
    for sku, author, rating, title, body in REVIEWS:
        db.execute("INSERT INTO reviews (product_id, author, rating, title, body) "
                   "VALUES ((SELECT id FROM products WHERE sku = ?), ?, ?, ?, ?)", (sku, author, rating, title, body))
    for username, password, full_name, email, street, city, zip_code in USERS:
        db.execute("INSERT INTO users (username, password_hash, full_name, email, street, city, zip) "
                   "VALUES (?, ?, ?, ?, ?, ?, ?)",
                   (username, password_hash(username, password), full_name, email, street, city, zip_code))
        db.execute("INSERT INTO sessions (token, user_id) VALUES (?, (SELECT id FROM users WHERE username = ?))",
                   (session_token(SITE, username), username))
    for number, date, status, items in ORDERS:
        cur = db.execute("INSERT INTO orders (number, user_id, date, status) VALUES (?, 1, ?, ?)",
                         (number, date, status))
        for sku, qty in items:
            db.execute("INSERT INTO order_items (order_id, product_id, qty, price) "
                       "SELECT ?, id, ?, price FROM products WHERE sku = ?", (cur.lastrowid, qty, sku))


class ShopApp:
    def __init__(self, db_path: str) -> None:
        self.db = SandboxedDB(seed, db_path)

    def app(self) -> web.Application:
        app = web.Application()
        r = app.router
        r.add_get("/", self.home)
        r.add_get("/category/{slug}", self.category)
        r.add_get("/product/{sku}", self.product)
        r.add_post("/product/{sku}/cart", self.add_to_cart)
        r.add_post("/product/{sku}/wishlist", self.add_to_wishlist)
        r.add_post("/product/{sku}/review", self.add_review)
        r.add_get("/search", self.search)
        r.add_get("/cart", self.cart)
        r.add_post("/cart/remove/{sku}", self.remove_from_cart)
        r.add_get("/wishlist", self.wishlist)
        r.add_get("/account", self.account)
        r.add_get("/account/orders", self.orders)
        r.add_get("/account/orders/{number}", self.order)
        r.add_get("/account/address", self.address_form)
        r.add_post("/account/address", self.save_address)
        r.add_get("/login", self.login_page)
        r.add_post("/login", self.login)
        r.add_get("/logout", self.logout)
        return app

    # ------------------------------------------------------------ helpers
    def _ctx(self, request: web.Request) -> tuple[sqlite3.Connection, sqlite3.Row | None]:
        db = self.db.conn(request)
        return db, current_user(db, request, COOKIE)

    def _page(self, db: sqlite3.Connection, user: sqlite3.Row | None, title: str, body: str) -> web.Response:
        cats = db.execute("SELECT name, slug FROM categories ORDER BY id").fetchall()
        links = "".join(f"<a href='/category/{c['slug']}'>{e(c['name'])}</a>" for c in cats)
        if user is not None:
            count = db.execute("SELECT COALESCE(SUM(qty), 0) FROM cart_items WHERE user_id = ?",
                               (user["id"],)).fetchone()[0]
            who = f"<a href='/account'>My Account</a><a href='/cart'>My Cart ({count})</a>"
        else:
            who = "<a href='/login'>Sign In</a>"
        search = ("<form method='get' action='/search' role='search'><input name='q' type='text' "
                  "aria-label='Search products'><button type='submit'>Search</button></form>")
        nav = f"<a href='/'>Corner Shop</a>{links}{who}{search}"
        return page(f"{title} - Corner Shop", body, nav)

    def _require_user(self, request: web.Request) -> tuple[sqlite3.Connection, sqlite3.Row]:
        db, user = self._ctx(request)
        if user is None:
            raise web.HTTPFound("/login?next=" + quote(request.path_qs))
        return db, user

    def _product(self, db: sqlite3.Connection, sku: str) -> sqlite3.Row:
        row = db.execute("SELECT * FROM products WHERE sku = ?", (sku,)).fetchone()
        if row is None:
            raise web.HTTPNotFound(text="no such product")
        return row

    @staticmethod
    def _product_rows(products: list[sqlite3.Row]) -> str:
        if not products:
            return "<p>No products found.</p>"
        rows = "".join(f"<tr><td><a href='/product/{p['sku']}'>{e(p['name'])}</a></td><td>{money(p['price'])}</td>"
                       f"<td>Rating: {p['rating']} of 5</td></tr>" for p in products)
        return f"<table><tr><th>Product</th><th>Price</th><th>Rating</th></tr>{rows}</table>"

    # ------------------------------------------------------------- pages
    async def home(self, request: web.Request) -> web.Response:
        db, user = self._ctx(request)
        top = db.execute("SELECT * FROM products WHERE rating = 5 ORDER BY sku LIMIT 4").fetchall()
        return self._page(db, user, "Home", "<h1>Welcome to Corner Shop</h1><h2>Top rated</h2>"
                          + self._product_rows(top))

    async def category(self, request: web.Request) -> web.Response:
        db, user = self._ctx(request)
        cat = db.execute("SELECT * FROM categories WHERE slug = ?", (request.match_info["slug"],)).fetchone()
        if cat is None:
            raise web.HTTPNotFound(text="no such category")
        order = "price" if request.query.get("sort") == "price" else "name"
        products = db.execute(f"SELECT * FROM products WHERE category_id = ? ORDER BY {order}",
                              (cat["id"],)).fetchall()
        sort = f"<a href='/category/{cat['slug']}?sort=price'>Sort by price</a>"
        return self._page(db, user, cat["name"], f"<h1>{e(cat['name'])}</h1>{sort}" + self._product_rows(products))

    async def product(self, request: web.Request) -> web.Response:
        db, user = self._ctx(request)
        p = self._product(db, request.match_info["sku"])
        reviews = db.execute("SELECT * FROM reviews WHERE product_id = ? ORDER BY id", (p["id"],)).fetchall()
        review_html = "".join(f"<article><h3>{e(r['title'])}</h3><p>By {e(r['author'])}, {r['rating']} of 5</p>"
                              f"<p>{e(r['body'])}</p></article>" for r in reviews) or "<p>No reviews yet.</p>"
        actions = ""
        if user is not None:
            actions = (f"<form method='post' action='/product/{p['sku']}/cart'><button type='submit'>Add to Cart"
                       f"</button></form><form method='post' action='/product/{p['sku']}/wishlist'>"
                       "<button type='submit'>Add to Wish List</button></form>")
            review_html += (f"<h2>Write a review</h2><form method='post' action='/product/{p['sku']}/review'>"
                            "<input name='title' type='text' aria-label='Review title'> "
                            "<input name='body' type='text' aria-label='Review text'> "
                            "<input name='rating' type='text' aria-label='Rating from 1 to 5'> "
                            "<button type='submit'>Submit Review</button></form>")
        body = (f"<h1>{e(p['name'])}</h1><p>SKU: {p['sku']}</p><p>Price: {money(p['price'])}</p>"
                f"<p>Rating: {p['rating']} of 5</p><p>{e(p['description'])}</p>{actions}"
                f"<section aria-label='Reviews'><h2>Reviews ({len(reviews)})</h2>{review_html}</section>")
        return self._page(db, user, p["name"], body)

    async def search(self, request: web.Request) -> web.Response:
        db, user = self._ctx(request)
        q = request.query.get("q", "").strip()
        products = db.execute("SELECT * FROM products WHERE name LIKE ? OR description LIKE ? ORDER BY name",
                              (f"%{q}%", f"%{q}%")).fetchall() if q else []
        return self._page(db, user, f"Search results for {q}",
                          f"<h1>Search results for '{e(q)}'</h1><p>{len(products)} items</p>"
                          + self._product_rows(products))

    async def add_to_cart(self, request: web.Request) -> web.Response:
        db, user = self._require_user(request)
        p = self._product(db, request.match_info["sku"])
        db.execute("INSERT INTO cart_items (user_id, product_id, qty) VALUES (?, ?, 1) "
                   "ON CONFLICT (user_id, product_id) DO UPDATE SET qty = qty + 1", (user["id"], p["id"]))
        db.commit()
        raise web.HTTPFound("/cart")

    async def add_to_wishlist(self, request: web.Request) -> web.Response:
        db, user = self._require_user(request)
        p = self._product(db, request.match_info["sku"])
        db.execute("INSERT OR IGNORE INTO wishlist (user_id, product_id) VALUES (?, ?)", (user["id"], p["id"]))
        db.commit()
        raise web.HTTPFound("/wishlist")

    async def add_review(self, request: web.Request) -> web.Response:
        db, user = self._require_user(request)
        p = self._product(db, request.match_info["sku"])
        form = await request.post()
        try:
            rating = min(5, max(1, int(str(form.get("rating", "")).strip())))
        except ValueError:
            rating = 5
        db.execute("INSERT INTO reviews (product_id, author, rating, title, body) VALUES (?, ?, ?, ?, ?)",
                   (p["id"], user["full_name"].split()[0], rating, str(form.get("title", "")).strip(),
                    str(form.get("body", "")).strip()))
        db.commit()
        raise web.HTTPFound(f"/product/{p['sku']}")

    async def cart(self, request: web.Request) -> web.Response:
        db, user = self._require_user(request)
        items = db.execute("SELECT products.*, cart_items.qty FROM cart_items JOIN products ON products.id = "
                           "product_id WHERE user_id = ? ORDER BY products.name", (user["id"],)).fetchall()
        rows = "".join(f"<tr><td><a href='/product/{i['sku']}'>{e(i['name'])}</a></td><td>Qty: {i['qty']}</td>"
                       f"<td>{money(i['price'] * i['qty'])}</td><td><form method='post' "
                       f"action='/cart/remove/{i['sku']}'><button type='submit'>Remove {e(i['name'])}</button>"
                       "</form></td></tr>" for i in items)
        total = sum(i["price"] * i["qty"] for i in items)
        body = (f"<h1>Shopping Cart</h1><table id='cart'>{rows}</table><p>Cart total: {money(total)}</p>"
                if items else "<h1>Shopping Cart</h1><p>Your cart is empty.</p>")
        return self._page(db, user, "Shopping Cart", body)

    async def remove_from_cart(self, request: web.Request) -> web.Response:
        db, user = self._require_user(request)
        p = self._product(db, request.match_info["sku"])
        db.execute("DELETE FROM cart_items WHERE user_id = ? AND product_id = ?", (user["id"], p["id"]))
        db.commit()
        raise web.HTTPFound("/cart")

    async def wishlist(self, request: web.Request) -> web.Response:
        db, user = self._require_user(request)
        items = db.execute("SELECT products.* FROM wishlist JOIN products ON products.id = product_id "
                           "WHERE user_id = ? ORDER BY name", (user["id"],)).fetchall()
        listing = "".join(f"<li><a href='/product/{p['sku']}'>{e(p['name'])}</a></li>" for p in items)
        return self._page(db, user, "My Wish List", f"<h1>My Wish List</h1><ul id='wishlist'>{listing}</ul>"
                          if items else "<h1>My Wish List</h1><p>Your wish list is empty.</p>")

    async def account(self, request: web.Request) -> web.Response:
        db, user = self._require_user(request)
        body = (f"<h1>My Account</h1><p>Name: {e(user['full_name'])}</p><p>Email: {e(user['email'])}</p>"
                f"<p id='address'>Address: {e(user['street'])}, {e(user['city'])} {e(user['zip'])}</p>"
                "<ul><li><a href='/account/orders'>My Orders</a></li><li><a href='/account/address'>Edit Address"
                "</a></li><li><a href='/wishlist'>My Wish List</a></li><li><a href='/logout'>Sign Out</a></li></ul>")
        return self._page(db, user, "My Account", body)

    def _order_total(self, db: sqlite3.Connection, order_id: int) -> int:
        return db.execute("SELECT COALESCE(SUM(qty * price), 0) FROM order_items WHERE order_id = ?",
                          (order_id,)).fetchone()[0]

    async def orders(self, request: web.Request) -> web.Response:
        db, user = self._require_user(request)
        orders = db.execute("SELECT * FROM orders WHERE user_id = ? ORDER BY date DESC", (user["id"],)).fetchall()
        rows = "".join(f"<tr><td><a href='/account/orders/{o['number']}'>Order #{o['number']}</a></td>"
                       f"<td>{o['date']}</td><td>{o['status']}</td><td>{money(self._order_total(db, o['id']))}</td>"
                       "</tr>" for o in orders)
        body = ("<h1>My Orders</h1><table><tr><th>Order</th><th>Date</th><th>Status</th><th>Total</th></tr>"
                f"{rows}</table>")
        return self._page(db, user, "My Orders", body)

    async def order(self, request: web.Request) -> web.Response:
        db, user = self._require_user(request)
        o = db.execute("SELECT * FROM orders WHERE number = ? AND user_id = ?",
                       (request.match_info["number"], user["id"])).fetchone()
        if o is None:
            raise web.HTTPNotFound(text="no such order")
        items = db.execute("SELECT products.name, order_items.qty, order_items.price FROM order_items JOIN products "
                           "ON products.id = product_id WHERE order_id = ? ORDER BY products.name",
                           (o["id"],)).fetchall()
        rows = "".join(f"<tr><td>{e(i['name'])}</td><td>Qty: {i['qty']}</td><td>{money(i['qty'] * i['price'])}</td>"
                       "</tr>" for i in items)
        body = (f"<h1>Order #{o['number']}</h1><p>Date: {o['date']}</p><p>Status: {o['status']}</p>"
                f"<table>{rows}</table><p>Order total: {money(self._order_total(db, o['id']))}</p>")
        return self._page(db, user, f"Order #{o['number']}", body)

    async def address_form(self, request: web.Request) -> web.Response:
        db, user = self._require_user(request)
        body = ("<h1>Edit Address</h1><form method='post' action='/account/address'>"
                f"<label>Street <input name='street' type='text' value='{e(user['street'])}'></label> "
                f"<label>City <input name='city' type='text' value='{e(user['city'])}'></label> "
                f"<label>Zip code <input name='zip' type='text' value='{e(user['zip'])}'></label> "
                "<button type='submit'>Save Address</button></form>")
        return self._page(db, user, "Edit Address", body)

    async def save_address(self, request: web.Request) -> web.Response:
        db, user = self._require_user(request)
        form = await request.post()
        db.execute("UPDATE users SET street = ?, city = ?, zip = ? WHERE id = ?",
                   (str(form.get("street", "")).strip(), str(form.get("city", "")).strip(),
                    str(form.get("zip", "")).strip(), user["id"]))
        db.commit()
        raise web.HTTPFound("/account")

    async def login_page(self, request: web.Request) -> web.Response:
        db, user = self._ctx(request)
        return self._page(db, user, "Sign In", login_form("/login"))

    async def login(self, request: web.Request) -> web.Response:
        db, _ = self._ctx(request)
        form = await request.post()
        token = log_in(db, SITE, str(form.get("username", "")), str(form.get("password", "")))
        if token is None:
            return self._page(db, None, "Sign In", login_form("/login", "The username or password is wrong."))
        response = web.HTTPFound(request.query.get("next", "/account") if request.query.get("next", "").startswith("/")
                                 else "/account")
        response.set_cookie(COOKIE, token, path="/")
        raise response

    async def logout(self, request: web.Request) -> web.Response:
        response = web.HTTPFound("/")
        response.del_cookie(COOKIE, path="/")
        raise response
