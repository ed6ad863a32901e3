"""The draft head's data (chapter 7): token ids, the target's features and labels, disjointness.

* **Generated ids**: the target's greedy continuations of :func:`specnb.corpus.training_prompts`,
  plus a second turn (a follow-up question) after some of them. They are generated once, in
  bfloat16 and large batches (the fast mode: :func:`generate_training_ids`), and committed as
  uint16 ids (``specnb/data/draft_train_ids.npz``); ``specnb train-draft --regenerate`` makes
  them again from scratch, timed on its own.
* **Features and labels** never come from the fast mode: one float32 teacher-forced target
  forward over every document (:func:`features`) gives, at each position t, ``f_t`` (the last
  hidden state after the final norm) and ``y_t = argmax lm_head(f_t)``, the target's own
  greedy choice, exactly as decoding computes it.
* **Teacher-forced text**: documents from files that ship with Python (:func:`specnb.corpus.teacher_text`).
* **Held-out data**: the target's float32 greedy continuations of :func:`specnb.corpus.held_out_prompts`.
  :func:`shared_ngrams` finds the 8-token n-grams any training document shares with a held-out
  prompt or scored continuation (the chat template's own tokens left out); :func:`build_data`
  drops those documents and records how many.

Every part is cached in the specnb cache under the target's fingerprint and the settings it
depends on, so a second run (another loss, another V') skips the forwards.
"""
from __future__ import annotations

import copy
import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from .cache import cache_keyword
from .prompts import chat_ids, encode

IDS_FILE = Path(__file__).parent / "data" / "draft_train_ids.npz"
GEN_DTYPE = torch.bfloat16  # the fast mode for the committed token ids
# The training features and labels come from a teacher-forced pass in TrainConfig.feature_dtype
# (bfloat16 by default: 2.9x float32's speed on the Intel build machine, whose AMX units run it; the card's
# feature_precision study);
# build_data measures how often its labels equal the float32 target's. Held-out data: always float32.


def in_dtype(target, dtype: torch.dtype):
    """``target`` itself when it already runs in ``dtype``, else a copy converted to it (the original untouched),
    on the target's kernels where they can run ``dtype`` here, else on MKL with the reason in its ``how``."""
    from .kernels import kernels_of, use_kernels

    if dtype == next(target.parameters()).dtype:
        return target
    out = copy.deepcopy(target).to(dtype)
    if kernels_of(target) is not None:
        use_kernels(out, kernels_of(target), remember=False)
    return out

GEN_BATCH = 64  # best of 16 / 32 / 64 on the 2-core Intel build machine (278 / 353 / 374 new tok/s)
NGRAM = 8


@dataclass
class Sequence:
    """One document with its target features: ``tokens (T,)``, ``features (T, H)`` fp16, ``labels (T,)``."""

    tokens: torch.Tensor
    features: torch.Tensor
    labels: torch.Tensor
    source: str  # "generated" or "teacher"
    prompt_len: int = 0


# ---------------------------------------------------------------------------------------------
# 1-2. Data and features


def generate(target, tokenizer, prompts, new_tokens: int, batch: int, desc: str = "generating",
             layers: tuple[int, ...] = ()) -> list[Sequence]:
    """The target's greedy continuations of ``prompts`` (see :func:`generate_ids`)."""
    encoded = [encode(tokenizer, p) for p in prompts]
    return generate_ids(target, encoded, new_tokens, batch, tokenizer.eos_token_id, desc, layers)


@torch.inference_mode()
def generate_ids(target, encoded: list[list[int]], new_tokens: int, batch: int, eos: int | None,
                 desc: str = "generating", layers: tuple[int, ...] = ()) -> list[Sequence]:
    """The target's greedy continuations of ``encoded`` prompts, with its features and labels at every position.

    Left-padded batches through the target's decoder with a KV cache; the features of
    the prompt come from the prefill and those of the continuation from the decode
    steps that produced it, so no second forward is needed. Each sequence is cut
    after EOS. Labels are the target's argmax at every position (in the continuation,
    simply the next token). Features: :func:`specnb.cache.decoder_features` of ``layers``, ``(T, F)``.
    """
    from .cache import decoder_features, new_cache

    base, lm_head = target.model, target.lm_head
    Hs = target.config.hidden_size
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))  # similar lengths together: less padding
    out: list[Sequence | None] = [None] * len(encoded)
    bar = tqdm(total=len(encoded) * new_tokens, desc=desc, unit="tok")
    for s in range(0, len(order), batch):
        idx = order[s:s + batch]
        B, L = len(idx), max(len(encoded[i]) for i in idx)
        ids = torch.zeros((B, L), dtype=torch.long)
        mask = torch.zeros((B, L), dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, L - len(encoded[i]):] = torch.tensor(encoded[i])
            mask[r, L - len(encoded[i]):] = 1
        cache = new_cache(target)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        h = decoder_features(base, layers, input_ids=ids, attention_mask=mask, position_ids=pos,
                             **{cache_keyword(base): cache})
        hs, ys = [h], [lm_head(h[..., -Hs:]).argmax(-1)]  # (B, L, F), (B, L)
        done = torch.zeros(B, dtype=torch.bool)
        for _ in range(new_tokens):
            nxt = ys[-1][:, -1:]  # (B, 1)
            if eos is not None:
                done |= nxt[:, 0] == eos
            ids = torch.cat([ids, nxt], 1)
            mask = torch.cat([mask, torch.ones(B, 1, dtype=torch.long)], 1)
            pos = pos[:, -1:] + 1
            bar.update(B)
            if bool(done.all()):
                break
            h = decoder_features(base, layers, input_ids=nxt, attention_mask=mask, position_ids=pos,
                                 **{cache_keyword(base): cache})
            hs.append(h)
            ys.append(lm_head(h[..., -Hs:]).argmax(-1))
        H, Y = torch.cat(hs, 1), torch.cat(ys, 1)  # features and labels for ids[:, :-1]
        for r, i in enumerate(idx):
            a = L - len(encoded[i])
            seq = ids[r, a:].tolist()
            cont = seq[len(encoded[i]):]
            if eos is not None and eos in cont:
                seq = seq[:len(encoded[i]) + cont.index(eos) + 1]
            n = len(seq) - 1  # features exist for every token but the last one generated
            out[i] = Sequence(torch.tensor(seq[:n]), H[r, a:a + n].to(torch.float16).clone(), Y[r, a:a + n].clone(),
                              "generated", len(encoded[i]))
    bar.close()
    return out  # type: ignore[return-value]


@torch.inference_mode()
def features(target, docs: list[list[int]], source: str, prompt_lens: list[int] | None = None,
             batch_tokens: int = 2048, desc: str = "features", layers: tuple[int, ...] = ()) -> list[Sequence]:
    """Teacher-forced target forwards: ``f_t`` and ``y_t = argmax`` at every position of every doc.

    Documents are batched by length with right padding (causal attention: padding after a
    sequence cannot change it). ``f_t``: :func:`specnb.cache.decoder_features` of ``layers``, ``(T, F)``.
    """
    from .cache import decoder_features

    Hs = target.config.hidden_size
    base, head = target.get_decoder() if hasattr(target, "get_decoder") else target.model, target.lm_head
    order = sorted(range(len(docs)), key=lambda i: len(docs[i]))
    out: list[Sequence | None] = [None] * len(docs)
    batches, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * len(docs[i]) > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    for idx in tqdm(batches, desc=desc, unit="batch"):
        L = max(len(docs[i]) for i in idx)
        ids = torch.zeros((len(idx), L), dtype=torch.long)
        mask = torch.zeros((len(idx), L), dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, :len(docs[i])] = torch.tensor(docs[i])
            mask[r, :len(docs[i])] = 1
        h = decoder_features(base, layers, input_ids=ids, attention_mask=mask)  # (B, L, F)
        # (B, L) the argmax; max(-1).indices returns the same (the first of equal maxima) in 68 ms against
        # argmax's 168 ms on (8, 256, 49152) bfloat16 logits (Intel Xeon): a fifth of the pass
        y = head(h[..., -Hs:]).max(-1).indices
        for r, i in enumerate(idx):
            n = len(docs[i])
            out[i] = Sequence(torch.tensor(docs[i]), h[r, :n].to(torch.float16).clone(), y[r, :n].clone(), source,
                              prompt_lens[i] if prompt_lens else 0)
    return out  # type: ignore[return-value]


def teacher_docs(tokenizer, max_chars: int, doc_tokens: int, seed: int) -> list[list[int]]:
    """Teacher-forced text as token windows of at most ``doc_tokens`` (each starting with BOS when the tokenizer has one)."""
    from .corpus import teacher_text

    docs = []
    for text in teacher_text(max_chars, seed):
        ids = tokenizer(text)["input_ids"]
        for s in range(0, len(ids), doc_tokens):
            window = ids[s:s + doc_tokens]
            if len(window) >= 32:
                docs.append(window)
    return docs


def draft_vocabulary(seqs: list[Sequence], size: int) -> torch.Tensor:
    """The ``size`` most frequent target labels in the training data: the head's reduced vocabulary ``(V',)``."""
    counts = torch.bincount(torch.cat([s.labels for s in seqs]))
    size = min(size, int((counts > 0).sum()))
    return torch.argsort(counts, descending=True, stable=True)[:size].sort().values


def vocab_coverage(seqs: list[Sequence], vocab_ids: torch.Tensor) -> float:
    """Share of target labels that the reduced vocabulary contains (an upper bound on agreement)."""
    labels = torch.cat([s.labels for s in seqs])
    return float(torch.isin(labels, vocab_ids).float().mean())




def _save_seqs(seqs: list[Sequence], path: Path) -> None:
    from safetensors.torch import save_file

    lens = torch.tensor([len(s.tokens) for s in seqs])
    save_file({"tokens": torch.cat([s.tokens for s in seqs]).to(torch.int32),
               "features": torch.cat([s.features for s in seqs]), "labels": torch.cat([s.labels for s in seqs]),
               "lengths": lens, "prompt_lens": torch.tensor([s.prompt_len for s in seqs]),
               "generated": torch.tensor([s.source == "generated" for s in seqs])}, str(path))


def _load_seqs(path: Path) -> list[Sequence]:
    from safetensors.torch import load_file

    d = load_file(str(path))
    out, a = [], 0
    for n, pl, g in zip(d["lengths"].tolist(), d["prompt_lens"].tolist(), d["generated"].tolist()):
        out.append(Sequence(d["tokens"][a:a + n].long(), d["features"][a:a + n], d["labels"][a:a + n],
                            "generated" if g else "teacher", pl))
        a += n
    return out


# ---------------------------------------------------------------------------------------------
# Generated token ids: made once in the fast mode, committed, read by `make draft`


def _follow_up_prompt(tokenizer, prompt_text: str, answer_ids: list[int], i: int) -> list[int]:
    """A second user turn after the target's first answer, through the chat template."""
    from .corpus import follow_up

    answer = tokenizer.decode(answer_ids, skip_special_tokens=True).strip()
    messages = [{"role": "user", "content": prompt_text}, {"role": "assistant", "content": answer},
                {"role": "user", "content": follow_up(i)}]
    return chat_ids(tokenizer, messages)


def generate_training_ids(target, tokenizer, new_tokens: int, batch: int = GEN_BATCH, max_prompts: int = 0,
                          follow_up_every: int = 5, seed: int = 0, dtype: torch.dtype = GEN_DTYPE) -> dict:
    """Token ids of the training conversations, generated greedily by a ``dtype`` copy of the target.

    Turn 1: every training prompt. Turn 2: every ``follow_up_every``-th chat prompt whose answer
    ended with EOS, followed by a follow-up question (:func:`specnb.corpus.follow_up`).
    Returns ``{"ids": [list[int]], "prompt_lens": [int], "prompt_index": [int], "turn": [int], "meta": {...}}``:
    each ``ids`` is prompt + continuation (through EOS when one came), ``prompt_lens`` the prompt part.
    """
    from .corpus import training_prompts

    prompts = training_prompts(seed)
    prompts = prompts[:max_prompts] if max_prompts else prompts
    fast = in_dtype(target, dtype)
    eos = tokenizer.eos_token_id
    t0 = time.perf_counter()
    encoded = [encode(tokenizer, p) for p in prompts]
    first = generate_ids(fast, encoded, new_tokens, batch, eos, "training ids, turn 1")
    out = {"ids": [], "prompt_lens": [], "prompt_index": [], "turn": []}
    for i, s in enumerate(first):
        out["ids"].append(s.tokens.tolist() + [int(s.labels[-1])])
        out["prompt_lens"].append(s.prompt_len)
        out["prompt_index"].append(i)
        out["turn"].append(1)
    second = [i for i, p in enumerate(prompts)
              if p.chat and i % follow_up_every == 0 and out["ids"][i][-1] == eos]
    enc2 = [_follow_up_prompt(tokenizer, prompts[i].text, out["ids"][i][out["prompt_lens"][i]:-1], n)
            for n, i in enumerate(second)]
    for i, s in zip(second, generate_ids(fast, enc2, new_tokens, batch, eos, "training ids, turn 2")):
        out["ids"].append(s.tokens.tolist() + [int(s.labels[-1])])
        out["prompt_lens"].append(s.prompt_len)
        out["prompt_index"].append(i)
        out["turn"].append(2)
    from .env import machine_info

    out["meta"] = {"dtype": str(dtype).replace("torch.", ""), "batch": batch, "new_tokens": new_tokens,
                   "seed": seed, "prompts": len(prompts), "follow_ups": len(second),
                   "seconds": round(time.perf_counter() - t0, 1),
                   "new_token_count": int(sum(len(x) - p for x, p in zip(out["ids"], out["prompt_lens"]))),
                   "machine": machine_info(target)}
    return out


def save_training_ids(data: dict, path: Path = IDS_FILE) -> Path:
    """``ids`` as one uint16 array plus ``lengths``, ``prompt_lens``, ``prompt_index``, ``turn`` and the meta (JSON)."""
    import json

    flat = np.concatenate([np.asarray(x, dtype=np.int64) for x in data["ids"]])
    if flat.max() >= 2**16:
        raise ValueError(f"token id {flat.max()} does not fit uint16")
    np.savez_compressed(path, ids=flat.astype(np.uint16), lengths=np.array([len(x) for x in data["ids"]]),
                        prompt_lens=np.array(data["prompt_lens"]), prompt_index=np.array(data["prompt_index"]),
                        turn=np.array(data["turn"]), meta=np.array(json.dumps(data["meta"])))
    return path


def load_training_ids(path: Path = IDS_FILE) -> dict:
    """The committed ids as :func:`generate_training_ids` returns them."""
    import json

    if not Path(path).exists():
        raise FileNotFoundError(f"no generated training ids at {path}: run `specnb train-draft --regenerate` "
                                "(about 15 minutes on 2 cores) to make them")
    z = np.load(path)
    ids = np.split(z["ids"].astype(np.int64), np.cumsum(z["lengths"])[:-1])
    meta = json.loads(str(z["meta"])) if "meta" in z else {}
    n = len(ids)
    return {"ids": [x.tolist() for x in ids],
            "prompt_lens": z["prompt_lens"].tolist() if "prompt_lens" in z else [0] * n,
            "prompt_index": z["prompt_index"].tolist() if "prompt_index" in z else list(range(n)),
            "turn": z["turn"].tolist() if "turn" in z else [1] * n, "meta": meta}


def ids_digest(path: Path = IDS_FILE) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:12]


# ---------------------------------------------------------------------------------------------
# Disjointness of held-out and training data


def ngrams(ids, n: int = NGRAM) -> set:
    return {tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)}


def template_ngrams(tokenizer, n: int = NGRAM) -> set:
    """The n-grams of the chat template's own tokens (system turn, role headers): every chat prompt has them."""
    if not getattr(tokenizer, "chat_template", None):
        return set()
    out = set()
    for text in ("x", "Hello there"):
        for gen in (True, False):
            ids = chat_ids(tokenizer, [{"role": "user", "content": text}], gen)
            text_ids = set(tokenizer(text, add_special_tokens=False)["input_ids"])
            out |= {g for g in ngrams(list(ids), n) if not text_ids & set(g)}
    return out


def shared_ngrams(train_docs: list[list[int]], held_docs: list[list[int]], exclude: set, skip_ids=(),
                  n: int = NGRAM) -> list[int]:
    """Indices of the training documents that share an n-gram with any held-out document; n-grams in
    ``exclude`` (the template's own) or holding a token of ``skip_ids`` (the special tokens of the chat
    template: ``...Hugging Face<|im_end|>\n<|im_start|>user\nGive`` is in every chat prompt) do not count."""
    held = set()
    for d in held_docs:
        held |= ngrams(d, n)
    skip = set(skip_ids)
    held = {g for g in held - exclude if skip.isdisjoint(g)}
    return [i for i, d in enumerate(train_docs) if not held.isdisjoint(ngrams(d, n))]


# ---------------------------------------------------------------------------------------------
# The three data sets, cached


def data_key(cfg, part: str, digest: str = "") -> str:
    fields = {"generated": ("max_prompts",), "teacher": ("seed", "teacher_chars", "doc_tokens"),
              "held_out": ("new_tokens", "max_held_out"), "open": ("open_conversations",),
              "described": ("described_conversations",)}[part]
    layers = getattr(cfg, "feature_layers", ())
    dtype = getattr(cfg, "feature_dtype", "float32") if part != "held_out" else "float32"
    return (part + "-" + "-".join(f"{f}{getattr(cfg, f)}" for f in fields) + (f"-{digest}" if digest else "")
            + ("-layers" + "_".join(map(str, layers)) if layers else "") + ("" if dtype == "float32" else f"-{dtype}"))


FLOAT32_PRECISION = {"dtype": "float32", "label_agreement": 1.0}  # what a float32 pass's labels are: the target's own


def feature_dtype(cfg) -> torch.dtype:
    """The torch dtype of ``cfg.feature_dtype`` (``"float32"`` or ``"bfloat16"``), with a clear error otherwise."""
    name = getattr(cfg, "feature_dtype", "float32")
    if name not in ("float32", "bfloat16"):
        raise ValueError(f"feature_dtype must be 'float32' or 'bfloat16', got {name!r}")
    return getattr(torch, name)


@torch.inference_mode()
def label_agreement(target, fast, docs: list[list[int]], layers: tuple[int, ...] = ()) -> dict:
    """How closely a ``fast`` (e.g. bfloat16) copy's teacher-forced labels and features match ``target``'s
    own (float32) on ``docs``: the share of positions whose argmax labels agree, and the median relative
    error of the last-hidden-state features, ``|f_fast - f| / |f|`` per position."""
    ref = features(target, docs, "check", desc="float32 check", layers=layers)
    got = features(fast, docs, "check", desc="fast check", layers=layers)
    H = target.config.hidden_size
    same = sum(int((a.labels == b.labels).sum()) for a, b in zip(ref, got))
    n = sum(len(a.labels) for a in ref)
    rel = torch.cat([(b.features[:, -H:].float() - a.features[:, -H:].float()).norm(dim=-1)
                     / a.features[:, -H:].float().norm(dim=-1) for a, b in zip(ref, got)])
    return {"dtype": str(next(fast.parameters()).dtype).replace("torch.", ""), "positions": n,
            "label_agreement": same / n, "feature_relative_error_median": float(rel.median())}


def held_out_set(cfg):
    from .corpus import held_out_prompts

    prompts = held_out_prompts()
    return prompts[:cfg.max_held_out] if cfg.max_held_out else prompts


def conversation_kinds(ids: dict, seed: int) -> list[str]:
    """The kind of text of each committed conversation in ``ids`` (:func:`load_training_ids`): its prompt's."""
    from .corpus import training_prompts

    kinds_of_prompt = [p.kind for p in training_prompts(ids["meta"].get("seed", seed))]
    return [kinds_of_prompt[i] for i in ids["prompt_index"]]


OPEN_SETS = ("open", "described")  # the Magpie sets (specnb.magpie.IDS_FILES), in the order build_data appends them


def load_open_ids(cfg, path: Path | None = None, which: str = "open") -> dict:
    """The first ``cfg.open_conversations`` committed open conversations (:mod:`specnb.magpie`), or with
    ``which="described"`` the first ``cfg.described_conversations`` described ones, as
    :func:`load_training_ids` returns them, plus ``digest``; a clear error when the file holds fewer."""
    from .magpie import IDS_FILES

    if which not in OPEN_SETS:
        raise ValueError(f"which must be one of {OPEN_SETS}, got {which!r}")
    path = Path(path or IDS_FILES[which])
    n = getattr(cfg, f"{which}_conversations", 0)
    if n < 0:
        raise ValueError(f"{which}_conversations must be 0 or more, got {n}")
    flag, opt = f"--regenerate-{which}", f"--{which}-conversations"
    took = {"open": "1,372 s for 2,400", "described": "1,217 s for 2,000"}[which]
    if not path.exists():
        raise FileNotFoundError(f"no {which} conversations at {path}: run `specnb train-draft {flag}` "
                                f"({took} on a 2-core Intel Xeon) or train with {opt} 0")
    ids = load_training_ids(path)
    if len(ids["ids"]) < n:
        raise ValueError(f"{which}_conversations={n} but {path} holds {len(ids['ids'])}: pass {opt} "
                         f"{len(ids['ids'])} or fewer, or regenerate with `specnb train-draft {flag} "
                         f"{opt} {n}`")
    out = {k: v[:n] for k, v in ids.items() if k != "meta"}
    return {**out, "meta": ids["meta"], "digest": ids_digest(path)}


def training_conversations(cfg, ids_path: Path = IDS_FILE, open_path: Path | None = None,
                           described_path: Path | None = None) -> dict:
    """Every generated training conversation in the order :func:`build_data` uses: the first
    ``cfg.max_prompts`` template conversations (all when 0), then the first ``cfg.open_conversations`` open
    ones and the first ``cfg.described_conversations`` described ones. ``{"ids": [list[int]],
    "prompt_lens": [int], "kinds": [str]}``; the Magpie sets' kinds are ``"open"`` and ``"described"``."""
    ids = load_training_ids(ids_path)
    n = cfg.max_prompts or len(ids["ids"])
    out = {"ids": ids["ids"][:n], "prompt_lens": ids["prompt_lens"][:n],
           "kinds": conversation_kinds(ids, cfg.seed)[:n]}
    for which, path in zip(OPEN_SETS, (open_path, described_path)):
        if getattr(cfg, f"{which}_conversations", 0):
            op = load_open_ids(cfg, path, which)
            out = {"ids": out["ids"] + op["ids"], "prompt_lens": out["prompt_lens"] + op["prompt_lens"],
                   "kinds": out["kinds"] + [which] * len(op["ids"])}
    return out


def build_data(target, tokenizer, cfg, folder: Path, reuse: bool = True, ids_path: Path = IDS_FILE,
               open_path: Path | None = None, described_path: Path | None = None) -> tuple[dict, dict]:
    """The data sets ``generated``, ``teacher``, ``held_out`` (lists of :class:`Sequence`), seconds per
    stage, and what was dropped for sharing an 8-gram with the held-out data.

    ``generated``: teacher-forced features over the committed ids (the first ``cfg.max_prompts``
    conversations when set), then over the first ``cfg.open_conversations`` open conversations
    (:mod:`specnb.magpie`; a part of its own in the cache, ``"open"``), then over the first
    ``cfg.described_conversations`` described ones (part ``"described"``). Training documents sharing an
    8-gram with a held-out prompt or its scored continuation are dropped (``data["dropped"]``).
    """
    folder.mkdir(parents=True, exist_ok=True)
    data, seconds, reused = {}, {}, []
    ids = load_training_ids(ids_path)
    digest = ids_digest(ids_path)
    sets = {which: load_open_ids(cfg, path, which) for which, path in zip(OPEN_SETS, (open_path, described_path))
            if getattr(cfg, f"{which}_conversations", 0)}
    fdtype = feature_dtype(cfg)
    fast = in_dtype(target, fdtype)  # the teacher-forced passes' model (target itself for float32)
    parts = ("held_out", "generated", "teacher") + tuple(sets)
    for part in parts:
        key_digest = sets[part]["digest"] if part in sets else (digest if part == "generated" else "")
        path = folder / f"{data_key(cfg, part, key_digest)}.safetensors"
        t0 = time.perf_counter()
        if reuse and path.exists():
            data[part] = _load_seqs(path)
            reused.append(part)
        else:
            if part == "generated":
                n = cfg.max_prompts or len(ids["ids"])
                seqs = features(fast, ids["ids"][:n], "generated", ids["prompt_lens"][:n],
                                desc=f"{cfg.feature_dtype} features of the generated ids", layers=cfg.feature_layers)
            elif part in sets:
                seqs = features(fast, sets[part]["ids"], "generated", sets[part]["prompt_lens"],
                                desc=f"{cfg.feature_dtype} features of the {part} conversations", layers=cfg.feature_layers)
            elif part == "held_out":
                seqs = generate(target, tokenizer, held_out_set(cfg), cfg.new_tokens, 16, "held-out data",
                                cfg.feature_layers)
            else:
                seqs = features(fast, teacher_docs(tokenizer, cfg.teacher_chars, cfg.doc_tokens, cfg.seed),
                                "teacher", desc=f"{cfg.feature_dtype} teacher-forced features", layers=cfg.feature_layers)
            _save_seqs(seqs, path)
            data[part] = seqs
        seconds[part] = time.perf_counter() - t0
    exclude = template_ngrams(tokenizer)
    held_docs = [s.tokens.tolist() + [int(s.labels[-1])] for s in data["held_out"]]
    data["dropped"] = {}
    kinds = conversation_kinds(ids, cfg.seed)[:len(data["generated"])]  # the validation gap is per kind
    for which, got in sets.items():
        data["generated"] = data["generated"] + data.pop(which)
        kinds = kinds + [which] * len(got["ids"])
        data[f"{which}_meta"] = got["meta"]
    for part in ("generated", "teacher"):
        bad = set(shared_ngrams([s.tokens.tolist() for s in data[part]], held_docs, exclude,
                                tokenizer.all_special_ids))
        data["dropped"][part] = len(bad)
        if part == "generated" and sets:  # the Magpie sets' shares, apart
            data["dropped"]["generated"] = sum(kinds[i] not in sets for i in bad)
            for which in sets:
                data["dropped"][which] = sum(kinds[i] == which for i in bad)
        data[part] = [s for i, s in enumerate(data[part]) if i not in bad]
        if part == "generated":
            data["generated_kinds"] = [k for i, k in enumerate(kinds) if i not in bad]
    data["reused"] = reused
    data["ids_meta"] = ids["meta"]
    if fdtype != torch.float32:  # measured on every run (9 s on the Intel build machine): the first 24 conversations
        t0 = time.perf_counter()
        data["feature_precision"] = label_agreement(target, fast, ids["ids"][:min(24, cfg.max_prompts or 24)],
                                                     cfg.feature_layers)
        seconds["precision_check"] = time.perf_counter() - t0
    data["feature_layers"] = tuple(cfg.feature_layers)
    return data, seconds


def for_layers(data: dict, layers: tuple[int, ...]) -> dict:
    """``data`` (from :func:`build_data`) with each sequence's features cut to ``layers`` and the last
    hidden state, ``(T, (len(layers) + 1) * H)``: heads that read fewer layers train on the same data.
    ``layers`` must be among the data's own ``feature_layers``."""
    have = tuple(data.get("feature_layers", ()))
    layers = tuple(layers)
    if layers == have:
        return data
    if not set(layers) <= set(have):
        raise ValueError(f"the data holds layers {list(have)}, not {list(layers)}: build it with "
                         f"feature_layers={list(layers)}")
    H = data["held_out"][0].features.shape[1] // (len(have) + 1)
    blocks = [have.index(i) for i in layers] + [len(have)]
    cols = torch.cat([torch.arange(b * H, (b + 1) * H) for b in blocks])
    out = dict(data, feature_layers=layers)
    for part in ("generated", "teacher", "held_out"):
        out[part] = [Sequence(s.tokens, s.features.index_select(1, cols), s.labels, s.source, s.prompt_len)
                     for s in data[part]]
    return out


def generation_throughput(target, tokenizer, batches=(16, 32, 64), dtypes=(torch.bfloat16, torch.float32),
                          n_prompts: int = 64, new_tokens: int = 64) -> list[dict]:
    """New tokens per second of batched greedy generation on the first ``n_prompts`` training prompts,
    for each batch size and dtype (how ``GEN_BATCH`` and ``GEN_DTYPE`` were chosen)."""
    from .corpus import training_prompts

    encoded = [encode(tokenizer, p) for p in training_prompts()[:n_prompts]]
    rows = []
    for dtype in dtypes:
        model = in_dtype(target, dtype)
        for b in batches:
            t0 = time.perf_counter()
            seqs = generate_ids(model, encoded, new_tokens, b, tokenizer.eos_token_id, f"{dtype} batch {b}")
            dt = time.perf_counter() - t0
            new = sum(len(s.tokens) + 1 - s.prompt_len for s in seqs)
            rows.append({"dtype": str(dtype).replace("torch.", ""), "batch": b, "new_tokens": new,
                         "seconds": round(dt, 2), "tokens_per_s": new / dt})
    return rows
