"""The head's training data (specnb.head_data, specnb.corpus): the precision of the teacher-forced
passes, the cache keys that keep float32 and bfloat16 data apart, and the teacher text's sources."""
import importlib.util
from types import SimpleNamespace

import pytest
import torch

from specnb import corpus
from specnb import head_data as hd
from specnb.tiny import perturbed_copy, tiny_llama


def _docs(n=6, length=40, vocab=96, seed=5):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length + 3 * i,), generator=gen).tolist() for i in range(n)]


def test_label_agreement_measures_how_often_the_fast_pass_labels_like_float32():
    target = tiny_llama(seed=0)
    docs = _docs()
    same = hd.label_agreement(target, target, docs)
    assert same["label_agreement"] == 1.0 and same["feature_relative_error_median"] == 0.0
    assert same["positions"] == sum(map(len, docs)) and same["dtype"] == "float32"
    bf16 = hd.label_agreement(target, hd.in_dtype(target, torch.bfloat16), docs)
    assert bf16["dtype"] == "bfloat16" and 0 < bf16["feature_relative_error_median"] < 0.05
    assert 0.8 < bf16["label_agreement"] <= 1.0, bf16
    # negative control: a pass that is not the target's (weights perturbed) is caught as labelling otherwise
    other = hd.label_agreement(target, perturbed_copy(target, noise=0.5, seed=3), docs)
    assert other["label_agreement"] < 0.8 and other["feature_relative_error_median"] > 0.1, other


def test_cache_keys_keep_feature_precisions_apart():
    cfg = SimpleNamespace(max_prompts=0, seed=0, teacher_chars=100, doc_tokens=512, new_tokens=192, max_held_out=0,
                          feature_layers=(), feature_dtype="float32")
    f32 = {p: hd.data_key(cfg, p) for p in ("generated", "teacher", "held_out")}
    cfg.feature_dtype = "bfloat16"
    bf16 = {p: hd.data_key(cfg, p) for p in ("generated", "teacher", "held_out")}
    assert bf16["held_out"] == f32["held_out"]  # held-out data is always the float32 target's own
    for p in ("generated", "teacher"):
        assert bf16[p] == f32[p] + "-bfloat16" and "bfloat16" not in f32[p]  # float32 keys as before
    assert hd.feature_dtype(cfg) is torch.bfloat16
    cfg.feature_dtype = "float16"
    with pytest.raises(ValueError, match="feature_dtype must be 'float32' or 'bfloat16'"):
        hd.feature_dtype(cfg)


def test_teacher_text_reads_package_docstrings_only_past_the_stdlib_size():
    pkg = set(corpus._package_docstring_documents(0))
    assert len(pkg) > 100 and all(len(d) >= 4000 for d in pkg)
    small = corpus.teacher_text(200_000)
    assert sum(map(len, small)) == 200_000 and not pkg & set(small), "a small corpus read package docstrings"
    big = corpus.teacher_text(3_000_000)
    assert sum(map(len, big)) == 3_000_000 and len(pkg & set(big)) > 20
    licences = corpus.teacher_licenses()
    assert set(licences) == {"python", "torch", "transformers"} and "Apache" in licences["transformers"]


def test_package_docstrings_keep_each_repeat_once(monkeypatch):
    monkeypatch.setattr(corpus, "_docstrings", lambda paths: ["a" * 300, "b" * 300, "a" * 300])
    monkeypatch.setattr(corpus, "DOC_PACKAGES", (("json", "json"),))
    docs = corpus._package_docstring_documents(0, per_doc=10)
    assert sorted(docs) == ["a" * 300, "b" * 300]


def test_package_docstrings_name_a_missing_package(monkeypatch):
    monkeypatch.setattr(corpus, "DOC_PACKAGES", (("no_such_package_here", "x"),))
    with pytest.raises(RuntimeError, match="needs the package 'no_such_package_here'.*make model"):
        corpus._package_docstring_documents(0)


def test_carried_studies_are_copied_with_their_source_and_nothing_else(tmp_path):
    """`specnb head-study --carry-studies CARD`: the studies that record their own data move to a new head's
    card, named with where they came from; the learning curve (one head's data) does not."""
    import json

    from specnb import head_study

    src = tmp_path / "old.json"
    src.write_text(json.dumps({"created": "then", "machine": {"cpu": "x"}, "ablation": {"rows": [1]},
                               "fused_layers": {"rows": [2]}, "recipe_levers": {"rows": [3]},
                               "feature_precision": {"rows": [5]}, "learning_curve": {"rows": [4]}}))
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "draft_head.json").write_text(json.dumps({"created": "now"}))
    assert head_study.carry_recipe_studies(tmp_path / "new", src) == ["ablation", "fused_layers", "recipe_levers", "feature_precision"]
    card = json.loads((tmp_path / "new" / "draft_head.json").read_text())
    assert card["ablation"] == {"rows": [1]} and "learning_curve" not in card and card["created"] == "now"
    assert card["feature_precision"] == {"rows": [5]}
    assert card["studies_carried"] == {"from": str(src), "keys": ["ablation", "fused_layers", "recipe_levers", "feature_precision"],
                                       "created": "then", "head_machine": {"cpu": "x"}}
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    with pytest.raises(ValueError, match="holds none of the studies"):
        head_study.carry_recipe_studies(tmp_path / "new", empty)
    with pytest.raises(FileNotFoundError, match="no head card at"):
        head_study.carry_recipe_studies(tmp_path, src)


def _card(train: dict, a1: float, prose: float, seconds: dict) -> dict:
    held = {"agree": [a1, 0.3], "conditional": [a1, 0.4], "chain": [a1, 0.1]}
    kinds = {"prose": {"agree": [prose], "conditional": [prose, 0.5]}}
    return {"config": {"train": train, "head": {"draft_vocab": 8192}}, "held_out": held, "held_out_by_kind": kinds,
            "data": {"training_tokens": 10, "vocab_coverage_held_out": 0.9, "generated_by_kind": {"prose": 3}},
            "kept_step": 5, "steps": 6, "validation_curve": [{"a1": 0.4}], "seconds": seconds,
            "created": "then", "machine": {"cpu": "x"}, "target_fingerprint": "f"}


def test_data_mix_puts_two_heads_side_by_side_and_refuses_other_recipes():
    """`specnb head-study --data-mix CARD`: two heads of one recipe and different data, each row from its own
    card (a_1, prose, make draft's whole time); a pair that differs in how it trained, or not in its data,
    is an error, not a comparison."""
    from specnb import head_study

    base = {"lr": 3e-3, "open_conversations": 2400, "teacher_chars": 4_000_000}
    other = {**base, "described_conversations": 2000, "teacher_chars": 2_600_000}
    a = _card(base, 0.43, 0.36, {"training": 100.0, "teacher": 20.0})
    b = _card(other, 0.44, 0.40, {"training": 120.0, "described": 30.0})
    study = head_study.data_mix(a, b)
    assert study["differs"] == ["described_conversations", "teacher_chars"]
    c, o = study["rows"]
    assert (c["a1"], c["by_kind"]["prose"]["a1"], c["make_draft_seconds"]) == (0.43, 0.36, 120.0)
    assert (o["a1"], o["by_kind"]["prose"]["a1"], o["make_draft_seconds"]) == (0.44, 0.40, 150.0)
    assert c["data"]["described_conversations"] == 0 and o["data"]["described_conversations"] == 2000
    with pytest.raises(ValueError, match=r"differ in how they were trained \(lr\)"):
        head_study.data_mix(a, _card({**other, "lr": 1e-3}, 0.4, 0.4, {"training": 1.0}))
    with pytest.raises(ValueError, match="same data mix"):
        head_study.data_mix(a, a)
    with pytest.raises(ValueError, match="different targets"):
        head_study.data_mix(a, {**b, "target_fingerprint": "g"})
