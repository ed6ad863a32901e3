"""specnb.check.check_exactness: passes the correct loop and catches a broken one (negative control)."""
import pytest

from specnb.check import check_exactness
from specnb.drafts import ModelDraft
from specnb.prompts import Prompt


class IdTokenizer:
    """Prompts are written as space-separated token ids; enough for check_exactness on tiny models."""

    eos_token_id = None

    def __call__(self, text):
        return {"input_ids": [int(t) for t in text.split()]}


@pytest.fixture(scope="module")
def id_prompts(prompts):
    return [Prompt("code", " ".join(map(str, ids))) for ids in prompts[1:]]


@pytest.mark.parametrize("mode", ["exact", "skip-target", "one-too-few"])
def test_check_exactness_passes_the_loop_and_catches_a_broken_rollback(target, noisy_draft_model, id_prompts, mode):
    report = check_exactness(target, IdTokenizer(), id_prompts, [ModelDraft(noisy_draft_model)], ks=(2, 4),
                             max_new_tokens=20, progress=False, rollback_mode=mode)
    assert sum(report.total.values()) == 2 * len(id_prompts)
    assert 0 < sum(sum(a) for a in report.acceptance.values()), "the draft must be right sometimes, or nothing rolls back"
    if mode == "exact":
        assert report.all_match and sum(report.matched.values()) == sum(report.total.values())
    else:  # the same check must fail a loop that leaves rejected drafts in the target's cache
        assert not report.all_match and report.mismatches
        assert all(m.position is not None and m.position >= 0 for m in report.mismatches)
        assert "MISMATCH" in report.table()


def test_check_counts_the_prompts_that_end_with_eos(target, noisy_draft_model, id_prompts):
    """The check reports how many prompts stop at EOS: runs that end early must match too."""
    from specnb.decode import greedy

    tok = IdTokenizer()
    ids = tok(id_prompts[0].text)["input_ids"]
    tok.eos_token_id = greedy(target, ids, 20, None).tokens[3]  # plain greedy then stops at its 4th token
    report = check_exactness(target, tok, id_prompts[:1], [ModelDraft(noisy_draft_model)], ks=(1, 4),
                             max_new_tokens=20, progress=False)
    assert report.prompts == 1 and report.ended_by_eos == 1 and report.all_match


def test_check_prompts_cover_formats_scripts_and_eos():
    from collections import Counter

    from specnb.corpus import check_prompts

    prompts = check_prompts(100)
    assert len(prompts) == 100 and len({p.text for p in prompts}) == 100
    kinds = Counter(p.kind for p in prompts)
    assert set(kinds) == {"code", "prose", "grounded", "list", "dialogue", "foreign"} and min(kinds.values()) >= 5
    text = "\n".join(p.text for p in prompts)
    for marker in ("{", "SELECT", "<html>", "東京", "Москва", "single word"):
        assert marker in text, marker
    with pytest.raises(ValueError, match="--prompts must be between 1 and"):
        check_prompts(0)


def test_compare_backends_agrees_on_a_tiny_model_and_reports_a_divergence(target, id_prompts, monkeypatch):
    """Plain greedy per kernel backend: identical here; and a backend that computes something else
    (the LM head perturbed, standing in for a real summation-order flip) is reported with margins."""
    import contextlib
    import copy

    import torch

    from specnb import check

    model = copy.deepcopy(target)
    same, divergences = check.compare_backends(model, IdTokenizer(), id_prompts, 16, progress=False)
    assert same == len(id_prompts) and not divergences

    @contextlib.contextmanager
    def perturbed(m, backend):
        saved = m.lm_head.weight.detach().clone()
        if backend == "onednn":
            with torch.no_grad():
                m.lm_head.weight.add_(0.5 * torch.randn_like(saved))
        try:
            yield None
        finally:
            with torch.no_grad():
                m.lm_head.weight.copy_(saved)

    monkeypatch.setattr(check, "using", perturbed)
    torch.manual_seed(0)
    same, divergences = check.compare_backends(model, IdTokenizer(), id_prompts, 16, progress=False)
    assert divergences and same < len(id_prompts)
    d = divergences[0]
    from specnb.skinny import unavailable

    assert set(d.tokens) == {"mkl", "onednn"} | ({"skinny"} if unavailable() is None else set())
    assert d.tokens["mkl"] != d.tokens["onednn"]
    assert all(m == m and m >= 0 for m in d.margins.values())
    assert "BACKENDS DIFFER" in check.backends_text(same, len(id_prompts), divergences)


@pytest.mark.parametrize("mode", ["exact", "rejected-left-in-cache", "siblings-see-each-other"])
def test_check_runs_tree_drafts_through_the_tree_loop_and_catches_a_broken_tree(target, id_prompts, mode):
    from specnb.tree_drafts import HeadTreeDraft, LookupTreeDraft
    from tests.test_head import random_head

    head = random_head(target, v=96, seed=2)
    drafts = [HeadTreeDraft(head, depth=3, branch=3, width=3), LookupTreeDraft()]
    report = check_exactness(target, IdTokenizer(), id_prompts, drafts, ks=(4, 8), max_new_tokens=20,
                             progress=False, rollback_mode=mode)
    assert sum(report.total.values()) == 4 * len(id_prompts)
    if mode == "exact":
        assert report.all_match
    else:
        assert not report.all_match
