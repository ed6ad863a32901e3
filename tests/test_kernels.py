"""specnb.kernels: the linear layers on MKL, oneDNN or both by rows; exactness under each; auto's choice."""
import copy
import json

import pytest
import torch

from specnb import kernels, skinny
from specnb.decode import greedy, speculative_greedy
from specnb.drafts import ModelDraft, PromptLookupDraft
from specnb.kernels import NEVER, KernelLinear, decide, kernels_of, make, use_kernels
from specnb.tiny import perturbed_copy, tiny_llama

pytestmark = pytest.mark.skipif(not kernels.onednn_available(), reason="this torch build has no oneDNN")

BACKENDS = {"mkl": lambda: make("mkl"), "onednn": lambda: make("onednn"), "mixed": lambda: make("mixed", 3),
            "onednn-unfused": lambda: make("onednn", fused=False), "skinny": lambda: make("skinny"),
            "skinny-unfused": lambda: make("skinny", fused=False)}
SKINNY = skinny.unavailable() is None


@pytest.fixture(scope="module")
def pair():
    """A tiny target and a noisy draft of it, each on its own copy (kernels are switched per test)."""
    target = tiny_llama(seed=0, vocab_size=96)
    return target, perturbed_copy(target, noise=0.02, seed=1)


def test_every_linear_is_wrapped_and_tied_weights_stay_tied():
    model = tiny_llama(seed=0)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    n_linear = sum(type(m) is torch.nn.Linear for m in model.modules())
    use_kernels(model, make("onednn"))
    assert sum(isinstance(m, KernelLinear) for m in model.modules()) == n_linear > 0
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert kernels_of(model).backend == "onednn"


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9])
def test_onednn_linear_matches_the_dense_product(rows):
    lin = torch.nn.Linear(64, 200, bias=True)
    x = torch.randn(1, rows, 64)
    ref = lin(x)
    k = KernelLinear.wrap(lin, make("onednn"))
    with torch.inference_mode():
        y = k(x)
    assert y.shape == ref.shape
    torch.testing.assert_close(y, ref.detach(), rtol=1e-5, atol=1e-5)
    assert k._packed is not None  # it really ran oneDNN


def test_mixed_routes_by_rows():
    lin = KernelLinear.wrap(torch.nn.Linear(16, 8), make("mixed", 4))
    with torch.inference_mode():
        lin(torch.randn(1, 3, 16))
        assert lin._packed is None  # 3 rows: MKL, nothing packed
        lin(torch.randn(1, 4, 16))
        assert lin._packed is not None  # 4 rows: oneDNN


def test_a_weight_changed_in_place_is_repacked():
    """A stale packed copy would silently keep the old weights: this catches it."""
    lin = KernelLinear.wrap(torch.nn.Linear(32, 32, bias=False), make("onednn"))
    x = torch.randn(2, 32)
    with torch.inference_mode():
        before = lin(x).clone()
    assert lin._packed is not None  # oneDNN ran, from a packed copy
    packed, version = lin._packed, lin._packed_version
    with torch.no_grad():
        lin.weight.mul_(2.0)
    with torch.inference_mode():
        after = lin(x)
    assert lin._packed is not packed and lin._packed_version != version  # the copy was made again
    torch.testing.assert_close(after, 2 * before, rtol=1e-5, atol=1e-5)


def test_training_runs_through_torch_and_gets_gradients():
    lin = KernelLinear.wrap(torch.nn.Linear(8, 4), make("onednn"))
    x = torch.randn(3, 8)
    lin(x).sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0
    assert lin._packed is None  # the autograd path never touched oneDNN


@pytest.mark.parametrize("backend", BACKENDS)
def test_speculative_equals_greedy_under_each_backend(pair, prompts, backend):
    target, noisy = copy.deepcopy(pair[0]), copy.deepcopy(pair[1])
    use_kernels(target, BACKENDS[backend]())
    use_kernels(noisy, kernels_of(target))
    partial = 0
    for ids in prompts:
        base = greedy(target, ids, 24).tokens
        for draft, k in ((ModelDraft(noisy, "in between"), 3), (ModelDraft(target, "always right"), 4),
                         (PromptLookupDraft(), 2)):
            spec = speculative_greedy(target, draft, ids, k, 24)
            assert spec.tokens == base, (backend, draft.name, k, ids)
            partial += sum(0 < r.accepted < r.drafted for r in spec.rounds)
    assert partial > 0  # the rollback path ran


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["skip-target", "one-too-few"])
def test_broken_rollback_is_caught_under_each_backend(pair, prompts, backend, mode):
    target, noisy = copy.deepcopy(pair[0]), copy.deepcopy(pair[1])
    use_kernels(target, BACKENDS[backend]())
    use_kernels(noisy, kernels_of(target))
    caught = sum(speculative_greedy(target, ModelDraft(noisy), ids, 4, 24, rollback_mode=mode).tokens
                 != greedy(target, ids, 24).tokens for ids in prompts)
    assert caught > 0


def test_unknown_backend_names_the_valid_ones(monkeypatch):
    model = tiny_llama(seed=0)
    monkeypatch.setenv(kernels.ENV, "fastest")
    with pytest.raises(ValueError, match="auto, mkl, onednn, mixed"):
        use_kernels(model)
    with pytest.raises(ValueError, match="valid"):
        make("blas")


def test_without_onednn_it_falls_back_to_mkl_and_says_so(monkeypatch):
    monkeypatch.setattr(kernels, "onednn_available", lambda: False)
    k = make("onednn")
    assert k.backend == "mkl" and k.onednn_from == NEVER and "no oneDNN" in k.how
    assert kernels.choose_for(tiny_llama(seed=0)).backend == "mkl"


@pytest.mark.parametrize("curves, expected", [
    ({"mkl": {1: 30, 2: 31, 4: 45, 9: 60}, "onednn": {1: 40, 2: 41, 4: 42, 9: 50}}, ("mixed", 4)),
    ({"mkl": {1: 36, 2: 54, 4: 53, 9: 70}, "onednn": {1: 28, 2: 33, 4: 34, 9: 38}}, ("onednn", 1)),
    ({"mkl": {1: 30, 2: 31, 4: 32, 9: 40}, "onednn": {1: 40, 2: 41, 4: 42, 9: 50}}, ("mkl", NEVER)),
    # oneDNN faster at n = 2 only, then slower again: not a single crossing, so not from 2
    ({"mkl": {1: 30, 2: 45, 4: 40, 9: 60}, "onednn": {1: 40, 2: 41, 4: 42, 9: 50}}, ("mixed", 9)),
])
def test_decide_takes_onednn_from_the_crossing(curves, expected):
    assert decide(curves) == expected


@pytest.mark.parametrize("skinny_curve, expected", [
    ({1: 30, 2: 31, 4: 33, 9: 40}, ("skinny", 1)),   # below mixed's 30, 31, 42, 50 on average
    ({1: 45, 2: 46, 4: 40, 9: 42}, ("mixed", 4)),    # faster at 4 and 9 only: the mean says mixed
])
def test_decide_takes_skinny_when_its_mean_curve_is_faster(skinny_curve, expected):
    curves = {"mkl": {1: 30, 2: 31, 4: 45, 9: 60}, "onednn": {1: 40, 2: 41, 4: 42, 9: 50}, "skinny": skinny_curve}
    assert decide(curves) == expected
    assert decide(curves, allowed=("mkl", "onednn", "mixed")) == ("mixed", 4)  # skinny not allowed


def test_without_skinny_kernels_skinny_falls_back_to_onednn_and_says_why(monkeypatch):
    monkeypatch.setattr(skinny, "_WHY", "no C++ compiler (install one: apt-get install -y g++)")
    monkeypatch.setattr(skinny, "_EXT", None)
    k = make("skinny")
    assert k.backend == "onednn" and "no C++ compiler" in k.how and "skinny -> onednn" in k.how
    assert set(kernels.measure_curves(tiny_llama(seed=0), ns=(1,), repeats=1, warmup=0)) == {"mkl", "onednn"}


@pytest.mark.skipif(not SKINNY, reason="specnb's skinny kernels do not run here")
def test_a_bfloat16_model_is_neither_timed_nor_labelled_skinny():
    """The skinny kernel is float32 only: a bfloat16 model gets no skinny curve, and asking for skinny
    gives oneDNN (or MKL where oneDNN has no bfloat16 path), saying why, so no label claims skinny."""
    model = tiny_llama(seed=0).to(torch.bfloat16)
    assert "skinny" not in kernels.measure_curves(model, ns=(1,), repeats=1, warmup=0)
    k = use_kernels(model, make("skinny"))
    assert k.backend in ("onednn", "mkl") and "skinny" not in k.label and "float32 only" in k.how + kernels._for_dtype(
        make("skinny"), model).how


@pytest.mark.skipif(not SKINNY, reason="specnb's skinny kernels do not run here")
def test_skinny_routes_by_rows_and_dtype(monkeypatch):
    """Up to SKINNY_ROWS rows of float32: the skinny kernel; more rows (a prefill): oneDNN."""
    calls = []
    real = skinny.linear
    monkeypatch.setattr(skinny, "linear", lambda x, ws, bs=None: calls.append(x.shape[:-1].numel()) or real(x, ws, bs))
    lin = KernelLinear.wrap(torch.nn.Linear(16, 8), make("skinny"))
    with torch.no_grad():  # a weight that needs a gradient runs torch's own product
        for rows in (1, 5, kernels.SKINNY_ROWS, kernels.SKINNY_ROWS + 1):
            x = torch.randn(rows, 16)
            torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
        lin.bfloat16()(torch.randn(2, 16, dtype=torch.bfloat16))  # bfloat16: oneDNN or torch, never this kernel
    assert calls == [1, 5, kernels.SKINNY_ROWS]


def test_auto_measures_once_and_caches_per_machine(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECNB_CACHE", str(tmp_path))
    calls = []
    fake = {"mkl": {1: 30.0, 2: 31.0, 4: 45.0}, "onednn": {1: 40.0, 2: 41.0, 4: 42.0}}
    monkeypatch.setattr(kernels, "measure_curves", lambda model, **kw: calls.append(kw) or fake)
    model = tiny_llama(seed=0)
    first = kernels.choose_for(model)
    second = kernels.choose_for(model)
    assert len(calls) == 1 and calls[0]["budget_s"] == kernels.AUTO_BUDGET_S
    assert (first.backend, first.onednn_from) == (second.backend, second.onednn_from) == ("mixed", 4)
    saved = json.loads((tmp_path / "kernels.json").read_text())
    assert list(saved) == [kernels.machine_key(model)] and "torch" in kernels.machine_key(model)
    assert "auto" in first.how and "MKL 30.0" in first.how


def test_measure_curves_on_a_tiny_model_leaves_it_on_mkl():
    model = tiny_llama(seed=0)
    use_kernels(model, make("onednn"))
    curves = kernels.measure_curves(model, ns=(1, 3), repeats=2, warmup=1)
    assert set(curves) == {"mkl", "onednn"} | ({"skinny"} if SKINNY else set()) and set(curves["mkl"]) == {1, 3}
    assert all(ms > 0 for c in curves.values() for ms in c.values())


def test_a_slow_model_is_timed_within_the_budget(monkeypatch):
    """auto's budget: a model whose first round takes over a tenth of it gets one warm-up round and
    stops after 3 or more repeats once the budget has passed; without a budget every repeat runs."""
    import time

    from specnb import cache

    real = cache.forward
    monkeypatch.setattr(cache, "forward", lambda *a, **kw: time.sleep(0.02) or real(*a, **kw))
    model = tiny_llama(seed=0)
    stats = {}
    kernels.measure_curves(model, ns=(1, 3), repeats=20, warmup=3, budget_s=0.5, stats=stats)
    assert stats["warmup"] == 1 and 3 <= stats["repeats"] < 20, stats
    stats = {}
    kernels.measure_curves(model, ns=(1, 3), repeats=4, warmup=2, stats=stats)
    assert stats == {"repeats": 4, "warmup": 2}


def test_the_backend_is_named_where_results_are_written():
    from specnb.env import machine_info, machine_line

    model = tiny_llama(seed=0)
    k = use_kernels(model, make("mixed", 4))
    assert machine_info()["kernels"] == k.label and k.label in machine_line()
    assert kernels.describe(k)["onednn_from"] == 4 and kernels.describe(make("mkl"))["onednn_from"] is None


def test_a_model_without_linear_layers_is_not_timed(monkeypatch):
    """GPT-2's projections are Conv1D, not nn.Linear: there is nothing to route, so auto measures nothing."""
    monkeypatch.setattr(kernels, "measure_curves", lambda model, **kw: pytest.fail("timed a model with nothing to route"))
    model = torch.nn.Sequential(torch.nn.Conv1d(4, 4, 1))
    k = kernels.choose_for(model)
    assert k.backend == "mkl" and "nothing to choose" in k.how


def test_results_name_the_kernels_of_their_model_not_of_the_last_one_loaded():
    """A sweep loads shape twins after the target: its results must still name the target's kernels
    (chapter 5 reuses them only on the same kernels)."""
    from specnb.env import machine_info

    target, twin = tiny_llama(seed=0), tiny_llama(seed=1)
    k_target = use_kernels(target, make("mixed", 4))
    use_kernels(twin, make("onednn"))  # loaded last
    assert machine_info(target)["kernels"] == k_target.label != machine_info()["kernels"]


# --- attention: grouped KV heads (no repeat_kv copies) ---------------------------------------

def _verify_logits(model, n: int, context: int = 12, seed: int = 0) -> torch.Tensor:
    """Logits of an n-token forward after a ``context``-token prefill (a masked forward when n > 1)."""
    from specnb.cache import forward, prefilled

    with torch.inference_mode():
        cache, new = prefilled(model, context, n, seed)
        return forward(model, new, cache)


@pytest.mark.parametrize("n", [1, 2, 5])
def test_grouped_attention_gives_the_same_logits_as_transformers_sdpa(n):
    model = tiny_llama(seed=3)
    use_kernels(model, make("mkl", attention="repeat"))
    assert model.config._attn_implementation == "sdpa"
    ref = _verify_logits(model, n)
    use_kernels(model, make("mkl"))
    assert model.config._attn_implementation == kernels.GROUPED_SDPA
    assert "grouped-KV attention" in kernels_of(model).label
    torch.testing.assert_close(_verify_logits(model, n), ref, rtol=1e-6, atol=1e-6)


def test_grouped_attention_runs_on_masked_forwards(monkeypatch):
    """It is really called with a mask on a verify-sized forward, and the equality above has teeth:
    a variant that drops the mask (each new token then sees the later ones) is caught by it."""
    model = tiny_llama(seed=3)
    use_kernels(model, make("mkl", attention="repeat"))
    ref = _verify_logits(model, 5)
    use_kernels(model, make("mkl"))
    calls = []
    real = kernels.grouped_sdpa

    def spy(module, query, key, value, attention_mask, **kw):
        calls.append(attention_mask is not None)
        return real(module, query, key, value, attention_mask, **kw)

    from transformers import AttentionInterface
    AttentionInterface.register(kernels.GROUPED_SDPA, spy)
    try:
        torch.testing.assert_close(_verify_logits(model, 5), ref, rtol=1e-6, atol=1e-6)
        layers = model.config.num_hidden_layers
        assert len(calls) == 2 * layers and all(calls[layers:])  # prefill (causal, no mask), then masked

        def maskless(module, query, key, value, attention_mask, **kw):
            return real(module, query, key, value, None, **kw)

        AttentionInterface.register(kernels.GROUPED_SDPA, maskless)
        broken = _verify_logits(model, 5)
        assert (broken[:-1] - ref[:-1]).abs().max() > 1e-3  # the check would catch it
    finally:
        AttentionInterface.register(kernels.GROUPED_SDPA, real)


def test_greedy_is_identical_with_either_attention(pair):
    target, noisy = copy.deepcopy(pair[0]), copy.deepcopy(pair[1])
    prompt = [5, 17, 33, 2, 9]
    use_kernels(target, make("mixed", 3, attention="repeat"))
    ref = greedy(target, prompt, 24, None).tokens
    use_kernels(target, make("mixed", 3))
    use_kernels(noisy, kernels_of(target))
    assert greedy(target, prompt, 24, None).tokens == ref
    assert speculative_greedy(target, ModelDraft(noisy), prompt, 4, 24, None).tokens == ref


def test_unknown_attention_is_refused():
    with pytest.raises(ValueError, match="unknown attention 'flash'.*grouped, repeat"):
        make("mkl", attention="flash")


# --- q/k/v and gate/up as one product each (kernels.FusedGroup) --------------------------------

def _tiny_logits(kernels_, n: int = 5, seed: int = 0) -> torch.Tensor:
    model = tiny_llama(seed=0, vocab_size=96)
    use_kernels(model, kernels_)
    ids = torch.randint(0, 96, (1, 12 + n), generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        return model(ids).logits[0], model


def test_siblings_are_fused_and_give_the_dense_products():
    fused, model = _tiny_logits(make("onednn"))
    alone, _ = _tiny_logits(make("onednn", fused=False))
    dense, _ = _tiny_logits(make("mkl"))
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.q_proj._group is attn.k_proj._group is attn.v_proj._group is not None
    assert mlp.gate_proj._group is mlp.up_proj._group is not None
    assert getattr(attn.o_proj, "_group", None) is None and getattr(mlp.down_proj, "_group", None) is None
    assert attn.q_proj._group._packed is not None and attn.q_proj._packed is None  # one packed weight for three
    torch.testing.assert_close(fused, alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused, dense, rtol=1e-4, atol=1e-4)
    assert "fused" in make("onednn").label and "fused" not in make("onednn", fused=False).label
    assert "fused" not in make("mkl").label


def _group_of_three():
    lins = [torch.nn.Linear(16, d, bias=False) for d in (24, 8, 8)]
    parent = torch.nn.Module()
    for name, lin in zip(("q_proj", "k_proj", "v_proj"), lins):
        setattr(parent, name, lin)
    use_kernels(parent, make("onednn"))
    return parent, lins


def test_a_sibling_given_another_input_computes_its_own():
    """The fused output is handed on only for the very tensor it was computed from: a sibling called
    with a different input (or the same tensor changed in place) gets its own product, not the stash."""
    parent, lins = _group_of_three()
    x1, x2 = torch.randn(3, 16), torch.randn(3, 16)
    with torch.no_grad():
        parent.q_proj(x1)
        torch.testing.assert_close(parent.k_proj(x2), x2 @ lins[1].weight.T, rtol=1e-5, atol=1e-5)
        parent.q_proj(x1)
        x1.mul_(3.0)
        torch.testing.assert_close(parent.v_proj(x1), x1 @ lins[2].weight.T, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(parent.k_proj(x1), x1 @ lins[1].weight.T, rtol=1e-5, atol=1e-5)
        # any order, and each member alone
        torch.testing.assert_close(parent.v_proj(x2), x2 @ lins[2].weight.T, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(parent.q_proj(x2), x2 @ lins[0].weight.T, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(parent.q_proj(x2), x2 @ lins[0].weight.T, rtol=1e-5, atol=1e-5)


def test_a_stash_served_without_its_checks_is_caught(monkeypatch):
    """Negative control for the test above: a group that hands on its last output whatever the input
    (the identity check removed) gives a sibling the wrong product, and the same comparison sees it."""
    parent, lins = _group_of_three()
    group = parent.q_proj._group
    real = kernels.FusedGroup.output

    def careless(self, member, x):
        i = self.members.index(member)
        if self._outputs is not None and i not in self._served:
            self._served.add(i)
            return self._outputs[i]
        return real(self, member, x)

    monkeypatch.setattr(kernels.FusedGroup, "output", careless)
    x1, x2 = torch.randn(3, 16), torch.randn(3, 16)
    with torch.no_grad():
        parent.q_proj(x1)
        wrong = parent.k_proj(x2)
    assert group is parent.k_proj._group
    assert not torch.allclose(wrong, x2 @ lins[1].weight.T, rtol=1e-3, atol=1e-3)


def test_a_fused_weight_changed_in_place_is_repacked():
    parent, lins = _group_of_three()
    x = torch.randn(2, 16)
    with torch.no_grad():
        parent.q_proj(x)
        group = parent.k_proj._group
        assert group._packed is not None  # the group ran on oneDNN, from a packed copy
        packed = group._packed
        lins[1].weight.mul_(2.0)  # the Parameter is shared with the wrapped layer
        parent.q_proj(x)
        assert group._packed is not packed  # the fused copy was made again
        torch.testing.assert_close(parent.k_proj(x), x @ lins[1].weight.T, rtol=1e-5, atol=1e-5)



@pytest.mark.parametrize("asked", ["auto", "onednn", "mixed"])
def test_a_dtype_onednn_cannot_run_here_falls_back_to_mkl_and_says_so(monkeypatch, asked):
    """An AMD EPYC of the Zen 3 generation (AVX2 only) has no oneDNN bfloat16 path: the bfloat16
    model must run MKL, with the reason in ``how``, instead of failing (or timing) on oneDNN."""
    monkeypatch.setattr(kernels, "_DTYPE_OK", {torch.bfloat16: False, torch.float32: True})
    model = tiny_llama(seed=0).to(torch.bfloat16)
    monkeypatch.setenv(kernels.ENV, asked)
    chosen = use_kernels(model)
    assert chosen.backend == "mkl" and "no bfloat16 path" in chosen.how
    assert use_kernels(model, make("onednn")).backend == "mkl"  # a Kernels object passed in, too
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3]]))
    fp32 = tiny_llama(seed=0)
    assert use_kernels(fp32, make("onednn")).backend == "onednn"


def test_onednn_supports_float32_here():
    assert kernels.onednn_supports(torch.float32)


def test_a_copy_cast_to_a_dtype_onednn_cannot_run_here_still_runs(monkeypatch):
    """A model put on oneDNN and then cast (``.to(torch.bfloat16)``, as the training-id generation
    does) must not call oneDNN's missing bfloat16 path; ``head_data.in_dtype`` also relabels the copy."""
    from specnb import head_data

    monkeypatch.setattr(kernels, "_DTYPE_OK", {torch.bfloat16: False, torch.float32: True})
    model = tiny_llama(seed=0)
    use_kernels(model, make("onednn"))
    before = kernels.in_use()
    cast = copy.deepcopy(model).to(torch.bfloat16)
    with torch.inference_mode():
        cast(torch.tensor([[1, 2, 3]]))  # would raise in oneDNN's bf16 reorder on an AVX2-only CPU
    copied = head_data.in_dtype(model, torch.bfloat16)
    assert kernels_of(copied).backend == "mkl" and "no bfloat16 path" in kernels_of(copied).how
    assert kernels_of(model).backend == "onednn" and kernels.in_use() is before


# --- the chapter 7 head's reduced LM head (a buffer, not an nn.Linear) --------------------------

def _tiny_head(seed: int = 0):
    from specnb.head import DraftHead, HeadConfig

    target = tiny_llama(seed=seed, vocab_size=96)
    torch.manual_seed(seed)
    head = DraftHead(HeadConfig.from_target(target.config, 40))
    head.vocab_ids.copy_(torch.randperm(96)[:40].sort().values)
    return head.attach(target).eval()


@pytest.mark.parametrize("rows", [1, 3, 6])
def test_the_heads_lm_rows_run_on_the_kernels_and_give_the_dense_product(rows):
    """Under oneDNN the head's logits (``predicted @ lm_rows^T``, most of a head step) use a packed copy
    of ``lm_rows``; the values equal the plain product, and the head gains no parameter or state."""
    head = _tiny_head()
    n_params, keys = sum(p.numel() for p in head.parameters()), set(head.state_dict())
    x = torch.randn(rows, head.cfg.hidden_size)
    ref = x @ head.lm_rows.T
    use_kernels(head, make("onednn"))
    with torch.inference_mode():
        y = head.logits(x)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    lm = head.__dict__["_lm_product"]
    assert lm._packed is not None  # it really ran oneDNN
    assert sum(p.numel() for p in head.parameters()) == n_params and set(head.state_dict()) == keys
    use_kernels(head, make("mkl"))
    with torch.inference_mode():
        head.logits(x)
    assert lm.kernels.backend == "mkl"  # switching the head's kernels switches its LM rows too


def test_the_heads_lm_rows_follow_a_new_vocabulary():
    """``attach`` replaces ``lm_rows``; a packed copy of the old rows would give the old logits."""
    head = _tiny_head()
    use_kernels(head, make("onednn"))
    x = torch.randn(2, head.cfg.hidden_size)
    with torch.inference_mode():
        head.logits(x)
        head.lm_rows = head.lm_rows.flip(0).clone()
        torch.testing.assert_close(head.logits(x), x @ head.lm_rows.T, rtol=1e-5, atol=1e-5)


def test_training_the_head_keeps_torchs_product_for_the_lm_rows():
    head = _tiny_head()
    use_kernels(head, make("onednn"))
    x = torch.randn(3, head.cfg.hidden_size, requires_grad=True)
    head.logits(x).sum().backward()
    assert x.grad is not None and head.__dict__["_lm_product"]._packed is None


def test_a_model_that_ran_on_onednn_can_be_deep_copied():
    """The packed oneDNN weights are opaque tensors that ``copy.deepcopy`` cannot copy: after one forward
    a plain deepcopy failed ("Cannot access storage of OpaqueTensorImpl"), which broke
    ``head_data.in_dtype`` (the bfloat16 copy that regenerates the training ids) once the target had run.
    The copy must drop the packed cache, keep its own fused groups, and compute the same logits."""
    if not kernels.onednn_supports(torch.float32):
        pytest.skip("oneDNN cannot run float32 here")
    model = tiny_llama(seed=0)
    use_kernels(model, make("onednn"))
    x = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    with torch.inference_mode():
        before = model(x).logits
    copied = copy.deepcopy(model)
    lin = [m for m in copied.modules() if isinstance(m, kernels.KernelLinear)]
    assert lin and all(m._packed is None for m in lin)
    groups = {id(m._group) for m in lin if getattr(m, "_group", None) is not None}
    originals = {id(m._group) for m in model.modules() if getattr(m, "_group", None) is not None}
    assert groups and not groups & originals  # the copy's members point at the copy's groups
    with torch.inference_mode():
        assert torch.equal(copied(x).logits, before)
    assert kernels_of(copied).backend == "onednn"


def test_kernels_are_rebuilt_from_their_label_skinny_too():
    """A card or results JSON records the kernels' label; from_label gives those kernels back (the
    committed training ids regenerate bit for bit only under the kernels that made them)."""
    for k in (make("mkl"), make("onednn"), make("onednn", fused=False), make("mixed", 4), make("mixed", 3, fused=False),
              make("mixed", 4, attention="repeat"), make("mkl", attention="repeat"), make("skinny"),
              make("skinny", fused=False)):
        back = kernels.from_label(k.label)
        assert (back.backend, back.onednn_from, back.attention, back.label) == (k.backend, k.onednn_from, k.attention, k.label)
        assert back.fused == k.fused or k.backend == "mkl"
    for bad in ("", "oneDNN kernels", "mixed kernels (MKL below 4 rows, oneDNN from 5)", "MKL kernels (torch default), fast"):
        with pytest.raises(ValueError, match="kernels label"):
            kernels.from_label(bad)
