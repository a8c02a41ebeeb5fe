"""Mutation testing of the data path: how many small changes of the code that guards against data loss the fast
unit tests notice, per module (issue 58; docs/faults.md).

mutmut 3 (``pip install -e ".[mutation]"``) makes one mutant per small change of each module in
``[tool.mutmut] source_paths`` (pyproject.toml: buffer/, protocol/validation.py and codec.py, the learner's
advantages, policy loss and batching, core/schedule.py and chat.py, actors/episode.py), runs the unit tests named
in ``pytest_add_cli_args_test_selection`` against each, and records whether they failed (killed), passed
(survived) or hung (timeout, counted as killed). This script runs it and prints the kill rate per module and
every survivor, so each one is either killed by a new test or explained as equivalent. It is not part of
``make test``: thousands of mutants take hours on two cores.

    python scripts/mutation_test.py [--max-children N] [--json OUT.json]

``mutmut browse`` / ``mutmut show NAME`` show a survivor's change. The mutants live in ``mutants/`` (git-ignored).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# "    horizonrl.buffer.wal.xǁWriteAheadLogǁreplay__mutmut_3: killed" -> module, status
RESULT = re.compile(r"^\s*(?P<name>(?P<module>[\w.]+?)\.x[_ǁ]\S*__mutmut_\d+): (?P<status>[\w ]+)$")
KILLED = ("killed", "timeout")  # a hang is a test that noticed (mutmut's own score counts it so)


def kill_rates(results: str) -> tuple[dict[str, Counter], dict[str, list[str]]]:
    """Statuses per module, and the names of the mutants that survived, from ``mutmut results --all true``."""
    by_module: dict[str, Counter] = defaultdict(Counter)
    survivors: dict[str, list[str]] = defaultdict(list)
    for line in results.splitlines():
        match = RESULT.match(line)
        if match is None:
            continue
        module, status = match["module"], match["status"].strip()
        by_module[module][status] += 1
        if status == "survived":
            survivors[module].append(match["name"])
    return by_module, survivors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-children", type=int, default=2, help="mutants tested at once (cores)")
    parser.add_argument("--json", type=Path, help="also write the rates and survivors here")
    args = parser.parse_args()
    run = subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", str(args.max_children)], cwd=REPO)
    if run.returncode not in (0, 1):  # 1: some mutants survived
        print(f"mutmut run exited with {run.returncode}", file=sys.stderr)
        return run.returncode
    results = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout
    by_module, survivors = kill_rates(results)
    summary = {}
    print(f"{'module':48} {'mutants':>8} {'killed':>8} {'rate':>7}")
    for module in sorted(by_module):
        counts = by_module[module]
        tested = sum(n for status, n in counts.items() if status not in ("skipped", "not checked"))
        killed = sum(counts[status] for status in KILLED)
        rate = killed / tested if tested else 0.0
        summary[module] = {"mutants": tested, "killed": killed, "rate": round(rate, 4), "statuses": dict(counts),
                           "survivors": survivors[module]}
        print(f"{module:48} {tested:8d} {killed:8d} {rate:7.1%}")
    for module, names in sorted(survivors.items()):
        print(f"\nsurvived in {module} ({len(names)}):")
        for name in names:
            print(f"  {name}")
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
