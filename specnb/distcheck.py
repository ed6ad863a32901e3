"""Is a sampler's output distributed as p? Total variation and a chi-square test (chapter 6).

:func:`chi_square_test` bins the vocabulary into the most likely tokens under p
(each with an expected count of at least ``min_expected``) plus one pooled bin
for the tail, and compares observed with expected counts. At level ``alpha`` a
correct sampler is rejected with probability ``alpha`` (the false-alarm rate);
a biased one is rejected more often, the more so the more samples there are
(the power). :func:`rejection_rate` measures both by repetition.

Not covered: exact multinomial tests, and tests of dependence between tokens
(the joint over several tokens is checked exactly by :mod:`specnb.exact`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


def chi2_sf(stat: float, df: int) -> float:
    """Upper tail P(X >= stat) of a chi-square with ``df`` degrees of freedom (regularized gamma Q)."""
    s = torch.tensor(stat / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), s))


@dataclass
class ChiSquare:
    stat: float
    df: int
    p_value: float
    bins: int  # tokens with their own bin (the tail is one more)
    tail_mass: float  # p's mass in the pooled tail bin


def chi_square_test(tokens: torch.Tensor, p: torch.Tensor, min_expected: float = 5.0,
                    max_bins: int = 200) -> ChiSquare:
    """Chi-square goodness of fit of sampled ``tokens: (n,)`` to ``p: (V,)``: top tokens, tail pooled."""
    n = len(tokens)
    p = p.to(torch.float64)
    counts = torch.bincount(tokens, minlength=len(p)).to(torch.float64)
    order = p.argsort(descending=True)
    expected = n * p[order]
    top = int(min((expected >= min_expected).sum(), max_bins))
    obs = torch.cat([counts[order[:top]], counts[order[top:]].sum().reshape(1)])
    exp = torch.cat([expected[:top], expected[top:].sum().reshape(1)])
    if exp[-1] < min_expected:  # too little tail to stand alone: merge it into the last bin
        obs = torch.cat([obs[:-2], (obs[-2] + obs[-1]).reshape(1)])
        exp = torch.cat([exp[:-2], (exp[-2] + exp[-1]).reshape(1)])
    if (obs[exp == 0] > 0).any():
        return ChiSquare(float("inf"), len(obs) - 1, 0.0, top, float(p[order[top:]].sum()))
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    return ChiSquare(stat, df, chi2_sf(stat, df), top, float(p[order[top:]].sum()))


def empirical_tv(tokens: torch.Tensor, p: torch.Tensor) -> float:
    """Total variation between the empirical distribution of ``tokens`` and ``p`` (includes sampling noise)."""
    freq = torch.bincount(tokens, minlength=len(p)).to(torch.float64) / len(tokens)
    return 0.5 * float((freq - p.to(torch.float64)).abs().sum())


def rejection_rate(draw: Callable[[torch.Generator], torch.Tensor], p: torch.Tensor, trials: int,
                   alpha: float = 0.01, seed: int = 0) -> float:
    """Fraction of ``trials`` independent samples (``draw(generator) -> tokens``) the test rejects at ``alpha``.

    For a correct sampler this estimates the false-alarm rate (about ``alpha``);
    for a biased one, the power of the test at that sample size.
    """
    generator = torch.Generator().manual_seed(seed)
    rejected = sum(chi_square_test(draw(generator), p).p_value < alpha for _ in range(trials))
    return rejected / trials
