"""The launcher: start every process of a run from one config, watch them, restart them, stop them.

It only starts, watches, restarts and stops: each role is a separate program
(``horizonrl coordinator|buffer|learner|actor --config run/config.yaml``) that can also be started by hand
for debugging. ``resolve.py`` fixes what a launch decides before anything starts (ports, resume, run id,
devices) into the config every process reads; ``supervisor.py`` is the policy of every backend (restarts
with back-off, the learner's gang restart, the order of a stop); ``local.py`` (subprocesses) and
``ray_cluster.py`` (Ray actors) are its backends; ``slurm.py`` writes the same run as a batch script;
``console.py`` is the terminal; ``launch.py`` runs it all for ``horizonrl train``.
"""

from horizonrl.launcher.launch import launch
from horizonrl.launcher.local import Launcher
from horizonrl.launcher.resolve import (check_writable, prepare_cluster_run, prepare_run, resolve_placement,
                                        resolve_ports, start_launch)
from horizonrl.launcher.supervisor import CoordinatorEvents, RestartPolicy, Supervisor

__all__ = ["CoordinatorEvents", "Launcher", "RestartPolicy", "Supervisor", "check_writable", "launch",
           "prepare_cluster_run", "prepare_run", "resolve_placement", "resolve_ports", "start_launch"]
