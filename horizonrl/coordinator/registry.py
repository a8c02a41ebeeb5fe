"""The run's registry of endpoints (protocol/registry.py): every process that serves something registers
where it bound; the newest registration of a name wins, and ``Control.endpoints`` carries them all."""

from __future__ import annotations

import logging

from horizonrl.protocol import Registration

log = logging.getLogger("horizonrl.coordinator")


class EndpointRegistry:
    def __init__(self) -> None:
        self.endpoints: dict[str, str] = {}
        self.pids: dict[str, int] = {}  # name -> the pid of its newest registration (its current incarnation)

    def register(self, registration: Registration) -> dict[str, str]:
        """Take a registration; returns what it changed (nothing: a heartbeat-like repeat)."""
        self.pids[registration.name] = registration.pid
        changed = {k: v for k, v in registration.endpoints.items() if self.endpoints.get(k) != v}
        if changed:
            self.endpoints.update(changed)
            log.info("%s (pid %d) registered %s", registration.name, registration.pid,
                     ", ".join(f"{k}={v}" for k, v in sorted(changed.items())))
        return changed
