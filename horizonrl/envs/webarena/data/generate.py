"""The bundled shop's and forum's tasks (``local_tasks.json``, WebArena's task format) and a scripted plan per
task (``local_expert.json``), as ``horizonrl make-webarena-tasks`` writes them (``apps/env_data.py``).

A plan step is one action with its element named by role and accessible name, resolved to an id
on the live page by ``WebArenaEnv.expert_action``: ``{"click": [role, name]}``,
``{"type": [role, name], "text": ..., "enter": 1}``, ``{"goto": url}``, ``{"stop": answer}``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SHOP, FORUM = "__SHOPPING__", "__REDDIT__"
SHOP_STATE, FORUM_STATE = "./.auth/shopping_state.json", "./.auth/reddit_state.json"


def click(role: str, name: str) -> dict[str, Any]:
    return {"click": [role, name]}


def type_(role: str, name: str, text: str, enter: int = 1) -> dict[str, Any]:
    return {"type": [role, name], "text": text, "enter": enter}


def stop(answer: str = "") -> dict[str, Any]:
    return {"stop": answer}


def info(answers: dict[str, Any]) -> dict[str, Any]:
    return {"eval_types": ["string_match"], "reference_answers": answers, "reference_url": "", "program_html": []}


def nav(url: str) -> dict[str, Any]:
    return {"eval_types": ["url_match"], "reference_answers": None, "reference_url": url, "program_html": []}


def state(url: str, locator: str, must: list[str]) -> dict[str, Any]:
    return {"eval_types": ["program_html"], "reference_answers": None, "reference_url": "",
            "program_html": [{"url": url, "locator": locator, "required_contents": {"must_include": must}}]}


Task = tuple[str, str, dict[str, Any], list[dict[str, Any]], bool]  # (site, intent, eval, plan, logged in)


def tasks() -> list[Task]:
    """Every task, the shop's first."""
    return shop_tasks() + forum_tasks()


def shop_tasks() -> list[Task]:
    out: list[Task] = []
    shop_login = [click("link", "My Account")]
    prices = [("Kitchen", "Steel Kettle", "$34.99"), ("Electronics", "Wireless Headphones", "$89.99"),
              ("Books", "Learning SQL", "$39.99"), ("Garden", "Pruning Shears", "$27.99"),
              ("Toys", "Kite", "$22.99"), ("Kitchen", "Chef Knife", "$59.99")]
    for category, product, price in prices:
        out.append(("shopping", f"What is the price of the {product}?", info({"must_include": [price]}),
                    [click("link", category), click("link", product), stop(price)], False))
    for query, product, sku in [("speaker", "Bluetooth Speaker", "EL-202"), ("bread", "Bread at Home", "BK-303"),
                                ("gloves", "Garden Gloves", "GD-403")]:
        out.append(("shopping", f"What is the SKU of the {product}?", info({"exact_match": sku}),
                    [type_("textbox", "Search products", query), click("link", product), stop(sku)], False))
    out += [
        ("shopping", "How many reviews does the Wireless Headphones product have?", info({"exact_match": "3"}),
         [click("link", "Electronics"), click("link", "Wireless Headphones"), stop("3")], False),
        ("shopping", "Which product in the Garden category is the cheapest?", info({"must_include": ["Garden Gloves"]}),
         [click("link", "Garden"), click("link", "Sort by price"), stop("Garden Gloves")], False),
        ("shopping", "What was the total of my order #000104?", info({"must_include": ["$89.99"]}),
         shop_login + [click("link", "My Orders"), click("link", "Order #000104"), stop("$89.99")], True),
        ("shopping", "On which date did I place my most recent order?", info({"must_include": ["2024-05-30"]}),
         shop_login + [click("link", "My Orders"), stop("2024-05-30")], True),
        ("shopping", "How many of my orders were canceled?", info({"exact_match": "1"}),
         shop_login + [click("link", "My Orders"), stop("1")], True),
        ("shopping", "What is the status of my order #000106?", info({"exact_match": "Pending"}),
         shop_login + [click("link", "My Orders"), click("link", "Order #000106"), stop("Pending")], True),
        ("shopping", "Which products did I buy in order #000105?",
         info({"must_include": ["The Quiet Garden", "Bread at Home", "Wooden Puzzle"]}),
         shop_login + [click("link", "My Orders"), click("link", "Order #000105"),
                       stop("The Quiet Garden, Bread at Home, Wooden Puzzle")], True),
        ("shopping", "Show me the Toys category.", nav(f"{SHOP}/category/toys"), [click("link", "Toys"), stop()],
         False),
        ("shopping", "Search the shop for lamps.", nav(f"{SHOP}/search?q=lamp"),
         [type_("textbox", "Search products", "lamp"), stop()], False),
        ("shopping", "Open the product page of the Bluetooth Speaker.", nav(f"{SHOP}/product/EL-202"),
         [click("link", "Electronics"), click("link", "Bluetooth Speaker"), stop()], False),
        ("shopping", "Show me my orders.", nav(f"{SHOP}/account/orders"),
         shop_login + [click("link", "My Orders"), stop()], True),
        ("shopping", "List the Electronics products sorted by price.", nav(f"{SHOP}/category/electronics?sort=price"),
         [click("link", "Electronics"), click("link", "Sort by price"), stop()], False),
        ("shopping", "Add the Bluetooth Speaker to my cart.",
         state(f"{SHOP}/cart", "document.querySelector('#cart').outerText", ["Bluetooth Speaker"]),
         [click("link", "Electronics"), click("link", "Bluetooth Speaker"), click("button", "Add to Cart"), stop()],
         True),
        ("shopping", "Add the Kite to my wish list.",
         state(f"{SHOP}/wishlist", "document.querySelector('#wishlist').outerText", ["Kite"]),
         [click("link", "Toys"), click("link", "Kite"), click("button", "Add to Wish List"), stop()], True),
        ("shopping", "I moved: change the city of my address to Shelbyville.",
         state(f"{SHOP}/account", "document.querySelector('#address').outerText", ["Shelbyville"]),
         shop_login + [click("link", "Edit Address"), type_("textbox", "City", "Shelbyville", 0),
                       click("button", "Save Address"), stop()], True),
        ("shopping", "Write a review of the Chef Knife titled 'Very sharp' saying 'Cuts tomatoes thin.' with rating 5.",
         state(f"{SHOP}/product/KT-104", "", ["Very sharp", "Cuts tomatoes thin."]),
         [click("link", "Kitchen"), click("link", "Chef Knife"), type_("textbox", "Review title", "Very sharp", 0),
          type_("textbox", "Review text", "Cuts tomatoes thin.", 0), type_("textbox", "Rating from 1 to 5", "5", 0),
          click("button", "Submit Review"), stop()], True),
    ]
    return out


def forum_tasks() -> list[Task]:
    posts = {"What are you reading this month?": ("books", 1), "Tomatoes splitting after rain": ("gardening", 4),
             "Easy weeknight curry": ("cooking", 6), "Cast iron care tips": ("cooking", 7),
             "Route around the lake": ("cycling", 8), "Tubeless tyres worth it?": ("cycling", 9)}

    def to_post(title: str) -> list[dict[str, Any]]:
        return [click("link", "Forums"), click("link", f"f/{posts[title][0]}"), click("link", title)]

    return [
        ("reddit", "How many points does the post 'Easy weeknight curry' have?", info({"exact_match": "56"}),
         to_post("Easy weeknight curry") + [stop("56")], False),
        ("reddit", "Who submitted the post 'Tubeless tyres worth it?'?", info({"exact_match": "tom"}),
         to_post("Tubeless tyres worth it?") + [stop("tom")], False),
        ("reddit", "How many comments does the post 'What are you reading this month?' have?",
         info({"exact_match": "3"}), to_post("What are you reading this month?") + [stop("3")], False),
        ("reddit", "In which forum was 'Route around the lake' posted? Answer with the forum's name.",
         info({"must_include": ["cycling"]}), [click("link", "Forums"), click("link", "f/cycling"), stop("cycling")],
         False),
        ("reddit", "What is the title of the top post in f/gardening?",
         info({"must_include": ["First harvest of the year"]}),
         [click("link", "Forums"), click("link", "f/gardening"), stop("First harvest of the year")], False),
        ("reddit", "Which forums am I subscribed to?", info({"must_include": ["movies", "cooking"]}),
         [click("link", "max"), stop("f/cooking, f/movies")], True),
        ("reddit", "What did nora reply to the post 'Tomatoes splitting after rain'?",
         info({"must_include": ["Water more evenly"]}),
         to_post("Tomatoes splitting after rain") + [stop("Water more evenly.")], False),
        ("reddit", "How many comments has the user ivan written?", info({"exact_match": "3"}),
         to_post("Route around the lake") + [click("link", "ivan"), stop("3")], False),
        ("reddit", "Open the forum f/cycling.", nav(f"{FORUM}/f/cycling"),
         [click("link", "Forums"), click("link", "f/cycling"), stop()], False),
        ("reddit", "Show me the list of all forums.", nav(f"{FORUM}/forums"), [click("link", "Forums"), stop()], False),
        ("reddit", "Open the profile page of the user lucy.", nav(f"{FORUM}/user/lucy"),
         [click("link", "Forums"), click("link", "f/movies"), click("link", "lucy"), stop()], False),
        ("reddit", "Open the post 'Cast iron care tips'.", nav(f"{FORUM}/f/cooking/7"),
         to_post("Cast iron care tips") + [stop()], False),
        ("reddit", "Subscribe me to the forum f/books.",
         state(f"{FORUM}/user/max", "document.querySelector('#subscriptions').outerText", ["f/books"]),
         [click("link", "Forums"), click("link", "f/books"), click("button", "Subscribe"), stop()], True),
        ("reddit", "Upvote the post 'Route around the lake'.",
         state(f"{FORUM}/f/cycling/8", "document.querySelector('#score').outerText", ["20 points"]),
         to_post("Route around the lake") + [click("button", "Upvote"), stop()], True),
        ("reddit", "Reply 'Try a calcium spray.' to the post 'Tomatoes splitting after rain'.",
         state(f"{FORUM}/f/gardening/4", "document.querySelector('#comments').outerText", ["Try a calcium spray."]),
         to_post("Tomatoes splitting after rain")
         + [type_("textbox", "Comment", "Try a calcium spray."), stop()], True),
        ("reddit", "Post in f/movies a submission titled 'Favourite westerns' with the body 'Post yours.'",
         state("func:reddit_get_post_url('__last_url__')", "document.querySelector('#submission').outerText",
               ["Favourite westerns", "Post yours."]),
         [click("link", "Forums"), click("link", "f/movies"), click("link", "Submit a post"),
          type_("textbox", "Title", "Favourite westerns", 0), type_("textbox", "Body", "Post yours.", 0),
          click("button", "Create submission"), stop()], True),
        ("reddit", "Downvote the post 'Cinema club meeting'.",
         state(f"{FORUM}/f/movies/11", "document.querySelector('#score').outerText", ["4 points"]),
         [click("link", "Forums"), click("link", "f/movies"), click("link", "Cinema club meeting"),
          click("button", "Downvote"), stop()], True),
        ("reddit", "Go to the post 'Easy weeknight curry' and tell me who commented 'Add lime at the end.'",
         info({"exact_match": "tom"}), to_post("Easy weeknight curry") + [stop("tom")], False),
    ]


def build() -> tuple[list[dict[str, Any]], dict[str, list[dict[str, Any]]]]:
    task_list, plans = [], {}
    for task_id, (site, intent, evaluation, plan, login) in enumerate(tasks()):
        base = SHOP if site == "shopping" else FORUM
        task_list.append({
            "task_id": task_id, "sites": [site], "require_login": login,
            "storage_state": (SHOP_STATE if site == "shopping" else FORUM_STATE) if login else None,
            "start_url": base, "geolocation": None, "intent_template": intent, "instantiation_dict": {},
            "intent": intent, "require_reset": "program_html" in evaluation["eval_types"], "eval": evaluation,
            "intent_template_id": task_id})
        plans[str(task_id)] = plan
    return task_list, plans
