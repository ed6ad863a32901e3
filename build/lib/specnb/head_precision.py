"""The chapter 7 head's precision at inference, chosen by measurement (float32 or bfloat16).

A head step is memory-bound: on an AMD EPYC (Zen 4, 2 cores, oneDNN) one step read about 36 MB
of float32 weights (fc 2.7 MB, q/k/v 2.2, o 1.3, gate/up 7.1, down 3.5, the 8,192 LM head rows
18.9 MB) in 1.43 ms, about 31 GB/s against a measured copy bandwidth of 32 GB/s. bfloat16 halves
the bytes. Exactness does not depend on it (the target verifies every draft in its own
precision); only agreement with the target can move, and chapter 7 measures by how much.

``SPECNB_HEAD_PRECISION=auto|float32|bfloat16`` (default ``auto``). ``auto`` keeps float32 unless
oneDNN runs bfloat16 on this CPU (AVX-512 or AVX-NE-CONVERT; an AVX2-only Zen 3 has no such
path, and torch's fallback bfloat16 product there is slower than float32) and the target runs
oneDNN kernels; then it times a head step (one row: a chain draft; three rows: a tree level)
both ways, interleaved, and takes bfloat16 when its summed median is below 0.9 of float32's.
The choice and its timings are cached per machine, torch version, head shape and kernels in the
specnb cache (``head_precision.json``), like the kernels' own choice.
"""
from __future__ import annotations

import os
import time

import numpy as np
import torch

from .kernels import Kernels, measured_once, onednn_supports

ENV = "SPECNB_HEAD_PRECISION"
CHOICES = ("auto", "float32", "bfloat16")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ROWS = (1, 3)  # a chain draft step; one level of a tree of branching 3
MARGIN = 0.9  # bfloat16 must take under this share of float32's time to be chosen


def requested(precision: str | None = None) -> str:
    """``precision``, else ``$SPECNB_HEAD_PRECISION``, else auto; an unknown value is an error naming the valid ones."""
    name = (precision or os.environ.get(ENV) or "auto").strip().lower()
    if name not in CHOICES:
        raise ValueError(f"{ENV}={name!r} is not a head precision; valid: {', '.join(CHOICES)}")
    return name


def step_ms(head, rows: int, context_len: int = 64, repeats: int = 15, seed: int = 0) -> list[float]:
    """Wall times (ms) of ``repeats`` head steps of ``rows`` nodes after ``context_len`` cached pairs:
    the head's forward on (1, rows) inputs and its logits for them, as a draft round runs them."""
    from transformers import DynamicCache

    from .cache import rollback
    from .head import causal_mask

    H, F = head.cfg.hidden_size, head.cfg.feature_size
    gen = torch.Generator().manual_seed(seed)
    feats = torch.randn(1, context_len, F, generator=gen)
    ids = torch.randint(0, head.embed.shape[0], (1, context_len + rows), generator=gen)
    cache = DynamicCache()
    out = []
    with torch.inference_mode():
        head(feats, ids[:, :context_len], torch.arange(context_len)[None], None, cache)
        pred = torch.randn(1, rows, H, generator=gen)
        mask = causal_mask(context_len, rows)
        pos = torch.full((1, rows), context_len)
        for r in range(repeats + 2):
            t0 = time.perf_counter()
            y = head(pred, ids[:, context_len:], pos, mask, cache)
            int(head.logits(y[0]).argmax())
            t1 = time.perf_counter()
            rollback(cache, rows)
            if r >= 2:
                out.append(1e3 * (t1 - t0))
    return out


def _cache_file():
    from .models import cache_dir

    return cache_dir() / "head_precision.json"


def machine_key(head, kernels: Kernels | None) -> str:
    from .env import _cpu_model

    c = head.cfg
    return (f"{_cpu_model()} | {os.cpu_count()} cores | {torch.get_num_threads()} threads | torch {torch.__version__}"
            f" | head {c.hidden_size}x{c.intermediate_size} V'={c.draft_vocab} F={c.feature_size}"
            f" | {kernels.label if kernels is not None else 'no kernels'}")


def measure(f32_head, bf16_head, repeats: int = 15) -> dict:
    """Median head-step times (ms) for each of :data:`ROWS`, float32 and bfloat16 interleaved."""
    times = {"float32": {n: [] for n in ROWS}, "bfloat16": {n: [] for n in ROWS}}
    for _ in range(3):  # three interleaved blocks, so drift hits both alike
        for n in ROWS:
            times["float32"][n] += step_ms(f32_head, n, repeats=repeats // 3 or 1)
            times["bfloat16"][n] += step_ms(bf16_head, n, repeats=repeats // 3 or 1)
    return {name: {str(n): float(np.median(t)) for n, t in per.items()} for name, per in times.items()}


def decide(medians: dict) -> str:
    """bfloat16 when its summed median step time is below :data:`MARGIN` of float32's."""
    f32 = sum(medians["float32"].values())
    bf16 = sum(medians["bfloat16"].values())
    return "bfloat16" if bf16 < MARGIN * f32 else "float32"


def _timings(medians: dict) -> str:
    return ", ".join(f"{n} row{'s' if n != '1' else ''} {medians['float32'][n]:.2f} -> {medians['bfloat16'][n]:.2f} ms"
                     for n in medians["float32"])


def choose(head, twin_factory, kernels: Kernels | None, precision: str | None = None,
           remeasure: bool = False) -> tuple[str, str]:
    """The precision for ``head`` (float32, as loaded) and how it was chosen: ``(name, how)``.

    ``twin_factory()`` returns a second float32 copy of the head on the same kernels, which auto
    casts to bfloat16 to time it against ``head``."""
    name = requested(precision)
    if name != "auto":
        how = f"{ENV}={name}" if os.environ.get(ENV) else f"asked for {name}"
        if name == "bfloat16" and not onednn_supports(torch.bfloat16):
            how += " (oneDNN has no bfloat16 path on this CPU: torch's fallback product runs it)"
        return name, how
    if not onednn_supports(torch.bfloat16):
        return "float32", "auto: oneDNN has no bfloat16 path on this CPU (it needs AVX-512 or AVX-NE-CONVERT)"
    if kernels is None or kernels.backend == "mkl":
        return "float32", "auto: the target runs MKL kernels, which have no fast bfloat16 product here"

    def timed() -> dict:
        medians = measure(head, twin_factory().set_precision(torch.bfloat16))
        return {"choice": decide(medians), "medians_ms": medians}

    entry = measured_once(_cache_file(), machine_key(head, kernels), timed, remeasure)
    return entry["choice"], f"auto (head step float32 -> bfloat16: {_timings(entry['medians_ms'])})"
