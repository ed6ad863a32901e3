"""Chapter 5's out-of-sample calibration: the replay reproduces the real loop's rounds, and the predictor
uses only what it was given."""
import math

import pytest

from specnb.calibration import Calibration, TeacherForcedDraft, calibrate, predict_speedup, replay, simple_prediction
from specnb.costmodel import refined_speedup, speedup
from specnb.decode import greedy, speculative_greedy
from specnb.drafts import ModelDraft, PromptLookupDraft
from specnb.sweep import run_record

N = 24


def _rounds(result):
    return [(r.drafted, r.accepted) for r in result.rounds]


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_teacher_forced_replay_matches_the_real_loop(target, noisy_draft_model, prompts, baselines, k):
    accepted = rejected = 0
    for ids, g in zip(prompts, baselines):
        real = speculative_greedy(target, ModelDraft(noisy_draft_model), ids, k, N)
        rep = replay(TeacherForcedDraft(noisy_draft_model, ids + g), ids, g, k, N)
        assert _rounds(real) == list(zip(rep.drafted, rep.accepted))
        assert rep.tokens == len(real.tokens) == N
        accepted += sum(rep.accepted)
        rejected += sum(n < m for m, n in zip(rep.drafted, rep.accepted))
    assert accepted and rejected, "the noisy draft must be right sometimes and wrong sometimes"


@pytest.mark.parametrize("k", [1, 4])
def test_lookup_replay_matches_the_real_loop(target, prompts, baselines, k):
    for ids, g in zip(prompts, baselines):
        real = speculative_greedy(target, PromptLookupDraft(), ids, k, N)
        rep = replay(PromptLookupDraft(), ids, g, k, N)
        assert _rounds(real) == list(zip(rep.drafted, rep.accepted))


def test_replay_of_another_draft_is_told_apart(target, noisy_draft_model, prompts, baselines):
    # Negative control: replaying the target's own argmaxes (an always-right draft) must not
    # reproduce the noisy draft's rounds.
    ids, g = prompts[3], baselines[3]
    real = speculative_greedy(target, ModelDraft(noisy_draft_model), ids, 4, N)
    wrong = replay(TeacherForcedDraft(target, ids + g), ids, g, 4, N)
    assert _rounds(real) != list(zip(wrong.drafted, wrong.accepted))
    assert all(m == n for m, n in zip(wrong.drafted, wrong.accepted))


def test_predict_from_hand_made_rounds():
    # k = 2: rounds (drafted, accepted) = (2, 0), (2, 1), (2, 2), (1, 1); model draft with c = 0.25.
    rounds = {2: [(2, 0, 0.0), (2, 1, 0.0), (2, 2, 0.0), (1, 1, 0.0)]}
    cal = Calibration.from_rounds("d", rounds, c=0.25, t1=0.1, prompts=1, tokens=8)
    st = cal.stats[2]
    assert st.survival == [3 / 4, 1 / 4] and st.drafted_hist == [0, 1, 3]
    assert st.a_pos == [3 / 4, 1 / 2]  # position 2 verified in the 2 rounds that kept draft 1 and drafted 2
    assert st.draft_cost == pytest.approx(0.25 * 7 / 4)
    verify = {1: 1.0, 2: 1.5, 3: 1.8}
    expected = refined_speedup([3 / 4, 1 / 4], 0.25 * 7 / 4 / 2, 2, (3 * 1.8 + 1.5) / 4)
    assert predict_speedup(cal, 2, verify) == pytest.approx(expected)
    assert predict_speedup(cal, 2, verify) == pytest.approx((1 + 1) / (0.25 * 7 / 4 + (3 * 1.8 + 1.5) / 4))
    with pytest.raises(KeyError, match="not calibrated at k = 3"):
        predict_speedup(cal, 3, verify)
    # The simple model on the same inputs: a = 4 accepted of 6 verified drafts (pooled counts, not the
    # mean of 3/4 and 1/2), c = draft cost per round / k, a verify of one forward.
    assert st.a == pytest.approx(4 / 6)
    assert simple_prediction(cal, 2) == pytest.approx(speedup(4 / 6, 0.25 * 7 / 4 / 2, 2))
    assert simple_prediction(cal, 2) == pytest.approx((1 + 4 / 6 + (4 / 6) ** 2) / (1 + 0.25 * 7 / 4))
    with pytest.raises(KeyError, match="not calibrated at k = 3"):
        simple_prediction(cal, 3)
    never = Calibration.from_rounds("d", {2: [(0, 0, 0.0)]}, c=0.25, t1=0.1, prompts=1, tokens=1)
    assert math.isnan(never.stats[2].a) and simple_prediction(never, 2) == pytest.approx(1.0)  # nothing drafted: E = 1
    # Without c, the draft cost is the measured draft time per round over T(1).
    timed = Calibration.from_rounds("d", {1: [(1, 1, 0.02), (1, 0, 0.04)]}, c=None, t1=0.1, prompts=1, tokens=3)
    assert timed.stats[1].draft_cost == pytest.approx(0.3)


def test_from_records_equals_replay(target, noisy_draft_model, prompts, baselines):
    ids, g = prompts[4], baselines[4]
    real = speculative_greedy(target, ModelDraft(noisy_draft_model), ids, 3, N)
    from_runs = Calibration.from_records("d", [{**run_record(real, 3), "k": 3}], t1=1.0)
    rep = replay(TeacherForcedDraft(noisy_draft_model, ids + g), ids, g, 3, N)
    from_replay = Calibration.from_rounds("d", {3: [(m, n, 0.0) for m, n in zip(rep.drafted, rep.accepted)]},
                                          c=0.1, t1=1.0, prompts=1, tokens=N)
    a, b = from_runs.stats[3], from_replay.stats[3]
    assert a.survival == b.survival and a.drafted_hist == b.drafted_hist and a.a == pytest.approx(b.a, nan_ok=True)
    assert all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a.a_pos, b.a_pos))


def test_calibrate_needs_c_for_a_model_draft(target, noisy_draft_model, prompts):
    class Tok:
        eos_token_id = None

    with pytest.raises(ValueError, match="cost_ratio"):
        calibrate(target, Tok(), ModelDraft(noisy_draft_model), prompts[:1], (1,), 8, t1=0.01)
    cal = calibrate(target, Tok(), ModelDraft(noisy_draft_model), prompts[:2], (1, 2), 8, t1=0.01, c=0.5)
    assert set(cal.stats) == {1, 2} and cal.tokens == 16 and cal.prompts == 2
    assert cal.stats[2].draft_cost == pytest.approx(0.5 * 2 * 0 + 0.5 * sum(
        m * h for m, h in enumerate(cal.stats[2].drafted_hist)) / cal.stats[2].rounds)


@pytest.mark.parametrize("k", [1, 3, 8])
def test_replay_of_a_greedy_text_that_ends_with_eos(target, noisy_draft_model, prompts, k):
    """A calibration prompt whose greedy output stops at EOS before the budget (a regression: the
    replay once refused it): rounds equal the real loop's, for a model draft and for prompt lookup,
    including the draft that is always right and drafts the EOS itself."""
    from specnb.decode import greedy

    for ids in prompts[2:]:
        eos = greedy(target, ids, N, None).tokens[5]
        g = greedy(target, ids, N, eos).tokens
        assert g[-1] == eos and len(g) < N
        real = speculative_greedy(target, PromptLookupDraft(), ids, k, N, eos)
        rep = replay(PromptLookupDraft(), ids, g, k, N, eos)
        assert _rounds(real) == list(zip(rep.drafted, rep.accepted)) and rep.tokens == len(real.tokens) == len(g)
        # A teacher-forced draft cannot know what the draft model would propose past the end of the text,
        # so rounds that reach past it may draft fewer tokens (all past the first rejection); acceptance is the same.
        real = speculative_greedy(target, ModelDraft(noisy_draft_model), ids, k, N, eos)
        rep = replay(TeacherForcedDraft(noisy_draft_model, ids + g), ids, g, k, N, eos)
        assert [r.accepted for r in real.rounds] == rep.accepted and rep.tokens == len(real.tokens) == len(g)
        done = 0
        for r, m in zip(real.rounds, rep.drafted):
            assert m == r.drafted if done + r.drafted < len(g) else m <= r.drafted
            done += r.accepted + 1
        right = replay(TeacherForcedDraft(target, ids + g), ids, g, k, N, eos)
        assert right.tokens == len(g) and all(m == n for m, n in zip(right.drafted, right.accepted))
    with pytest.raises(ValueError, match="ends before the budget"):
        replay(PromptLookupDraft(), prompts[2], greedy(target, prompts[2], N, None).tokens[:5], 2, N, None)
