"""The cost models of chapter 5: formulas against brute force, the study's figures, and the wrong formula."""
import itertools

import numpy as np
import pytest

from specnb import costmodel as cm
from specnb.decode import speculative_greedy
from specnb.drafts import ModelDraft
from specnb.sweep import run_record


def brute_expected_tokens(a: float, k: int) -> float:
    """Enumerate all 2^k accept/reject patterns of k independent drafts; the round stops at the first reject."""
    total = 0.0
    for pattern in itertools.product([True, False], repeat=k):
        prob = np.prod([a if ok else 1 - a for ok in pattern])
        n = next((i for i, ok in enumerate(pattern) if not ok), k)
        total += prob * (n + 1)
    return total


@pytest.mark.parametrize("a", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_expected_tokens_matches_enumeration(a, k):
    assert cm.expected_tokens(a, k) == pytest.approx(brute_expected_tokens(a, k), abs=1e-12)
    # The positional form with s_i = a^i is the same number.
    assert cm.expected_tokens_positional([a ** i for i in range(1, k + 1)]) == pytest.approx(cm.expected_tokens(a, k))


def test_the_studys_production_figures():
    # Production-style numbers of the SmolLM2/GPT-2 study: c=0.14, a=0.75, k=4 -> 1.96x; c=0.05, a=0.8, k=4 -> 2.80x.
    assert round(float(cm.speedup(0.75, 0.14, 4)), 2) == 1.96
    assert round(float(cm.speedup(0.8, 0.05, 4)), 2) == 2.80
    # SmolLM2 pair (a=0.477, c=0.486, k=4): Leviathan 0.63x, the wrong formula 1.51x.
    assert round(float(cm.speedup(0.477, 0.486, 4)), 2) == 0.63
    assert round(float(cm.naive_speedup(0.477, 4, 1 / 0.486)), 2) == 1.51
    # GPT-2 pair at k=6 with the study's acceptance 0.338 and c=0.181: 0.72x predicted.
    assert round(float(cm.speedup(0.338, 0.181, 6)), 2) == 0.72


def test_pays_iff_a_greater_than_c():
    a = np.linspace(0, 0.99, 100)[:, None]
    c = np.linspace(0, 1, 101)[None, :]
    pays = cm.pays(a, c, k_max=64)
    off_diagonal = np.abs(a - c) > 1e-9
    assert np.array_equal(pays[np.broadcast_to(off_diagonal, pays.shape)],
                          np.broadcast_to(a > c, pays.shape)[np.broadcast_to(off_diagonal, pays.shape)])


def test_optimal_k_is_the_argmax():
    for a, c in [(0.5, 0.1), (0.8, 0.05), (0.3, 0.5), (0.9, 0.01)]:
        k, s = cm.optimal_k(a, c, k_max=20)
        brute = max(range(1, 21), key=lambda kk: float(cm.speedup(a, c, kk)))
        assert k == brute and s == pytest.approx(float(cm.speedup(a, c, brute)))
    # A measured verify cost moves the optimum: verification that costs more favours fewer, surer rounds.
    free_k, _ = cm.optimal_k(0.8, 0.05, k_max=20)
    costly_k, costly_s = cm.optimal_k(0.8, 0.05, k_max=20, verify={n: 1 + 0.3 * (n - 1) for n in range(2, 22)})
    assert costly_k < free_k and costly_s < cm.optimal_k(0.8, 0.05, 20)[1]


def test_naive_formula_is_wrong_where_it_matters():
    # Negative control: a draft that is never right costs k*c per round and gains nothing,
    # so the true speedup is 1/(1 + k*c) < 1; the wrong formula says 1x.
    k, c = 4, 0.3
    assert float(cm.naive_speedup(0.0, k, 1 / c)) == 1.0
    assert float(cm.speedup(0.0, c, k)) == pytest.approx(1 / (1 + k * c))
    # And it disagrees with the enumeration wherever 0 < a < 1.
    for a in (0.2, 0.5, 0.8):
        assert abs(float(cm.naive_speedup(a, k, 1 / c)) - brute_expected_tokens(a, k) / (1 + k * c)) > 0.1


def test_bad_inputs():
    with pytest.raises(ValueError, match="acceptance a"):
        cm.expected_tokens(1.2, 3)
    with pytest.raises(ValueError, match="cost ratio c"):
        cm.speedup(0.5, -0.1, 3)


def test_positional_tokens_match_a_real_loop(target, noisy_draft_model, prompts):
    """E = 1 + sum_i s_i with s_i the product of the per-position rates a_j that the sweep's bookkeeping
    records (accepts / attempts by position) equals the tokens per round the loop emitted; a bookkeeping
    that divides by all rounds instead of the verified ones does not (negative control)."""
    import dataclasses

    import numpy as np

    for k in (2, 4):
        result = speculative_greedy(target, ModelDraft(noisy_draft_model), prompts[3], k, 60)
        assert sum(run_record(result, k)["accepts"]) == result.accepted
        full = [r for r in result.rounds if r.drafted == k]  # rounds not cut by the budget
        rec = run_record(dataclasses.replace(result, rounds=full), k)
        assert all(rec["attempts"]), "every position verified at least once: the check is not vacuous"
        a = np.array(rec["accepts"]) / np.array(rec["attempts"])  # a_i, conditional on the drafts before
        emitted = sum(r.emitted for r in full) / len(full)
        assert cm.expected_tokens_positional(np.cumprod(a)) == pytest.approx(emitted, abs=1e-12)
        wrong = np.array(rec["accepts"]) / len(full)  # unconditional: counts unverified drafts as failures
        assert cm.expected_tokens_positional(np.cumprod(wrong)) != pytest.approx(emitted, abs=1e-3)
        assert 0 < result.acceptance_rate < 1  # a partial draft: the check is not vacuous


def test_needed_acceptance_is_the_break_even_point():
    from specnb.costmodel import needed_acceptance, speedup_positional

    verify = {n: 1.0 + 0.05 * (n - 1) for n in range(1, 12)}
    a, k = needed_acceptance(1.3, 0.07, verify, 8)
    assert 0 < a < 1 and 1 <= k <= 8
    assert abs(speedup_positional(a, a, 0.07, k, verify) - 1.3) < 1e-6
    # no smaller a_1 reaches 1.3x at any k (the search is over k too)
    assert all(speedup_positional(a - 0.01, a - 0.01, 0.07, j, verify) < 1.3 for j in range(1, 9))
    # k = 1 does not care about a_rest; a target above (k+1)/(k c + T(k+1)) for every k is unreachable
    a1, k1 = needed_acceptance(1.3, 0.07, verify, 1, a_rest=0.0)
    assert k1 == 1 and abs((1 + a1) / (0.07 + verify[2]) - 1.3) < 1e-6
    assert needed_acceptance(50.0, 0.07, verify, 8) == (None, None)


def test_loop_c_charges_a_rounds_draft_time_to_k_positions():
    # 10 rounds at k = 4, 0.8 s of draft time, T(1) = 0.05 s: 0.02 s per position = 0.4 T(1)
    assert cm.loop_c(0.8, 10, 4, 0.05) == pytest.approx(0.4)
    # so that k c is the round's draft cost in target forwards, as round_cost counts it
    assert cm.round_cost(cm.loop_c(0.8, 10, 4, 0.05), 4) == pytest.approx(0.8 / 10 / 0.05 + 1)
    assert np.isnan(cm.loop_c(0.0, 0, 4, 0.05))  # no rounds: no measurement
    for bad in ((0.8, 10, 0, 0.05), (0.8, 10, 4, 0.0), (-1.0, 10, 4, 0.05)):
        with pytest.raises(ValueError, match="loop_c needs"):
            cm.loop_c(*bad)


@pytest.mark.parametrize("a", [0.0, 0.3, 0.9, 1.0])
@pytest.mark.parametrize("k", [1, 2, 6])
def test_accepted_per_drafted_matches_the_closed_form(a, k):
    closed = a if a in (0.0, 1.0) or k == 1 else a * (1 - a ** k) / (k * (1 - a))
    assert cm.accepted_per_drafted(a, k) == pytest.approx(closed)


@pytest.mark.parametrize("a", [0.0, 0.3, 0.7, 1.0])
def test_accepted_per_drafted_given_the_rounds_drafted_lengths(a):
    """Every round at k: the closed form. Rounds of 1 and 2 drafts, equally many: (a + a(1 + a)) / 3,
    which is above the k = 2 closed form (a short round has no unverified draft to count as a failure).
    Checked also by simulating independent acceptance over a histogram."""
    assert cm.accepted_per_drafted_given(a, [0, 0, 0, 0, 5]) == pytest.approx(cm.accepted_per_drafted(a, 4))
    mixed = cm.accepted_per_drafted_given(a, [7, 3, 3])  # rounds with no draft count for nothing
    assert mixed == pytest.approx((a + a * (1 + a)) / 3)
    if 0 < a < 1:
        assert mixed > cm.accepted_per_drafted(a, 2)
    rng = np.random.default_rng(0)
    hist = [2, 5, 1, 0, 4]
    lengths = np.repeat(np.arange(len(hist)), hist)
    accepted = drafted = 0
    for _ in range(4000):
        for m in lengths:
            ok = rng.random(m) < a
            accepted += int(np.argmin(ok)) if not ok.all() else m
            drafted += m
    assert cm.accepted_per_drafted_given(a, hist) == pytest.approx(accepted / drafted, abs=0.01)
    assert np.isnan(cm.accepted_per_drafted_given(a, [3]))
