"""Speculative greedy == plain greedy, token for token, on tiny models; and the negative controls."""
import pytest

from specnb.decode import greedy, speculative_greedy
from specnb.viz import RecordingDraft
from specnb.drafts import Draft, ModelDraft, PromptLookupDraft

N_NEW = 24


class WrongDraft(Draft):
    """Proposes the target's greedy tokens shifted by one id: always wrong at the first position."""

    name = "always wrong"

    def __init__(self, model, vocab):
        super().__init__()
        self.inner, self.vocab = ModelDraft(model), vocab

    def reset(self, eos_token_id=None):
        super().reset(eos_token_id)
        self.inner.reset(None)

    def propose(self, ids, k):
        out = [(t + 1) % self.vocab for t in self.inner.propose(ids, k)]
        self.forwards = self.inner.forwards
        return out

    def update(self, ids, n_accepted):
        self.inner.update(ids, n_accepted)


def drafts(target, noisy):
    return {"always right": ModelDraft(target, "always right"),
            "always wrong": WrongDraft(target, target.config.vocab_size),
            "in between": ModelDraft(noisy, "in between"),
            "prompt lookup": PromptLookupDraft()}


@pytest.mark.parametrize("k", range(1, 9))
def test_speculative_equals_greedy(target, noisy_draft_model, prompts, baselines, k):
    accs, partial = {}, 0
    for name, draft in drafts(target, noisy_draft_model).items():
        rates = []
        for ids, base in zip(prompts, baselines):
            spec = speculative_greedy(target, draft, ids, k, N_NEW)
            assert spec.tokens == base, (name, k, ids)
            assert sum(r.emitted for r in spec.rounds) == N_NEW
            rates.append(spec.acceptance_rate)
            if name == "in between":
                partial += sum(0 < r.accepted < r.drafted for r in spec.rounds)
        accs[name] = rates
    # The drafts are what they claim to be, so the test covers all acceptance regimes.
    assert all(a == 1.0 for a in accs["always right"])
    assert all(a == 0.0 for a in accs["always wrong"])
    assert 0 < min(accs["in between"]) and max(accs["in between"]) < 1
    if k > 1:
        assert partial > 0  # rounds that accept some drafts and reject the rest: the rollback path


def test_always_right_draft_earns_bonus_tokens(target, prompts):
    spec = speculative_greedy(target, ModelDraft(target), prompts[2], 4, 20)
    assert all(r.bonus and r.emitted == 5 for r in spec.rounds)
    assert spec.target_forwards == 1 + 4  # prefill + 4 rounds of 5 tokens
    assert spec.tokens == greedy(target, prompts[2], 20).tokens


@pytest.mark.parametrize("k", [1, 3, 8])
def test_eos_inside_a_draft(target, prompts, k):
    ids = prompts[3]
    free = greedy(target, ids, N_NEW).tokens
    # a token greedy emits where the always-right draft drafts it, not where a bonus token goes
    # (k = 1: rounds emit draft, bonus, draft, bonus, ...); earlier if it repeats
    eos = free[4 if k == 1 else 5]
    stop_at = free.index(eos)
    base = greedy(target, ids, N_NEW, eos_token_id=eos)
    assert base.tokens == free[: stop_at + 1] and base.stop == "eos"
    rec = RecordingDraft(ModelDraft(target))
    for draft in (rec, PromptLookupDraft()):
        spec = speculative_greedy(target, draft, ids, k, N_NEW, eos_token_id=eos)
        assert spec.tokens == base.tokens and spec.stop == "eos"
    assert any(eos in p for p in rec.proposals), "the model draft must have drafted the EOS"


@pytest.mark.parametrize("max_new", [1, 2, 3])
def test_max_new_tokens_smaller_than_k(target, prompts, max_new):
    for ids in prompts:
        base = greedy(target, ids, max_new)
        spec = speculative_greedy(target, ModelDraft(target), ids, 8, max_new)
        assert len(spec.tokens) == max_new and spec.tokens == base.tokens
        assert all(r.drafted <= max_new - 1 for r in spec.rounds)


@pytest.mark.parametrize("mode", ["skip-target", "one-too-few"])
def test_negative_control_broken_rollback_is_caught(target, noisy_draft_model, prompts, baselines, mode):
    """The same equality check must fail when the target cache keeps rejected tokens."""
    diverged = 0
    for ids, base in zip(prompts, baselines):
        spec = speculative_greedy(target, ModelDraft(noisy_draft_model), ids, 4, N_NEW, rollback_mode=mode)
        diverged += spec.tokens != base
    assert diverged >= len(prompts) - 1


def test_broken_draft_rollback_keeps_output_but_loses_acceptance(target, prompts, baselines):
    """Draft-side stale cache: the target still verifies every token, so greedy output stays exact;
    the damage shows as lower acceptance. With an always-right draft, a = 1 drops below 1."""
    for ids, base in list(zip(prompts, baselines))[1:]:
        good = speculative_greedy(target, ModelDraft(target), ids, 3, N_NEW)
        bad = speculative_greedy(target, WrongThenRight(target), ids, 3, N_NEW)
        bad_faulty = speculative_greedy(target, WrongThenRight(target, faulty=True), ids, 3, N_NEW)
        assert good.tokens == bad.tokens == bad_faulty.tokens == base
        assert good.acceptance_rate == 1.0
        assert bad_faulty.acceptance_rate < bad.acceptance_rate < 1


class WrongThenRight(ModelDraft):
    """The target as draft, but every third round its first proposal is corrupted, forcing a rejection
    at position 1 while the draft's cache already holds the true tokens: a draft-cache rollback."""

    def __init__(self, model, faulty=False):
        super().__init__(model, faulty_rollback=faulty)
        self.round = 0

    def propose(self, ids, k):
        out = super().propose(ids, k)
        self.round += 1
        if self.round % 3 == 0 and len(out) > 1:
            out[0] = (out[0] + 1) % self.model.config.vocab_size
        return out


def test_prompt_lookup_proposes_the_earlier_continuation():
    d = PromptLookupDraft(max_ngram=2)
    d.reset()
    assert d.propose([1, 2, 3, 4, 9, 1, 2], 3) == [3, 4, 9]
    assert d.propose([5, 6, 7], 3) == []
    assert d.propose([1, 2, 1, 2, 5, 1, 2], 2) == [5, 1]  # the most recent match wins
    d.reset(eos_token_id=4)
    assert d.propose([1, 2, 3, 4, 9, 1, 2], 5) == [3, 4]  # stops at EOS


def test_round_statistics_add_up(target, noisy_draft_model, prompts):
    spec = speculative_greedy(target, ModelDraft(noisy_draft_model), prompts[4], 4, N_NEW)
    assert len(spec.tokens) == sum(r.emitted for r in spec.rounds) == N_NEW
    assert spec.target_forwards == 1 + len(spec.rounds)
    assert spec.draft_forwards == sum(r.draft_forwards for r in spec.rounds)
    assert all(r.accepted <= r.drafted and r.emitted == r.accepted + 1 for r in spec.rounds)
    assert spec.wall_time >= spec.t_draft + spec.t_target - spec.t_prefill > 0


def test_a_counts_verified_drafts_and_acceptance_rate_counts_drafted_ones():
    from specnb.decode import DecodeResult, RoundStats

    rounds = [RoundStats(4, 1, 2, False, 4, 0.0, 0.0), RoundStats(4, 4, 5, True, 4, 0.0, 0.0),
              RoundStats(2, 0, 1, False, 2, 0.0, 0.0)]
    res = DecodeResult(tokens=[0] * 8, prompt_len=1, wall_time=1.0, target_forwards=4, rounds=rounds)
    assert res.acceptance_rate == 5 / 10      # accepted / drafted
    assert res.a == 5 / 7                     # accepted / verified: 2 + 4 + 1 drafts were looked at


def test_cut_drafts_keeps_room_for_the_targets_token_and_stops_at_eos():
    from specnb.decode import cut_drafts

    assert cut_drafts([5, 6, 7, 8], budget=10, eos_token_id=None) == [5, 6, 7, 8]
    assert cut_drafts([5, 6, 7, 8], budget=3, eos_token_id=None) == [5, 6]  # 2 drafts + the target's token
    assert cut_drafts([5, 6, 7, 8], budget=1, eos_token_id=None) == []
    assert cut_drafts([5, 2, 7, 8], budget=10, eos_token_id=2) == [5, 2]  # nothing after EOS
    assert cut_drafts([5, 6, 7, 2], budget=3, eos_token_id=2) == [5, 6]
