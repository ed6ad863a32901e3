"""Chapter 5's refined model extended to token trees (chapter 8): accepted length from acceptance by depth and rank.

A static tree's nodes are rank paths (:mod:`specnb.tree_drafts`): ``(0,)`` the head's top token at
depth 1, ``(1, 0)`` the top token after its second one. Let A[d][r] be the probability that the
target's token at depth d is the head's rank-r candidate, given that the walk reached depth d - 1.
A node is on the accepted path when every step of its rank path was the target's token, so

    E[tokens per round] = 1 + sum over nodes of  A[1][r_1] * A[2][r_2] * ... * A[d][r_d]

(the 1 is the target's own token), assuming each step depends only on its depth and rank, as
chapter 5's refined model assumes of a chain's a_i. With T(n) the verify forward's time and
c_round the draft's time per round, both over T(1), the predicted speedup is

    E[tokens per round] / (T(N + 1) / T(1) + c_round).

A comes from the walks of calibration runs (:func:`rank_acceptance`); it is estimated only where
the calibration trees offered that rank at that depth.
"""
from __future__ import annotations

import math

import numpy as np

from .tree_drafts import check_shape


def rank_acceptance(records: list[dict], depths: int = 4, ranks: int = 3) -> np.ndarray:
    """``A: (depths, ranks)`` from tree runs' walks (records of :func:`specnb.sweep.run_record`); nan where
    no calibration tree offered that rank at that depth."""
    num = np.zeros((depths, ranks))
    den = np.zeros((depths, ranks))
    for rec in records:
        for taken, offered in rec.get("walks", ()):
            for d, o in enumerate(offered[:depths]):
                den[d, :min(o, ranks)] += 1
                if d < len(taken) and taken[d] < ranks:
                    num[d, taken[d]] += 1
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.maximum(den, 1), np.nan)


def expected_tokens(shape, A: np.ndarray, n_nodes: int | None = None) -> float:
    """E[tokens per round] of a static shape (its first ``n_nodes`` nodes, as the draft keeps them)."""
    paths = check_shape(shape)[:n_nodes]
    total = 1.0
    for path in paths:
        prob = 1.0
        for d, r in enumerate(path):
            a = A[d, r] if d < A.shape[0] and r < A.shape[1] else math.nan
            if math.isnan(a):
                raise ValueError(f"no calibration estimate of acceptance at depth {d + 1}, rank {r}: "
                                 "calibrate with a tree that offers it")
            prob *= a
        total += prob
    return total


def predict_speedup(shape, A: np.ndarray, n_nodes: int, verify: dict[int, float], c_round: float) -> float:
    """Predicted speedup of a static tree: E[tokens per round] / (T(N+1)/T(1) + c_round)."""
    n = len(check_shape(shape)[:n_nodes])
    if n + 1 not in verify:
        raise ValueError(f"need T({n + 1})/T(1) in verify (have n = {sorted(verify)})")
    return expected_tokens(shape, A, n_nodes) / (verify[n + 1] + c_round)
