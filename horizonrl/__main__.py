import sys

from horizonrl.apps.cli import main

if __name__ == "__main__":  # vLLM spawns processes that re-import the main module
    sys.exit(main())
