"""Exact output distributions of speculative sampling, by enumeration in float64 (chapter 6).

Two computations, both calling the rule's own pieces from :mod:`specnb.sampling`
(``acceptance_probability`` and a residual function), so they check the code
the decoding loop runs, not a second copy of the maths:

* :func:`first_token_distribution`: the distribution of the first token a round
  emits, given p, the q the draft samples from, and the q it reports. Any
  vocabulary size (a loop over drafted tokens only when the residual depends on
  the drafted token).
* :func:`emitted_distribution`: the joint distribution of the first
  ``n_tokens`` tokens emitted by rounds of k drafts on a first-order Markov
  model (target ``P: (V, V)``, draft ``Q: (V, V)``, rows are next-token
  distributions), across round boundaries. Enumerates every path: keep V, k
  and n_tokens small (V^k drafts per round).

Not covered: exact rational arithmetic (float64 is exact to about 1e-16 per
operation, far below the 1e-12 the tests ask for), models with longer memory.
"""
from __future__ import annotations

import torch

from .sampling import DTYPE, Residual, acceptance_probability, residual


def first_token_distribution(p: torch.Tensor, q_draw: torch.Tensor, q_report: torch.Tensor | None = None,
                             residual_fn: Residual = residual, min_weight: float = 0.0,
                             chunk: int = 1) -> torch.Tensor:
    """``P(first emitted token = x)`` for ``p, q: (V,)`` -> ``(V,)``.

    Sum over the drafted token t ~ q_draw of: accept (prob ``a(t) = min(1, p(t)/q_report(t))``,
    emit t) or reject (emit from ``residual_fn(p, q_report, t)``). For a residual
    that depends on t, drafted tokens whose rejection has probability below
    ``min_weight`` may be skipped (to save time on a real vocabulary): each cell
    of the result is then off by at most their total, below ``V * min_weight``.
    """
    p, q_draw = p.to(DTYPE), q_draw.to(DTYPE)
    q_report = q_draw if q_report is None else q_report.to(DTYPE)
    a = acceptance_probability(p, q_report)  # (V,): a(t) for every t
    out = q_draw * a  # accepted drafts emit themselves
    w = q_draw * (1 - a)  # (V,): probability of drafting t and rejecting it
    if not getattr(residual_fn, "uses_draft_token", True):
        return out + w.sum() * residual_fn(p, q_report, None)
    drafted = (w > min_weight).nonzero().squeeze(-1)
    for start in range(0, len(drafted), chunk):  # ``chunk`` drafted tokens at once: (chunk, V); 1 is fastest on CPU
        t = drafted[start:start + chunk]
        out = out + (w[t, None] * residual_fn(p, q_report, t)).sum(0)
    return out


def _round_paths(P, Q_draw, Q_report, state, k, need, residual_fn, weight, emitted, paths):
    """Append (probability, emitted tokens) for every way one round can go, stopping once ``need`` are emitted."""
    if len(emitted) >= need or weight == 0:
        if weight:
            paths.append((weight, tuple(emitted[:need])))
        return
    if len(emitted) == k:  # 3. all k accepted: the bonus token from the target
        for x in P[state].nonzero().squeeze(-1).tolist():
            _round_paths(P, Q_draw, Q_report, x, k, need, residual_fn, weight * P[state, x], emitted + [x], paths)
        return
    p, qd, qr = P[state], Q_draw[state], Q_report[state]
    a = acceptance_probability(p, qr)
    for t in qd.nonzero().squeeze(-1).tolist():
        # 1. accepted: t is emitted and the next draft and target distributions condition on it
        _round_paths(P, Q_draw, Q_report, t, k, need, residual_fn, weight * qd[t] * a[t], emitted + [t], paths)
        # 2. rejected: one token from the residual ends the round
        reject = weight * qd[t] * (1 - a[t])
        if reject > 0:
            r = residual_fn(p, qr, t)
            for x in r.nonzero().squeeze(-1).tolist():
                paths.append((reject * r[x], tuple(emitted + [x])[:need]))


def emitted_distribution(P: torch.Tensor, Q_draw: torch.Tensor, start: int, k: int, n_tokens: int,
                         Q_report: torch.Tensor | None = None, residual_fn: Residual = residual) -> torch.Tensor:
    """Joint distribution ``(V,) * n_tokens`` of the first ``n_tokens`` emitted after token ``start``.

    Rounds of ``k`` drafts follow each other; a new round starts from the last
    emitted token, as in :func:`specnb.decode.speculative_sample`.
    """
    P, Q_draw = P.to(DTYPE), Q_draw.to(DTYPE)
    Q_report = Q_draw if Q_report is None else Q_report.to(DTYPE)
    V = P.shape[0]
    out = torch.zeros((V,) * n_tokens, dtype=DTYPE)

    def rounds(state: int, prefix: tuple, weight: torch.Tensor) -> None:
        paths: list = []
        _round_paths(P, Q_draw, Q_report, state, k, n_tokens - len(prefix), residual_fn, weight, [], paths)
        for w, emitted in paths:
            seq = prefix + emitted
            if len(seq) >= n_tokens:
                out[seq[:n_tokens]] += w
            else:
                rounds(seq[-1], seq, w)

    rounds(start, (), torch.tensor(1.0, dtype=DTYPE))
    return out


def target_distribution(P: torch.Tensor, start: int, n_tokens: int) -> torch.Tensor:
    """The target's own joint of ``n_tokens`` tokens after ``start``: products of P's rows."""
    P = P.to(DTYPE)
    out = P[start]
    for _ in range(n_tokens - 1):
        out = out.unsqueeze(-1) * P  # (..., V, 1) * (V, V): P[x_j, x_{j+1}] on the last two axes
    return out


def total_variation(a: torch.Tensor, b: torch.Tensor) -> float:
    """``(1/2) sum |a - b|`` over all cells."""
    return 0.5 * float((a.to(DTYPE) - b.to(DTYPE)).abs().sum())


def scalar_alpha_is_exact(p: torch.Tensor, q: torch.Tensor, tol: float = 1e-12) -> bool:
    """When the scalar-alpha residual ``norm((p - alpha q)^+)`` still gives an exact round, ``p, q: (V,)``.

    A drafted t is rejected only if ``p(t) < q(t)``, so ``alpha = p(t)/q(t) < 1``. The round is exact iff,
    for every such t, ``(p - alpha q)^+`` is proportional to ``(p - q)^+``: no token x other than t has
    ``alpha q(x) < p(x) <= q(x)``, and ``p(x)/q(x)`` is the same for every x with ``p(x) > q(x)``
    (chapter 6 proves it). Float comparisons use ``tol``.
    """
    p, q = p.to(DTYPE), q.to(DTYPE)
    above = p > q + tol  # S: the tokens the residual must refill
    ratio = (p / q)[above]  # inf where q(x) = 0 < p(x)
    if bool(torch.isinf(ratio).any()):
        equal_ratios = bool(torch.isinf(ratio).all())
    else:
        equal_ratios = len(ratio) == 0 or float(ratio.max() - ratio.min()) <= 1e-9 * float(ratio.max())
    for t in ((p < q - tol) & (q > 0)).nonzero().squeeze(-1).tolist():  # every draft that can be rejected
        alpha = p[t] / q[t]
        middle = (alpha * q < p - tol) & (p <= q + tol)
        middle[t] = False
        if bool(middle.any()) or not equal_ratios:
            return False
    return True
