"""Sphinx extension for the book's build: one execution cache per mode, invalidated by what a chapter depends on.

Jupyter Book's ``execute_notebooks: cache`` (jupyter-cache) re-executes a notebook only when its
code cells change. That alone is not enough here:

1. **Quick and full mode** (``SPECNB_QUICK``) produce different figures from the same code, so each
   mode gets its own cache under the configured ``execute.cache`` path (``.../quick``, ``.../full``).
   A full build never shows quick-mode results.
2. **The package and the requirements.** A change to ``specnb/``, ``requirements.txt`` or
   ``pyproject.toml`` changes what every chapter computes: every chapter's cache entry is dropped.
3. **A chapter's inputs.** Chapter 5 reads the sweep chapter 4 writes (``sweep.book_results_path``).
   Its fingerprint includes chapter 4's, so a change to chapter 4 re-executes both. When only
   chapter 5 must run, the results file must be the one chapter 4's cached page shows (same hash,
   recorded when chapter 4 last ran, and young enough for ``sweep.reuse_or_run`` to reuse it);
   otherwise chapter 4 re-executes first.

A clean build (no ``_build``) still executes everything: no stored outputs are shipped.

At the end of the build it prints a per-chapter timing table (executed now or taken from the cache,
with the execution time jupyter-cache recorded) and writes it to ``_build/timings.json``.

It also removes duplicate ``<script>`` tags from pages (sphinx-thebe 0.3 adds its inline
configuration twice under Sphinx 7.4, a ``const`` redeclared: a script error on every page).

Leaves out: dependencies other than the ones declared in ``DEPENDS`` below.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from sphinx.application import Sphinx
from sphinx.util import logging

logger = logging.getLogger(__name__)

def _sweep_results(quick: bool) -> Path:
    from specnb.sweep import book_results_path

    return book_results_path(quick)


# docname -> (upstream docname, function(quick) -> the file the upstream writes and the docname reads)
DEPENDS = {"notebooks/05_cost_model": ("notebooks/04_measured_sweep", _sweep_results)}
REUSE_MAX_AGE_H = 11.0          # sweep.reuse_or_run reuses results younger than 12 h; keep a margin
PACKAGE_INPUTS = ("specnb/**/*.py", "requirements.txt", "pyproject.toml")
STATE = "specnb-state.json"


def _quick() -> bool:
    from specnb.env import quick_mode

    return quick_mode()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _package_hash(root: Path) -> str:
    h = hashlib.sha256()
    for pattern in PACKAGE_INPUTS:
        for p in sorted(root.glob(pattern)):
            if "__pycache__" not in p.parts:
                h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def _code_hash(path: Path) -> str:
    """Hash of a notebook's code cells (what jupyter-cache keys on), not of its outputs or markdown."""
    nb = json.loads(path.read_text())
    return _sha(json.dumps([c["source"] for c in nb["cells"] if c["cell_type"] == "code"]).encode())


def fingerprints(root: Path, quick: bool) -> dict[str, str]:
    """docname -> fingerprint of everything its execution depends on besides its own code."""
    base = _sha(f"quick={quick}|{_package_hash(root)}".encode())
    fps = {p.relative_to(root).with_suffix("").as_posix(): base for p in sorted(root.glob("notebooks/*.ipynb"))}
    for doc, (up, _) in DEPENDS.items():
        if doc in fps and up in fps:
            fps[doc] = _sha(f"{fps[doc]}|{up}|{fps[up]}|{_code_hash(root / (up + '.ipynb'))}".encode())
    return fps


def _cache_path(app: Sphinx) -> Path:
    return Path(app.config.nb_execution_cache_path)


def _drop(cache, root: Path, doc: str) -> int:
    """Remove every cache record of ``doc``; returns how many."""
    path = (root / (doc + ".ipynb")).resolve()
    n = 0
    for rec in cache.list_cache_records():
        if Path(rec.uri).resolve() == path:
            cache.remove_cache(rec.pk)
            n += 1
    return n


def _cached(cache, root: Path, doc: str) -> bool:
    import nbformat

    try:
        cache.match_cache_notebook(nbformat.read(root / (doc + ".ipynb"), as_version=4))
        return True
    except KeyError:
        return False


def mode_cache_dir(base: Path, quick: bool) -> Path:
    """The execution cache of one mode under the configured ``execute.cache`` path."""
    return base / ("quick" if quick else "full")


def config_inited(app: Sphinx, config) -> None:
    app.specnb_quick = _quick()
    base = Path(config.nb_execution_cache_path or "_build/.jupyter_cache")
    if not base.is_absolute():
        base = Path(app.confdir) / base
    config.nb_execution_cache_path = str(mode_cache_dir(base, app.specnb_quick))


def builder_inited(app: Sphinx) -> None:
    """Drop the cache entries that no longer match what their chapter depends on."""
    app.specnb_start = time.time()
    app.specnb_forced = set()
    if app.config.nb_execution_mode != "cache":
        return
    from jupyter_cache import get_cache

    root = Path(app.confdir)
    cache_dir = _cache_path(app)
    cache_dir.mkdir(parents=True, exist_ok=True)
    cache = get_cache(str(cache_dir))
    state_file = cache_dir / STATE
    state = app.specnb_state = json.loads(state_file.read_text()) if state_file.exists() else {}
    fps = app.specnb_fps = fingerprints(root, app.specnb_quick)
    old = state.get("fingerprints", {})
    for doc, fp in fps.items():
        if old.get(doc) != fp and _drop(cache, root, doc):
            app.specnb_forced.add(doc)
            logger.info(f"[specnb] {doc}: package, requirements, mode or an upstream chapter changed: re-executing")
    for doc, (up, output) in DEPENDS.items():
        if doc not in fps or up not in fps or up in app.specnb_forced or _cached(cache, root, doc):
            continue
        # `doc` will execute and read `up`'s output: it must be the output `up`'s cached page shows.
        path, rec = output(app.specnb_quick), state.get("outputs", {}).get(up)
        why = None
        if not path.exists():
            why = f"{path} is missing"
        elif rec is None or rec.get("sha256") != _sha(path.read_bytes()):
            why = f"{path} is not the file {up} wrote when it last ran"
        elif time.time() - path.stat().st_mtime > REUSE_MAX_AGE_H * 3600:
            why = f"{path} is older than {REUSE_MAX_AGE_H:g} h"
        if why is not None:
            _drop(cache, root, up)
            app.specnb_forced.add(up)
            logger.info(f"[specnb] {up}: re-executing before {doc}, because {why}")


def env_get_outdated(app: Sphinx, env, added, changed, removed) -> list[str]:
    """Make Sphinx re-read the chapters whose cache entry was dropped or whose fingerprint changed."""
    seen = getattr(env, "specnb_fps", {})
    fps = getattr(app, "specnb_fps", {})
    redo = {d for d, fp in fps.items() if seen.get(d) != fp} | getattr(app, "specnb_forced", set())
    return sorted(d for d in redo if d in env.found_docs and d not in added and d not in changed)


def _save_state(app: Sphinx) -> None:
    (_cache_path(app) / STATE).write_text(json.dumps(app.specnb_state, indent=1))


def doctree_read(app: Sphinx, doctree) -> None:
    """A chapter was read (executed or taken from the cache): record the fingerprint it was made with.

    Saved at once, so that a build that fails later (say, a claim's assert in another chapter)
    keeps what it executed: the next build re-executes only what still needs it.
    """
    env = app.env
    if not hasattr(env, "specnb_fps"):
        env.specnb_fps = {}
    fp = getattr(app, "specnb_fps", {}).get(env.docname)
    if fp is not None:
        env.specnb_fps[env.docname] = fp
        if hasattr(app, "specnb_state"):
            app.specnb_state.setdefault("fingerprints", {})[env.docname] = fp
            _save_state(app)


def html_page_context(app: Sphinx, pagename, templatename, context, doctree) -> None:
    scripts = context.get("script_files")
    if not scripts:
        return
    seen, unique = set(), []
    for js in scripts:
        key = (getattr(js, "filename", str(js)) or "", tuple(sorted((getattr(js, "attributes", None) or {}).items())))
        if key not in seen:
            seen.add(key)
            unique.append(js)
    scripts[:] = unique


def timing_rows(app: Sphinx) -> list[dict]:
    from myst_nb.sphinx_ import NbMetadataCollector

    rows = []
    for doc in sorted(app.env.found_docs):
        data = NbMetadataCollector.get_exec_data(app.env, doc)
        if not data:
            continue
        now = data.get("mtime", 0) >= getattr(app, "specnb_start", 0)
        rows.append({"chapter": doc, "executed": "now" if now else "cache",
                     "seconds": data.get("runtime"), "succeeded": data.get("succeeded"),
                     "at": time.strftime("%Y-%m-%d %H:%M", time.localtime(data.get("mtime", 0)))})
    return rows


def build_finished(app: Sphinx, exc) -> None:
    if exc is not None or app.builder.format != "html":
        return
    rows = timing_rows(app)
    mode = "quick" if getattr(app, "specnb_quick", False) else "full"
    if app.config.nb_execution_mode == "cache" and hasattr(app, "specnb_fps"):
        state = app.specnb_state
        for doc, (up, output) in DEPENDS.items():
            row = next((r for r in rows if r["chapter"] == up), None)
            path = output(app.specnb_quick)
            if row is not None and row["executed"] == "now" and path.exists():
                state.setdefault("outputs", {})[up] = {"path": str(path), "sha256": _sha(path.read_bytes())}
        _save_state(app)
    total_now = sum(r["seconds"] or 0 for r in rows if r["executed"] == "now")
    lines = [f"Notebook execution ({mode} mode, cache {_cache_path(app)}):",
             f"  {'chapter':<40} {'executed':<20} {'seconds':>8}"]
    for r in rows:
        how = "now" if r["executed"] == "now" else f"cache ({r['at']})"
        sec = f"{r['seconds']:.1f}" if r["seconds"] is not None else "-"
        lines.append(f"  {r['chapter']:<40} {how:<20} {sec:>8}")
    lines.append(f"  {'executed in this build':<61} {total_now:>8.1f}")
    print("\n".join(lines), flush=True)
    out = Path(app.outdir).parent / "timings.json"
    out.write_text(json.dumps({"mode": mode, "machine_cores": os.cpu_count(), "rows": rows}, indent=1))


def setup(app: Sphinx) -> dict:
    app.connect("config-inited", config_inited, priority=400)
    app.connect("builder-inited", builder_inited, priority=600)     # after myst-nb reads the config
    app.connect("env-get-outdated", env_get_outdated)
    app.connect("doctree-read", doctree_read)
    app.connect("html-page-context", html_page_context, priority=900)
    app.connect("build-finished", build_finished)
    return {"version": "1", "parallel_read_safe": False, "parallel_write_safe": True}
