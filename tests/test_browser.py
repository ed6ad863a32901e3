"""The built book in a real browser: Debian's chromium driven by Playwright, offline.

Serves ``_build/html`` (or ``SPECNB_SITE``) on 127.0.0.1 and opens every page. Any request to
another host is aborted and fails the test. On each page: no console error, no failed request,
no raw TeX in the visible text (MathJax typeset it), every ``<img>`` loaded, no Python traceback
in an output. Then the interactive parts: chapter 5's static explorer reacts to its sliders,
chapter 2's step view shows its rounds. Full-page screenshots go to ``_build/screenshots/``.

The negative controls (``tests/data/site_broken``) are pages with a missing image, raw TeX,
a script error and an external request: the same checks must catch each.

Skips when the site has not been built (``make test`` runs before ``make book``), unless
``SPECNB_REQUIRE_BROWSER=1`` (``make browser-test``, which CI runs after ``make book``).
"""
from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import socketserver
import tempfile
import threading
from pathlib import Path
from urllib.parse import urlparse

import pytest

ROOT = Path(__file__).resolve().parents[1]
SITE = Path(os.environ.get("SPECNB_SITE", ROOT / "_build" / "html"))
SHOTS = Path(os.environ.get("SPECNB_SCREENSHOTS", ROOT / "_build" / "screenshots"))
BROKEN = Path(__file__).parent / "data" / "site_broken"
CHROMIUM = os.environ.get("SPECNB_CHROMIUM", "/usr/bin/chromium")
REQUIRED = os.environ.get("SPECNB_REQUIRE_BROWSER", "").strip() not in ("", "0")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SKIP_PAGES = {"search.html", "genindex.html", "py-modindex.html"}

# Raw TeX left in the visible text means MathJax did not run (code blocks are hidden before reading).
RAW_TEX = re.compile(r"\\\(|\\\)|\\\[|\\\]|\$\$|\\(?:frac|begin|end|mathrm|sum|le|ge|cdot|alpha)\b|\$[^$\s][^$]*\$")
TRACEBACK = re.compile(r"Traceback \(most recent call last\)|^\w*(?:Error|Exception): ", re.M)


def _unavailable(why: str):
    if REQUIRED:
        pytest.fail(f"{why} (SPECNB_REQUIRE_BROWSER is set: the browser test must run)")
    pytest.skip(why)


def site_pages(site: Path) -> list[str]:
    """Every HTML page of the built book, relative to the site root (index pages and chapters)."""
    return sorted(p.relative_to(site).as_posix() for p in site.rglob("*.html")
                  if not p.relative_to(site).parts[0].startswith(("_", ".")) and p.name not in SKIP_PAGES)


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@functools.lru_cache(maxsize=None)
def _serve(directory: str) -> str:
    """Start (once per directory) a static server on 127.0.0.1; returns its base URL."""
    handler = functools.partial(_Quiet, directory=directory)
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/"


@pytest.fixture(scope="session")
def browser_context():
    if os.environ.get("SPECNB_SKIP_BROWSER") == "1" and not REQUIRED:
        pytest.skip("SPECNB_SKIP_BROWSER=1 (CI installs chromium meanwhile; `make browser-test` runs these)")
    if not Path(CHROMIUM).exists():
        _unavailable(f"{CHROMIUM} not found: install Debian's chromium (apt-get install -y chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("playwright is not installed (pip install -r requirements.txt)")
    profile = tempfile.mkdtemp(prefix="specnb-chromium-")
    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, headless=True,
                                                   args=FLAGS, viewport={"width": 1280, "height": 900})
        yield ctx
        ctx.close()
    shutil.rmtree(profile, ignore_errors=True)


def open_page(ctx, url: str):
    """Open ``url`` with every request outside 127.0.0.1 aborted; returns (page, problems)."""
    problems: list[str] = []
    page = ctx.new_page()

    def route(r):
        host = urlparse(r.request.url).hostname
        if r.request.url.startswith(("data:", "blob:", "file:")) or host == "127.0.0.1":
            r.continue_()
        else:
            problems.append(f"external request (aborted): {r.request.url}")
            r.abort()

    page.route("**/*", route)
    page.on("console", lambda m: m.type == "error" and problems.append(f"console error: {m.text}"))
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: (urlparse(r.url).hostname == "127.0.0.1" or r.url.startswith("file:"))
            and problems.append(f"failed request: {r.url} ({r.failure})"))
    page.on("response", lambda r: r.status >= 400 and problems.append(f"HTTP {r.status}: {r.url}"))
    page.goto(url, wait_until="load")
    page.wait_for_load_state("networkidle")
    # MathJax typesets after load; wait for it where the page has math.
    page.evaluate("() => window.MathJax && MathJax.startup ? MathJax.startup.promise : null")
    return page, problems


def visible_text(page, hidden: str) -> str:
    """The page's visible text with the elements matching the CSS selector ``hidden`` left out."""
    return page.evaluate("""(hidden) => {
        const s = document.createElement('style');
        s.textContent = hidden + ' {display: none !important}';
        document.head.appendChild(s);
        const t = document.body.innerText;
        s.remove();
        return t;
    }""", hidden)


def page_problems(page) -> list[str]:
    """Checks of a loaded page: images, raw TeX, tracebacks (console/network ones are collected by open_page)."""
    problems = []
    page.evaluate("""async () => {
        for (const img of document.images) { img.loading = "eager"; try { await img.decode(); } catch (e) {} }
    }""")
    for src in page.evaluate("() => Array.from(document.images).filter(i => !(i.complete && i.naturalWidth > 0))"
                             ".map(i => i.getAttribute('src'))"):
        problems.append(f"image not loaded: {src}")
    for fid in page.evaluate("() => Array.from(document.querySelectorAll('figure[id]')).filter(f => !("
                             "f.querySelector('img, canvas') || Array.from(f.querySelectorAll('svg'))"
                             ".some(s => !s.closest('button')))).map(f => f.id)"):  # (copy buttons hold an svg)
        problems.append(f"figure without an image: {fid}")  # e.g. a plot helper that returned None
    outputs = page.evaluate("() => Array.from(document.querySelectorAll('.cell_output, .output'))"
                            ".map(e => e.innerText).join('\\n')")
    if page.locator(".output.traceback, .output.error").count() or TRACEBACK.search(outputs):
        m = TRACEBACK.search(outputs)
        problems.append(f"Python error in an output: {m.group(0) if m else 'traceback output'}")
    for line in page.evaluate("() => Array.from(document.querySelectorAll('div.highlight pre'))"
                              ".filter(p => !p.closest('.cell_output') && p.scrollWidth > p.clientWidth + 2)"
                              ".map(p => p.innerText.split('\\n').sort((a, b) => b.length - a.length)[0])"):
        problems.append(f"code block wider than its box (a line is cut off or scrolls): {line[:70]!r}")
    # Visible prose only: hide code (which may legitimately contain backslashes and dollars).
    text = visible_text(page, "pre, code, .highlight, script, style")
    for m in list(RAW_TEX.finditer(text))[:3]:
        problems.append(f"raw TeX in visible text: ...{text[max(0, m.start() - 30):m.end() + 30]!r}...")
    # The book's own prose only (cell outputs may show generated text, Markdown fences included):
    # a backtick there is Markdown pasted as plain text, e.g. a glued sentence with code in it.
    prose = visible_text(page, "pre, code, .highlight, script, style, .cell_output, .output")
    for m in list(re.finditer("`", prose))[:3]:
        problems.append(f"raw Markdown backtick in visible text: ...{prose[max(0, m.start() - 30):m.end() + 30]!r}...")
    return problems


def check(ctx, base: str, rel: str, shot: Path | None = None) -> list[str]:
    page, problems = open_page(ctx, base + rel)
    try:
        problems += page_problems(page)
        if shot is not None:
            shot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(shot), full_page=True)
        page.wait_for_load_state("networkidle")
        return problems
    finally:
        page.close()


def _pages_or_placeholder():
    return site_pages(SITE) if (SITE / "index.html").exists() else ["<site not built>"]


@pytest.fixture(scope="session")
def site():
    if not (SITE / "index.html").exists():
        _unavailable(f"{SITE}/index.html not found: build the book first (make book)")
    return _serve(str(SITE))


@pytest.mark.parametrize("rel", _pages_or_placeholder())
def test_page(site, browser_context, rel):
    shot = SHOTS / (rel.replace("/", "__").removesuffix(".html") + ".png")
    problems = check(browser_context, site, rel, shot)
    assert not problems, f"{rel}:\n  " + "\n  ".join(problems)


def test_every_chapter_is_a_page(site):
    """The page list comes from the build: make sure it has every chapter of the table of contents."""
    import yaml

    def toc_files(node):
        if isinstance(node, dict):
            return ([node["root"]] if "root" in node else []) + ([node["file"]] if "file" in node else []) + \
                [f for v in node.values() if isinstance(v, list) for item in v for f in toc_files(item)]
        return []

    files = toc_files(yaml.safe_load((ROOT / "_toc.yml").read_text()))
    assert len(files) >= 2
    pages = set(site_pages(SITE))
    assert [f for f in files if f + ".html" not in pages] == []


def _chapter(prefix: str) -> str:
    pages = [p for p in site_pages(SITE) if p.startswith("notebooks/" + prefix)]
    assert len(pages) == 1, f"expected one page for chapter {prefix}, found {pages}"
    return pages[0]


def test_cost_model_explorer_reacts(site, browser_context):
    """Chapter 5's static explorer: moving a slider redraws the figure and changes the readout."""
    page, problems = open_page(browser_context, site + _chapter("05_"))
    try:
        root = page.locator("div[id^=sx]").filter(has=page.locator("input.a[type=range]")).first
        assert root.count() == 1, "chapter 5 has no static explorer (div#sx... with range inputs)"
        root.scroll_into_view_if_needed()
        svg, out = root.locator("svg"), root.locator(".out")
        before = (svg.inner_html(), out.inner_text(), root.locator(".av").inner_text())
        assert "x at k=" in before[1], f"readout not drawn: {before[1]!r}"
        slider = root.locator("input.a")
        slider.fill(str(int(slider.get_attribute("max")) - 2))       # a near the top of its range
        after = (svg.inner_html(), out.inner_text(), root.locator(".av").inner_text())
        assert after[0] != before[0], "the figure did not change when the a slider moved"
        assert after[1] != before[1], "the readout did not change when the a slider moved"
        assert after[2] != before[2]
        k = root.locator("input.k")
        k.fill("1")
        assert "at k=1 " in out.inner_text()
        assert not problems, problems
    finally:
        page.close()


def test_greedy_step_view_shows_rounds(site, browser_context):
    """Chapter 2's static step view: its rounds are drawn, one target token and one separator per round."""
    page, problems = open_page(browser_context, site + _chapter("02_"))
    try:
        view = page.locator("div").filter(has_text=re.compile(r"\d+ rounds, \d+ tokens: .* target forwards")).last
        assert view.count() == 1, "chapter 2 shows no step view"
        text = view.inner_text()
        m = re.search(r"(\d+) rounds, (\d+) tokens", text)
        rounds, tokens = int(m.group(1)), int(m.group(2))
        assert rounds >= 1 and tokens >= rounds
        f = re.search(r"(\d+) target forwards.* would have used (\d+) .* so (-?\d+) were saved", text)
        spec, plain, saved = int(f.group(1)), int(f.group(2)), int(f.group(3))
        assert spec in (rounds, rounds + 1) and plain == tokens and saved == plain - spec, text
        target_tokens = view.locator("span[title=correction], span[title=bonus]").count() - 2   # minus the legend
        separators = view.locator("span", has_text=re.compile(r"^\|$")).count()
        assert separators == rounds, (separators, rounds)
        # Every round ends with the target's token, except a last round that stopped at an accepted EOS.
        assert rounds - 1 <= target_tokens <= rounds, (target_tokens, rounds)
        assert view.locator("span[title=accepted]").count() >= 1
        assert view.is_visible()
        assert not problems, problems
    finally:
        page.close()


def test_site_works_from_disk(site, browser_context):
    """Opened as files (no server): the chapters with math and widgets still load everything they need."""
    for rel in [p for p in site_pages(SITE) if p.startswith(("notebooks/02_", "notebooks/05_"))]:
        problems = check(browser_context, (SITE / rel).as_uri().removesuffix(rel), rel)
        assert not problems, f"{rel} from disk:\n  " + "\n  ".join(problems)


# --- negative controls: a broken site must fail the same checks -------------------------------

BROKEN_EXPECT = {
    "missing_image.html": "image not loaded",
    "raw_tex.html": "raw TeX in visible text",
    "script_error.html": "page error",
    "external.html": "external request (aborted)",
    "traceback.html": "Python error in an output",
    "figure_none.html": "figure without an image",
    "wide_code.html": "code block wider than its box",
    "raw_backtick.html": "raw Markdown backtick in visible text",
}


@pytest.mark.parametrize("rel", sorted(BROKEN_EXPECT))
def test_broken_page_is_caught(browser_context, rel):
    base = _serve(str(BROKEN))
    problems = check(browser_context, base, rel)
    assert any(p.startswith(BROKEN_EXPECT[rel]) for p in problems), problems


def test_clean_control_page_passes(browser_context):
    """The broken pages' healthy twin passes: the checks do not fire on everything."""
    assert check(browser_context, _serve(str(BROKEN)), "ok.html") == []
