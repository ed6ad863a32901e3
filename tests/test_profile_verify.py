"""The verify breakdown and GEMM table (specnb.profile_verify) on tiny models, under each kernel backend."""
import pytest
import torch

from specnb.cache import forward, forward_features, new_cache
from specnb.kernels import kernels_of, make, use_kernels
from specnb.profile_verify import breakdown_table, gemm_table, gemm_text, op_table, verify_breakdown


@pytest.mark.parametrize("n", [1, 3, 5, 9, 17])
def test_verify_forwards_give_the_models_own_logits(target, prompts, n):
    """specnb's forward and forward_features (decoder + LM head) equal the model's own forward."""
    ids = list(prompts[-1]) * 2  # 40 ids
    prefix, new = ids[:-n], ids[-n:]
    own_cache, ours_cache, feat_cache = new_cache(target), new_cache(target), new_cache(target)
    for c in (own_cache, ours_cache, feat_cache):
        forward(target, prefix, c, logits_to_keep=1)
    with torch.inference_mode():
        own = target(input_ids=torch.tensor([new]), past_key_values=own_cache, use_cache=True).logits[0]
    ours = forward(target, new, ours_cache)
    feats, hidden = forward_features(target, new, feat_cache)
    assert hidden.shape == (n, target.config.hidden_size)
    assert torch.allclose(own, ours, atol=1e-5, rtol=0) and torch.equal(own.argmax(-1), ours.argmax(-1))
    assert torch.allclose(own, feats, atol=1e-5, rtol=0) and torch.equal(own.argmax(-1), feats.argmax(-1))
    # and both equal one forward of the whole sequence with no cache, a reference that shares no code path
    with torch.inference_mode():
        whole = target(input_ids=torch.tensor([ids])).logits[0, -n:]
    assert torch.allclose(whole, ours, atol=1e-4, rtol=0) and torch.equal(whole.argmax(-1), ours.argmax(-1))


def test_verify_breakdown_gemm_table_and_op_table_run(target):
    import copy

    model = copy.deepcopy(target)
    use_kernels(model, make("mixed", 3))
    b = verify_breakdown(model, ns=(1, 3), context_len=8, repeats=2, warmup=1, progress=False)
    from specnb.skinny import OP_NAME, unavailable

    assert set(b["median"]) == {"mkl", "onednn"} | ({"skinny"} if unavailable() is None else set())
    assert all(set(m) == {"full", "body", "head", "rest"} for m in b["median"].values())
    assert all(t > 0 for m in b["median"].values() for part in m.values() for t in part.values())
    assert b["max_diff"][3] < 1e-3  # two libraries: close (at this tiny size even identical)
    assert any(m._packed is not None for m in model.modules() if hasattr(m, "_packed"))  # oneDNN really ran
    assert kernels_of(model).backend == "mixed"  # the model's own kernels restored
    assert "T(n)/T(1)" in breakdown_table(b)
    rows = gemm_table(model, ns=(1, 2), repeats=2, warmup=1)
    shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    assert {r["shape"] for r in rows} == shapes and sum(r["count"] for r in rows) == 2 * 7 + 1
    assert "onednn" in gemm_text(rows)
    ops = op_table(model, 3, context_len=8, repeats=1, top=5)
    assert 0 < len(ops) <= 5 and all(ms > 0 and 0 < share <= 1 for _, ms, share in ops)
    if unavailable() is None:  # the skinny kernel is a pybind call: the profiler must still see it by name
        use_kernels(model, make("skinny"))
        assert OP_NAME in {name for name, _, _ in op_table(model, 3, context_len=8, repeats=1, top=50)}


def test_chapter_1_kernel_figures_draw(target):
    import copy

    import matplotlib

    matplotlib.use("Agg")
    from specnb import plots

    model = copy.deepcopy(target)
    b = verify_breakdown(model, ns=(1, 2), context_len=8, repeats=1, warmup=0, progress=False)
    rows = gemm_table(model, ns=(1, 2), repeats=1, warmup=0)
    curves = {"mkl": {1: 30.0, 2: 31.0}, "onednn": {1: 35.0, 2: 34.0}}
    for fig in (plots.verify_breakdown(b, "tiny"),
                plots.kernel_curves(curves, {"label": "mkl", "ms": {1: 30.0, 2: 31.5}}, rows, "tiny")):
        assert fig is not None and fig.axes


def test_stubbed_linear_layers_run_no_product_and_are_restored(target, prompts):
    """The breakdown's ``rest``: inside the block no linear layer multiplies (logits are all zero and
    no layer's own forward runs); after it the model gives its own logits again."""
    import copy

    from specnb.profile_verify import linear_layers_stubbed, products_share_of_growth

    model = copy.deepcopy(target)
    ids = list(prompts[0])
    before = forward(model, ids, new_cache(model))
    calls = []
    hooks = [m.register_forward_hook(lambda mod, i, o: calls.append(mod)) for m in model.modules()
             if isinstance(m, torch.nn.Linear)]
    with linear_layers_stubbed(model) as stubbed:
        stubbed_logits = forward(model, ids, new_cache(model))
    assert stubbed == 2 * 7 + 1  # 2 layers x (q, k, v, o, gate, up, down) + the LM head
    assert stubbed_logits.shape == before.shape and not stubbed_logits.any()
    assert len(calls) == stubbed * 1  # the hooks fire (the module is called) ...
    for h in hooks:
        h.remove()
    after = forward(model, ids, new_cache(model))
    assert torch.equal(before, after) and before.any()  # ... and the real products are back
    with pytest.raises(RuntimeError, match="boom"), linear_layers_stubbed(model):
        raise RuntimeError("boom")
    assert torch.equal(forward(model, ids, new_cache(model)), before)  # restored on error too
    b = {"ns": [1, 5], "median": {"x": {"full": {1: 30.0, 5: 40.0}, "rest": {1: 7.0, 5: 8.0}}}}
    assert products_share_of_growth(b, "x", 5) == pytest.approx(0.9)
    # from paired samples, the whole's growth, the rest's and the share add up even where medians do not
    from specnb.profile_verify import growth_parts

    s = {"ns": [1, 5], "samples": {"x": {"full": {1: [30.0, 31.0, 29.0], 5: [40.0, 30.5, 30.0]},
                                         "rest": {1: [7.0, 7.0, 7.0], 5: [8.0, 9.0, 7.5]}}}}
    whole, rest, share = growth_parts(s, "x", 5)
    assert (whole, rest) == (pytest.approx(1.0), pytest.approx(1.0)) and share == pytest.approx(1 - rest / whole)


def test_the_breakdown_times_oneDNN_with_and_without_the_fusion():
    from specnb.tiny import tiny_llama

    model = tiny_llama(seed=0, vocab_size=96)
    b = verify_breakdown(model, (1, 3), backends=("mkl", "onednn", "onednn-unfused"), repeats=2, warmup=1,
                         progress=False)
    assert b["backends"] == ["mkl", "onednn", "onednn-unfused"]
    assert b["max_diff_vs_first"]["mkl"][3] == 0.0
    # the libraries agree to rounding; on this tiny model they may agree bit for bit (an Intel Xeon with
    # AMX did), so what shows that the unfused backend is oneDNN without the groups is its kernels:
    assert b["max_diff_vs_first"]["onednn-unfused"][3] < 1e-4
    from specnb.profile_verify import _kernels_named

    unfused, fused = _kernels_named("onednn-unfused"), _kernels_named("onednn")
    assert (unfused.backend, unfused.fused, fused.backend, fused.fused) == ("onednn", False, "onednn", True)
    assert "onednn-unfused" in breakdown_table(b)
    with pytest.raises(ValueError, match="valid: mkl, onednn"):
        verify_breakdown(model, (1,), backends=("mkl", "fastest"), repeats=1, progress=False)
