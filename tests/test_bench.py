"""Side by side with transformers (bench.py, lookup_hf.py): same proposals, same outputs, broken loops caught."""
import pytest
import torch

from specnb.bench import HF_METHODS, bench_drafts, hf_speculative, side_by_side, table_markdown
from specnb.decode import greedy, speculative_greedy
from specnb.drafts import ModelDraft, PromptLookupDraft, early_exit_model
from specnb.lookup_hf import HFPromptLookupDraft
from specnb.prompts import Prompt

N = 20


def _hf_rule(ids, k, eos=None, max_ngram=2):
    """transformers' own PromptLookupCandidateGenerator on ``ids``: the candidates it returns."""
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    gen = PromptLookupCandidateGenerator(eos_token_id=None if eos is None else torch.tensor([eos]),
                                         num_output_tokens=k, max_matching_ngram_size=max_ngram, max_length=10_000)
    x = torch.tensor([ids])
    out, _ = gen.get_candidates(x)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("max_ngram", [1, 2, 3])
def test_hf_rule_is_transformers_rule_on_random_sequences(max_ngram):
    # the same n on both sides: HFPromptLookupDraft(max_ngram=n) and max_matching_ngram_size=n
    gen = torch.Generator().manual_seed(0)
    differs_from_specnb = 0
    for trial in range(400):
        vocab = 3 + trial % 6  # small vocabularies: many repeated n-grams
        ids = torch.randint(0, vocab, (int(torch.randint(2, 30, (1,), generator=gen)),), generator=gen).tolist()
        k = 1 + trial % 7
        eos = trial % vocab if trial % 3 == 0 else None
        draft = HFPromptLookupDraft(max_ngram=max_ngram)
        draft.reset(eos)
        assert draft.propose(ids, k) == _hf_rule(ids, k, eos, max_ngram), (ids, k, eos, max_ngram)
        ours = PromptLookupDraft()
        ours.reset(eos)
        differs_from_specnb += ours.propose(ids, k) != draft.propose(ids, k)
    assert differs_from_specnb > 50, "the two rules should differ often (first vs most recent match, n<=max_ngram vs 3)"


def test_hf_rule_first_match_and_eos():
    d = HFPromptLookupDraft()
    seq = [5, 1, 2, 7, 1, 2, 8, 9, 1, 2]
    assert d.propose(seq, 2) == [7, 1]  # the first match of (1, 2) from the start, not the most recent ([8, 9])
    assert PromptLookupDraft().propose(seq, 2) == [8, 9]
    d.reset(eos_token_id=7)
    assert d.propose(seq, 3) == []  # cut before EOS leaves nothing: transformers proposes nothing
    with pytest.raises(ValueError, match="max_ngram"):
        HFPromptLookupDraft(max_ngram=0)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_same_rounds_as_transformers_prompt_lookup(target, prompts, baselines, k):
    # Same rule on both sides: the same tokens and the same (candidates, matches) in every round
    # but possibly the last, where transformers drafts past the budget and specnb does not.
    for ids, base in zip(prompts, baselines):
        ids = ids + ids  # a repeated prompt gives lookup something to find
        spec = speculative_greedy(target, HFPromptLookupDraft(), ids, k, N)
        theirs = hf_speculative(target, ids, "prompt_lookup", k, N, None)
        assert spec.tokens == theirs.tokens == greedy(target, ids, N).tokens
        ours = [(r.drafted, r.accepted) for r in spec.rounds]
        free = _unbudgeted(spec, k)
        assert free >= 1 and ours[:free] == list(zip(theirs.drafted, theirs.accepted))[:free]


def _unbudgeted(spec, k):
    """How many leading rounds specnb drafted without its budget cap (min(k, budget - 1)) binding."""
    emitted = 0
    for j, r in enumerate(spec.rounds):
        if N - emitted - 1 < k:
            return j
        emitted += r.emitted
    return len(spec.rounds)


def test_same_rounds_as_transformers_assistant(target, noisy_draft_model, prompts, baselines):
    for ids, base in zip(prompts[2:], baselines[2:]):
        spec = speculative_greedy(target, ModelDraft(noisy_draft_model), ids, 3, N)
        theirs = hf_speculative(target, ids, "assistant_model", 3, N, None, assistant=noisy_draft_model)
        assert spec.tokens == theirs.tokens
        free = _unbudgeted(spec, 3)
        assert [r.accepted for r in spec.rounds][:free] == theirs.accepted[:free]
    # the recording hooks are gone afterwards
    from transformers.generation import candidate_generator as cg
    assert "update_candidate_strategy" not in cg.PromptLookupCandidateGenerator.__dict__


def test_early_exit_both_ways(target, prompts):
    ids = prompts[3]
    exit1 = early_exit_model(target, 1)
    base = greedy(target, ids, N).tokens
    a = hf_speculative(target, ids, "assistant_early_exit", 2, N, None, early_exit=1)
    b = hf_speculative(target, ids, "assistant_model", 2, N, None, assistant=exit1)
    c = speculative_greedy(target, ModelDraft(exit1), ids, 2, N)
    assert a.tokens == b.tokens == c.tokens == base
    assert a.accepted == b.accepted  # the same draft, whether transformers slices the target or gets a copy
    assert target.config.num_hidden_layers == 2 and target.generation_config.num_assistant_tokens != 2


class _Tok:
    """Characters to ids, enough for raw-text prompts on a tiny model."""

    eos_token_id = None

    def __call__(self, text):
        return {"input_ids": [ord(ch) % 90 + 1 for ch in text]}


@pytest.mark.parametrize("name", ["lookup-hf", "exit1"])
def test_side_by_side_checks_outputs_and_catches_a_broken_loop(target, name):
    prompts = [Prompt("code", "abcabcabd abcabc xyzxyz abc"), Prompt("prose", "the cat sat on the mat; the cat")]
    for draft, method, layers in bench_drafts(target, [name]):
        good = side_by_side(target, _Tok(), draft, method, prompts, 3, N, kind="t", early_exit=layers,
                            progress=False)
        assert good.identical == good.runs == 2
        assert good.same_rounds() and all(n >= 1 for n in good.budget_free)  # same proposals, round by round
        assert good.counts["specnb"]["drafted"] > good.counts["specnb"]["accepted"] >= 0
        assert good.acceptance("specnb") == pytest.approx(good.acceptance("hf"))  # same rule/draft on both sides
        bad = side_by_side(target, _Tok(), draft, method, prompts, 3, N, kind="t", early_exit=layers,
                           progress=False, rollback_mode="skip-target")
        assert bad.identical < bad.runs, "a loop that skips the cache rollback must be caught"
    text = table_markdown([good])
    assert "| t |" in text and f"{good.identical}/{good.runs}" in text


@pytest.mark.parametrize("max_ngram", [1, 3])
def test_side_by_side_passes_max_ngram(target, max_ngram):
    """side_by_side hands max_ngram to transformers' rule: with the same n on both sides, the same rounds."""
    prompts = [Prompt("code", "abcabcabd abcabc xyzxyz abc abd abcab")]
    good = side_by_side(target, _Tok(), HFPromptLookupDraft(max_ngram=max_ngram), "prompt_lookup", prompts, 3, N,
                        kind="t", progress=False, max_ngram=max_ngram)
    assert good.identical == good.runs == 1 and good.same_rounds()
    assert good.counts["specnb"]["drafted"] > 0


def test_bad_input():
    with pytest.raises(ValueError, match="method must be one of"):
        hf_speculative(None, [1], "medusa", 2, 4, None)
    with pytest.raises(ValueError, match="unknown bench draft"):
        bench_drafts(None, ["eagle"])
    assert HF_METHODS == ("prompt_lookup", "assistant_model", "assistant_early_exit")


def test_baseline_vs_generate_on_the_same_and_on_default_kernels(target, prompts):
    """specnb's greedy against generate on the model's own kernels and on torch's default: identical tokens,
    the kernels named in the labels, and the model's own kernels restored afterwards."""
    import copy

    from specnb.bench import baseline_vs_generate
    from specnb.kernels import kernels_of, make, use_kernels

    class IdTok:
        eos_token_id = None

        def __call__(self, text):
            return {"input_ids": [int(t) for t in text.split()]}

    model = copy.deepcopy(target)
    use_kernels(model, make("onednn"))
    ps = [Prompt("code", " ".join(map(str, ids))) for ids in prompts[1:3]]
    same = baseline_vs_generate(model, IdTok(), ps, max_new_tokens=8, repeats=1)
    default = baseline_vs_generate(model, IdTok(), ps, max_new_tokens=8, repeats=1, generate_kernels="default")
    assert same.identical == same.runs == 2 and default.identical == default.runs == 2
    assert "[onednn]" in same.name_a and "[onednn]" in same.name_b and "[transformers defaults]" in default.name_b
    assert kernels_of(model).backend == "onednn"
