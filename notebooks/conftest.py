"""nbval runs every notebook as a test. With ``SPECNB_KEEP_EXECUTED=<folder>`` set, each notebook whose
cells all passed is also written there *with the outputs of that very run*, so that CI can build the
book from the notebooks it has just executed and tested instead of executing all of them a second
time (``make book-executed``). Unset (the default, and ``make book``), nothing is written.
"""
import os
from pathlib import Path

import pytest

_failed: set = set()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not os.environ.get("SPECNB_KEEP_EXECUTED") or not hasattr(item, "test_outputs"):
        return
    if report.failed:
        _failed.add(item.parent)
    if call.when == "call" and item.test_outputs is not None:
        item.cell.outputs = list(item.test_outputs)
        item.cell.execution_count = getattr(item.cell, "execution_count", None) or 1


def pytest_sessionfinish(session):
    folder = os.environ.get("SPECNB_KEEP_EXECUTED")
    if not folder:
        return
    import nbformat

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    seen = set()
    for item in session.items:
        parent = getattr(item, "parent", None)
        if not hasattr(item, "test_outputs") or parent in seen:
            continue
        seen.add(parent)
        if parent in _failed:
            continue
        nb = parent.nb
        nb.metadata.setdefault("specnb", {})["executed_by"] = "nbval (make test)"
        nbformat.write(nb, str(out / Path(str(parent.fspath)).name))
