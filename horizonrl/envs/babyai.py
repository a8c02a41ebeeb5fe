"""BabyAI on minigrid's BabyAI levels, in AgentGym's text format.

Task ids follow AgentGym: id -> level ``LEVELS[id % 40]`` (AgentGym's levels 1..40) and seed
``id // 40``. With ``levels=[...]`` the ids range over those levels instead:
level ``levels[id % len(levels)]``, seed ``id // len(levels)``. The test split is every seed
divisible by 5 (``seed % 5 == 0``), the train split all other seeds, so the splits are disjoint
by construction for any id.

Observation (AgentGym's wording): ``Your goal: <mission>``, what is visible relative to the
agent (``There is a red ball 1 3 steps in front of you and 2 steps to your left.``), walls,
what it carries, then ``Available actions: ["turn left", ...]``. Actions: ``turn left``,
``turn right``, ``move forward``, ``go to <obj> <n>``, ``pickup <obj> <n>`` (``pick up`` is
accepted too), ``drop``, ``toggle``, ``go through <door> <n>``, ``toggle and go through <door>
<n>``, ``go to goal``, ``check available actions``. A high-level action runs a shortest path of
primitive minigrid steps inside the visible area.

Reward: minigrid's ``1 - 0.9 * steps / max_steps`` on the step that solves the mission (steps
are primitive minigrid steps), else 0; ``success`` is set when the mission is solved. The
episode also ends (unsuccessfully) when minigrid's ``max_steps`` primitive steps are used up.

Where this differs from AgentGym (fixes): the mission is shown verbatim (AgentGym rewrites
"then"/"after you" to "and", which loses the order the mission asks for); ``go through``
ends on the far side of the door; ``toggle`` is offered for any door or box in front;
"no objects" is reported when only walls are visible; ``BabyAI-GoToObjS6-v0`` (deprecated in
minigrid 3) is ``-v1``.

Settings for small models: ``observation="compact"`` gives a short observation
(``red ball 1: 3 forward, 2 left``) and ``high_level_actions=False`` leaves only the
primitive actions.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import threading
from collections import deque
from typing import Any

from horizonrl.envs.base import StepResult, extract_react_action, run_blocking

# AgentGym's 40 levels, in its order (its level k is LEVELS[k - 1]).
LEVELS: tuple[str, ...] = (
    "BabyAI-GoToRedBallGrey-v0", "BabyAI-GoToRedBall-v0", "BabyAI-GoToRedBallNoDists-v0",
    "BabyAI-GoToObjS6-v1", "BabyAI-GoToLocalS8N7-v0", "BabyAI-GoToObjMazeS7-v0",
    "BabyAI-GoToImpUnlock-v0", "BabyAI-GoToSeqS5R2-v0", "BabyAI-GoToRedBlueBall-v0",
    "BabyAI-GoToDoor-v0", "BabyAI-GoToObjDoor-v0", "BabyAI-Open-v0", "BabyAI-OpenRedDoor-v0",
    "BabyAI-OpenDoorLoc-v0", "BabyAI-OpenRedBlueDoorsDebug-v0", "BabyAI-OpenDoorsOrderN4Debug-v0",
    "BabyAI-Pickup-v0", "BabyAI-UnblockPickup-v0", "BabyAI-PickupLoc-v0",
    "BabyAI-PickupDistDebug-v0", "BabyAI-PickupAbove-v0", "BabyAI-PutNextLocalS6N4-v0",
    "BabyAI-PutNextS7N4Carrying-v0", "BabyAI-Unlock-v0", "BabyAI-UnlockLocalDist-v0",
    "BabyAI-KeyInBox-v0", "BabyAI-UnlockPickupDist-v0", "BabyAI-BlockedUnlockPickup-v0",
    "BabyAI-UnlockToUnlock-v0", "BabyAI-ActionObjDoor-v0", "BabyAI-FindObjS7-v0",
    "BabyAI-KeyCorridorS6R3-v0", "BabyAI-OneRoomS20-v0", "BabyAI-MoveTwoAcrossS8N9-v0",
    "BabyAI-SynthS5R2-v0", "BabyAI-SynthLoc-v0", "BabyAI-SynthSeq-v0",
    "BabyAI-MiniBossLevel-v0", "BabyAI-BossLevel-v0", "BabyAI-BossLevelNoUnlock-v0",
)

# minigrid's primitive actions
LEFT, RIGHT, FORWARD, PICKUP, DROP, TOGGLE, DONE = range(7)
# direction index -> (dx, dy), as minigrid's DIR_TO_VEC
DIR_VEC = ((1, 0), (0, 1), (-1, 0), (0, -1))
CHECK = "check available actions"
# Levels where minigrid's BabyAI bot is not a usable oracle: it cannot open boxes (KeyInBox),
# crashes when the episode starts with the agent carrying (PutNextS7N4Carrying), and minigrid's
# strict verifier fails "A after B" missions the moment B is done (OpenDoorsOrderN4Debug).
BOT_UNSUPPORTED_LEVELS = frozenset(
    {"BabyAI-KeyInBox-v0", "BabyAI-PutNextS7N4Carrying-v0", "BabyAI-OpenDoorsOrderN4Debug-v0"}
)
TEST_SEED_MODULUS = 5
_BLOCKING_TYPES = {"wall", "box", "ball", "key", "lava"}
# minigrid prints "Sampling rejected: ..." while generating levels; the swap of sys.stdout that
# silences it is process-wide, so one lock serialises it.
_QUIET_LOCK = threading.Lock()


class BabyAIEnv:
    """One BabyAI episode at a time (see the module docstring for the format)."""

    name = "babyai"

    def __init__(
        self,
        levels: list[str] | None = None,
        max_steps: int | None = None,
        num_seeds: int = 1000,
        high_level_actions: bool = True,
        observation: str = "agentgym",
    ) -> None:
        import gymnasium
        import minigrid  # noqa: F401  (registers the BabyAI levels)

        self.levels = tuple(levels) if levels else LEVELS
        for level in self.levels:
            if level not in gymnasium.registry:
                raise ValueError(f"unknown BabyAI level {level!r}")
        if max_steps is not None and max_steps < 1:
            raise ValueError("max_steps must be >= 1")
        if observation not in ("agentgym", "compact"):
            raise ValueError("observation must be 'agentgym' or 'compact'")
        if num_seeds < TEST_SEED_MODULUS:
            raise ValueError(f"num_seeds must be >= {TEST_SEED_MODULUS}")
        self.max_steps = max_steps
        self.num_seeds = num_seeds
        self.high_level_actions = high_level_actions
        self.observation_style = observation
        self._gym_envs: dict[str, Any] = {}
        self._env: Any = None
        self._actions: dict[str, list[int]] = {}
        self._errors: dict[str, str] = {}
        self._done = True
        self._success = False
        self._score = 0.0
        self._task_id = -1

    # ----------------------------------------------------------------- ids
    def level_and_seed(self, task_id: int) -> tuple[str, int]:
        n = len(self.levels)
        return self.levels[task_id % n], task_id // n

    def task_ids(self, split: str) -> list[int]:
        n = len(self.levels)
        ids = range(n * self.num_seeds)
        if split == "train":
            return [i for i in ids if (i // n) % TEST_SEED_MODULUS != 0]
        if split == "test":
            return [i for i in ids if (i // n) % TEST_SEED_MODULUS == 0]
        raise ValueError(f"unknown split {split!r}; use 'train' or 'test'")

    def task_category(self, task_id: int) -> str:
        return self.level_and_seed(task_id)[0]

    # ------------------------------------------------------------- episode
    async def reset(self, task_id: int) -> str:
        if not isinstance(task_id, int) or isinstance(task_id, bool) or not 0 <= task_id < 2**31:
            raise ValueError(f"babyai task id must be an integer in 0..2**31-1, got {task_id!r}")
        return await run_blocking(self._reset, task_id)

    async def step(self, action_text: str) -> StepResult:
        return await run_blocking(self._step, action_text)

    async def close(self) -> None:
        for env in self._gym_envs.values():
            env.close()
        self._gym_envs.clear()
        self._env = None
        self._done = True

    def random_action(self, rng: random.Random) -> str:
        choices = [a for a in self._actions if a != CHECK] or ["turn left"]
        return f"Action: {rng.choice(choices)}"

    def available_actions(self) -> list[str]:
        return list(self._actions)

    # ------------------------------------------------------------- blocking
    def _reset(self, task_id: int) -> str:
        import gymnasium

        level, seed = self.level_and_seed(task_id)
        if level not in self._gym_envs:
            kwargs = {"max_steps": self.max_steps} if self.max_steps else {}
            self._gym_envs[level] = gymnasium.make(level, disable_env_checker=True, **kwargs)
        self._env = self._gym_envs[level]
        with _QUIET_LOCK, contextlib.redirect_stdout(io.StringIO()):
            self._env.reset(seed=seed)
        self._task_id = task_id
        self._done = False
        self._success = False
        self._score = 0.0
        description = self._describe()
        mission = self._env.unwrapped.mission
        goal = f"Goal: {mission}" if self.observation_style == "compact" else f"Your goal: {mission}"
        return f"{goal}\n{description}\n{self._actions_text()}"

    def _step(self, action_text: str) -> StepResult:
        if self._done or self._env is None:
            return StepResult(
                "The episode is over; no more actions are accepted.", 0.0, True, self._success, self._score,
                {"invalid_action": True},
            )
        action = extract_react_action(action_text or "")
        if action is None:
            return self._invalid("Invalid format: reply with 'Action: <one of the available actions>'.")
        action = " ".join(action.lower().split()).replace("pick up", "pickup")
        if action.startswith("check"):
            text = "You can take the following actions: " + ", ".join(self._actions)
            return StepResult(f"{text}\n{self._actions_text()}", 0.0, False, info=self._info(True))
        if action not in self._actions:
            message = self._errors.get(action, "The action is not recognized. Please check valid actions.")
            return self._invalid(message)
        reward, terminated, truncated = 0.0, False, False
        unwrapped = self._env.unwrapped
        for primitive in self._actions[action]:
            before = tuple(unwrapped.agent_pos)
            _, r, terminated, truncated, _ = self._env.step(primitive)
            reward += float(r)
            if terminated or truncated:
                break
            if primitive == FORWARD and tuple(unwrapped.agent_pos) == before:
                break  # blocked: stop the rest of the plan
        description = self._describe()
        if terminated or truncated:
            self._done = True
            self._success = bool(terminated and reward > 0)
            self._score = reward if self._success else 0.0
            if self._success:
                ending = "The task is completed."
            else:
                ending = "The episode ran out of steps." if truncated else "The task failed."
            return StepResult(f"{description}\n{ending}", self._score, True, self._success, self._score,
                              self._info(True))
        return StepResult(f"{description}\n{self._actions_text()}", 0.0, False, info=self._info(True))

    def _invalid(self, message: str) -> StepResult:
        return StepResult(f"{message}\n{self._actions_text()}", 0.0, False, info=self._info(False))

    def _info(self, valid: bool) -> dict[str, Any]:
        return {"invalid_action": not valid, "steps": int(self._env.unwrapped.step_count)}

    def _actions_text(self) -> str:
        if self.observation_style == "compact":
            return "Actions: " + ", ".join(a for a in self._actions if a != CHECK)
        return "Available actions: " + json.dumps(list(self._actions))

    # ------------------------------------------------- perception and plans
    def _visible(self) -> tuple[list[dict[str, Any]], set[tuple[int, int]]]:
        """Visible objects (nearest first) and the visible cells the agent may walk on."""
        u = self._env.unwrapped
        grid, vis_mask = u.gen_obs_grid()
        view = u.agent_view_size
        (px, py), (fx, fy), (rx, ry) = u.agent_pos, DIR_VEC[u.agent_dir], DIR_VEC[(u.agent_dir + 1) % 4]
        objects, free = [], set()
        for i in range(view):
            for j in range(view):
                if not vis_mask[i, j]:
                    continue
                fwd, right = view - 1 - j, i - view // 2
                x, y = px + fx * fwd + rx * right, py + fy * fwd + ry * right
                if not (0 <= x < u.width and 0 <= y < u.height):
                    continue
                if fwd == 0 and right == 0:
                    free.add((x, y))
                    continue
                cell = u.grid.get(x, y)
                if cell is None or (cell.can_overlap() and cell.type != "lava"):
                    free.add((x, y))
                if cell is None:
                    continue
                if cell.type == "door":
                    state = "locked" if cell.is_locked else ("open" if cell.is_open else "closed")
                    name = f"{cell.color} {state} door"
                else:
                    name = f"{cell.color} {cell.type}"
                objects.append({"name": name, "type": cell.type, "pos": (x, y), "fwd": fwd, "right": right,
                                "dist": abs(fwd) + abs(right)})
        objects.sort(key=lambda o: (o["dist"], o["fwd"], o["right"]))
        return objects, free

    def _path(self, target: tuple[int, int], free: set[tuple[int, int]], arrive: bool) -> list[int] | None:
        """Shortest primitive plan to face ``target`` (arrive=False) or stand on it (arrive=True)."""
        u = self._env.unwrapped
        start = (tuple(u.agent_pos), u.agent_dir)
        parents: dict[tuple, tuple | None] = {start: None}
        queue = deque([start])
        while queue:
            state = queue.popleft()
            (x, y), d = state
            dx, dy = DIR_VEC[d]
            if (arrive and (x, y) == target) or (not arrive and (x + dx, y + dy) == target):
                plan = []
                while parents[state] is not None:
                    state, primitive = parents[state]
                    plan.append(primitive)
                return plan[::-1]
            for primitive, nxt in ((FORWARD, ((x + dx, y + dy), d)), (LEFT, ((x, y), (d - 1) % 4)),
                                   (RIGHT, ((x, y), (d + 1) % 4))):
                if nxt in parents or (primitive == FORWARD and nxt[0] not in free):
                    continue
                parents[nxt] = (state, primitive)
                queue.append(nxt)
        return None

    def _describe(self) -> str:
        """Build the text description and the table of valid actions for the current state."""
        u = self._env.unwrapped
        objects, free = self._visible()
        carrying = u.carrying
        fx, fy = DIR_VEC[u.agent_dir]
        front = (u.agent_pos[0] + fx, u.agent_pos[1] + fy)
        front_cell = u.grid.get(*front)
        actions: dict[str, list[int]] = {"turn left": [LEFT], "turn right": [RIGHT]}
        errors: dict[str, str] = {}
        if front_cell is None or front_cell.can_overlap() or front_cell.type == "door":
            actions["move forward"] = [FORWARD]
        else:
            errors["move forward"] = "There is a barrier in front of you, you can't move forward."

        counts: dict[str, int] = {}
        for obj in objects:
            if obj["type"] != "wall":
                counts[obj["name"]] = counts.get(obj["name"], 0) + 1
                obj["label"] = f"{obj['name']} {counts[obj['name']]}"

        def add(action: str, plan: list[int] | None, why: str = "there is no path leading to it") -> None:
            if plan is None:
                errors[action] = f"You cannot {action}, as {why}."
            else:
                actions[action] = plan

        labelled = [o for o in objects if "label" in o]
        if self.high_level_actions:
            if carrying is None:
                for obj in labelled:
                    if obj["type"] in ("key", "ball", "box"):
                        plan = self._path(obj["pos"], free, arrive=False)
                        add(f"pickup {obj['label']}", None if plan is None else plan + [PICKUP])
        elif carrying is None and front_cell is not None and front_cell.can_pickup():
            label = next((o["label"] for o in labelled if o["pos"] == front), None)
            if label:
                actions[f"pickup {label}"] = [PICKUP]
        if carrying is not None:
            if front_cell is None:
                actions["drop"] = [DROP]
            else:
                errors["drop"] = "You cannot drop the object, as there is already an object in front of you."
        else:
            errors["drop"] = "You cannot drop the object, as you are not carrying anything."
        if front_cell is not None and front_cell.type in ("door", "box"):
            actions["toggle"] = [TOGGLE]
        if self.high_level_actions:
            for obj in labelled:
                if obj["type"] != "door":
                    continue
                if "open" in obj["name"]:
                    plan = self._path(obj["pos"], free, arrive=True)
                    add(f"go through {obj['label']}", None if plan is None else plan + [FORWARD])
                    continue
                action = f"toggle and go through {obj['label']}"
                if "locked" in obj["name"] and (carrying is None or carrying.type != "key"):
                    errors[action] = f"You cannot {action}, as you are not carrying a key."
                    continue
                if "locked" in obj["name"] and carrying.color != obj["name"].split()[0]:
                    errors[action] = (f"You cannot {action}, as the color of the key you are carrying does "
                                      "not match the color of door.")
                    continue
                plan = self._path(obj["pos"], free, arrive=False)
                add(action, None if plan is None else plan + [TOGGLE, FORWARD, FORWARD])
                errors.setdefault(f"go through {obj['label']}",
                                  f"You cannot go through {obj['label']}, as it is closed. You should toggle it first.")
            for obj in objects:
                if obj["type"] == "goal":
                    add("go to goal", self._path(obj["pos"], free, arrive=True))
                    break
            for obj in labelled:
                if obj["type"] != "goal":
                    add(f"go to {obj['label']}", self._path(obj["pos"], free, arrive=False))
            actions[CHECK] = []
        self._actions, self._errors = actions, errors
        if self.observation_style == "compact":
            return self._compact_text(labelled, carrying)
        return self._agentgym_text(objects, labelled, carrying)

    @staticmethod
    def _relative(obj: dict[str, Any]) -> tuple[int, int]:
        return obj["fwd"], obj["right"]

    def _agentgym_text(self, objects: list[dict], labelled: list[dict], carrying: Any) -> str:
        parts = []
        if labelled:
            parts.append("In front of you in this room, you can see several objects:")
            for obj in labelled:
                fwd, right = self._relative(obj)
                if right == 0:
                    where = f"right in front of you {fwd} steps away."
                elif right > 0:
                    where = f"{fwd} steps in front of you and {right} steps to your right."
                else:
                    where = f"{fwd} steps in front of you and {-right} steps to your left."
                parts.append(f"There is a {obj['label']} {where}")
        else:
            parts.append("You cannot see any objects within sight.")
        parts.append("The room has walls around you.")
        ahead = [o for o in objects if o["right"] == 0 and o["type"] in ("wall", "box")]
        if ahead:
            parts.append(f"You are facing a {ahead[0]['type']} {ahead[0]['fwd']} steps away.")
        if carrying is not None:
            parts.append(f"You are carrying a {carrying.color} {carrying.type}.")
        else:
            parts.append("You are not carrying anything.")
        return " ".join(parts)

    def _compact_text(self, labelled: list[dict], carrying: Any) -> str:
        lines = []
        for obj in labelled:
            fwd, right = self._relative(obj)
            side = f", {right} right" if right > 0 else (f", {-right} left" if right < 0 else "")
            lines.append(f"{obj['label']}: {fwd} forward{side}")
        if not lines:
            lines.append("nothing visible")
        if carrying is not None:
            lines.append(f"carrying: {carrying.color} {carrying.type}")
        return "\n".join(lines)

    # ------------------------------------------------------------- expert
    def expert_action(self, bot: Any | None = None) -> tuple[str, Any]:
        """The BabyAI bot's next move as a reply, and the bot (pass it back next time).

        The bot plans in primitive actions; they map onto this action set one to one
        (a pickup/drop/toggle in front of the agent is a one-primitive action here).
        """
        from minigrid.utils.baby_ai_bot import BabyAIBot

        if bot is None:
            bot = BabyAIBot(self._env)
        primitive = int(bot.replan())
        names = {LEFT: "turn left", RIGHT: "turn right", FORWARD: "move forward"}
        if primitive in names:
            return f"Action: {names[primitive]}", bot
        for action, plan in self._actions.items():
            if plan == [primitive]:
                return f"Action: {action}", bot
        return "Action: turn left", bot
