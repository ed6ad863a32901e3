"""tools/nbval_book_cache.py: a notebook that passes nbval lands in the book's execution cache as
nbclient would have executed it; one that fails does not land there."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import specnb_site  # noqa: E402

CELLS = [
    "import sys\nprint('to stdout'); print('to stderr', file=sys.stderr)",
    "from IPython.display import HTML, clear_output, display\n"
    "display(HTML('<b>gone</b>')); clear_output(wait=True); print('after clear')",
    "h = display(HTML('<i>first</i>'), display_id=True)\nh.update(HTML('<i>updated</i>'))\n40 + 2",
    "import ipywidgets as w\nw.IntSlider(value=3, min=0, max=9, description='k')",
    # an Output widget (chapter 5's): nbclient's mimic of it needs a kernel client to send its state to
    "out = w.Output()\nwith out:\n    print('inside the output widget')\nout",
]


def _book(tmp: Path, cells: list[str]) -> Path:
    (tmp / "notebooks").mkdir(parents=True)
    (tmp / "_config.yml").write_text("execute:\n  cache: _build/.jupyter_cache\n")
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    nb.cells = [nbformat.v4.new_markdown_cell("# t")] + [nbformat.v4.new_code_cell(c) for c in cells]
    path = tmp / "notebooks" / "t.ipynb"
    nbformat.write(nb, path)
    return path


def _nbval(book: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tools"), "SPECNB_QUICK": "1"}
    env.pop("SPECNB_NBVAL_BOOK_CACHE", None)
    return subprocess.run([sys.executable, "-m", "pytest", "notebooks", "--nbval-lax", "-p", "nbval_book_cache",
                           "-p", "no:cacheprovider", "-q", "--rootdir", str(book)],
                          cwd=book, env=env, capture_output=True, text=True, timeout=300)


def _cache(book: Path):
    from jupyter_cache import get_cache

    return get_cache(str(book / "_build" / ".jupyter_cache" / "quick"))


def _normalised(nb) -> list:
    """Code cells' outputs with random widget model ids and execution counts taken out."""
    out = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for o in cell.outputs:
            o = json.loads(json.dumps(o))
            o.pop("execution_count", None)
            o.get("data", {}).pop("application/vnd.jupyter.widget-view+json", None)
            out.append(o)
    return out


def _widgets(nb) -> list:
    state = nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {}).get("state", {})
    return sorted((s["model_name"], re.sub(r"IPY_MODEL_[0-9a-f]+", "IPY_MODEL_*", json.dumps(s["state"], sort_keys=True)))
                  for s in state.values())


def test_a_passing_notebook_is_cached_as_nbclient_executes_it(tmp_path):
    from nbclient import NotebookClient

    path = _book(tmp_path, CELLS)
    run = _nbval(path.parents[1])
    assert run.returncode == 0, run.stdout + run.stderr
    assert "notebooks/t: stored in" in run.stdout, run.stdout
    cache = _cache(path.parents[1])
    # myst-nb's lookup (what `execute_notebooks: cache` does with the notebook it reads) finds it
    assert specnb_site._cached(cache, path.parents[1], "notebooks/t")
    _, cached = cache.merge_match_into_notebook(nbformat.read(path, as_version=4))
    reference = nbformat.read(path, as_version=4)
    NotebookClient(reference, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    assert _normalised(cached) == _normalised(reference)
    assert [o.get("text") for o in _normalised(cached) if o["output_type"] == "stream"] == \
        ["to stdout\n", "to stderr\n", "after clear\n"]
    assert _widgets(cached) == _widgets(reference) and _widgets(cached), _widgets(cached)
    assert "inside the output widget" in json.dumps(_widgets(cached))
    assert cached.metadata["language_info"]["name"] == "python"
    # the fingerprint specnb_site checks before reusing an entry
    state = json.loads((path.parents[1] / "_build/.jupyter_cache/quick" / specnb_site.STATE).read_text())
    assert state["fingerprints"]["notebooks/t"] == specnb_site.fingerprints(path.parents[1], True)["notebooks/t"]
    # a code cell edited after the test run: the book's lookup misses, and the book executes it again
    nb = nbformat.read(path, as_version=4)
    nb.cells[1].source += "\nprint('edited')"
    nbformat.write(nb, path)
    assert not specnb_site._cached(cache, path.parents[1], "notebooks/t")


def test_a_failing_notebook_is_not_cached(tmp_path):
    """Negative control: one failing cell (the others pass) and nothing is stored."""
    path = _book(tmp_path, CELLS[:2] + ["assert 1 == 2, 'a claim that stopped holding'"] + CELLS[2:])
    run = _nbval(path.parents[1])
    assert run.returncode != 0 and "a claim that stopped holding" in run.stdout, run.stdout
    assert ": stored in" not in run.stdout and "t.ipynb: not stored (a cell failed" in run.stdout, run.stdout
    assert not specnb_site._cached(_cache(path.parents[1]), path.parents[1], "notebooks/t")
