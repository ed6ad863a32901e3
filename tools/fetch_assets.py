"""Vendor the book's JavaScript so that no page loads anything from outside the site.

MathJax 3, RequireJS and the Jupyter widgets HTML manager come from pinned npm
tarballs (fetched with ``npm pack``, the npm client's own download), checked
against the sha512 integrity pinned below, cached in ``<specnb cache>/npm`` and
unpacked into ``_build/vendor`` (``html_static_path`` in ``_config.yml``;
Sphinx copies it to ``_build/html/_static``). The reader's machine needs no
node: only the machine that builds the book needs ``npm``, and only until the
three tarballs are cached.

Leaves out: everything of the packages that the pages do not load (MathJax's
other combined builds and its SVG output, the widget manager's source maps).

Usage: ``python tools/fetch_assets.py [--dest _build/vendor]``.
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

# name, version, sha512 integrity (as the npm registry reports it), and what to keep:
# {path inside the tarball's package/: path under dest}.
ASSETS = [
    ("mathjax", "3.2.2",
     "sha512-Bt+SSVU8eBG27zChVewOicYs7Xsdt40qm4+UpHyX7k0/O9NliPc+x77k1/FEsPsjKPZGJvtRZM1vO+geW0OhGw==",
     # The combined TeX+MathML->CHTML build, its fonts, and what it loads on demand
     # (TeX extensions through autoload, the menu's accessibility components).
     {"es5/tex-mml-chtml.js": "mathjax/tex-mml-chtml.js",
      "es5/output/chtml/fonts/woff-v2": "mathjax/output/chtml/fonts/woff-v2",
      "es5/input/tex/extensions": "mathjax/input/tex/extensions",
      "es5/a11y": "mathjax/a11y",
      "es5/ui": "mathjax/ui",
      "es5/sre": "mathjax/sre",
      "LICENSE": "mathjax/LICENSE"}),
    ("requirejs", "2.3.8",
     "sha512-7/cTSLOdYkNBNJcDMWf+luFvMriVm7eYxp4BcFCsAX0wF421Vyce5SXP17c+Jd5otXKGNehIonFlyQXSowL6Mw==",
     {"require.js": "requirejs/require.js", "package.json": "requirejs/package.json"}),
    ("@jupyter-widgets/html-manager", "1.0.15",
     "sha512-5thBIV6ymNgmPVOHvzx+gGy8ZSKmSazhtGw4/c4xJDVzRhG9PTeQsRjF3FUTopvFi//SABeNz1yp47bCrJ3CQA==",
     # embed-amd.js bundles base, controls and output widgets; the fonts are font-awesome's, loaded by its CSS.
     {"dist": "@jupyter-widgets/html-manager/dist", "package.json": "@jupyter-widgets/html-manager/package.json"}),
]
# Our own glue, copied next to them: RequireJS's baseUrl, and MathJax 2's Hub.Queue on MathJax 3.
OWN = {Path(__file__).parent / "static" / "widgets-setup.js": "site/widgets-setup.js",
       Path(__file__).parent / "static" / "specnb.css": "site/specnb.css"}
SKIP_SUFFIXES = (".map",)
SKIP_NAMES = {"embed.js", "libembed-amd.js", "embed.js.LICENSE.txt"}   # only embed-amd.js is loaded
STAMP = ".fetched"
FONT_SUFFIXES = (".woff2", ".woff", ".ttf", ".eot", ".svg")


def cache_dir() -> Path:
    root = os.environ.get("SPECNB_CACHE") or Path.home() / ".cache" / "specnb"
    return Path(root) / "npm"


def integrity(data: bytes) -> str:
    return "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()


def tarball(name: str, version: str, expected: str) -> bytes:
    """The package's tarball, from the cache or ``npm pack``; raises if its hash is not the pinned one."""
    cached = cache_dir() / f"{name.replace('/', '+')}-{version}.tgz"
    if cached.exists():
        data = cached.read_bytes()
        if integrity(data) == expected:
            return data
        cached.unlink()     # a corrupt or tampered cache entry: fetch again
    npm = shutil.which("npm")
    if npm is None:
        raise SystemExit(f"fetch_assets: {name}@{version} is not in {cache_dir()} and `npm` is not installed. "
                         "Install npm (Debian: apt-get install npm) to fetch it once, "
                         f"or put the tarball at {cached}.")
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run([npm, "pack", "--silent", f"{name}@{version}", "--pack-destination", tmp],
                              capture_output=True, text=True)
        files = list(Path(tmp).glob("*.tgz"))
        if proc.returncode != 0 or len(files) != 1:
            raise SystemExit(f"fetch_assets: `npm pack {name}@{version}` failed ({proc.returncode}):\n{proc.stderr}")
        data = files[0].read_bytes()
    got = integrity(data)
    if got != expected:
        raise SystemExit(f"fetch_assets: {name}@{version} has hash {got}, pinned {expected}. "
                         "Refusing to use it: the registry served different bytes for a pinned version.")
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_bytes(data)
    return data


def _keep(member: str) -> bool:
    base = member.rsplit("/", 1)[-1]
    return not member.endswith(SKIP_SUFFIXES) and base not in SKIP_NAMES


def unpack(data: bytes, keep: dict[str, str], dest: Path) -> int:
    """Extract the kept paths of a tarball under ``dest``; returns the number of files written."""
    n, found = 0, set()
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for m in tar.getmembers():
            if not m.isfile() or not m.name.startswith("package/"):
                continue
            rel = m.name[len("package/"):]
            for src, dst in keep.items():
                if (rel == src or rel.startswith(src + "/")) and _keep(rel):
                    out = dest / (dst + rel[len(src):])
                    if ".." in Path(dst + rel[len(src):]).parts:
                        raise SystemExit(f"fetch_assets: refusing path {m.name!r}")
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_bytes(tar.extractfile(m).read())
                    n += 1
                    found.add(src)
    missing = sorted(set(keep) - found)
    if missing:
        raise SystemExit(f"fetch_assets: paths {missing} not found in the tarball")
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", default="_build/vendor", help="where the site's static assets go")
    args = ap.parse_args(argv)
    dest = Path(args.dest)
    want = "\n".join(["fonts also under @jupyter-widgets/"] + [f"{n}@{v} {h}" for n, v, h, _ in ASSETS] +
                     [f"{dst} {hashlib.sha256(src.read_bytes()).hexdigest()}" for src, dst in OWN.items()])
    stamp = dest / STAMP
    if stamp.exists() and stamp.read_text() == want:
        return 0            # already unpacked from these exact tarballs
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for name, version, expected, keep in ASSETS:
        n = unpack(tarball(name, version, expected), keep, dest)
        print(f"fetch_assets: {name}@{version} (sha512 checked): {n} files -> {dest}")
    for src, dst in OWN.items():
        (dest / dst).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest / dst)
    # The widget bundle's CSS asks for font-awesome's files relative to the bundle's public path,
    # which on some pages resolves to _static/@jupyter-widgets/ instead of .../html-manager/dist/
    # (seen by the browser test as 404s on chapter 8's page): serve them at both places.
    fonts = dest / "@jupyter-widgets" / "html-manager" / "dist"
    for f in fonts.iterdir():
        if f.suffix in FONT_SUFFIXES:
            shutil.copyfile(f, dest / "@jupyter-widgets" / f.name)
    stamp.write_text(want)
    return 0


if __name__ == "__main__":
    sys.exit(main())
