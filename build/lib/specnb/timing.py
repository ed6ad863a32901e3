"""How long one target forward takes, as a function of how many tokens it feeds (chapter 1).

Three measurements, all on the machine at hand:

* :func:`forward_time_curve`: T(n), the wall time of one forward of n new
  tokens through a KV cache that already holds a fixed context. A verify
  forward of k drafts is T(k+1); plain decoding is T(1) per token.
* :func:`decode_latencies`: per-token wall time of plain cached greedy decoding,
  and :func:`decode_vs_t1`, the same paired step by step with T(1) forwards.
* :func:`memory_bandwidth_gbps` and :func:`weight_bytes`: the bandwidth floor,
  weight bytes / bandwidth, below which no per-token forward can go if every
  weight is read once from memory.

Not covered: batches of sequences, GPU timing (no ``cuda.synchronize`` here:
a GPU run would need it), and energy or FLOP counts. Timings are wall clock
(``time.perf_counter``) and noisy; report medians and quartiles, compare ratios.
"""
from __future__ import annotations

import time

import numpy as np
import torch
from tqdm.auto import tqdm

from .cache import forward, new_cache, prefilled, rollback
from .env import machine_info


def _stats(times: list[float]) -> dict:
    q1, med, q3 = np.percentile(times, [25, 50, 75])
    return {"median": float(med), "q1": float(q1), "q3": float(q3), "min": float(min(times))}


def lead_in_forward(model: torch.nn.Module, new: list[int], cache) -> None:
    """One untimed one-token forward, rolled back: what precedes every timed forward of a T(n) curve
    (:func:`forward_time_curve`, and the kernels' own timing), so each is timed after a one-token step."""
    forward(model, new[:1], cache, logits_to_keep=1)
    rollback(cache, 1)


@torch.inference_mode()
def forward_time_curve(model: torch.nn.Module, ns=(1, 2, 4, 8, 16), context_len: int = 64,
                       repeats: int = 10, warmup: int = 2, seed: int = 0, progress: bool = True,
                       lead_in: bool = True) -> dict:
    """T(n) for each n in ``ns``: seconds for one forward of n new tokens after ``context_len`` cached ones.

    The cache is prefilled once with ``context_len`` seeded random token ids
    (shape ``(1, context_len)``). Each timing feeds n more ids, ``logits: (n, vocab)``
    (every position through the LM head, as a verify forward needs), then rolls
    the cache back by n. The n values are interleaved round-robin within each
    repeat, so slow drifts of a noisy machine hit every n alike.

    Each timed forward follows an untimed one-token forward (the lead-in), as every forward
    of decoding follows a one-token step. Without it, the first n of a round is timed right
    after the previous round's largest forwards, and reads slow: on an Intel Xeon (2 cores,
    mixed kernels) T(1) read 34-35 ms that way, in a notebook and in a plain process alike,
    against 31.1 ms with the lead-in and 31.4 ms per plain decoding step, which turned a
    two-token verify's T(2)/T(1) of 1.01-1.03 into 0.91-0.92 (38.7 ms and 0.84 in one build's
    chapter 1). ``lead_in=False`` times the bare round-robin.

    Returns ``{"ns": [...], "context_len": int, "times": {n: [s, ...]},
    "median": {n: s}, "q1": {n: s}, "q3": {n: s}, "min": {n: s}, "machine": machine_info()}``.
    """
    ns = [int(n) for n in ns]
    cache, new = prefilled(model, context_len, max(ns), seed)
    times: dict[int, list[float]] = {n: [] for n in ns}
    for r in tqdm(range(warmup + repeats), desc="T(n) rounds", disable=not progress):
        for n in ns:
            if lead_in:
                lead_in_forward(model, new, cache)
            t0 = time.perf_counter()
            forward(model, new[:n], cache, logits_to_keep=0)
            dt = time.perf_counter() - t0
            rollback(cache, n)
            if r >= warmup:
                times[n].append(dt)
    stats = {n: _stats(t) for n, t in times.items()}
    return {"ns": ns, "context_len": context_len, "times": times,
            **{key: {n: s[key] for n, s in stats.items()} for key in ("median", "q1", "q3", "min")},
            "machine": machine_info(model)}


def _decode_steps(model: torch.nn.Module, prompt_ids: list[int]):
    """Cached greedy decoding after an untimed prefill; yields the seconds of each 1-token step."""
    cache = new_cache(model)  # cache.forward runs under inference_mode itself
    token = int(forward(model, list(prompt_ids), cache, logits_to_keep=1)[-1].argmax())
    while True:
        t0 = time.perf_counter()
        logits = forward(model, [token], cache, logits_to_keep=1)  # (1, vocab)
        token = int(logits[-1].argmax())
        yield time.perf_counter() - t0


def decode_latencies(model: torch.nn.Module, prompt_ids: list[int], n_tokens: int) -> list[float]:
    """Seconds per token of plain cached greedy decoding, prefill excluded (``n_tokens`` values).

    Same loop as :func:`specnb.decode.greedy`: each token is one 1-token forward,
    ``logits: (1, vocab)``, then argmax.
    """
    steps = _decode_steps(model, prompt_ids)
    return [next(steps) for _ in range(n_tokens)]


@torch.inference_mode()
def decode_vs_t1(model: torch.nn.Module, prompt_ids: list[int], n_tokens: int, context_len: int = 64,
                 seed: int = 0) -> dict:
    """Paired samples: each decode step (as in :func:`decode_latencies`) is followed by one
    timed T(1) forward through a fixed ``context_len`` cache, so load from other processes
    hits both alike. Returns ``{"decode": [s] * n_tokens, "t1": [s] * n_tokens}``.
    """
    cache, new = prefilled(model, context_len, 1, seed)
    steps, out = _decode_steps(model, prompt_ids), {"decode": [], "t1": []}
    for _ in range(n_tokens):
        out["decode"].append(next(steps))
        t0 = time.perf_counter()
        forward(model, new, cache, logits_to_keep=0)
        out["t1"].append(time.perf_counter() - t0)
        rollback(cache, 1)
    return out


@torch.inference_mode()
def memory_bandwidth_gbps(mbytes: int = 512, repeats: int = 5) -> float:
    """Achievable read bandwidth in GB/s (1e9 bytes/s): best of ``repeats`` sums of a float32 tensor of ``mbytes`` MB."""
    x = torch.ones(mbytes * 1_000_000 // 4, dtype=torch.float32)  # (mbytes*250_000,)
    x.sum()  # touch every page once before timing
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters, each tensor counted once (tied embedding and LM head share one)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        ptr = p.data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += p.numel() * p.element_size()
    return total


@torch.inference_mode()
def cost_ratio(target: torch.nn.Module, draft: torch.nn.Module, context_len: int = 64, repeats: int = 10,
               warmup: int = 2, seed: int = 0, progress: bool = True) -> dict:
    """c = (one draft forward) / (one target forward), each a 1-token decode step through a cache.

    Both caches are prefilled with ``context_len`` seeded random ids; then draft and
    target steps alternate (``logits: (1, vocab)`` each, cache rolled back after), so
    a noisy machine slows both alike. Works for shape twins (chapter 4), whose cost
    is the real models' cost. Returns ``{"c": median of paired ratios, "c_q1", "c_q3",
    "t_target": median s, "t_draft": median s, "machine": machine_info()}``.
    """
    vocab = min(target.config.vocab_size, draft.config.vocab_size)  # the same ids mean something to both
    caches, new = {}, None
    for name, model in (("target", target), ("draft", draft)):
        caches[name], new = prefilled(model, context_len, 1, seed, vocab)
    times: dict[str, list[float]] = {"target": [], "draft": []}
    for r in tqdm(range(warmup + repeats), desc="c: draft vs target forward", disable=not progress):
        for name, model in (("draft", draft), ("target", target)):
            t0 = time.perf_counter()
            forward(model, new, caches[name], logits_to_keep=1)
            dt = time.perf_counter() - t0
            rollback(caches[name], 1)
            if r >= warmup:
                times[name].append(dt)
    ratios = np.array(times["draft"]) / np.array(times["target"])
    q1, med, q3 = np.percentile(ratios, [25, 50, 75])
    return {"c": float(med), "c_q1": float(q1), "c_q3": float(q3),
            "t_target": float(np.median(times["target"])), "t_draft": float(np.median(times["draft"])),
            "machine": machine_info(target)}


@torch.inference_mode()
def head_cost_ratio(target: torch.nn.Module, head, context_len: int = 64, repeats: int = 20, seed: int = 0) -> dict:
    """c of chapter 7's draft head: one head step (a drafted token) / one 1-token target forward.

    Both run after ``context_len`` cached positions (random tokens; features from the
    target's own prefill), alternating, each rolled back after it is timed. c is defined as in
    :func:`cost_ratio` (the notation page's one definition): the median of the paired ratios.
    Returns ``{"c", "c_q1", "c_q3", "t1": median target s, "head": median head s}``.
    """
    from transformers import DynamicCache

    from .cache import forward_features
    from .head import causal_mask

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.config.vocab_size, (context_len + 1,), generator=gen).tolist()
    cache = new_cache(target)
    _, feats = forward_features(target, ids[:-1], cache, logits_to_keep=1, layers=head.cfg.feature_layers)
    hcache = DynamicCache()
    pred = head(feats[None, :-1], torch.tensor([ids[1:-1]]), torch.arange(context_len - 1)[None], None, hcache)[:, -1:]
    t_target, t_head = [], []
    for r in range(repeats + 2):
        t0 = time.perf_counter()
        forward(target, [ids[-1]], cache, logits_to_keep=1)
        t1 = time.perf_counter()
        rollback(cache, 1)
        t2 = time.perf_counter()
        out = head(pred, torch.tensor([[ids[-1]]]), torch.tensor([[context_len - 1]]),
                   causal_mask(context_len - 1, 1), hcache)
        int(head.logits(out[0, 0]).argmax())
        t3 = time.perf_counter()
        rollback(hcache, 1)
        if r >= 2:
            t_target.append(t1 - t0)
            t_head.append(t3 - t2)
    q1, med, q3 = np.percentile(np.array(t_head) / np.array(t_target), [25, 50, 75])
    return {"c": float(med), "c_q1": float(q1), "c_q3": float(q3),
            "t1": float(np.median(t_target)), "head": float(np.median(t_head))}
