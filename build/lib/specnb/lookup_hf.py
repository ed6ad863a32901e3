"""Prompt lookup with transformers' own n-gram rule, as a specnb draft (for side-by-side benchmarks).

transformers' ``PromptLookupCandidateGenerator`` (``generate(prompt_lookup_num_tokens=k)``,
transformers 5.24, ``generation/candidate_generator.py``) chooses its candidates thus:

* n-gram sizes from ``max_matching_ngram_size`` (default 2) down to 1;
* for a size, every window of the whole sequence equal to its last n tokens, in
  order from the *start* of the sequence: the *first* one whose continuation is
  not empty wins (the last window, the n-gram itself, has none);
* the candidates are up to k tokens of that continuation, cut *before* the first
  EOS token; if that leaves none, it proposes nothing this round.

specnb's :class:`~specnb.drafts.PromptLookupDraft` differs on purpose (n-grams up
to 3, the *most recent* match, EOS kept). :class:`HFPromptLookupDraft` reproduces
transformers' rule exactly, so that specnb's loop and transformers' can be timed
with the same proposals: then a difference in tokens/s is loop cost, not draft quality.
Not covered: transformers' ``logits_processor`` check of forbidden candidates
(greedy decoding without processors never forbids a token).
"""
from __future__ import annotations

import numpy as np

from .drafts import Draft


class HFPromptLookupDraft(Draft):
    """transformers' prompt-lookup rule (first match from the start, n-grams up to ``max_ngram``)."""

    def __init__(self, max_ngram: int = 2, name: str | None = None) -> None:
        super().__init__()
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1 (transformers' max_matching_ngram_size), got {max_ngram}")
        self.max_ngram = max_ngram
        self.name = name or f"prompt lookup, transformers' rule (n<={max_ngram}, first match)"

    def propose(self, ids: list[int], k: int) -> list[int]:
        if k <= 0:
            return []
        seq = np.asarray(ids)
        L = len(seq)
        for n in range(min(self.max_ngram, L - 1), 0, -1):
            windows = np.lib.stride_tricks.sliding_window_view(seq, n)  # (L-n+1, n): every window, the last included
            for idx in np.flatnonzero((windows == seq[L - n:]).all(axis=1)):
                start, end = int(idx) + n, min(int(idx) + n + k, L)
                if start < end:
                    out = [int(t) for t in seq[start:end]]
                    if self.eos_token_id is not None and self.eos_token_id in out:
                        out = out[:out.index(self.eos_token_id)]  # transformers cuts before EOS
                    return out
        return []
