"""Open conversations (specnb.magpie): user turns the target writes from its own chat template, answered
greedily; how they are filtered, loaded beside the template conversations, and what the committed ones are."""
from types import SimpleNamespace

import pytest
import torch

from specnb import head_data as hd
from specnb import magpie

END = 2


class _Tok:
    """A tokenizer of single characters (id = ord + 10) with a chat template like SmolLM2's."""

    eos_token_id = END

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        text = "".join(f"[{m['role']}]{m['content']}|" for m in messages)
        return text + ("[assistant]" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) + 10 for c in text]}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i - 10) for i in ids if i != END)


def _row(text, end=True, pad=0):
    return [ord(c) + 10 for c in text] + ([END] * (1 + pad) if end else [])


class _Model:
    """Returns the header, then the rows given, batch after batch."""

    def __init__(self, rows):
        self.rows, self.calls = rows, 0

    def generate(self, x, **kw):
        assert kw["do_sample"] and kw["top_k"] == 0 and kw["eos_token_id"] == END
        rows = [self.rows[(self.calls * len(x) + r) % len(self.rows)] for r in range(len(x))]
        self.calls += 1
        width = max(map(len, rows))
        rows = [r + [END] * (width - len(r)) for r in rows]
        return torch.cat([x, torch.tensor(rows)], 1)


def test_user_header_is_the_template_up_to_the_users_text():
    tok = _Tok()
    assert tok.decode(magpie.user_header_ids(tok)) == "[user]"

    class NoUserText(_Tok):
        def apply_chat_template(self, messages, **kw):
            return "[user]fixed|"
    with pytest.raises(ValueError, match="does not place the user's text verbatim"):
        magpie.user_header_ids(NoUserText())


def test_sample_user_turns_keeps_finished_long_enough_distinct_turns():
    rows = [_row("How do bees make honey from nectar?"), _row("an unfinished turn that runs on and on, longer than any other row here", end=False),
            _row("Hi there"), _row("How do bees make honey from nectar?", pad=2),
            _row("Write a poem about the sea at night.")]
    turns, counts = magpie.sample_user_turns(_Model(rows), _Tok(), 2, batch=5)
    assert turns == ["How do bees make honey from nectar?", "Write a poem about the sea at night."]
    assert counts == {"drawn": 5, "unfinished": 1, "short": 1, "repeated": 1, "surplus": 0}
    turns, counts = magpie.sample_user_turns(_Model(rows), _Tok(), 1, batch=5)   # the batch's second good turn
    assert turns == ["How do bees make honey from nectar?"] and counts["surplus"] == 1 and counts["drawn"] == 5
    # a model that never closes the user's turn is an error, not an endless loop
    with pytest.raises(RuntimeError, match="does not write user turns"):
        magpie.sample_user_turns(_Model([_row("on and on", end=False)]), _Tok(), 3, batch=4)
    with pytest.raises(ValueError, match="at least 1"):
        magpie.sample_user_turns(_Model(rows), _Tok(), 0)


def test_openers_begin_each_batchs_turns_and_are_part_of_the_kept_text():
    """Batch b's prompt is the header plus ``openers[b % len(openers)]``, and each kept turn starts with it.
    Negative control: the model's rows without the opener (what a loop that forgot to prepend it keeps)
    are not what comes back."""
    class Recording(_Model):
        def generate(self, x, **kw):
            self.prompts = getattr(self, "prompts", []) + [x[0].tolist()]
            return super().generate(x, **kw)

    tok = _Tok()
    rows = [_row(" the tides of a small bay."), _row(" a city at night, street by street."),
            _row(" the first lighthouse was lit."), _row(" why owls hunt at dusk and not at noon.")]
    model = Recording(rows)
    turns, counts = magpie.sample_user_turns(model, tok, 4, batch=2, openers=("Describe", "Explain how"))
    assert [tok.decode(p) for p in model.prompts] == ["[user]Describe", "[user]Explain how"]
    assert turns == ["Describe the tides of a small bay.", "Describe a city at night, street by street.",
                     "Explain how the first lighthouse was lit.", "Explain how why owls hunt at dusk and not at noon."]
    assert turns != [tok.decode(r).strip() for r in rows]
    with pytest.raises(ValueError, match="at least one opener"):
        magpie.sample_user_turns(model, tok, 1, openers=())


def _save(path, convs):
    hd.save_training_ids({"ids": convs, "prompt_lens": [2] * len(convs), "prompt_index": list(range(len(convs))),
                          "turn": [1] * len(convs), "meta": {"what": "test"}}, path)
    return path


def test_training_conversations_put_open_ones_after_the_template_ones(tmp_path):
    ids = hd.load_training_ids()
    open_path = _save(tmp_path / "open.npz", [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14]])
    cfg = SimpleNamespace(max_prompts=3, open_conversations=2, seed=0)
    conv = hd.training_conversations(cfg, open_path=open_path)
    assert conv["ids"] == ids["ids"][:3] + [[5, 6, 7, 8], [9, 10, 11]]
    assert conv["kinds"][3:] == ["open", "open"] and "open" not in conv["kinds"][:3]
    assert conv["prompt_lens"] == ids["prompt_lens"][:3] + [2, 2]
    cfg.open_conversations = 0
    assert hd.training_conversations(cfg, open_path=open_path)["ids"] == ids["ids"][:3]
    cfg.open_conversations = 4
    with pytest.raises(ValueError, match="holds 3: pass --open-conversations 3 or fewer"):
        hd.training_conversations(cfg, open_path=open_path)
    with pytest.raises(FileNotFoundError, match="--regenerate-open"):
        hd.training_conversations(cfg, open_path=tmp_path / "none.npz")
    # the described set comes after the open one, with its own kind, count and errors
    cfg.open_conversations, cfg.described_conversations = 1, 2
    described_path = _save(tmp_path / "described.npz", [[20, 21, 22], [23, 24], [25, 26, 27]])
    conv = hd.training_conversations(cfg, open_path=open_path, described_path=described_path)
    assert conv["ids"] == ids["ids"][:3] + [[5, 6, 7, 8], [20, 21, 22], [23, 24]]
    assert conv["kinds"][3:] == ["open", "described", "described"]
    cfg.described_conversations = 5
    with pytest.raises(ValueError, match="holds 3: pass --described-conversations 3 or fewer"):
        hd.training_conversations(cfg, open_path=open_path, described_path=described_path)
    with pytest.raises(FileNotFoundError, match="--regenerate-described"):
        hd.training_conversations(cfg, open_path=open_path, described_path=tmp_path / "none.npz")
    with pytest.raises(ValueError, match="must be one of"):
        hd.load_open_ids(cfg, open_path, "closed")
    cfg.described_conversations = 0
    cfg.open_conversations = -1
    with pytest.raises(ValueError, match="0 or more"):
        hd.load_open_ids(cfg, open_path)
    # the open part's cache key names how many and which file
    key = hd.data_key(SimpleNamespace(open_conversations=2, feature_dtype="bfloat16"), "open", "abc")
    assert key == "open-open_conversations2-abc-bfloat16"
    key = hd.data_key(SimpleNamespace(described_conversations=3, feature_dtype="bfloat16"), "described", "abc")
    assert key == "described-described_conversations3-abc-bfloat16"


@pytest.mark.parametrize("which", ["open", "described"])
def test_committed_open_conversations_are_chat_turns_answered_by_the_target(real, which):
    """The committed open (and described) conversations: as many as the default recipe reads; each prompt is one user turn
    through the chat template; each answer is the target's greedy continuation. A float32 teacher-forced
    pass over the first 16 must choose the committed next token at almost every answer position (they were
    generated in bfloat16, whose labels matched float32's on 0.986 of positions; see the card). Negative
    control: the same answers with one token in ten replaced by another (answers that are not all the target's
    own choices) fall below the bar. (Dropping one token is no control: teacher-forced, the target still
    predicts the rest of the shifted text, 0.94 of positions when tried.)"""
    from specnb.prompts import chat_ids
    from specnb.train_head import TrainConfig

    tok = real.tokenizer
    op = hd.load_training_ids(magpie.IDS_FILES[which])
    assert len(op["ids"]) >= max(getattr(TrainConfig(), f"{which}_conversations"), 1)
    header, close = magpie.user_header_ids(tok), chat_ids(tok, [{"role": "user", "content": "x"}])[-6:]
    for ids, n in zip(op["ids"], op["prompt_lens"]):
        assert ids[:len(header)] == header and ids[n - 6:n] == close
    texts = [tok.decode(ids[len(header):n - 6], skip_special_tokens=True) for ids, n in zip(op["ids"], op["prompt_lens"])]
    assert len(set(texts)) == len(texts), "open user turns repeat"
    openers = op["meta"].get("openers", [""])
    assert (which == "described") == any(openers)
    assert all(any(t.startswith(o) for o in openers) for t in texts)

    def agreement(docs, lens):
        seqs = hd.features(real.model, docs, "generated", lens)
        same = total = 0
        for s, doc, n in zip(seqs, docs, lens):
            labels, nxt = s.labels[n - 1:].tolist(), doc[n:]
            same += sum(a == b for a, b in zip(labels, nxt))
            total += len(nxt)
        return same / total

    docs, lens = op["ids"][:16], op["prompt_lens"][:16]
    a = agreement(docs, lens)
    vocab = real.model.config.vocab_size
    corrupt = [d[:n] + [(t + 1) % vocab if (i - n) % 10 == 5 else t for i, t in enumerate(d[n:], n)]
               for d, n in zip(docs, lens)]   # one answer token in ten is not the committed one
    b = agreement(corrupt, lens)
    print(f"float32 labels equal to the committed answers: {a:.3f}; with one token in ten replaced: {b:.3f}")
    assert a >= 0.95 > b, (a, b)
