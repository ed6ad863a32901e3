"""A pytest plugin: every notebook that passes nbval is stored in the book's execution cache, so that
``make book`` after ``make test`` (as CI runs them) does not execute the notebooks a second time.

``make test`` runs every notebook through nbval; ``make book`` then executed every notebook again
through jupyter-cache (myst-nb's ``execute_notebooks: cache``): on a 2-core AMD EPYC (Zen 3) that
second pass was about a quarter of CI. nbval already has every message the kernel sent. This plugin
keeps them (nbval reads them through ``IPyNbFile.get_kernel_message``; the plugin wraps that method,
nothing else), and when a notebook's last code cell has passed and none failed or was skipped, it
rebuilds the executed notebook *with nbclient's own message handling* (``NotebookClient.process_message``
on the same messages: outputs, ``clear_output``, display ids, widget state), exactly what
``jupyter-cache`` would have stored had it run the notebook, and stores it in the cache of the
mode it ran in (``<execute.cache>/quick`` or ``/full``, the paths ``tools/specnb_site.py`` uses)
together with the fingerprints ``specnb_site`` checks (package, requirements, mode, upstream
chapter). A notebook with any failed or skipped cell is not stored, so the book build executes it
and fails the same way. A changed package or notebook after the test run changes the fingerprint or
the code hash, and the book executes that chapter again.

``tests/test_nbval_book_cache.py`` checks the stored notebook against nbclient's execution of the
same notebook (outputs, widget state), that myst-nb's cache lookup finds it, and (negative control)
that a notebook with a failing cell is not stored.

Set ``SPECNB_NBVAL_BOOK_CACHE=0`` to turn it off, or to a directory to use that cache base instead
of ``_config.yml``'s ``execute.cache``.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

ENV = "SPECNB_NBVAL_BOOK_CACHE"


def _enabled() -> bool:
    return os.environ.get(ENV, "1") not in ("0", "")


def book_root(path: Path) -> Path:
    """The book a notebook belongs to: the nearest folder above it with a ``_config.yml``."""
    for parent in path.resolve().parents:
        if (parent / "_config.yml").exists():
            return parent
    raise FileNotFoundError(f"{path} is not inside a book (no _config.yml above it)")


def cache_base(root: Path) -> Path:
    """The book's execution cache base (``execute.cache`` in ``_config.yml``), or ``$SPECNB_NBVAL_BOOK_CACHE``."""
    override = os.environ.get(ENV, "")
    if override not in ("", "0", "1"):
        return Path(override)
    import yaml

    cfg = yaml.safe_load((root / "_config.yml").read_text()) or {}
    return root / (cfg.get("execute") or {}).get("cache", "_build/.jupyter_cache")


def _site():
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    try:
        import specnb_site
    finally:
        sys.path.pop(0)
    return specnb_site


class _Run:
    """One notebook's nbval run: the iopub messages of each code cell, and whether all passed."""

    def __init__(self, path: Path):
        self.path = path
        self.messages: list[dict] = []       # the iopub messages nbval read for the cell running now
        self.cells: dict[int, list[dict]] = {}
        self.ok = True
        self.seconds = 0.0


_RUNS: dict[str, _Run] = {}
_SAID: list[str] = []        # what was stored (or why not), printed in the terminal summary


def _run_of(item) -> _Run:
    key = str(item.parent.fspath)
    if key not in _RUNS:
        _RUNS[key] = _Run(Path(key))
    return _RUNS[key]


def _wrap_nbval() -> None:
    from nbval.plugin import IPyNbFile

    if getattr(IPyNbFile.get_kernel_message, "_specnb_tee", False):
        return
    original = IPyNbFile.get_kernel_message

    def get_kernel_message(self, timeout=None, stream="iopub"):
        msg = original(self, timeout=timeout, stream=stream)
        if stream == "iopub":
            run = _RUNS.get(str(self.fspath))
            if run is not None:
                run.messages.append(msg)
        return msg

    get_kernel_message._specnb_tee = True
    IPyNbFile.get_kernel_message = get_kernel_message


def _is_cell(item) -> bool:
    from nbval.plugin import IPyNbCell

    return isinstance(item, IPyNbCell)


def pytest_configure(config) -> None:
    if _enabled() and (getattr(config.option, "nbval_lax", False) or getattr(config.option, "nbval", False)):
        _wrap_nbval()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    if not (_enabled() and _is_cell(item)):
        yield
        return
    run = _run_of(item)
    run.messages.clear()
    t0 = time.perf_counter()
    outcome = yield
    run.seconds += time.perf_counter() - t0
    got = run.messages
    # nbval stops reading at the idle status whose parent is this cell's execute request.
    if outcome.excinfo is not None or not got or got[-1]["msg_type"] != "status":
        run.ok = False
        return
    msg_id = got[-1]["parent_header"].get("msg_id")
    run.cells[item.cell_num] = [m for m in got if m["parent_header"].get("msg_id") == msg_id]
    n_code = sum(1 for c in item.parent.nb.cells if c.cell_type == "code")
    if item.cell_num == n_code - 1 and run.ok and len(run.cells) == n_code:
        try:
            language_info = item.parent.kernel.kc.kernel_info(reply=True, timeout=30)["content"]["language_info"]
            store(run.path, run.cells, language_info, run.seconds)
        except Exception as exc:  # the cache is an optimisation: say why, never fail the test for it
            _SAID.append(f"{run.path.name}: not stored in the book's cache: {exc!r}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if _enabled() and _is_cell(item) and (report.failed or report.skipped):
        _run_of(item).ok = False


class _GoneKernel:
    """What nbclient's Output-widget mimic (``nbclient.output_widget.OutputWidget``) needs of a kernel
    client: a session to build the state updates it sends back to the kernel, and a shell channel.
    The kernel that ran the notebook has gone, so the updates are dropped; the mimic keeps the same
    state in the client's ``widget_state``, which is what the stored notebook's widget metadata holds."""

    def __init__(self):
        from types import SimpleNamespace

        from jupyter_client.session import Session

        self.session = Session()
        self.shell_channel = SimpleNamespace(send=lambda msg: None)


def executed_notebook(path: Path, cells: dict[int, list[dict]], language_info: dict):
    """The notebook at ``path`` with the outputs and widget state nbclient makes from these messages.

    cells: code-cell index (0-based, code cells only) -> that cell's iopub messages, in order.
    """
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionComplete

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, record_timing=False)   # as jupyter-cache runs it; no kernel: only its message handling is used
    client.reset_execution_trackers()
    client.kc = _GoneKernel()   # an Output widget's mimic sends its state to the kernel: drop it
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    for k, index in enumerate(code):
        cell = nb.cells[index]
        cell.outputs = []
        cell.execution_count = None
        client.clear_before_next_output = False
        for msg in cells[k]:
            try:
                client.process_message(msg, cell, index)
            except CellExecutionComplete:
                break
    client.set_widgets_metadata()
    nb.metadata["language_info"] = language_info
    return nb


def store(path: Path, cells: dict[int, list[dict]], language_info: dict, seconds: float) -> None:
    """Put the executed notebook into the book's cache for the current mode, with specnb_site's fingerprints."""
    from jupyter_cache import get_cache
    from jupyter_cache.base import CacheBundleIn

    site = _site()
    quick = site._quick()
    root = book_root(path)
    cache_dir = site.mode_cache_dir(cache_base(root), quick)
    cache_dir.mkdir(parents=True, exist_ok=True)
    nb = executed_notebook(path, cells, language_info)
    cache = get_cache(str(cache_dir))
    doc = path.resolve().relative_to(root).with_suffix("").as_posix()
    site._drop(cache, root, doc)
    cache.cache_notebook_bundle(CacheBundleIn(nb, str(path.resolve()), data={"execution_seconds": seconds}),
                                check_validity=False, overwrite=True)
    state_file = cache_dir / site.STATE
    state = json.loads(state_file.read_text()) if state_file.exists() else {}
    state.setdefault("fingerprints", {})[doc] = site.fingerprints(root, quick)[doc]
    for up, output in site.DEPENDS.values():
        out = output(quick)
        if up == doc and out.exists():
            state.setdefault("outputs", {})[up] = {"path": str(out), "sha256": site._sha(out.read_bytes())}
    state_file.write_text(json.dumps(state, indent=1))
    _SAID.append(f"{doc}: stored in {cache_dir} ({seconds:.0f} s of cells)")


def pytest_terminal_summary(terminalreporter) -> None:
    if not _RUNS:
        return
    terminalreporter.section("notebooks stored in the book's execution cache (tools/nbval_book_cache.py)")
    for line in _SAID:
        terminalreporter.write_line(line)
    for run in _RUNS.values():
        if not run.ok:
            terminalreporter.write_line(f"{run.path.name}: not stored (a cell failed or was skipped): the book executes it")
