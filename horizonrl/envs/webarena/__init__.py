"""WebArena (the fifth AgentGym-RL scenario) in a real browser; see ``env.py``."""

from horizonrl.envs.webarena.env import WebArenaEnv

__all__ = ["WebArenaEnv"]
