"""The programs: each wires parts together for one command (``apps/cli.py`` is ``horizonrl``). Programs may
import any part and the bottom layer; no part imports a program (tests/test_dependencies.py)."""
