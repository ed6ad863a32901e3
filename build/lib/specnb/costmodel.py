"""Cost models of speculative decoding (chapter 5): what speedup a draft should give.

Symbols as in Leviathan et al. (2023) and the book: ``a`` the probability that a
drafted token is accepted, ``c`` the cost ratio (one draft forward / one target
forward), ``k`` tokens drafted per round.

* The simple model (Leviathan et al., section 3): with each draft accepted
  independently with probability ``a``, a round emits
  ``E = (1 - a^(k+1)) / (1 - a)`` tokens and costs ``C = k*c + 1`` target
  forwards, so the speedup is ``E / C`` (:func:`speedup`). The "1" says a verify
  forward of k+1 tokens costs what a one-token forward costs.
* The refined model (:func:`refined_speedup`): the measured forward-time curve
  T(n) replaces that "1" by ``T(k+1)/T(1)``, and measured per-position acceptance
  replaces the single ``a``.
* :func:`naive_speedup`: ``(1 + k*a) / (1 + k*a/draft_speedup)``, a formula from a
  public explainer, kept to show that it is wrong (the book's chapter 5).

Everything broadcasts over numpy arrays. Not covered: tree drafts, batches,
sampling-mode acceptance (which chapter 6 relates to the overlap of p and q).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np


def expected_tokens(a, k):
    """E = (1 - a^(k+1)) / (1 - a): expected tokens a round emits (accepted drafts + the target's own).

    ``a`` in [0, 1], ``k >= 0``; at ``a == 1`` the limit k + 1.
    """
    a = np.asarray(a, dtype=float)
    k = np.asarray(k, dtype=float)
    if np.any((a < 0) | (a > 1)):
        raise ValueError(f"acceptance a must lie in [0, 1], got {a}")
    with np.errstate(divide="ignore", invalid="ignore"):
        e = (1 - a ** (k + 1)) / (1 - a)
    return np.where(a == 1, k + 1, e)[()]


def draft_cost_per_round(draft_seconds: float, rounds: int, t1: float) -> float:
    """A round's draft time in target forwards: the draft's seconds per round / T(1), T(1) being the
    seconds per token of plain greedy decoding paired with the loop. This is the ``k c`` of
    :func:`round_cost` (:func:`loop_c` divides it by k). ``nan`` for a run with no rounds."""
    if rounds <= 0:
        return float("nan")
    if t1 <= 0 or draft_seconds < 0:
        raise ValueError(f"loop_c needs k >= 1, T(1) > 0 and draft seconds >= 0 (draft_cost_per_round the "
                         f"last two), got t1={t1}, draft_seconds={draft_seconds}")
    return draft_seconds / rounds / t1


def loop_c(draft_seconds: float, rounds: int, k: int, t1: float) -> float:
    """c measured inside a decoding loop: the draft's seconds per round / k, in units of T(1).

    The notation page's c is one draft forward / one target forward. Two ways to measure it, one
    definition: timed apart (:func:`specnb.timing.cost_ratio`, :func:`specnb.timing.head_cost_ratio`:
    the median of paired one-token forwards) or, here, from a loop's own draft time, with T(1)
    the seconds per token of plain greedy decoding paired with it. A draft that runs one forward
    per drafted token and drafts k every round gives exactly that ratio; one that drafts fewer
    (prompt lookup, a confidence threshold) is charged its whole round's draft time over k
    positions, so that a round's draft cost (:func:`draft_cost_per_round`) is k c target forwards,
    as :func:`round_cost` counts it. For a tree, k is the most nodes a round drafts. ``nan`` for a
    run with no rounds.
    """
    if k < 1:
        raise ValueError(f"loop_c needs k >= 1, T(1) > 0 and draft seconds >= 0, got k={k}")
    return draft_cost_per_round(draft_seconds, rounds, t1) / k


def accepted_per_drafted(a, k):
    """(E - 1) / k: accepted drafts / drafted tokens that independent acceptance ``a`` at every
    position gives with k drafts a round, a (1 - a^k) / (k (1 - a)); at k = 1 it is a itself."""
    return (expected_tokens(a, k) - 1) / np.asarray(k, dtype=float)


def accepted_per_drafted_given(a: float, drafted_hist) -> float:
    """Accepted / drafted under independent acceptance ``a`` when the rounds drafted different numbers
    of tokens: ``drafted_hist[m]`` rounds drafted m (prompt lookup often drafts fewer than k).
    Each round of m drafts accepts E(a, m) - 1 on average, so the ratio is
    sum_m h_m (E(a, m) - 1) / sum_m h_m m; with every round at k it is :func:`accepted_per_drafted`."""
    h = np.asarray(drafted_hist, dtype=float)
    m = np.arange(len(h))
    drafted = float((h * m).sum())
    if drafted == 0:
        return float("nan")
    return float((h * (expected_tokens(a, m) - 1)).sum() / drafted)


def round_cost(c, k, verify=1.0):
    """C = k*c + verify: a round's cost in target forwards (``verify`` = T(k+1)/T(1); 1 in the simple model)."""
    c = np.asarray(c, dtype=float)
    if np.any(c < 0):
        raise ValueError(f"cost ratio c must be >= 0, got {c}")
    return k * c + np.asarray(verify, dtype=float)


def speedup(a, c, k, verify=1.0):
    """E / C: the simple model's speedup over plain decoding (``verify`` as in :func:`round_cost`)."""
    return expected_tokens(a, k) / round_cost(c, k, verify)


def optimal_k(a, c, k_max: int = 64, verify: Mapping[int, float] | None = None):
    """The k in 1..k_max with the highest speedup, and that speedup: ``(k, speedup)``, broadcast over a and c.

    ``verify`` maps n to T(n)/T(1), so a verify of k drafts costs ``verify[k+1]``
    (a missing n takes the nearest measured one below); ``None`` is the simple model's 1.
    """
    a, c = np.broadcast_arrays(np.asarray(a, dtype=float), np.asarray(c, dtype=float))
    ks = np.arange(1, k_max + 1)
    v = np.array([1.0 if verify is None else _lookup(verify, int(k) + 1) for k in ks])
    s = speedup(a[..., None], c[..., None], ks, v)  # (..., k_max)
    best = s.argmax(axis=-1)
    return (ks[best])[()], np.take_along_axis(s, best[..., None], axis=-1)[..., 0][()]


def pays(a, c, k_max: int = 64, verify: Mapping[int, float] | None = None):
    """True where some k in 1..k_max gives a speedup above 1.

    In the simple model this is exactly ``a > c``: at k = 1 the speedup is
    (1 + a)/(1 + c), and if a <= c then E = 1 + a + ... + a^k <= 1 + k*a <= 1 + k*c = C
    for every k. Chapter 5 checks this on a grid.
    """
    return optimal_k(a, c, k_max, verify)[1] > 1


def _lookup(table: Mapping[int, float], n: int) -> float:
    if n in table:
        return float(table[n])
    below = [m for m in table if m <= n]
    if not below:
        raise KeyError(f"no measured value at or below {n}")
    return float(table[max(below)])


def expected_tokens_positional(survival: Sequence[float]) -> float:
    """E = 1 + sum_i s_i, where ``survival[i-1]`` = s_i = P(at least i drafts accepted in a round).

    With per-position acceptance a_1..a_k (a_i = P(draft i accepted | drafts 1..i-1 were))
    and a draft that always proposes k tokens, s_i = a_1 * ... * a_i. With a single a
    this is :func:`expected_tokens`.
    """
    return 1.0 + float(np.sum(survival))


def refined_speedup(survival: Sequence[float], c: float, k: int, verify_cost: float) -> float:
    """The refined model: ``E_positional / (k*c + verify_cost)``.

    ``survival`` as in :func:`expected_tokens_positional` (measured), ``c`` the
    measured cost ratio, ``verify_cost`` the mean of T(m+1)/T(1) over rounds, m the
    tokens actually drafted that round (T from the measured curve of chapter 1).
    """
    return expected_tokens_positional(survival) / (k * c + verify_cost)


def naive_speedup(a, k, draft_speedup):
    """``(1 + k*a) / (1 + k*a/draft_speedup)``: the wrong formula of a public explainer.

    With ``draft_speedup = 1/c`` it is (1 + k*a)/(1 + k*a*c). It counts k*a accepted
    tokens (as if a rejection did not end the round) and charges the draft only
    for accepted tokens; the verify pass it charges one target forward (the 1 of its
    denominator), as the simple model does. At a = 0 it predicts 1x where
    a useless draft costs k*c extra per token. Chapter 5 shows it against measurement.
    """
    a = np.asarray(a, dtype=float)
    return (1 + k * a) / (1 + k * a / np.asarray(draft_speedup, dtype=float))


def speedup_positional(a1: float, a_rest: float, c: float, k: int, verify: Mapping[int, float]) -> float:
    """Speedup at k with a_1 = ``a1`` and a_i|i-1 = ``a_rest`` for i >= 2: ``(1 + sum_i s_i) / (k c + T(k+1)/T(1))``."""
    survival = [a1 * a_rest ** i for i in range(k)]
    return refined_speedup(survival, c, k, _lookup(verify, k + 1))


def needed_acceptance(target: float, c: float, verify: Mapping[int, float], k_max: int = 8,
                      a_rest: float | None = None) -> tuple[float | None, int | None]:
    """The smallest a_1 that reaches speedup ``target`` at some k <= ``k_max``, and that k.

    ``a_rest``: a_i|i-1 for i >= 2 (None: equal to a_1, one a for every position); ``verify``:
    measured T(n)/T(1). Returns (None, None) when no a_1 <= 1 reaches the target (the break-even
    table of chapter 7).
    """
    best: tuple[float | None, int | None] = (None, None)
    for k in range(1, k_max + 1):
        if k + 1 > max(verify):
            break
        f = (lambda a: speedup_positional(a, a if a_rest is None else a_rest, c, k, verify))
        if f(1.0) < target:
            continue
        lo, hi = 0.0, 1.0
        for _ in range(50):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
        if best[0] is None or hi < best[0]:
            best = (hi, k)
    return best
