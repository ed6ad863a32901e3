"""Is a sampler's output distributed as p? Total variation and a chi-square test (chapter 6).

:func:`chi_square_test` bins the vocabulary into the most likely tokens under p
(each with an expected count of at least ``min_expected``) plus one pooled bin
for the tail, and compares observed with expected counts. At level ``alpha`` a
correct sampler is rejected with probability ``alpha`` (the false-alarm rate);
a biased one is rejected more often, the more so the more samples there are
(the power). :func:`rejection_rate` measures both by repetition.


:func:`later_token_test` tests a *later* token: the second token of each run against the target's
exact p(. | prompt, that run's first token), pooled over every run through the probability
integral transform; it exercises what a loop carries between rounds (caches, their rollback, a
draft's own state).

Not covered: exact multinomial tests, and dependence over more than two tokens
(the joint over several tokens is checked exactly by :mod:`specnb.exact`).
"""
from __future__ import annotations

import math
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


def pit_values(tokens: torch.Tensor, ps: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Randomized probability integral transform of sampled ``tokens: (n,)`` under their own ``ps: (n, V)``.

    With the vocabulary ordered by decreasing p, ``u = F(x-) + U * p(x)`` (U uniform): if each token
    was drawn from its row of ``ps``, the n values are independent and uniform on [0, 1), whatever
    the rows are. A sampler that puts too much mass on tokens p finds unlikely pushes u up.
    """
    ps = ps.to(torch.float64)
    order = ps.argsort(dim=-1, descending=True)
    sorted_p = ps.gather(-1, order)
    rank = (order == tokens[:, None]).float().argmax(-1)  # (n,) position of each token in its row's order
    below = torch.cumsum(sorted_p, -1).gather(-1, rank[:, None])[:, 0] - sorted_p.gather(-1, rank[:, None])[:, 0]
    own = sorted_p.gather(-1, rank[:, None])[:, 0]
    return below + torch.rand(len(tokens), generator=generator, dtype=torch.float64) * own


def later_token_test(first: torch.Tensor, second: torch.Tensor, p_given: Callable[[int], torch.Tensor],
                     bins: int = 10, seed: int = 0) -> ChiSquare:
    """Does ``second: (n,)`` follow p(. | prefix, first) for every run? ``p_given(x) -> (V,)``.

    Pools every run, whatever its first token (:func:`pit_values` against its own conditional p), and
    tests the n values for uniformity with a chi-square over ``bins`` equal bins. ``bins`` is the
    number of bins, ``tail_mass`` 0 (no run is left out).
    """
    if len(first) < 5 * bins:
        raise ValueError(f"{len(first)} samples for {bins} bins: draw at least {5 * bins} samples")
    cache: dict[int, torch.Tensor] = {}
    ps = torch.stack([cache.setdefault(int(x), p_given(int(x))).to(torch.float64) for x in first.tolist()])
    u = pit_values(second, ps, torch.Generator().manual_seed(seed))
    counts = torch.bincount((u * bins).long().clamp(max=bins - 1), minlength=bins).to(torch.float64)
    expected = len(u) / bins
    stat = float(((counts - expected) ** 2 / expected).sum())
    return ChiSquare(stat, bins - 1, chi2_sf(stat, bins - 1), bins, 0.0)


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


def false_alarm_chance(trials: int, allowed: int, alpha: float = 0.01) -> float:
    """P(a correct sampler is rejected in more than ``allowed`` of ``trials`` repeats at level ``alpha``).

    The repeats are independent, so the count is Binomial(trials, alpha): this is the chance that an
    assert "at most ``allowed`` false alarms" fails the build for a sampler that is right.
    """
    return sum(math.comb(trials, j) * alpha ** j * (1 - alpha) ** (trials - j) for j in range(allowed + 1, trials + 1))
