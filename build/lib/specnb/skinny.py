"""specnb's own kernel for skinny products: ``x @ W^T`` with x of a few rows (chapter 1).

A decode step multiplies every weight by 1 row; a verify forward by k+1 rows. With so few rows the
product is bound by reading W from memory (2 x 4 bytes of W per multiply-add at n = 1), so ideally
a 5-row product costs what a 1-row product does. Neither library in reach does that on every CPU
(:mod:`specnb.kernels` has the measurements): MKL's one-row kernel streams W at full speed but jumps
at 4 rows on an Intel Xeon and at 2 on an AMD EPYC, and oneDNN grows gently but pays about 10 us a
call and streams W more slowly. ``csrc/skinny.cpp`` is the kernel the arithmetic asks for: each block
of 4 weight rows is read once and multiplied with every row of x while it sits in L1 (up to 5 rows
per pass in AVX-512 registers, 2 in AVX2), the next block is prefetched meanwhile, and sibling weights
(q/k/v, gate/up) run in one call without a concatenated copy. Its sums run in another order than
MKL's (max |logit difference| about 1e-5 on the target), so plain greedy and speculative decoding
always run it together (:mod:`specnb.kernels` applies one backend to the whole model).

It is C++ built at first use by ``torch.utils.cpp_extension`` (a C++ compiler and ninja; about
20 s) with ``-march=native``, into the specnb cache under a key of the CPU's model and flags, the
source and the torch version, so a cache shared between machines never runs a build for another
CPU. float32 only; AVX-512 or AVX2 with FMA. Where it cannot be built, :func:`unavailable` says why,
and ``auto`` chooses among MKL and oneDNN alone.
"""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
import sysconfig
import warnings
from pathlib import Path

import torch
import torch.autograd.profiler as _profiler

SOURCE = Path(__file__).parent / "csrc" / "skinny.cpp"
MAX_ROWS = 16  # products of more rows (a prompt's prefill) run oneDNN: this kernel is for verify widths
PREFETCH_BLOCKS = 1  # weight blocks prefetched ahead (Xeon, whole target: T(5) 43.8 ms without, 36.1 with 1, 37.4 with 3)

OP_NAME = "specnb::skinny_linear"  # what torch.profiler shows for one call

_EXT = None
_WHY: str | None = None


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _build_key(flags: set[str]) -> str:
    from .env import _cpu_model

    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), _cpu_model().encode(), " ".join(sorted(flags)).encode(),
                 torch.__version__.encode(), sys.version.encode()):
        h.update(part)
    return h.hexdigest()[:16]


def _missing(flags: set[str]) -> str | None:
    """Why this machine cannot build the kernel, or None."""
    if not SOURCE.exists():
        return f"its source {SOURCE} is missing from this install of specnb"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"it is x86 code and this CPU is {platform.machine()}"
    if not ("avx512f" in flags or {"avx2", "fma"} <= flags):
        return "this CPU has neither AVX-512 nor AVX2 with FMA"
    if not (shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")):
        return "no C++ compiler (install one: apt-get install -y g++)"
    if not shutil.which("ninja"):
        return "no ninja (pip install ninja)"
    if not Path(sysconfig.get_paths()["include"], "Python.h").exists():
        return "no Python headers (apt-get install -y python3-dev)"
    return None


def load(verbose: bool = False):
    """The compiled extension (built once per machine into the specnb cache), or None: see :func:`unavailable`."""
    global _EXT, _WHY
    if _EXT is not None or _WHY is not None:
        return _EXT
    bin_dir = str(Path(sys.executable).parent)  # a venv's ninja, when the venv is not activated
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    flags = cpu_flags()
    _WHY = _missing(flags)
    if _WHY is not None:
        return None
    from torch.utils import cpp_extension

    from .models import cache_dir

    key = _build_key(flags)
    build = cache_dir() / "skinny" / key
    build.mkdir(parents=True, exist_ok=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if not any(build.glob("*.so")):
                print("specnb skinny kernels: compiling csrc/skinny.cpp for this CPU once (about 20 s) ...",
                      file=sys.stderr)
            _EXT = cpp_extension.load(f"specnb_skinny_{key}", [str(SOURCE)], build_directory=str(build),
                                      extra_cflags=["-O3", "-march=native", "-fopenmp"],
                                      extra_ldflags=["-fopenmp"], verbose=verbose)
    except Exception as e:  # a compiler error must not stop MKL and oneDNN from running
        _WHY = f"its build failed ({type(e).__name__}: {str(e).strip().splitlines()[-1][:200]})"
        _EXT = None
    return _EXT


def unavailable() -> str | None:
    """None when the kernel runs here, else why not (one phrase)."""
    load()
    return _WHY


def isa() -> str:
    """The instruction set the build uses ("AVX-512" or "AVX2"); "" where there is no build."""
    ext = load()
    return ext.isa() if ext is not None else ""


def linear(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None] | None = None) -> torch.Tensor:
    """``x @ [W_1; W_2; ...]^T`` (+ biases): x ``(..., K)`` float32, each W_i ``(N_i, K)`` float32 ->
    ``(..., sum N_i)``, weight i's products in its own columns. Raises RuntimeError where there is no build."""
    ext = load()
    if ext is None:
        raise RuntimeError(f"specnb's skinny kernels do not run here: {_WHY}")
    ws = [w.detach() if w.is_contiguous() else w.detach().contiguous() for w in weights]
    bs = [None if b is None else b.detach() for b in (biases or [None] * len(ws))]
    if _profiler._is_profiler_enabled:  # a pybind call is no torch operator: name it for torch.profiler
        with torch.profiler.record_function(OP_NAME):
            return ext.linear(x, ws, bs, PREFETCH_BLOCKS)
    return ext.linear(x, ws, bs, PREFETCH_BLOCKS)
