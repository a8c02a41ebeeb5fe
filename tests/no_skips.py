"""A pytest plugin: a skipped test is a failure unless ``--allow-skips`` is given.

A suite that skips what it cannot run (no Java, no browser, no vLLM) passes without having tested
it; here the missing dependency is reported as the failure it is. Deselection (``-m "not slow"``)
is not a skip and is unaffected. Loaded by tests/conftest.py.
"""

import pytest


def pytest_addoption(parser):
    parser.addoption("--allow-skips", action="store_true",
                     help="report skipped tests as skipped; by default a skip is a failure, so a missing "
                          "dependency can never make the suite pass without running its tests")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail") and not item.config.getoption("--allow-skips"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"this test was skipped ({reason}); a skip counts as a failure (--allow-skips to permit)"
