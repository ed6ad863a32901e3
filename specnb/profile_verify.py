"""Where a verify forward's time goes: the decoder stack against the LM head, and the top ops.

A verify forward of k drafts feeds n = k + 1 tokens and needs logits at all n
positions; plain decoding feeds one and needs one row. On the CPUs this book is
built on, T(n)/T(1) is well above 1 even for small n (chapter 1). This module
splits T(n) into its two parts, timed in alternation on the same cache:

* the **body**: embedding, decoder layers and final norm (``hidden: (n, H)``);
* the **LM head**: ``logits: (n, V) = hidden @ W.T``, one matrix product over
  the V-row output embedding, computed either in one call (what transformers
  does) or in blocks of vocabulary rows (:func:`specnb.cache.lm_head_logits`).

:func:`op_table` adds torch.profiler's self CPU time per operator for one n.

Not covered: GPUs (no synchronisation here), batches, and quantized kernels.
Timings are wall clock and noisy: compare the ratios of one run.
"""
from __future__ import annotations

import time

import numpy as np
import torch
from tqdm.auto import tqdm

from .cache import _decoder_and_head, cache_keyword, forward, lm_head_logits, new_cache, rollback


def _model_forward(model, token_ids: list[int], cache) -> torch.Tensor:
    """The model's own forward (transformers'), logits at every position: what T(n) measured."""
    x = torch.tensor([token_ids], dtype=torch.long)  # (1, n)
    return model(input_ids=x, **{cache_keyword(model): cache, "use_cache": True}).logits[0]


def _body(model, token_ids: list[int], cache) -> torch.Tensor:
    decoder, _ = _decoder_and_head(model)
    x = torch.tensor([token_ids], dtype=torch.long)  # (1, n)
    return decoder(input_ids=x, **{cache_keyword(decoder): cache, "use_cache": True}).last_hidden_state[0]


@torch.inference_mode()
def verify_breakdown(model: torch.nn.Module, ns=(1, 2, 3, 5, 9), context_len: int = 64, repeats: int = 20,
                     warmup: int = 2, seed: int = 0, progress: bool = True) -> dict:
    """Median seconds per forward of n new tokens after ``context_len`` cached ones, split into parts.

    For each n: ``full`` (the model's own forward with logits at every position),
    ``specnb`` (:func:`specnb.cache.forward`, what the decoding loops call: the LM head blocked
    for n in :data:`specnb.cache.LM_HEAD_BLOCKED_NS`), ``body`` (decoder stack,
    ``hidden: (n, H)``), ``head`` (the LM head over all n rows in one product, as the model's
    forward computes it) and ``head_blocked`` (the same logits in blocks of vocabulary rows,
    at every n). Every n and part is interleaved within each repeat. Also checks that the
    blocked logits, and specnb's, equal the model's exactly.

    Returns ``{"ns": [...], "median": {part: {n: s}}, "equal": {n: bool}}``.
    """
    ns = [int(n) for n in ns]
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    context = torch.randint(0, vocab, (context_len,), generator=gen).tolist()
    new = torch.randint(0, vocab, (max(ns),), generator=gen).tolist()
    cache = new_cache(model)
    forward(model, context, cache, logits_to_keep=1)
    _, lm_head = _decoder_and_head(model)
    parts = ("full", "specnb", "body", "head", "head_blocked")
    times = {p: {n: [] for n in ns} for p in parts}
    equal = {}
    every_n = range(1, max(ns) + 1)
    for r in tqdm(range(warmup + repeats), desc="verify breakdown", disable=not progress):
        for n in ns:
            t = [time.perf_counter()]
            own = _model_forward(model, new[:n], cache)
            t.append(time.perf_counter())
            rollback(cache, n)
            t.append(time.perf_counter())
            ours = forward(model, new[:n], cache)
            t.append(time.perf_counter())
            rollback(cache, n)
            t.append(time.perf_counter())
            hidden = _body(model, new[:n], cache)
            t.append(time.perf_counter())
            rollback(cache, n)
            t.append(time.perf_counter())
            one = lm_head(hidden)
            t.append(time.perf_counter())
            blocked = lm_head_logits(lm_head, hidden, blocked_ns=every_n)
            t.append(time.perf_counter())
            if r >= warmup:
                for p, dt in zip(parts, (t[1] - t[0], t[3] - t[2], t[5] - t[4], t[7] - t[6], t[8] - t[7])):
                    times[p][n].append(dt)
            equal[n] = equal.get(n, True) and torch.equal(one, blocked) and torch.equal(own, ours)
    return {"ns": ns, "context_len": context_len, "repeats": repeats,
            "median": {p: {n: float(np.median(times[p][n])) for n in ns} for p in parts}, "equal": equal}


@torch.inference_mode()
def op_table(model: torch.nn.Module, n: int, context_len: int = 64, repeats: int = 5, top: int = 10) -> list[tuple]:
    """torch.profiler's top ``top`` operators by self CPU time for a forward of n tokens with logits at
    every position: ``[(op name, ms per forward, share of the total), ...]``."""
    from torch.profiler import ProfilerActivity, profile

    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    context = torch.randint(0, vocab, (context_len,), generator=gen).tolist()
    new = torch.randint(0, vocab, (n,), generator=gen).tolist()
    cache = new_cache(model)
    forward(model, context, cache, logits_to_keep=1)
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


def breakdown_table(b: dict) -> str:
    """The breakdown as text: ms per part (model = the model's own forward, specnb = specnb's), the two
    forwards' ratios to the model's n = 1 time, the body's and head's ratios to their own n = 1 times."""
    ns, med = b["ns"], b["median"]
    lines = [f"{'n':>3} {'model':>8} {'specnb':>8} {'body':>8} {'LM head':>8} {'blocked':>8}   "
             f"{'model/T1':>8} {'specnb/T1':>9} {'body/1':>7} {'head/1':>7} {'head share':>10} {'equal':>6}"]
    t1 = med["full"][ns[0]]
    for n in ns:
        lines.append(f"{n:>3} " + " ".join(f"{med[p][n] * 1e3:8.2f}" for p in ("full", "specnb", "body", "head",
                                                                             "head_blocked"))
                     + f"   {med['full'][n] / t1:8.2f} {med['specnb'][n] / t1:9.2f} "
                     f"{med['body'][n] / med['body'][ns[0]]:7.2f} {med['head'][n] / med['head'][ns[0]]:7.2f} "
                     f"{med['head'][n] / med['full'][n]:10.2f} {str(b['equal'][n]):>6}")
    return "\n".join(lines)
