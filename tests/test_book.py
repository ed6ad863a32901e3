"""The book's apparatus, checked on the source files (no build needed, runs in well under a second).

Sources are cited, not a document the reader never sees; every "chapter N" in prose is a link; every figure
has a numbered caption; every chapter links the notation page and ends with exercises whose hint and solution
are folded away; every citation key is in the bibliography; every cross-reference has a target.
"""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "notebooks").glob("0[0-9]_*.ipynb"))
PAGES = sorted((ROOT / "book").glob("*.md"))
BINARY = {".png", ".jpg", ".gif", ".gguf", ".safetensors", ".pdf", ".ico"}
NEEDLE = re.compile(r"\bbri" + "ef", re.I)  # no page, docstring or test may cite a document the reader never sees


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        files = [ROOT / line for line in out.splitlines() if line]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: walk the tree
        skip = {".venv", "_build", ".git", "results"}
        files = [p for p in ROOT.rglob("*") if p.is_file() and not skip & set(p.relative_to(ROOT).parts)]
    return [p for p in files if p.suffix not in BINARY and p.is_file()]


def _param(path: Path):
    rel = str(path.relative_to(ROOT))
    return rel


@pytest.mark.parametrize("rel", [_param(p) for p in tracked_files()])
def test_no_file_cites_an_unseen_document(rel):
    text = (ROOT / rel).read_text(encoding="utf-8", errors="replace")
    hits = [f"{n}: {line.strip()[:100]}" for n, line in enumerate(text.splitlines(), 1) if NEEDLE.search(line)]
    assert not hits, f"{rel} cites a document the reader never has; cite the primary source instead:\n" + "\n".join(hits)


def markdown_cells(path: Path) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "markdown"]


def code_cells(path: Path) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def prose(path: Path) -> str:
    text = "\n\n".join(markdown_cells(path)) if path.suffix == ".ipynb" else path.read_text()
    text = re.sub(r"^```(?!\{)[^\n]*\n.*?^```", "", text, flags=re.S | re.M)  # code blocks (not directives)
    text = re.sub(r"\{[\w:-]+\}`[^`]*`", "", text)  # roles: {doc}`chapter 4 <...>` is a link
    return re.sub(r"`[^`\n]*`", "", text)  # inline code


def test_the_checks_see_a_plain_chapter_mention(tmp_path):
    """Negative control for the next test: a plain mention is found, a linked one is not."""
    page = tmp_path / "p.md"
    page.write_text("As chapter 4 shows, and {doc}`chapter 5 </notebooks/05_cost_model>` models.")
    assert re.findall(r"\b[Cc]hapters? \d", prose(page)) == ["chapter 4"]


@pytest.mark.parametrize("path", CHAPTERS + PAGES, ids=lambda p: p.name)
def test_chapter_mentions_are_links(path):
    plain = re.findall(r"[^\n]{0,40}\b[Cc]hapters? \d[^\n]{0,20}", prose(path))
    assert not plain, f"{path.name}: write {{doc}}`chapter N </notebooks/0N_...>`, not plain text: {plain}"


def _figures(path: Path):
    md = "\n".join(markdown_cells(path))
    glued = set(re.findall(r"""\bg(?:lue)?\(\s*["'](fig_\w+)["']""", "\n".join(code_cells(path))))
    blocks = re.findall(r"```\{glue:figure\}\s*(\S+)\n((?::\w+:.*\n)*)", md)
    return md, glued, blocks


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_every_figure_has_a_numbered_caption(path):
    md, glued, blocks = _figures(path)
    names = {key: re.search(r":name:\s*(\S+)", opts) for key, opts in blocks}
    assert not [c for c in code_cells(path) if "plt.show()" in c], "a figure drawn without a caption: glue it"
    assert glued == set(names), f"glued figures {sorted(glued)} vs captioned {sorted(names)}"
    for key, name in names.items():
        assert name and name.group(1).startswith("fig-"), f"{key}: needs :name: fig-..."
        assert "{numref}`" + name.group(1) + "`" in md, f"{name.group(1)} is never referenced with {{numref}}"


@pytest.mark.parametrize("path", [p for p in CHAPTERS if p.name[:2] in {"01", "02", "03", "04", "05", "06", "07", "08", "09"}],
                         ids=lambda p: p.name)
def test_every_chapter_links_notation_and_ends_with_folded_exercises(path):
    md = markdown_cells(path)
    assert any("{ref}`notation" in s or "<notation>`" in s or "/book/notation" in s for s in md[:2]), \
        "link the notation page from the chapter's opening"
    last = md[-1]
    exercises = re.findall(r"^:+\{exercise\}", last, re.M)
    solutions = re.findall(r"^:+\{solution\} \S+\n:class: dropdown", last, re.M)
    hints = re.findall(r"^:+\{hint\}\n:class: dropdown", last, re.M)
    assert exercises and len(exercises) == len(solutions) == len(hints), (len(exercises), len(solutions), len(hints))


def _all_prose() -> str:
    return "\n".join(["\n".join(markdown_cells(p)) for p in CHAPTERS] + [p.read_text() for p in PAGES])


def test_citations_are_in_the_bibliography_with_links():
    bib = (ROOT / "book" / "references.bib").read_text()
    entries = dict(re.findall(r"@\w+\{(\w+),(.*?)\n\}", bib, re.S))
    for key, body in entries.items():
        assert re.search(r"url\s*=\s*\{https://(arxiv\.org/abs/\d{4}\.\d{5}|github\.com/)", body), key
    cited = {k.strip() for group in re.findall(r"\{cite(?::\w+)?\}`([^`]*)`", _all_prose()) for k in group.split(",")}
    assert cited and cited <= set(entries), f"cited but not in references.bib: {sorted(cited - set(entries))}"


def test_cross_references_have_targets():
    text = _all_prose()
    targets = set(re.findall(r"^\((\S+)\)=$", text, re.M)) | set(re.findall(r"^:label: (\S+)$", text, re.M))
    refs = [m.split("<")[-1].rstrip(">").strip() for m in re.findall(r"\{(?:ref|prf:ref)\}`([^`]*)`", text)]
    missing = sorted({r for r in refs if r not in targets})
    assert refs and not missing, f"references without a (label)= target: {missing}"


def fence_errors(text: str) -> list[str]:
    """Unbalanced MyST colon fences: a closing line of fewer colons than its opening does not close it
    (markdown-it's container rule), so a solution would swallow the next exercise. Exercises and
    solutions must sit at the top level, hints inside an exercise."""
    stack, errors = [], []
    for no, line in enumerate(text.splitlines(), 1):
        opened = re.match(r"^(:{3,})\{(\w+)\}", line)
        closed = re.match(r"^(:{3,})\s*$", line)
        if opened:
            name = opened.group(2)
            if name in ("exercise", "solution") and stack:
                errors.append(f"line {no}: {{{name}}} opened inside {{{stack[-1][1]}}} (opened line {stack[-1][2]})")
            if name == "hint" and (not stack or stack[-1][1] != "exercise"):
                errors.append(f"line {no}: {{hint}} outside an exercise")
            stack.append((len(opened.group(1)), name, no))
        elif closed:
            if not stack:
                errors.append(f"line {no}: a closing fence with nothing open")
            elif len(closed.group(1)) < stack[-1][0]:
                errors.append(f"line {no}: {len(closed.group(1))} colons cannot close {{{stack[-1][1]}}} opened "
                              f"with {stack[-1][0]} on line {stack[-1][2]}")
            else:
                stack.pop()
    errors += [f"{{{name}}} opened on line {no} is never closed" for _, name, no in stack]
    return errors


def test_fence_checker_catches_a_solution_closed_too_short():
    good = "::::{exercise}\n:label: a\n:::{hint}\n:class: dropdown\nx\n:::\n::::\n\n::::{solution} a\n:class: dropdown\ny\n::::\n"
    assert fence_errors(good) == []
    bad = good.replace("y\n::::\n", "y\n:::\n")
    assert fence_errors(bad) and "cannot close {solution}" in fence_errors(bad)[0]


@pytest.mark.parametrize("path", CHAPTERS + PAGES, ids=lambda p: p.name)
def test_exercise_hint_and_solution_fences_are_balanced(path):
    text = "\n\n".join(markdown_cells(path)) if path.suffix == ".ipynb" else path.read_text()
    assert fence_errors(text) == []


GLUE_KEY = re.compile(r'\b(?:g|glue)\("([A-Za-z0-9_]+)"')


def glue_key_repeats(cells: list[str]) -> dict[str, int]:
    """Glue keys set more than once by literal ``g("key", ...)`` / ``glue("key", ...)`` calls: myst-nb warns
    on a duplicate, and the page then shows one of the values without saying which."""
    counts: dict[str, int] = {}
    for src in cells:
        for m in GLUE_KEY.finditer(src):
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return {k: n for k, n in counts.items() if n > 1}


def test_glue_key_check_catches_a_repeat():
    assert glue_key_repeats(['g("a", 1)\nglue("b", fig)', 'g("a", Words("x"))']) == {"a": 2}


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_each_glue_key_is_set_once(path):
    assert not glue_key_repeats(code_cells(path)), "rename one of the glue keys"
