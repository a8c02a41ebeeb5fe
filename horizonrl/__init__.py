"""horizonrl: asynchronous actor-learner RL for long-horizon, multi-turn LLM agents."""

__version__ = "0.1.0"
