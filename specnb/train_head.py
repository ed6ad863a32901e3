"""Training the draft head of ``head.py`` (chapter 7): data, features, loss, evaluation, checkpoint.

1. **Data**: the target's own greedy continuations of :func:`specnb.corpus.training_prompts`
   (generated in batches), plus teacher-forced documents from :func:`specnb.corpus.teacher_text`.
2. **Features**: one teacher-forced target forward per document gives, at every position t,
   the feature ``f_t`` (last hidden state after the final norm) and the label
   ``y_t = argmax lm_head(f_t)``, the target's greedy next token.
3. **Training**: the head sees pairs (f_t, x_{t+1}) and learns to predict y_{t+1}
   (cross-entropy over its reduced vocabulary) and f_{t+1} (smooth-L1 regression,
   weighted by ``reg_weight``). With ``depth > 1`` it also learns from its own fed-back
   features ("training-time test", EAGLE-3): pass d feeds pass d-1's predictions back,
   with the attention mask of drafting (real keys up to t, then the chain's own keys).
4. **Evaluation**: the same chained passes on held-out continuations give the
   agreement with the target at each draft position.

A checkpoint is ``draft_head.safetensors`` (fp16) plus ``draft_head.json`` (the card):
config, data sizes, seed, steps, loss curve, held-out agreement, machine, versions,
and the target's fingerprint. Loading checks the card before the weights.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from .cache import cache_keyword
from .kernels import kernels_of, use_kernels
from .head import DraftHead, HeadConfig
from .models import cache_dir
from .prompts import encode

HEAD_NAME = "draft_head"
FORMAT = 1


class HeadUnavailableError(RuntimeError):
    """No usable trained head: missing, corrupt, or trained for another target."""


@dataclass
class TrainConfig:
    """Everything `specnb train-draft` does; the defaults are the full run (`make draft`)."""

    seed: int = 0
    new_tokens: int = 192  # greedy continuation length per training prompt
    gen_batch: int = 16  # prompts generated together (left-padded)
    max_prompts: int = 0  # 0: all of corpus.training_prompts()
    teacher_chars: int = 300_000  # characters of teacher-forced text (reference pages + stdlib code)
    doc_tokens: int = 512  # teacher documents are cut into windows of this many tokens
    draft_vocab: int = 8192  # V': the reduced draft vocabulary (most frequent target labels)
    depth: int = 1  # chained passes in training (1: no training-time test)
    reg_weight: float = 0.1  # weight of the feature regression next to the token cross-entropy
    epochs: float = 3.0
    batch_tokens: int = 1024  # tokens per optimizer step
    seq_len: int = 256  # training windows
    lr: float = 3e-3
    warmup: int = 50
    init_from_last_layer: bool = True
    init_fc_identity: bool = False  # start fc as [0 | I]: the layer first sees the target's own feature
    holdout: float = 0.08  # fraction of generated continuations kept out for evaluation
    eval_depth: int = 4
    max_held_out: int = 0  # 0: every held-out prompt (quick runs evaluate on fewer)

    @classmethod
    def quick(cls, **overrides) -> "TrainConfig":
        """A run of a minute or two that exercises every stage (tests, CI): tiny data, few steps."""
        small = dict(max_prompts=12, new_tokens=24, teacher_chars=6000, epochs=2.0, depth=2, eval_depth=3,
                     max_held_out=6, draft_vocab=2048)
        return cls(**{**small, **overrides})


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


def generate(target, tokenizer, prompts, new_tokens: int, batch: int, desc: str = "generating") -> list[Sequence]:
    """The target's greedy continuations of ``prompts`` (see :func:`generate_ids`)."""
    encoded = [encode(tokenizer, p) for p in prompts]
    return generate_ids(target, encoded, new_tokens, batch, tokenizer.eos_token_id, desc)


@torch.inference_mode()
def generate_ids(target, encoded: list[list[int]], new_tokens: int, batch: int, eos: int | None,
                 desc: str = "generating") -> list[Sequence]:
    """The target's greedy continuations of ``encoded`` prompts, with its features and labels at every position.

    Left-padded batches through the target's decoder with a KV cache; the features of
    the prompt come from the prefill and those of the continuation from the decode
    steps that produced it, so no second forward is needed. Each sequence is cut
    after EOS. Labels are the target's argmax at every position (in the continuation,
    simply the next token).
    """
    from .cache import new_cache

    base, lm_head = target.model, target.lm_head
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
        h = base(input_ids=ids, attention_mask=mask, position_ids=pos, **{cache_keyword(base): cache}).last_hidden_state
        hs, ys = [h], [lm_head(h).argmax(-1)]  # (B, L, H), (B, L)
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
            h = base(input_ids=nxt, attention_mask=mask, position_ids=pos, **{cache_keyword(base): cache}).last_hidden_state
            hs.append(h)
            ys.append(lm_head(h).argmax(-1))
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
             batch_tokens: int = 2048, desc: str = "features") -> list[Sequence]:
    """Teacher-forced target forwards: ``f_t`` and ``y_t = argmax`` at every position of every doc.

    Documents are batched by length with right padding (causal attention: padding after a
    sequence cannot change it).
    """
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
        h = base(input_ids=ids, attention_mask=mask).last_hidden_state  # (B, L, H)
        y = head(h).argmax(-1)  # (B, L)
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


# ---------------------------------------------------------------------------------------------
# 3. Chained passes (training-time test) and the loss


def chain_mask(T: int, d: int) -> torch.Tensor:
    """``(1, 1, T, (d+1)*T)`` bool mask for pass d+1 (0-based ``d``) of a chain over T positions.

    Query i of pass d+1 (the chain's (d+1)-th step from real pair i) sees pass-1 keys 0..i
    (real pairs) and the key at index i of passes 2..d+1 (its own chain so far), exactly
    what the head sees when it drafts its (d+1)-th token after position i.
    """
    i = torch.arange(T)
    blocks = [i[None, :] <= i[:, None]] + [torch.eye(T, dtype=torch.bool)] * d
    return torch.cat(blocks, dim=1)[None, None]


def chained_forward(head: DraftHead, feats: torch.Tensor, tokens: torch.Tensor, depth: int,
                    detach: bool = False) -> list[torch.Tensor]:
    """``feats: (B, T, H)`` f_t, ``tokens: (B, T)`` x_t -> ``depth`` predictions, each ``(B, T - 1, H)``.

    Prediction d (0-based) at index i is the head's guess of f_{i+d+1} after d of its own
    features were fed back (pair (f^_{i+d}, x_{i+d+1}) at position i+d); it is scored against
    ``labels[i + d + 1]``. One forward per pass, through a cache holding the earlier passes'
    keys and values, with the masks of :func:`chain_mask`: the same computation as drafting.
    """
    from transformers import DynamicCache

    B, T, H = feats.shape
    n = T - 1
    pos = torch.arange(n)[None].expand(B, n)
    cache = DynamicCache()
    preds: list[torch.Tensor] = []
    for d in range(depth):
        if d == 0:
            f_in, x_in = feats[:, :n], tokens[:, 1:]
        else:
            f_in = preds[-1].detach() if detach else preds[-1]
            x_in = torch.zeros_like(tokens[:, 1:])
            x_in[:, :n - d] = tokens[:, 1 + d:]  # indices past the end are padding, never scored
        preds.append(head(f_in, x_in, pos + d, chain_mask(n, d), cache))
    return preds


def loss_terms(head: DraftHead, preds: list[torch.Tensor], feats: torch.Tensor, labels: torch.Tensor,
               valid: torch.Tensor, label_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
    """Cross-entropy and regression over all passes; also the per-pass top-1 agreement on this batch.

    ``labels: (B, T)`` target argmax ids; ``valid: (B, T)`` real (unpadded) positions;
    ``label_index: (vocab,)`` maps a token id to its index in the reduced vocabulary, or -1.
    """
    n = feats.shape[1] - 1
    ce_sum, reg_sum, agree = 0.0, 0.0, []
    for d, pred in enumerate(preds):
        m = n - d  # indices with a label at i + d + 1
        p = pred[:, :m]
        y = labels[:, d + 1:d + 1 + m]
        ok = valid[:, d + 1:d + 1 + m]
        yi = label_index[y]
        keep = ok & (yi >= 0)
        logits = head.logits(p)  # (B, m, V')
        ce = torch.nn.functional.cross_entropy(logits[keep], yi[keep]) if keep.any() else logits.sum() * 0
        target_f = feats[:, d + 1:d + 1 + m].float()
        reg = torch.nn.functional.smooth_l1_loss(p[ok], target_f[ok]) if ok.any() else p.sum() * 0
        ce_sum = ce_sum + ce
        reg_sum = reg_sum + reg
        with torch.no_grad():
            hit = (head.vocab_ids[logits.argmax(-1)] == y) & ok
            agree.append(float(hit.sum() / ok.sum().clamp(min=1)))
    return ce_sum / len(preds), reg_sum / len(preds), agree


def _windows(seqs: list[Sequence], seq_len: int) -> list[tuple[int, int, int]]:
    """(sequence index, start, end) windows of at most ``seq_len`` tokens covering every sequence."""
    out = []
    for i, s in enumerate(seqs):
        T = len(s.tokens)
        step = seq_len - 8  # overlap a little so every position has left context somewhere
        for a in range(0, max(T - 8, 1), step):
            out.append((i, a, min(a + seq_len, T)))
    return out


def _batch(seqs: list[Sequence], windows, pad_to: int):
    B = len(windows)
    H = seqs[0].features.shape[1]
    feats = torch.zeros(B, pad_to, H)
    tokens = torch.zeros(B, pad_to, dtype=torch.long)
    labels = torch.zeros(B, pad_to, dtype=torch.long)
    valid = torch.zeros(B, pad_to, dtype=torch.bool)
    for r, (i, a, b) in enumerate(windows):
        s = seqs[i]
        feats[r, :b - a] = s.features[a:b].float()
        tokens[r, :b - a] = s.tokens[a:b]
        labels[r, :b - a] = s.labels[a:b]
        valid[r, :b - a] = True
    return feats, tokens, labels, valid


def train(head: DraftHead, seqs: list[Sequence], cfg: TrainConfig, vocab_size: int,
          progress: bool = True) -> dict:
    """Train ``head`` in place on ``seqs``; returns the loss curve and the training agreement."""
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    label_index = torch.full((vocab_size,), -1, dtype=torch.long)
    label_index[head.vocab_ids] = torch.arange(len(head.vocab_ids))
    windows = _windows(seqs, cfg.seq_len)
    per_batch = max(1, cfg.batch_tokens // cfg.seq_len)
    steps = max(1, int(math.ceil(len(windows) * cfg.epochs / per_batch)))
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    curve: list[dict] = []
    head.train()
    order = np.concatenate([rng.permutation(len(windows)) for _ in range(int(math.ceil(cfg.epochs)) + 1)])
    bar = tqdm(range(steps), desc="training", unit="step", disable=not progress)
    ema = None
    for step in bar:
        pick = [windows[j] for j in order[step * per_batch:(step + 1) * per_batch]]
        feats, tokens, labels, valid = _batch(seqs, pick, max(b - a for _, a, b in pick))
        preds = chained_forward(head, feats, tokens, cfg.depth)
        ce, reg, agree = loss_terms(head, preds, feats, labels, valid, label_index)
        loss = ce + cfg.reg_weight * reg
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        sched.step()
        row = {"step": step + 1, "ce": float(ce.detach()), "reg": float(reg.detach()), "agree": agree}
        ema = row["ce"] if ema is None else 0.95 * ema + 0.05 * row["ce"]
        if step % 10 == 0 or step == steps - 1:
            curve.append(row)
            bar.set_postfix(ce=f"{ema:.3f}", a1=f"{agree[0]:.2f}")
    head.eval()
    return {"steps": steps, "curve": curve, "windows": len(windows)}


@torch.no_grad()
def evaluate(head: DraftHead, seqs: list[Sequence], depth: int, seq_len: int = 512,
             generated_only: bool = True) -> dict:
    """Held-out agreement at each draft position, by chained passes over the continuations.

    Only positions inside the generated continuation count (the target's own greedy text,
    what the head drafts at inference). ``agree[d]``: share of positions where draft d+1
    equals the target's token; ``chain[d]``: share where drafts 1..d+1 all do;
    ``conditional[d] = chain[d] / chain[d-1]``: acceptance at position d+1 given the ones before.
    """
    head.eval()
    hits = np.zeros(depth)
    chains = np.zeros(depth)
    total = 0
    for s in seqs:
        T = len(s.tokens)
        for a in range(0, T, seq_len):
            b = min(a + seq_len, T)
            if b - a < depth + 2:
                continue
            feats = s.features[None, a:b].float()
            tokens = s.tokens[None, a:b]
            preds = chained_forward(head, feats, tokens, depth)
            n = b - a - 1
            # count start indices i whose whole chain lies inside the continuation
            start = max(s.prompt_len - 1 - a, 0) if generated_only else 0
            last = n - depth  # i + depth <= n - 1... labels at i + d + 1 <= b - a - 1
            if last <= start:
                continue
            ok_chain = torch.ones(last - start, dtype=torch.bool)
            for d in range(depth):
                guess = head.vocab_ids[head.logits(preds[d][0, start:last]).argmax(-1)]
                truth = s.labels[a + start + d + 1:a + last + d + 1]
                hit = guess == truth
                hits[d] += float(hit.sum())
                ok_chain &= hit
                chains[d] += float(ok_chain.sum())
            total += last - start
    agree = (hits / max(total, 1)).tolist()
    chain = (chains / max(total, 1)).tolist()
    cond = [chain[0]] + [chain[d] / chain[d - 1] if chain[d - 1] else None for d in range(1, depth)]
    return {"positions": total, "agree": agree, "chain": chain, "conditional": cond}


# ---------------------------------------------------------------------------------------------
# 5. Checkpoint: safetensors + card


def target_fingerprint(target) -> str:
    """A short hash of the target's config and a strided sample of its weights (changes with any retrain)."""
    h = hashlib.sha256()
    cfg = target.config.to_dict()
    for key in ("hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size", "num_attention_heads"):
        h.update(f"{key}={cfg.get(key)};".encode())
    last = f"model.layers.{cfg.get('num_hidden_layers', 1) - 1}."  # the last decoder layer (29 for SmolLM2-135M)
    with torch.no_grad():
        for name, p in sorted(target.state_dict().items()):
            if name.endswith(("norm.weight", "embed_tokens.weight")) or name.startswith(last):
                h.update(name.encode())
                h.update(p.detach().float().flatten()[::97].numpy().tobytes())
    return h.hexdigest()[:16]


def head_dir() -> Path:
    return cache_dir() / "draft-head"


def packaged_dir() -> Path:
    return Path(__file__).parent / "data"


def save_head(head: DraftHead, card: dict, folder: Path) -> Path:
    """Write ``draft_head.safetensors`` (fp16) and ``draft_head.json`` atomically into ``folder``."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    state = {k: (v.half() if v.is_floating_point() else v).contiguous() for k, v in head.state_dict().items()}
    tmp = folder / f".{HEAD_NAME}.safetensors.partial"
    save_file(state, str(tmp))
    tmp.replace(folder / f"{HEAD_NAME}.safetensors")
    (folder / f"{HEAD_NAME}.json").write_text(json.dumps(card, indent=1) + "\n")
    return folder


def find_head() -> Path:
    """The folder holding a trained head: the specnb cache first, then the copy inside the package."""
    for folder in (head_dir(), packaged_dir()):
        if (folder / f"{HEAD_NAME}.json").exists() and (folder / f"{HEAD_NAME}.safetensors").exists():
            return folder
    raise HeadUnavailableError(
        f"no trained draft head found in {head_dir()} or {packaged_dir()}: run `make draft` "
        "(or `specnb train-draft`) to train one (about 45 minutes on 2 cores)")


def load_head(target, folder: Path | None = None) -> tuple[DraftHead, dict]:
    """Load a head for ``target``: check its card (format, target fingerprint) before the weights."""
    from safetensors.torch import load_file

    folder = Path(folder) if folder is not None else find_head()
    card_path, weights = folder / f"{HEAD_NAME}.json", folder / f"{HEAD_NAME}.safetensors"
    try:
        card = json.loads(card_path.read_text())
        cfg = HeadConfig(**card["config"]["head"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise HeadUnavailableError(f"the draft head's card {card_path} is missing or corrupt ({e}): "
                                   "run `make draft` to retrain it") from None
    if card.get("format") != FORMAT:
        raise HeadUnavailableError(f"{card_path} has format {card.get('format')!r}, this specnb reads {FORMAT}: "
                                   "run `make draft`")
    fp = target_fingerprint(target)
    if card.get("target_fingerprint") != fp:
        raise HeadUnavailableError(
            f"the draft head in {folder} was trained for another target (fingerprint "
            f"{card.get('target_fingerprint')} != this target's {fp}): run `make draft` to train one for it")
    head = DraftHead(cfg)
    try:
        state = load_file(str(weights))
        head.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    except Exception as e:  # safetensors raises several types on truncated or foreign files
        raise HeadUnavailableError(f"the draft head's weights {weights} are missing or corrupt ({e}): "
                                   "run `make draft` to retrain it") from None
    head.attach(target)
    head.eval()
    if kernels_of(target) is not None:
        use_kernels(head, kernels_of(target))  # the target's kernels: one backend per run
    return head, card


def new_head(target, vocab_ids: torch.Tensor, cfg: TrainConfig) -> DraftHead:
    head = DraftHead(HeadConfig.from_target(target.config, len(vocab_ids)))
    head.vocab_ids.copy_(vocab_ids)
    if cfg.init_from_last_layer:
        head.init_from_target_layer(target)
    if cfg.init_fc_identity:
        H = head.cfg.hidden_size
        with torch.no_grad():
            head.fc.weight.zero_()
            head.fc.weight[:, H:] = torch.eye(H)
            head.fc.bias.zero_()
    return head.attach(target)


def config_dict(cfg: TrainConfig, head: DraftHead) -> dict:
    return {"train": asdict(cfg), "head": head.cfg.to_dict()}


__all__ = ["TrainConfig", "Sequence", "generate", "features", "teacher_docs", "draft_vocabulary", "chain_mask",
           "chained_forward", "train", "evaluate", "save_head", "load_head", "find_head", "target_fingerprint",
           "HeadUnavailableError", "time", "field"]


# ---------------------------------------------------------------------------------------------
# The whole run: `specnb train-draft` / `make draft`


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


def data_key(cfg: TrainConfig, part: str) -> str:
    fields = {"generated": ("seed", "new_tokens", "max_prompts"), "teacher": ("seed", "teacher_chars", "doc_tokens"),
              "held_out": ("new_tokens", "max_held_out")}[part]
    return part + "-" + "-".join(f"{f}{getattr(cfg, f)}" for f in fields)


def _held_out(cfg: TrainConfig):
    from .corpus import held_out_prompts

    prompts = held_out_prompts()
    return prompts[:cfg.max_held_out] if cfg.max_held_out else prompts


def build_data(target, tokenizer, cfg: TrainConfig, fingerprint: str, reuse: bool = True) -> tuple[dict, dict]:
    """The three data sets (generated, teacher, held_out) as lists of :class:`Sequence`, and seconds per stage.

    Each is cached in the specnb cache under the target's fingerprint and the config
    fields it depends on, so a second run (another loss, another V') skips the forwards.
    """
    from .corpus import held_out_prompts, training_prompts

    folder = head_dir() / "data" / fingerprint
    folder.mkdir(parents=True, exist_ok=True)
    data, seconds = {}, {}
    data["reused"] = []
    for part in ("generated", "teacher", "held_out"):
        path = folder / f"{data_key(cfg, part)}.safetensors"
        t0 = time.perf_counter()
        if reuse and path.exists():
            data[part] = _load_seqs(path)
            data["reused"].append(part)
        else:
            if part == "generated":
                prompts = training_prompts(cfg.seed)
                prompts = prompts[:cfg.max_prompts] if cfg.max_prompts else prompts
                seqs = generate(target, tokenizer, prompts, cfg.new_tokens, cfg.gen_batch, "training data")
            elif part == "held_out":
                seqs = generate(target, tokenizer, _held_out(cfg), cfg.new_tokens, cfg.gen_batch, "held-out data")
            else:
                seqs = features(target, teacher_docs(tokenizer, cfg.teacher_chars, cfg.doc_tokens, cfg.seed),
                                "teacher", desc="teacher-forced features")
            _save_seqs(seqs, path)
            data[part] = seqs
        seconds[part] = time.perf_counter() - t0
    return data, seconds


def train_draft(target, tokenizer, cfg: TrainConfig = TrainConfig(), out: Path | None = None,
                reuse_data: bool = True, progress: bool = True) -> tuple[DraftHead, dict]:
    """Build the data, train a head, evaluate it on held-out prompts, save it with its card."""
    from .env import machine_info

    torch.manual_seed(cfg.seed)
    fp = target_fingerprint(target)
    data, seconds = build_data(target, tokenizer, cfg, fp, reuse_data)
    reused = data.pop("reused")
    train_seqs = data["generated"] + data["teacher"]
    vocab_ids = draft_vocabulary(train_seqs, cfg.draft_vocab)
    head = new_head(target, vocab_ids, cfg)
    t0 = time.perf_counter()
    log = train(head, train_seqs, cfg, target.config.vocab_size, progress)
    seconds["training"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    held = evaluate(head, data["held_out"], cfg.eval_depth)
    by_kind = {}
    kinds = [p.kind for p in _held_out(cfg)]
    for kind in sorted(set(kinds)):
        sel = [s for s, k in zip(data["held_out"], kinds) if k == kind]
        by_kind[kind] = evaluate(head, sel, cfg.eval_depth)
    train_eval = evaluate(head, data["generated"][:40], cfg.eval_depth)
    seconds["evaluation"] = time.perf_counter() - t0
    gen_tokens = sum(len(s.tokens) for s in data["generated"])
    card = {
        "format": FORMAT,
        "what": "EAGLE-style draft head for SmolLM2-135M-Instruct (Q4_1 GGUF dequantized): specnb chapter 7",
        "target_fingerprint": fp,
        "config": config_dict(cfg, head),
        "data": {"generated_sequences": len(data["generated"]), "generated_tokens": gen_tokens,
                 "generated_new_tokens": sum(len(s.tokens) - s.prompt_len for s in data["generated"]),
                 "teacher_documents": len(data["teacher"]),
                 "teacher_tokens": sum(len(s.tokens) for s in data["teacher"]),
                 "teacher_license": __import__("specnb.corpus", fromlist=["x"]).TEACHER_LICENSE,
                 "held_out_sequences": len(data["held_out"]),
                 "vocab_coverage_held_out": vocab_coverage(data["held_out"], vocab_ids)},
        "trainable_parameters": head.trainable_parameters,
        "steps": log["steps"],
        "loss_curve": log["curve"],
        "held_out": held,
        "held_out_by_kind": by_kind,
        "train_agreement": train_eval,
        "seconds": {k: round(v, 1) for k, v in seconds.items()},
        "data_reused": reused,  # parts loaded from the specnb cache (their seconds are load times)
        "machine": machine_info(target),
        "created": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    folder = save_head(head, card, Path(out) if out else head_dir())
    export_training_ids(data["generated"], folder / "draft_train_ids.npz")
    return head, card


def export_training_ids(seqs: list[Sequence], path: Path) -> Path:
    """The generated training sequences' token ids (uint16) and lengths: what the 8-gram test checks."""
    ids = torch.cat([s.tokens for s in seqs]).numpy()
    assert ids.max() < 2**16, "token ids do not fit uint16"
    np.savez_compressed(path, ids=ids.astype(np.uint16), lengths=np.array([len(s.tokens) for s in seqs]))
    return path
