"""Sampling on a tree (chapter 8): several candidate children at one node, and the rule that keeps p.

At a node the target's distribution is p and the draft proposed m children x_1..x_m from q:
drawn independently (``replacement=True``) or one after another without repeats
(``replacement=False``, each from q with the earlier candidates removed and renormalized).

**Multi-candidate rule** (SpecInfer, Miao et al. 2023, arXiv:2305.09781; without replacement as in
Jeon et al. 2024, arXiv:2402.14160): start with r_1 = p; for i = 1..m, accept x_i with probability
min(1, r_i(x_i) / q_i(x_i)), where q_i is the distribution x_i was drawn from; on rejection set
r_{i+1} = norm(max(0, r_i - q_i)); if all m are rejected, draw from r_{m+1}. Each step is chapter 6's
rule with target r_i and proposal q_i, so it outputs exactly r_i whatever q_i is; its rejection
branch hands on r_{i+1}, which the next step outputs exactly; by induction from the last step the
round outputs r_1 = p. (Without replacement q_{i+1} depends on x_i, but the argument holds given
x_i, and r_{i+1}(x_i) = 0 because x_i was rejected, so nothing is lost by removing it.)

**Naive rule** (kept as a negative control): accept the first x_i that passes chapter 6's own test
min(1, p(x_i) / q(x_i)) against the *original* p, else draw from norm(max(0, p - q)). Every
candidate gets its own chance at p, so tokens q likes are over-produced: biased whenever m > 1.

:func:`round_distribution` computes a rule's exact output distribution by enumerating every
candidate sequence (V^m with replacement, V!/(V-m)! without), in float64.
"""
from __future__ import annotations

import itertools

import torch

from .sampling import DTYPE, acceptance_probability, residual, sample_token

RULES = ("multi-candidate", "naive")


def draw_candidates(q: torch.Tensor, m: int, generator: torch.Generator, replacement: bool) -> list[int]:
    """m candidate tokens from ``q: (V,)``: independent, or without repeats (then m <= the support of q)."""
    if replacement:
        return [sample_token(q, generator) for _ in range(m)]
    if m > int((q > 0).sum()):
        raise ValueError(f"cannot draw {m} distinct candidates from a q with {int((q > 0).sum())} tokens of mass")
    qi, out = q.clone(), []
    for _ in range(m):
        t = sample_token(qi, generator)
        out.append(t)
        qi[t] = 0
        qi = qi / qi.sum()
    return out


def proposals(q: torch.Tensor, candidates: list[int], replacement: bool) -> list[torch.Tensor]:
    """q_i for each candidate: q itself (with replacement), or q without the earlier candidates."""
    out, qi = [], q.to(DTYPE)
    for t in candidates:
        out.append(qi)
        if not replacement:
            qi = qi.clone()
            qi[t] = 0
            total = qi.sum()
            qi = qi / total if total > 0 else qi
    return out


def multi_candidate_round(p: torch.Tensor, q: torch.Tensor, candidates: list[int], generator: torch.Generator,
                          replacement: bool = True, rule: str = "multi-candidate") -> tuple[int | None, int]:
    """One node: ``p, q: (V,)``, ``candidates`` drawn from q as :func:`draw_candidates` does.

    Returns (index of the accepted candidate, or None; the token emitted at this node).
    """
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    p, q = p.to(DTYPE), q.to(DTYPE)
    r = p
    for i, (t, qi) in enumerate(zip(candidates, proposals(q, candidates, replacement))):
        u = torch.rand((), generator=generator, dtype=DTYPE)
        if rule == "naive":
            if u < acceptance_probability(p[t], q[t]):
                return i, t
            continue
        if u < acceptance_probability(r[t], qi[t]):
            return i, t
        r = residual(r, qi)
    return None, sample_token(residual(p, q) if rule == "naive" else r, generator)


def _outcome(p: torch.Tensor, q: torch.Tensor, candidates, replacement: bool, rule: str) -> torch.Tensor:
    """The exact output distribution ``(V,)`` of one rule given the candidates (the randomness of u)."""
    out = torch.zeros_like(p)
    reach = torch.ones((), dtype=DTYPE)  # probability that every earlier candidate was rejected
    r = p
    for t, qi in zip(candidates, proposals(q, candidates, replacement)):
        a = acceptance_probability(p[t], q[t]) if rule == "naive" else acceptance_probability(r[t], qi[t])
        out[t] += reach * a
        reach = reach * (1 - a)
        if rule != "naive":
            r = residual(r, qi)
    return out + reach * (residual(p, q) if rule == "naive" else r)


def round_distribution(p: torch.Tensor, q: torch.Tensor, m: int, replacement: bool = True,
                       rule: str = "multi-candidate") -> torch.Tensor:
    """The exact distribution ``(V,)`` of the token a node emits, over the candidates' draws and the rule's.

    ``p, q: (V,)``; enumerates every candidate sequence with its probability (float64).
    """
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    p, q = p.to(DTYPE), q.to(DTYPE)
    V = len(p)
    total = torch.zeros(V, dtype=DTYPE)
    seqs = itertools.product(range(V), repeat=m) if replacement else itertools.permutations(range(V), m)
    for cands in seqs:
        weight = torch.ones((), dtype=DTYPE)
        for t, qi in zip(cands, proposals(q, list(cands), replacement)):
            weight = weight * qi[t]
        if weight > 0:
            total += weight * _outcome(p, q, cands, replacement, rule)
    return total
