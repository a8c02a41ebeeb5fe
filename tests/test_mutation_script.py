"""scripts/mutation_test.py reads mutmut's results into a kill rate per module (the run itself is not a test:
hours on two cores)."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "mutation_test.py"


def test_results_are_counted_per_module_with_timeouts_as_killed_and_survivors_named():
    spec = importlib.util.spec_from_file_location("mutation_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = """
    horizonrl.buffer.wal.xǁWriteAheadLogǁreplay__mutmut_1: killed
    horizonrl.buffer.wal.xǁWriteAheadLogǁreplay__mutmut_2: survived
    horizonrl.buffer.wal.x__writev_all__mutmut_1: timeout
    horizonrl.protocol.validation.x_trajectory_problem__mutmut_7: killed
    not a result line
"""
    by_module, survivors = module.kill_rates(results)
    assert dict(by_module["horizonrl.buffer.wal"]) == {"killed": 1, "survived": 1, "timeout": 1}
    assert dict(by_module["horizonrl.protocol.validation"]) == {"killed": 1}
    assert survivors == {"horizonrl.buffer.wal": ["horizonrl.buffer.wal.xǁWriteAheadLogǁreplay__mutmut_2"]}
