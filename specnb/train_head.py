"""Training the draft head of ``head.py`` (chapter 7): recipe, loss, evaluation, checkpoint.

1. **Data** (``head_data.py``): float32 teacher-forced features and labels over the committed
   generated conversations and over teacher-forced text; held-out continuations kept disjoint.
2. **Training**: the head sees pairs (f_t, x_{t+1}) and learns to predict the target's next
   token (cross-entropy over its reduced vocabulary V', against the target's argmax or, with
   ``soft_labels``, against the target's whole softmax over V') and f_{t+1} (smooth-L1 regression,
   weighted by ``reg_weight``). With ``depth > 1`` it also learns from its own fed-back
   features ("training-time test", EAGLE-3): pass d feeds pass d-1's predictions back,
   with the attention mask of drafting, weighted ``depth_decay ** d``. ``noise`` adds uniform
   noise to the input features (EAGLE-1). Early stopping on a validation split of the
   *training* conversations (never the held-out ones).
3. **Evaluation**: the same chained passes on held-out continuations give the
   agreement with the target at each draft position.

The checkpoint (``draft_head.safetensors`` in fp16 plus the card ``draft_head.json``) is written
and read by ``head_io.py``; this module re-exports its names for the chapters' ``th.load_head``.
"""
from __future__ import annotations

import collections
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from .head import DraftHead, HeadConfig
from .head_data import (FLOAT32_PRECISION, Sequence, build_data, draft_vocabulary, features, generate,  # noqa: F401
                        generate_ids, held_out_set, teacher_docs, vocab_coverage)
from .head_io import (FORMAT, HEAD_NAME, HeadUnavailableError, find_head, head_dir, load_head,  # noqa: F401
                      packaged_dir, save_head, target_fingerprint)


@dataclass
class TrainConfig:
    """Everything `specnb train-draft` does; the defaults are the full run (`make draft`)."""

    seed: int = 0
    new_tokens: int = 192  # held-out continuation length (the committed ids were generated with the same)
    max_prompts: int = 0  # 0: every committed generated conversation; n: the first n
    open_conversations: int = 2400  # the first n committed open conversations (user turns the target wrote; 0: none)
    described_conversations: int = 2000  # the first n committed described ones (user turns begun with an opener;
    #                                      0: none); added with the cheaper loss (LinearCrossEntropy): 2,742 s in all
    teacher_chars: int = 4_000_000  # characters of teacher-forced text (reference pages, stdlib code and docstrings,
    #                                 and past 2.6M the torch and transformers docstrings); 6M before the open
    #                                 conversations, cut to keep `make draft` within 45 minutes with them
    #                                 (2,685 s on a 2-core Intel Xeon, 2026-12-07)
    feature_dtype: str = "bfloat16"  # the teacher-forced passes' precision ("float32": the target's own labels exactly)
    doc_tokens: int = 512  # teacher documents are cut into windows of this many tokens
    train_fraction: float = 1.0  # learning curve: train on this seeded share of the training documents
    draft_vocab: int = 8192  # V': the reduced draft vocabulary (most frequent target labels)
    input_norms: bool = False  # separate RMS norms on the token embedding and the feature before fc (EAGLE-3)
    feature_layers: tuple = ()  # also read these target layers' outputs, fused with the last (EAGLE-3); () = last only
    soft_labels: bool = False  # cross-entropy against the target's softmax over V' (else its argmax)
    depth: int = 2  # chained passes in training (1: no training-time test)
    depth_decay: float = 0.8  # pass d's loss weight is depth_decay ** d (EAGLE-3)
    ce_weight: float = 1.0  # weight of the token cross-entropy
    reg_weight: float = 0.1  # weight of the feature regression (EAGLE-1: 1.0, with ce_weight 0.1)
    noise: float = 0.0  # uniform noise U(-noise, noise) on the input features (EAGLE-1)
    bf16: bool = True  # bfloat16 autocast for the training passes where the CPU has bf16 units (weights stay float32)
    epochs: float = 2.0
    batch_tokens: int = 2048  # tokens per optimizer step (padded positions included)
    batch_by: str = "windows"  # "windows": batch_tokens // seq_len random windows a step; "tokens": windows of
    #                            similar length filling batch_tokens (token_batches: less padding, fewer steps)
    seq_len: int = 256  # training windows
    lr: float = 3e-3
    weight_decay: float = 0.0
    warmup: int = 50
    init_from_last_layer: bool = True
    init_fc_identity: bool = False  # start fc as [0 | I]: the layer first sees the target's own feature
    val_fraction: float = 0.04  # share of the generated training conversations kept for early stopping
    val_every: int = 100  # steps between validation evaluations
    patience: int = 4  # stop after this many validations without a better a_1
    eval_depth: int = 4
    max_held_out: int = 0  # 0: every held-out prompt (quick runs evaluate on fewer)

    @classmethod
    def quick(cls, **overrides) -> "TrainConfig":
        """A run of a minute or two that exercises every stage (tests, CI): tiny data, few steps."""
        small = dict(max_prompts=24, open_conversations=8, described_conversations=8, new_tokens=24, teacher_chars=6000, epochs=2.0, depth=2, eval_depth=3,
                     max_held_out=6, draft_vocab=2048, val_every=5, val_fraction=0.2, batch_tokens=1024)
        return cls(**{**small, **overrides})


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
                    detach: bool = False, noise: float = 0.0) -> list[torch.Tensor]:
    """``feats: (B, T, F)`` f_t, ``tokens: (B, T)`` x_t -> ``depth`` predictions, each ``(B, T - 1, H)``.

    Prediction d (0-based) at index i is the head's guess of f_{i+d+1} after d of its own
    features were fed back (pair (f^_{i+d}, x_{i+d+1}) at position i+d); it is scored against
    ``labels[i + d + 1]``. One forward per pass, through a cache holding the earlier passes'
    keys and values, with the masks of :func:`chain_mask`: the same computation as drafting.
    ``noise`` (training only) adds U(-noise, noise) to the real input features of pass 1.
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
            if noise:
                f_in = f_in + (torch.rand_like(f_in) * 2 - 1) * noise
        else:
            f_in = preds[-1].detach() if detach else preds[-1]
            x_in = torch.zeros_like(tokens[:, 1:])
            x_in[:, :n - d] = tokens[:, 1 + d:]  # indices past the end are padding, never scored
        preds.append(head(f_in, x_in, pos + d, chain_mask(n, d), cache))
    return preds


class LinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of the logits ``x @ W.T`` against ``y``, the logits never kept (row blocks).

    ``x: (N, H)``, ``W: (V', H)`` frozen, ``y: (N,)`` indices into V' or -100 (left out of the mean).
    Returns the loss and, with ``want_argmax``, each row's argmax ``(N,)`` (else None). Forward computes
    each block's logits once, in ``dtype`` (bfloat16 under autocast, as ``x @ W.T`` would run) and
    float32 softmax, and with them the gradient ``(softmax - onehot(y)) @ W / K``; backward is a
    scaling. The plain form (logits, ``cross_entropy``, autograd) stores ``(N, V')`` logits in two
    precisions and walks them three more times: on the Intel Xeon (AMX, bfloat16) one call of the
    training step's size (N = 2,040, V' = 8,192) took 113 ms that way and 48 ms this way, blocks of 256
    rows the best of 128 to 1,024. ``tests/test_head.py`` checks the loss and gradient against the plain form.
    """

    @staticmethod
    def forward(ctx, x, W, y, dtype, want_argmax, block=256):
        N = x.shape[0]
        keep = y >= 0
        K = max(int(keep.sum()), 1)
        with torch.autocast("cpu", enabled=False):
            xc, Wc = x.to(dtype), W.to(dtype)
            grad = torch.empty(N, x.shape[1], dtype=dtype)
            loss = torch.zeros((), dtype=torch.float32)
            top = torch.empty(N, dtype=torch.long) if want_argmax else None
            for a in range(0, N, block):
                b = min(a + block, N)
                z = (xc[a:b] @ Wc.T).float()  # (n, V') logits
                if top is not None:
                    top[a:b] = z.argmax(-1)
                lse = torch.logsumexp(z, -1)
                k = keep[a:b]
                yi = y[a:b].clamp(min=0)
                loss += (lse - z.gather(1, yi[:, None])[:, 0])[k].sum()
                z.sub_(lse[:, None]).exp_()  # softmax, in place
                z[torch.arange(b - a), yi] -= 1.0
                z.mul_((k.float() / K)[:, None])  # rows left out get no gradient
                grad[a:b] = z.to(dtype) @ Wc
        ctx.save_for_backward(grad)
        ctx.x_dtype = x.dtype
        if top is not None:
            ctx.mark_non_differentiable(top)
        return loss / K, top

    @staticmethod
    def backward(ctx, gout, _gtop):
        (grad,) = ctx.saved_tensors
        return (grad.float() * gout).to(ctx.x_dtype), None, None, None, None, None


def loss_terms(head: DraftHead, preds: list[torch.Tensor], feats: torch.Tensor, labels: torch.Tensor,
               valid: torch.Tensor, label_index: torch.Tensor, soft: bool = False,
               decay: float = 1.0, with_agree: bool = True) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
    """Cross-entropy and regression over all passes (pass d weighted ``decay ** d``, normalised);
    also the per-pass top-1 agreement on this batch (``with_agree=False``: an empty list; the
    argmax over ``(B, T, V')`` costs a few percent of a training step, so the loop asks only when it logs).

    ``labels: (B, T)`` target argmax ids; ``valid: (B, T)`` real (unpadded) positions;
    ``label_index: (vocab,)`` maps a token id to its index in the reduced vocabulary, or -1.
    ``soft``: the cross-entropy is against the target's softmax over V', ``softmax(lm_rows @ f_{t+1})``
    (the target's logits restricted to V', from the stored feature); positions whose target token
    is outside V' are left out in both cases.
    """
    n = feats.shape[1] - 1
    H = head.cfg.hidden_size  # a multi-layer head's features end with the last hidden state: the target
    ce_sum, reg_sum, agree, wsum = 0.0, 0.0, [], 0.0
    for d, pred in enumerate(preds):
        m = n - d  # indices with a label at i + d + 1
        p = pred[:, :m]
        y = labels[:, d + 1:d + 1 + m]
        ok = valid[:, d + 1:d + 1 + m]
        yi = label_index[y]
        keep = ok & (yi >= 0)
        target_f = feats[:, d + 1:d + 1 + m, -H:].float()
        top = None
        if not keep.any():
            ce = p.sum() * 0
        elif soft:
            logits = head.logits(p)  # (B, m, V')
            with torch.no_grad():
                q = torch.softmax(head.logits(target_f[keep]), dim=-1)  # (K, V') the target's distribution on V'
            ce = -(q * torch.log_softmax(logits[keep], dim=-1)).sum(-1).mean()
            top = logits.detach().argmax(-1) if with_agree else None
        else:  # the mean over kept positions, the logits in row blocks (LinearCrossEntropy)
            dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else p.dtype
            ce, top = LinearCrossEntropy.apply(p.flatten(0, 1), head.lm_rows, yi.masked_fill(~keep, -100).flatten(),
                                               dtype, with_agree)
            top = top.view(keep.shape) if top is not None else None
        reg = torch.nn.functional.smooth_l1_loss(p[ok], target_f[ok]) if ok.any() else p.sum() * 0
        w = decay ** d
        ce_sum = ce_sum + w * ce
        reg_sum = reg_sum + w * reg
        wsum += w
        if with_agree:
            with torch.no_grad():
                if top is None:  # no position to score
                    top = head.logits(p.detach()).argmax(-1)
                hit = (head.vocab_ids[top] == y) & ok
                agree.append(float(hit.sum() / ok.sum().clamp(min=1)))
    return ce_sum / wsum, reg_sum / wsum, agree


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


PAD_MULTIPLE = 32  # training batches are padded to a multiple of this: a few shapes, whose oneDNN primitives stay cached


def padded_length(n: int) -> int:
    """``n`` rounded up to :data:`PAD_MULTIPLE` (a batch's length once padded)."""
    return -(-int(n) // PAD_MULTIPLE) * PAD_MULTIPLE


def token_batches(order: np.ndarray, lengths: np.ndarray, batch_tokens: int, rng: np.random.Generator,
                  chunk_batches: int = 8) -> list[np.ndarray]:
    """Cut one epoch's shuffled window ``order`` into batches of about ``batch_tokens`` padded positions.

    Each chunk of about ``chunk_batches`` batches' worth of windows is sorted by length, longest first,
    and cut so that a batch's windows, padded to its longest (:func:`padded_length`), fill at most
    ``batch_tokens`` positions; the batches are shuffled. A window keeps its place in the epoch to within
    one chunk. On chapter 7's data: 1,425 steps an epoch with 12% padding, against 1,603 steps with 28%
    for ``batch_tokens // seq_len`` random windows a step (the default, ``batch_by="windows"``). At full
    scale on the Intel Xeon, training took 1,197 s against 1,542 s but held-out a_1 fell from 0.458 to
    0.427, so it is not the default.
    """
    out: list[np.ndarray] = []
    c = 0
    while c < len(order):
        e, tokens = c, 0
        while e < len(order) and tokens < chunk_batches * batch_tokens:
            tokens += lengths[order[e]]
            e += 1
        chunk = order[c:e][np.argsort(-lengths[order[c:e]], kind="stable")]
        cut, i = [], 0
        while i < len(chunk):
            n = max(1, batch_tokens // padded_length(lengths[chunk[i]]))
            cut.append(chunk[i:i + n])
            i += n
        out += [cut[j] for j in rng.permutation(len(cut))]
        c = e
    return out


def bf16_training_supported() -> bool:
    """Whether this CPU has bfloat16 units that oneDNN uses (AMX or AVX512-BF16).

    Measured on the Intel Xeon (Sapphire Rapids, AMX), one step of 2,048 tokens: 0.66 s in
    float32 and 0.27 s under bfloat16 autocast at depth 1; 1.28 s and 0.55 s at depth 2 (0.39 s since the
    loss is :class:`LinearCrossEntropy`).
    Without such units autocast would emulate bfloat16 and be slower, so training stays float32.
    """
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def train(head: DraftHead, seqs: list[Sequence], cfg: TrainConfig, vocab_size: int,
          progress: bool = True, validation: list[Sequence] | None = None) -> dict:
    """Train ``head`` in place on ``seqs``; returns the loss curve, the validation curve and the step kept.

    With ``validation`` (training conversations held back, never the held-out prompts), a_1 and
    a_2|1 on it are measured every ``cfg.val_every`` steps; the weights with the best a_1 are kept
    and training stops after ``cfg.patience`` validations without a better one. Validation runs in the
    training passes' precision: under bfloat16 autocast, batched, a pass over the 232 validation
    conversations took 4.2 s on the Intel Xeon against 7.6 s in float32 one window at a time, and gave
    a_1 0.4910 against 0.4917 for the committed head (the held-out evaluation stays float32).
    """
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    autocast = cfg.bf16 and bf16_training_supported()
    label_index = torch.full((vocab_size,), -1, dtype=torch.long)
    label_index[head.vocab_ids] = torch.arange(len(head.vocab_ids))
    windows = _windows(seqs, cfg.seq_len)
    per_batch = max(1, cfg.batch_tokens // cfg.seq_len)
    if cfg.batch_by == "tokens":
        lengths = np.array([b - a for _, a, b in windows])
        epochs = [token_batches(rng.permutation(len(windows)), lengths, cfg.batch_tokens, rng)
                  for _ in range(int(math.ceil(cfg.epochs)) + 1)]
        batches = [b for e in epochs for b in e]
        steps = max(1, int(math.ceil(len(epochs[0]) * cfg.epochs)))
    elif cfg.batch_by == "windows":
        order = np.concatenate([rng.permutation(len(windows)) for _ in range(int(math.ceil(cfg.epochs)) + 1)])
        batches = [order[i:i + per_batch] for i in range(0, len(order), per_batch)]
        steps = max(1, int(math.ceil(len(windows) * cfg.epochs / per_batch)))
    else:
        raise ValueError(f"batch_by must be 'windows' or 'tokens', got {cfg.batch_by!r}")
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    curve: list[dict] = []
    val_curve: list[dict] = []
    best, best_state, since = -1.0, None, 0
    head.train()
    bar = tqdm(range(steps), desc="training", unit="step", disable=not progress)
    ema = None
    stopped = None
    for step in bar:
        pick = [windows[j] for j in batches[step]]
        feats, tokens, labels, valid = _batch(seqs, pick, padded_length(max(b - a for _, a, b in pick)))
        log_now = step % 10 == 0 or step == steps - 1
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            preds = chained_forward(head, feats, tokens, cfg.depth, noise=cfg.noise)
            ce, reg, agree = loss_terms(head, preds, feats, labels, valid, label_index, cfg.soft_labels,
                                        cfg.depth_decay, with_agree=log_now)
            loss = cfg.ce_weight * ce + cfg.reg_weight * reg
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        sched.step()
        row = {"step": step + 1, "ce": float(ce.detach()), "reg": float(reg.detach()), "agree": agree}
        ema = row["ce"] if ema is None else 0.95 * ema + 0.05 * row["ce"]
        if log_now:
            curve.append(row)
            bar.set_postfix(ce=f"{ema:.3f}", a1=f"{agree[0]:.2f}", val=f"{max(best, 0):.3f}")
        if validation and ((step + 1) % cfg.val_every == 0 or step == steps - 1):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):  # as the training passes run
                ev = evaluate(head, validation, 2)
            head.train()
            val_curve.append({"step": step + 1, "a1": ev["agree"][0], "a2_given_1": ev["conditional"][1]})
            if ev["agree"][0] > best:
                best, since = ev["agree"][0], 0
                best_state = {k: v.detach().clone() for k, v in head.state_dict().items()}
                kept = step + 1
            else:
                since += 1
                if since >= cfg.patience:
                    stopped = step + 1
                    break
    if best_state is not None:
        head.load_state_dict(best_state)
    head.eval()
    return {"steps": steps, "curve": curve, "windows": len(windows), "validation": val_curve,
            "precision": "bfloat16 autocast" if autocast else "float32",
            "kept_step": kept if best_state is not None else steps, "stopped_at": stopped}


@torch.no_grad()
def evaluate(head: DraftHead, seqs: list[Sequence], depth: int, seq_len: int = 512,
             generated_only: bool = True, batch: int = 16) -> dict:
    """Held-out agreement at each draft position, by chained passes over the continuations.

    Only positions inside the generated continuation count (the target's own greedy text,
    what the head drafts at inference). ``agree[d]``: share of positions where draft d+1
    equals the target's token; ``chain[d]``: share where drafts 1..d+1 all do;
    ``conditional[d] = chain[d] / chain[d-1]``: acceptance at position d+1 given the ones before.

    Windows of up to ``seq_len`` tokens run ``batch`` at a time, sorted by length and padded on the
    right: a scored position sees only real positions (the masks are causal), so padding changes
    nothing but the rounding of the batched products. One window at a time (``batch=1``), the 232
    validation conversations took 8.3 s a pass on the Intel Xeon; ``tests/test_head.py`` checks that
    the batched counts match it.
    """
    head.eval()
    hits = np.zeros(depth)
    chains = np.zeros(depth)
    total = 0
    # (sequence index, window start, window end, first scored index, end of scored indices)
    jobs = []
    for i, s in enumerate(seqs):
        T = len(s.tokens)
        for a in range(0, T, seq_len):
            b = min(a + seq_len, T)
            if b - a < depth + 2:
                continue
            n = b - a - 1
            start = max(s.prompt_len - 1 - a, 0) if generated_only else 0  # chains that lie inside the continuation
            last = n - depth  # labels at i + d + 1 <= b - a - 1
            if last > start:
                jobs.append((i, a, b, start, last))
    jobs.sort(key=lambda j: j[2] - j[1])
    for g in range(0, len(jobs), batch):
        group = jobs[g:g + batch]
        feats, tokens, _, _ = _batch(seqs, [j[:3] for j in group], max(b - a for _, a, b, _, _ in group))
        preds = chained_forward(head, feats, tokens, depth)
        for r, (i, a, b, start, last) in enumerate(group):
            s = seqs[i]
            ok_chain = torch.ones(last - start, dtype=torch.bool)
            for d in range(depth):
                guess = head.vocab_ids[head.logits(preds[d][r, start:last]).argmax(-1)]
                hit = guess == s.labels[a + start + d + 1:a + last + d + 1]
                hits[d] += float(hit.sum())
                ok_chain &= hit
                chains[d] += float(ok_chain.sum())
            total += last - start
    agree = (hits / max(total, 1)).tolist()
    chain = (chains / max(total, 1)).tolist()
    cond = [chain[0]] + [chain[d] / chain[d - 1] if chain[d - 1] else None for d in range(1, depth)]
    return {"positions": total, "agree": agree, "chain": chain, "conditional": cond}


@torch.no_grad()
def same_first_drafts(head_a: DraftHead, head_b: DraftHead, seqs: list[Sequence], seq_len: int = 512) -> float:
    """Share of the continuation positions (those :func:`evaluate` scores) where two heads draft the same
    token at position 1: the same weights in two precisions, say (chapter 7)."""
    same = total = 0
    for s in seqs:
        for a in range(0, len(s.tokens), seq_len):
            b = min(a + seq_len, len(s.tokens))
            start = max(s.prompt_len - 1 - a, 0)
            last = b - a - 2  # as evaluate(..., depth=1): the label of position i is at i + 2
            if b - a < 3 or last <= start:
                continue
            feats, tokens = s.features[None, a:b].float(), s.tokens[None, a:b]
            pa, pb = (chained_forward(h, feats, tokens, 1)[0][0, start:last] for h in (head_a, head_b))
            da, db = head_a.logits(pa).argmax(-1), head_b.logits(pb).argmax(-1)
            same += int((head_a.vocab_ids[da] == head_b.vocab_ids[db]).sum())
            total += len(da)
    return same / max(total, 1)


# ---------------------------------------------------------------------------------------------
# 5. Checkpoint: safetensors + card


def new_head(target, vocab_ids: torch.Tensor, cfg: TrainConfig) -> DraftHead:
    head = DraftHead(HeadConfig.from_target(target.config, len(vocab_ids), cfg.input_norms, cfg.feature_layers))
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
           "chained_forward", "train", "evaluate", "same_first_drafts", "save_head", "load_head", "find_head", "target_fingerprint",
           "HeadUnavailableError", "time", "field"]


# ---------------------------------------------------------------------------------------------
# The whole run: `specnb train-draft` / `make draft`


def split_validation(seqs: list[Sequence], fraction: float, seed: int) -> tuple[list[Sequence], list[Sequence]]:
    """Hold back a seeded ``fraction`` of the generated training conversations for early stopping."""
    n = int(round(len(seqs) * fraction))
    pick = set(np.random.default_rng(seed + 7).permutation(len(seqs))[:n].tolist())
    return [s for i, s in enumerate(seqs) if i not in pick], [s for i, s in enumerate(seqs) if i in pick]


def subsample(seqs: list[Sequence], fraction: float, seed: int) -> list[Sequence]:
    """A seeded share of ``seqs`` (the learning curve's smaller training sets; nested as the share grows)."""
    if fraction >= 1:
        return seqs
    order = np.random.default_rng(seed + 11).permutation(len(seqs))
    keep = set(order[:max(1, int(round(len(seqs) * fraction)))].tolist())
    return [s for i, s in enumerate(seqs) if i in keep]


def evaluate_by_kind(head: DraftHead, held: list[Sequence], cfg: TrainConfig) -> tuple[dict, dict]:
    """Held-out agreement over all prompts and per kind of text."""
    overall = evaluate(head, held, cfg.eval_depth)
    kinds = [p.kind for p in held_out_set(cfg)]
    by_kind = {kind: evaluate(head, [s for s, k in zip(held, kinds) if k == kind], cfg.eval_depth)
               for kind in sorted(set(kinds))}
    return overall, by_kind


def validation_gap_rows(head: DraftHead, validation: list[Sequence], kinds: list[str], held_a1: float,
                        held_by_kind: dict) -> dict:
    """The head on its validation split (answers to training prompts that training never saw), by kind of
    text, beside its held-out figures (``held_a1``, ``held_by_kind`` as the card stores them): chapter 7's
    validation gap. ``kinds[i]`` is the kind of ``validation[i]``'s prompt."""
    rows = {}
    for kind in sorted(set(kinds)):
        ev = evaluate(head, [s for s, k in zip(validation, kinds) if k == kind], 2)
        ho = held_by_kind.get(kind, {})
        rows[kind] = {"validation": {"a1": ev["agree"][0], "a2_given_1": ev["conditional"][1],
                                     "positions": ev["positions"], "conversations": kinds.count(kind)},
                      "held_out": {"a1": ho.get("agree", [None])[0],
                                   "a2_given_1": (ho.get("conditional") or [None, None])[1],
                                   "positions": ho.get("positions")}}
    ev = evaluate(head, validation, 2)
    return {"validation_a1": ev["agree"][0], "held_out_a1": held_a1, "validation_sequences": len(validation),
            "by_kind": rows}


# Chapter 7's studies of the recipe (each trains heads of its own; ``specnb head-study`` writes them into
# a card). They describe a recipe, not one head's weights.
STUDY_KEYS = ("ablation", "learning_curve", "fused_layers", "recipe_levers", "feature_precision")


def recorded_recipe(train: dict) -> dict:
    """A card's ``config.train`` as JSON, with each field newer than the card at its default (which keeps
    the behaviour the field did not yet change: 0 described conversations, for one)."""
    return {**json.loads(json.dumps(asdict(TrainConfig()))), **json.loads(json.dumps(train))}


def carry_studies(card: dict, ref: dict, source: str) -> list[str]:
    """Copy the recipe studies of ``ref`` (the packaged head's card) into ``card`` when both heads were
    trained with the same recipe (``config.train`` equal, a field newer than ``ref``'s card counted at its
    default, as :func:`specnb.head_study.learning_curve` counts it); ``card["studies_from"]`` then names ``source``,
    ``ref``'s date and machine. Returns the keys copied (none when the recipes differ)."""
    def plain(x):
        return json.loads(json.dumps(x))

    ref_train = ref.get("config", {}).get("train")
    if not isinstance(ref_train, dict) or recorded_recipe(ref_train) != plain(card["config"]["train"]):
        return []
    keys = [k for k in STUDY_KEYS if k in ref]
    for k in keys:
        card[k] = ref[k]
    if keys:
        card["studies_from"] = {"card": source, "created": ref.get("created"), "machine": ref.get("machine")}
    return keys


def train_on(target, data: dict, cfg: TrainConfig, progress: bool = True) -> tuple[DraftHead, dict, dict]:
    """One training run of ``cfg`` on built ``data``: returns the head, its training log and its data sizes."""
    torch.manual_seed(cfg.seed)
    generated, validation = split_validation(data["generated"], cfg.val_fraction, cfg.seed)
    train_seqs = subsample(generated, cfg.train_fraction, cfg.seed) + subsample(data["teacher"], cfg.train_fraction,
                                                                                 cfg.seed)
    vocab_ids = draft_vocabulary(train_seqs, cfg.draft_vocab)
    head = new_head(target, vocab_ids, cfg)
    t0 = time.perf_counter()
    log = train(head, train_seqs, cfg, target.config.vocab_size, progress, validation)
    log["seconds"] = time.perf_counter() - t0
    sizes = {"training_tokens": sum(len(s.tokens) for s in train_seqs),
             "training_generated_tokens": sum(len(s.tokens) for s in train_seqs if s.source == "generated"),
             "validation_sequences": len(validation), "validation_tokens": sum(len(s.tokens) for s in validation),
             "vocab_coverage_held_out": vocab_coverage(data["held_out"], vocab_ids)}
    return head, log, sizes


def train_draft(target, tokenizer, cfg: TrainConfig = TrainConfig(), out: Path | None = None,
                reuse_data: bool = True, progress: bool = True, ids_path: Path | None = None,
                open_path: Path | None = None, described_path: Path | None = None) -> tuple[DraftHead, dict]:
    """Build the data, train a head, evaluate it on held-out prompts, save it with its card."""
    from .head_data import IDS_FILE

    from .corpus import TEACHER_SOURCES, teacher_licenses
    from .env import machine_info, machine_line

    fp = target_fingerprint(target)
    data, seconds = build_data(target, tokenizer, cfg, head_dir() / "data" / fp, reuse_data, ids_path or IDS_FILE,
                               open_path, described_path)
    head, log, sizes = train_on(target, data, cfg, progress)
    seconds["training"] = log["seconds"]
    t0 = time.perf_counter()
    held, by_kind = evaluate_by_kind(head, data["held_out"], cfg)
    trained, pairs = split_validation(list(zip(data["generated"], data["generated_kinds"])), cfg.val_fraction, cfg.seed)
    train_eval = evaluate(head, [s for s, _ in trained[:40]], cfg.eval_depth)
    gap = validation_gap_rows(head, [s for s, _ in pairs], [k for _, k in pairs], held["agree"][0], by_kind)
    seconds["evaluation"] = time.perf_counter() - t0
    gen = data["generated"]
    card = {
        "format": FORMAT,
        "what": "EAGLE-style draft head for SmolLM2-135M-Instruct (Q4_1 GGUF dequantized): specnb chapter 7",
        "target_fingerprint": fp,
        "config": config_dict(cfg, head),
        "data": {"generated_sequences": len(gen), "generated_tokens": sum(len(s.tokens) for s in gen),
                 "generated_new_tokens": sum(len(s.tokens) - s.prompt_len for s in gen),
                 "generated_ids": data["ids_meta"],
                 "open_conversations": data.get("open_meta"),
                 "described_conversations": data.get("described_meta"),
                 "generated_by_kind": dict(sorted(collections.Counter(data["generated_kinds"]).items())),
                 "teacher_documents": len(data["teacher"]),
                 "teacher_tokens": sum(len(s.tokens) for s in data["teacher"]),
                 "teacher_license": __import__("specnb.corpus", fromlist=["x"]).TEACHER_LICENSE,
                 "teacher_sources": TEACHER_SOURCES,
                 "teacher_licenses": teacher_licenses(),
                 "feature_precision": data.get("feature_precision", FLOAT32_PRECISION),
                 "dropped_for_shared_8_grams": data["dropped"],
                 "held_out_sequences": len(data["held_out"]), **sizes},
        "trainable_parameters": head.trainable_parameters,
        "steps": log["steps"],
        "kept_step": log["kept_step"],
        "precision": log["precision"],
        "stopped_at": log["stopped_at"],
        "loss_curve": log["curve"],
        "validation_curve": log["validation"],
        "held_out": held,
        "held_out_by_kind": by_kind,
        "train_agreement": train_eval,
        "seconds": {k: round(v, 1) for k, v in seconds.items()},
        "data_reused": data["reused"],  # parts loaded from the specnb cache (their seconds are load times)
        "machine": machine_info(target),
        "created": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "validation_gap": {**gap, "machine": machine_line(target)},
    }
    folder = Path(out) if out else head_dir()
    packaged = packaged_dir() / "draft_head.json"
    if packaged.exists() and folder.resolve() != packaged.parent.resolve():
        carry_studies(card, json.loads(packaged.read_text()), "specnb/data/draft_head.json")
    save_head(head, card, folder)
    return head, card
