"""The coordinator: owns the turn-budget schedule, the weight version, health and shutdown, and is the one
writer of TensorBoard scalars.

Inputs (PULL): ``LearnerReport`` after each learner step, ``Heartbeat`` from every process, ``ProcessEvent``
from the launcher (a process died, was restarted, or the launcher gave up on it), ``Registration`` from every
process that serves something, ``EpisodeSample`` and ``HeldOutEval`` from the actors. Output (PUB):
``Control`` — completed learner steps, the max-turn budget for episodes started now, the newest weight
version, the rollout pause, the stop flag, and every registered endpoint. It is the registry
(protocol/registry.py): its address is the one every process is given.

It restarts like every other process (docs/faults.md): it writes what nobody re-sends to the run directory
(core/coordinator_state.py) and a restarted one reads it back; the rest comes with the next heartbeats,
registrations and reports. ``process.py`` wires the jobs of the other modules together.
"""

from horizonrl.coordinator.held_out import HeldOutPlateau, held_out_scalars
from horizonrl.coordinator.process import Coordinator, main
from horizonrl.coordinator.writers import episode_markdown

__all__ = ["Coordinator", "HeldOutPlateau", "episode_markdown", "held_out_scalars", "main"]
