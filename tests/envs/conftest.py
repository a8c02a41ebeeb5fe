"""Fixtures: an environment server in its own process on a free 127.0.0.1 port."""

from __future__ import annotations

import pytest
from env_server_proc import ServerProcess


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess(["babyai", "textcraft", "searchqa", "signpost"])
    yield proc
    proc.stop()
