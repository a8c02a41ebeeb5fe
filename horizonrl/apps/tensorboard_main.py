"""TensorBoard as a process of a run (``horizonrl train --tensorboard``): its own command line, behind the watch
every process the launcher starts keeps on it (``core/runtime.py stop_when_launcher_dies``), so it ends with
its launcher, however the launcher died."""

from __future__ import annotations

import sys


def main() -> None:
    from tensorboard.main import run_main

    from horizonrl.core.runtime import stop_when_launcher_dies

    stop_when_launcher_dies()
    sys.argv[0] = "tensorboard"
    run_main()


if __name__ == "__main__":
    main()
