"""Where a verify forward's time goes, under each kernel backend (chapter 1).

A verify forward of k drafts feeds n = k + 1 tokens and needs logits at all n positions; plain
decoding feeds one and needs one row. Whether T(n) stays near T(1) is decided by the GEMM library
that runs the linear layers (:mod:`specnb.kernels`). This module measures, on the same cache and
interleaved so a noisy machine's drift hits all alike:

* :func:`verify_breakdown`: for each backend (MKL, oneDNN) and each n, the whole forward, the
  **body** (embedding, decoder layers, final norm; ``hidden: (n, H)``) and the **LM head**
  (``logits: (n, V) = hidden @ W.T``), and the **rest**: the same forward with every linear layer
  stubbed out (:func:`linear_layers_stubbed`), i.e. everything but the matrix products (Python,
  norms, rotary, attention, the cache); and how far the two backends' logits differ;
* :func:`gemm_table`: one ``x @ W.T`` for every distinct weight shape of the model, x of n rows,
  under each backend: the per-shape timing that explains the whole-model curves;
* :func:`op_table`: torch.profiler's self CPU time per operator for one n.

Not covered: GPUs (no synchronisation here), batches, and quantized kernels.
Timings are wall clock and noisy: compare the ratios of one run.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import numpy as np
import torch
from tqdm.auto import tqdm

from .cache import _decoder_and_head, cache_keyword, forward, prefilled, rollback
from .kernels import KernelLinear, kernels_of, make, use_kernels
from .skinny import unavailable

BACKENDS = ("mkl", "onednn") + (("skinny",) if unavailable() is None else ())  # skinny: where it can be built
NAMED = ("mkl", "onednn", "mixed", "onednn-unfused", "skinny")  # what ``backends`` may name


def _kernels_named(name: str):
    """``make(name)``; ``onednn-unfused``: oneDNN with one call per linear layer (no FusedGroup)."""
    if name == "onednn-unfused":
        return make("onednn", fused=False)
    if name == "mixed":
        return make("mixed", 4)
    if name not in NAMED:
        raise ValueError(f"unknown backend {name!r} for the breakdown; valid: {', '.join(NAMED)}")
    return make(name)


@contextmanager
def linear_layers_stubbed(model: torch.nn.Module):
    """Inside the block every ``nn.Linear`` of ``model`` returns zeros of its output shape, no product.

    ``x: (..., in) -> zeros (..., out)``. A forward then runs every other operator on the same shapes
    (norms, rotary, attention, the cache), and no CPU operator's time depends on the values, so its
    time is the forward's time outside the linear layers. Yields the number of layers stubbed; each
    layer's own ``forward`` is restored on exit (also on error).
    """
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    saved = [m.__dict__.get("forward") for m in layers]

    def stub(out_features: int):
        return lambda x: x.new_zeros(*x.shape[:-1], out_features)

    for m in layers:
        m.forward = stub(m.out_features)
    try:
        yield len(layers)
    finally:
        for m, own in zip(layers, saved):
            if own is None:
                del m.forward
            else:
                m.forward = own


def _body(model, token_ids: list[int], cache) -> torch.Tensor:
    decoder, _ = _decoder_and_head(model)
    x = torch.tensor([token_ids], dtype=torch.long)  # (1, n)
    return decoder(input_ids=x, **{cache_keyword(decoder): cache, "use_cache": True}).last_hidden_state[0]


@torch.inference_mode()
def verify_breakdown(model: torch.nn.Module, ns=(1, 2, 3, 5, 9), backends=BACKENDS, context_len: int = 64,
                     repeats: int = 20, warmup: int = 2, seed: int = 0, progress: bool = True) -> dict:
    """Median seconds per forward of n new tokens after ``context_len`` cached ones, by backend and part.

    Parts: ``full`` (the model's forward, logits at every position, as T(n) measures), ``body``
    (decoder stack, ``hidden: (n, H)``), ``head`` (the LM head over the n rows) and ``rest`` (the
    full forward with every linear layer stubbed: all but the products; the same under any
    backend). Backends and n are interleaved within each repeat; the model's own kernels are
    restored at the end.
    ``max_diff[n]``: the largest |logit difference| between the first two backends' full forwards.

    Returns ``{"ns", "backends", "median": {backend: {part: {n: s}}}, "max_diff": {n: float}}``.
    """
    ns = [int(n) for n in ns]
    before = kernels_of(model)
    chosen = {b: _kernels_named(b) for b in backends}
    cache, new = prefilled(model, context_len, max(ns), seed)
    _, lm_head = _decoder_and_head(model)
    parts = ("full", "body", "head", "rest")
    times = {b: {p: {n: [] for n in ns} for p in parts} for b in backends}
    max_diff_vs_first = {b: {n: 0.0 for n in ns} for b in backends}
    try:
        for r in tqdm(range(warmup + repeats), desc="verify breakdown", disable=not progress):
            for n in ns:
                logits = {}
                for b, kernels in chosen.items():
                    use_kernels(model, kernels)
                    t0 = time.perf_counter()
                    logits[b] = forward(model, new[:n], cache)
                    t1 = time.perf_counter()
                    rollback(cache, n)
                    t2 = time.perf_counter()
                    hidden = _body(model, new[:n], cache)
                    t3 = time.perf_counter()
                    rollback(cache, n)
                    t4 = time.perf_counter()
                    lm_head(hidden)
                    t5 = time.perf_counter()
                    with linear_layers_stubbed(model):
                        t6 = time.perf_counter()
                        forward(model, new[:n], cache)
                        t7 = time.perf_counter()
                    rollback(cache, n)
                    if r >= warmup:
                        for p, dt in zip(parts, (t1 - t0, t3 - t2, t5 - t4, t7 - t6)):
                            times[b][p][n].append(dt)
                first = logits[backends[0]]
                for name, out in logits.items():
                    max_diff_vs_first[name][n] = max(max_diff_vs_first[name][n], float((out - first).abs().max()))
    finally:
        if before is not None:
            use_kernels(model, before)
    max_diff = max_diff_vs_first[backends[1]] if len(backends) > 1 else {n: 0.0 for n in ns}
    return {"ns": ns, "backends": list(backends), "context_len": context_len, "repeats": repeats,
            "median": {b: {p: {n: float(np.median(times[b][p][n])) for n in ns} for p in parts} for b in backends},
            "max_diff": max_diff, "max_diff_vs_first": max_diff_vs_first,
            "samples": {b: {p: {n: [float(t) for t in times[b][p][n]] for n in ns} for p in parts} for b in backends}}


@torch.inference_mode()
def gemm_table(model: torch.nn.Module, ns=(1, 2, 3, 4, 5, 9), backends=BACKENDS, repeats: int = 30,
               warmup: int = 3, seed: int = 0) -> list[dict]:
    """One ``x @ W.T`` (x: (n, in)) per distinct weight shape of ``model``'s linear layers, by backend.

    Returns ``[{"shape": (out, in), "count": layers with it, "ms": {backend: {n: median ms}}}, ...]``,
    the largest shape first. The weights are random of each shape (timing depends on shape only).
    """
    shapes: dict[tuple[int, int], int] = {}
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            shape = tuple(m.weight.shape)
            shapes[shape] = shapes.get(shape, 0) + 1
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for shape, count in sorted(shapes.items(), key=lambda kv: -kv[0][0] * kv[0][1]):
        with torch.inference_mode(False):
            lin = torch.nn.Linear(shape[1], shape[0], bias=False)
        layers = {b: KernelLinear.wrap(lin, make(b)) for b in backends}
        xs = {n: torch.randn(n, shape[1], generator=gen) for n in ns}
        times = {b: {n: [] for n in ns} for b in backends}
        for r in range(warmup + repeats):
            for n in ns:
                for b, layer in layers.items():
                    t0 = time.perf_counter()
                    layer(xs[n])
                    dt = time.perf_counter() - t0
                    if r >= warmup:
                        times[b][n].append(dt)
        rows.append({"shape": shape, "count": count,
                     "ms": {b: {n: float(np.median(t)) * 1e3 for n, t in per.items()} for b, per in times.items()}})
    return rows


def gemm_text(rows: list[dict]) -> str:
    """:func:`gemm_table` as text: ms per product and each backend's time at n over its time at n = 1."""
    backends = list(rows[0]["ms"])
    ns = list(rows[0]["ms"][backends[0]])
    lines = [f"{'W (out x in)':>14} {'layers':>6} {'backend':>7} " + " ".join(f"{'n=' + str(n):>8}" for n in ns)
             + "   " + " ".join(f"{'x' + str(n):>6}" for n in ns[1:])]
    for row in rows:
        for b in backends:
            ms = row["ms"][b]
            lines.append(f"{'x'.join(map(str, row['shape'])):>14} {row['count']:>6} {b:>7} "
                         + " ".join(f"{ms[n]:8.3f}" for n in ns) + "   "
                         + " ".join(f"{ms[n] / ms[ns[0]]:6.2f}" for n in ns[1:]))
    return "\n".join(lines)


@torch.inference_mode()
def op_table(model: torch.nn.Module, n: int, context_len: int = 64, repeats: int = 5, top: int = 10) -> list[tuple]:
    """torch.profiler's top ``top`` operators by self CPU time for a forward of n tokens with logits at
    every position, on the model's own kernels: ``[(op name, ms per forward, share of the total), ...]``."""
    from torch.profiler import ProfilerActivity, profile

    cache, new = prefilled(model, context_len, n)
    forward(model, new, cache)
    rollback(cache, n)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            forward(model, new, cache)
            rollback(cache, n)
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: -e.self_cpu_time_total)
    return [(e.key, e.self_cpu_time_total / 1e3 / repeats, e.self_cpu_time_total / total) for e in events[:top]]


def growth_parts(b: dict, backend: str, n: int) -> tuple[float, float, float]:
    """From the first n measured to ``n`` under ``backend``: the whole forward's growth, the rest's growth
    (the forward with its linear layers stubbed) in seconds, and the products' share of the growth,
    ``1 - rest / whole``. With per-repeat samples both growths are medians of differences paired within a
    repeat (n = n0 and n, whole and stubbed, timed seconds apart); the share is computed from those two
    medians, so the three numbers always add up (a share below 0: the rest grew more than the whole)."""
    n0 = b["ns"][0]
    if "samples" in b:
        t = b["samples"][backend]
        growth = float(np.median(np.subtract(t["full"][n], t["full"][n0])))
        rest = float(np.median(np.subtract(t["rest"][n], t["rest"][n0])))
    else:
        m = b["median"][backend]
        growth, rest = m["full"][n] - m["full"][n0], m["rest"][n] - m["rest"][n0]
    return growth, rest, (1 - rest / growth) if growth > 0 else float("nan")


def products_share_of_growth(b: dict, backend: str, n: int) -> float:
    """Of the whole forward's growth from the first n measured to ``n``, the share that is the linear
    layers' products under ``backend`` (:func:`growth_parts`): 1 = all of it."""
    return growth_parts(b, backend, n)[2]


def breakdown_table(b: dict) -> str:
    """The breakdown as text: ms per part for each backend (``rest``: the forward without its products),
    and the whole forward's T(n)/T(1)."""
    ns, med = b["ns"], b["median"]
    w = max(7, *(len(be) for be in b["backends"]))
    lines = [f"{'n':>3} {'backend':>{w}} {'forward':>8} {'body':>8} {'LM head':>8} {'rest':>8}   {'T(n)/T(1)':>9} "
             f"{'head share':>10} {'max |dlogit|':>12}"]
    for n in ns:
        for be in b["backends"]:
            m = med[be]
            lines.append(f"{n:>3} {be:>{w}} " + " ".join(f"{m[p][n] * 1e3:8.2f}" for p in ("full", "body", "head", "rest"))
                         + f"   {m['full'][n] / m['full'][ns[0]]:9.2f} {m['head'][n] / m['full'][n]:10.2f} "
                         f"{b['max_diff'][n]:12.1e}")
    return "\n".join(lines)

