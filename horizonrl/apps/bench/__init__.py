"""Throughput benchmarks: each part measures one boundary of the system.

Every part is a module with ``run(quick, out_dir, **options) -> dict`` returning a result
in the shape :mod:`horizonrl.apps.bench.report` prints, saves and charts, and a ``__main__``
that runs it alone (``python -m horizonrl.apps.bench.weight_sync --quick``). The machine is
shared and noisy, so every figure is a median over repeats with its min and max, and every
ratio compares baseline and candidate measured back to back within the same repeat.
"""
