"""The chapter 7 head in bfloat16 (``DraftHead.set_precision``, ``specnb.head_precision``): drafting stays
exact on both kernel backends, chain and tree; the logits it hands the loops are float32; what must stay
float32 does; the choice is measured once per machine and explained; bad values are named."""
import json

import pytest
import torch

from specnb import head_precision as hp
from specnb.decode import greedy, speculative_greedy, speculative_sample
from specnb.drafts import HeadDraft, HybridDraft, PromptLookupDraft
from specnb.kernels import make, onednn_supports, use_kernels
from specnb.sampling import SamplingParams, draft_distributions
from specnb.tree_decode import speculative_tree_greedy
from specnb.tree_drafts import HeadTreeDraft, shape_from_branching
from tests.test_head import random_head

N_NEW = 24


def bf16_head(target, backend: str = "mkl", seed: int = 2):
    head = random_head(target, v=96, seed=seed)
    use_kernels(head, make(backend), remember=False)
    return head.set_precision(torch.bfloat16)


@pytest.mark.parametrize("backend", ["mkl", "onednn"])
def test_a_bfloat16_head_keeps_greedy_exact_in_chains_and_trees(target, prompts, baselines, backend):
    if backend == "onednn" and not onednn_supports(torch.bfloat16):
        pytest.skip("this CPU's oneDNN has no bfloat16 path: the head would run MKL, the other case")
    head = bf16_head(target, backend)
    assert head.precision == torch.bfloat16 and head.layer.mlp.up_proj.weight.dtype == torch.bfloat16
    chains = [HeadDraft(head), HeadDraft(head, 0.3), HybridDraft(PromptLookupDraft(), HeadDraft(head))]
    trees = [HeadTreeDraft(head), HeadTreeDraft(head, shape_from_branching((3, 1, 1)))]
    for ids, ref in zip(prompts, baselines):
        for draft in chains:
            for k in (1, 3, 6):
                assert speculative_greedy(target, draft, ids, k, N_NEW).tokens == ref, (draft.name, k)
        for draft in trees:
            for n in (1, 5, 12):
                assert speculative_tree_greedy(target, draft, ids, n, N_NEW).tokens == ref, (draft.name, n)


def test_a_bfloat16_head_picks_what_its_float32_self_picks(target):
    """The same weights rounded to bfloat16 give the float32 head's top token on most inputs (chapter 7
    measures the real head's agreement both ways), and the loops still receive float32 logits."""
    f32, b16 = random_head(target, v=96, seed=2), bf16_head(target)
    x = torch.randn(200, f32.cfg.hidden_size)
    with torch.inference_mode():
        lf, lb = f32.logits(x), b16.logits(x)
    assert lb.dtype == torch.float32  # the loops always get float32 logits
    same = float((lf.argmax(-1) == lb.argmax(-1)).float().mean())
    assert same > 0.9, same
    assert 0 < float((lf - lb).abs().max()) < 0.1 * float(lf.abs().max())  # really rounded, and only slightly


def test_what_stays_float32_and_shared(target):
    head = bf16_head(target)
    assert head.embed.dtype == torch.float32 and head.embed.data_ptr() == target.get_input_embeddings().weight.data_ptr()
    assert head.inv_freq.dtype == torch.float32  # bfloat16 rotary frequencies would blur positions past ~256
    assert head.lm_rows.dtype == torch.bfloat16
    f32 = random_head(target, v=96, seed=2)
    assert set(head.state_dict()) == set(f32.state_dict())
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        head.set_precision(torch.float16)


def test_a_bfloat16_heads_sampled_drafts_report_a_full_precision_q(target, prompts):
    head = bf16_head(target)
    draft = HeadDraft(head)
    draft.reset(None)
    out = speculative_sample(target, draft, prompts[2], 3, 8, SamplingParams(temperature=0.8), seed=0)
    assert len(out.tokens) == 8
    draft.reset(None)
    from specnb.cache import forward_features, new_cache

    ids = prompts[2]
    _, feats = forward_features(target, ids, new_cache(target), logits_to_keep=1)
    draft.observe(feats)
    seen = []

    def recording_q(logits, params):   # the logits the head hands the warp
        seen.append(logits.dtype)
        return draft_distributions(logits, params)

    tokens, q = draft.propose_sampled(ids, 3, SamplingParams(temperature=0.8), torch.Generator().manual_seed(0),
                                      target.config.vocab_size, recording_q)
    assert seen and set(seen) == {torch.float32}  # never bfloat16's 8-bit mantissa
    assert q.dtype in (torch.float32, torch.float64)
    assert torch.allclose(q.sum(-1), torch.ones(len(tokens), dtype=q.dtype), atol=1e-6)


def test_explicit_and_unknown_precisions(monkeypatch):
    assert hp.requested("float32") == "float32" and hp.requested(" BFloat16 ") == "bfloat16"
    monkeypatch.setenv(hp.ENV, "half")
    with pytest.raises(ValueError, match="auto, float32, bfloat16"):
        hp.requested()
    monkeypatch.setenv(hp.ENV, "float32")
    assert hp.choose(None, None, make("onednn")) == ("float32", f"{hp.ENV}=float32")


def test_auto_keeps_float32_where_bfloat16_has_no_fast_path(monkeypatch, target):
    head = random_head(target, v=96)
    monkeypatch.delenv(hp.ENV, raising=False)
    monkeypatch.setattr(hp, "measure", lambda *a, **kw: pytest.fail("nothing to time"))
    monkeypatch.setattr(hp, "onednn_supports", lambda dtype: True)  # MKL is the reason here, whatever this CPU has
    name, how = hp.choose(head, None, make("mkl"))
    assert name == "float32" and "MKL" in how
    monkeypatch.setattr(hp, "onednn_supports", lambda dtype: False)
    name, how = hp.choose(head, None, make("onednn"))
    assert name == "float32" and "no bfloat16 path" in how


def test_auto_measures_once_per_machine_and_follows_the_timings(monkeypatch, tmp_path, target):
    """The timings are faked, so this runs on any CPU: the choice follows them and is cached per machine."""
    monkeypatch.setattr(hp, "onednn_supports", lambda dtype: True)
    monkeypatch.setenv("SPECNB_CACHE", str(tmp_path))
    monkeypatch.delenv(hp.ENV, raising=False)
    head = random_head(target, v=96)
    use_kernels(head, make("onednn"), remember=False)
    fake = {"float32": {"1": 1.4, "3": 1.5}, "bfloat16": {"1": 0.9, "3": 1.0}}
    calls = []
    monkeypatch.setattr(hp, "measure", lambda a, b: calls.append(b.precision) or fake)
    factory = lambda: random_head(target, v=96)  # noqa: E731
    name, how = hp.choose(head, factory, make("onednn"))
    assert name == "bfloat16" and "1 row 1.40 -> 0.90 ms" in how and calls == [torch.bfloat16]
    assert hp.choose(head, factory, make("onednn"))[0] == "bfloat16" and len(calls) == 1  # cached
    saved = json.loads((tmp_path / "head_precision.json").read_text())
    assert list(saved.values())[0]["medians_ms"] == fake
    fake = {"float32": {"1": 1.0, "3": 1.0}, "bfloat16": {"1": 0.95, "3": 0.95}}  # under 10% faster: not worth it
    assert hp.choose(head, factory, make("onednn"), remeasure=True)[0] == "float32"


@pytest.mark.skipif(not onednn_supports(torch.bfloat16), reason="this CPU's oneDNN has no bfloat16 path")
def test_step_timing_runs_both_heads(target):
    head = random_head(target, v=96)
    twin = random_head(target, v=96).set_precision(torch.bfloat16)
    medians = hp.measure(head, twin, repeats=3)
    assert set(medians) == {"float32", "bfloat16"} and all(v > 0 for m in medians.values() for v in m.values())


def test_greedy_baseline_unchanged_by_a_bfloat16_head(target, prompts):
    """The head never touches the target: plain greedy after drafting with a bfloat16 head is the same."""
    ref = greedy(target, prompts[3], N_NEW).tokens
    speculative_greedy(target, HeadDraft(bf16_head(target)), prompts[3], 4, N_NEW)
    assert greedy(target, prompts[3], N_NEW).tokens == ref
    assert next(target.parameters()).dtype == torch.float32
