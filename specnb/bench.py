"""Benchmarks that print ratios measured side by side in one run.

These machines are noisy, so absolute tokens per second drift from run to run;
what is comparable is a ratio of two loops timed alternately (A, B, A, B, ...) on
the same prompts in the same process. Nothing here is a timed test.

* :func:`baseline_vs_generate`: specnb's plain greedy loop against transformers'
  own ``generate`` (greedy). Our baseline must not be a strawman: the ratio
  should be close to 1 or better.
* :func:`speculative_vs_greedy`: speculative greedy with a given draft against
  specnb's plain greedy.

Not covered: the sweep over k and drafts (chapter 4).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from .decode import greedy, speculative_greedy
from .drafts import Draft
from .prompts import Prompt, encode


@dataclass
class PairedTiming:
    """Tokens per second of two methods, timed alternately on the same prompts."""

    name_a: str
    name_b: str
    tps_a: list[float]  # one per (prompt, repeat)
    tps_b: list[float]
    identical: int  # runs where both produced the same tokens
    runs: int

    @property
    def ratios(self) -> list[float]:
        return [a / b for a, b in zip(self.tps_a, self.tps_b)]

    def summary(self) -> str:
        r = self.ratios
        q = statistics.quantiles(r, n=4) if len(r) >= 2 else [r[0]] * 3
        return (f"{self.name_a}: {statistics.median(self.tps_a):.2f} tok/s   "
                f"{self.name_b}: {statistics.median(self.tps_b):.2f} tok/s   "
                f"ratio {self.name_a}/{self.name_b}: median {statistics.median(r):.3f} "
                f"(quartiles {q[0]:.3f}-{q[2]:.3f}, {len(r)} paired runs); "
                f"identical tokens in {self.identical}/{self.runs}")


@torch.inference_mode()
def hf_generate(model, ids: list[int], max_new_tokens: int, eos_token_id: int | None) -> tuple[list[int], float]:
    """transformers' ``generate``, greedy; returns (new tokens, seconds)."""
    x = torch.tensor([ids])
    start = time.perf_counter()
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=eos_token_id, pad_token_id=eos_token_id)
    seconds = time.perf_counter() - start
    return out[0, len(ids):].tolist(), seconds


def baseline_vs_generate(model, tokenizer, prompts: list[Prompt], max_new_tokens: int = 64,
                         repeats: int = 3) -> PairedTiming:
    """specnb greedy vs transformers ``generate``, alternating, after one warm-up of each."""
    eos = tokenizer.eos_token_id
    warm = encode(tokenizer, prompts[0])
    greedy(model, warm, 4, eos)
    hf_generate(model, warm, 4, eos)
    result = PairedTiming("specnb greedy", "transformers generate", [], [], 0, 0)
    for r in tqdm(range(repeats * len(prompts)), desc="baseline vs generate"):
        ids = encode(tokenizer, prompts[r % len(prompts)])
        order = (0, 1) if r % 2 == 0 else (1, 0)  # alternate who goes first
        for which in order:
            if which == 0:
                ours = greedy(model, ids, max_new_tokens, eos)
            else:
                theirs, seconds = hf_generate(model, ids, max_new_tokens, eos)
        result.tps_a.append(ours.tokens_per_second)
        result.tps_b.append(len(theirs) / seconds)
        result.identical += ours.tokens == theirs
        result.runs += 1
    return result


def speculative_vs_greedy(model, tokenizer, draft: Draft, prompts: list[Prompt], k: int,
                          max_new_tokens: int = 64, repeats: int = 3) -> PairedTiming:
    """Speculative greedy with ``draft`` vs specnb's plain greedy, alternating."""
    eos = tokenizer.eos_token_id
    result = PairedTiming(f"speculative ({draft.name}, k={k})", "plain greedy", [], [], 0, 0)
    for r in tqdm(range(repeats * len(prompts)), desc=f"{draft.name} k={k}"):
        ids = encode(tokenizer, prompts[r % len(prompts)])
        order = (0, 1) if r % 2 == 0 else (1, 0)
        for which in order:
            if which == 0:
                spec = speculative_greedy(model, draft, ids, k, max_new_tokens, eos)
            else:
                base = greedy(model, ids, max_new_tokens, eos)
        result.tps_a.append(spec.tokens_per_second)
        result.tps_b.append(base.tokens_per_second)
        result.identical += spec.tokens == base.tokens
        result.runs += 1
    return result
