"""``horizonrl import-agentgym-rl SCRIPT.sh``: an AgentGym-RL training script as a horizonrl config
(``convert.py``; docs/agentgym-rl.md)."""

from horizonrl.apps.import_agentgym_rl.convert import Conversion, convert, find_overrides, main
from horizonrl.apps.import_agentgym_rl.hydra_values import parse_hydra_value
from horizonrl.apps.import_agentgym_rl.shell import parse_script

__all__ = ["Conversion", "convert", "find_overrides", "main", "parse_hydra_value", "parse_script"]
