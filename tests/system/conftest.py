"""System tests: a real systemd booted with systemd-nspawn (see nspawn.py). A failing test's
report gets the container's journal and the wcd units' state as an extra section."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "system: boots a real systemd in a container (root; skipped otherwise)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    outcome = yield
    report = outcome.get_result()
    box = getattr(item, "funcargs", {}).get("box")
    if report.failed and box is not None and call.when in ("call", "setup"):
        report.sections.append(("container journal and units", box.diagnostics()))
