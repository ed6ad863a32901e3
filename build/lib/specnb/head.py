"""A trained draft head in the style of EAGLE (Li et al. 2024): the model file (chapter 7).

The head drafts from the target's own features. At position t its input is the
target's last hidden state ``f_t`` (after the final norm, what the LM head reads)
and the embedding of the next token ``x_{t+1}``; it predicts ``f_{t+1}``, and the
target's LM head, restricted to the ``V'`` most frequent tokens of the training
data (a reduced draft vocabulary, as in FR-Spec), turns that into a guess for
``x_{t+2}``. To draft further it feeds its own predicted feature back in.

    e(x_{t+1}) ++ f_t  --fc-->  one decoder layer  --norm-->  f^_{t+1}  --lm_head[V']-->  x^_{t+2}

The decoder layer has the target's architecture (Llama: grouped-query attention
with rotary positions, SwiGLU MLP), so it can start from the target's last
layer. The token embedding and the LM head rows are the target's own, frozen
and not stored; a checkpoint holds only ``fc``, the layer, the norm and the
``V'`` token ids. The head keeps its own one-layer KV cache, rolled back through
:func:`specnb.cache.rollback` like every other cache.

Exactness does not depend on the head: the target verifies every draft with its
full vocabulary. Training lives in ``train_head.py``, the draft interface in
``drafts.HeadDraft``; :meth:`HeadState.grow` feeds a whole level of a token tree at once
(chapter 8, ``tree_drafts.HeadTreeDraft``). With ``HeadConfig.feature_layers`` the head also
reads lower layers of the target (EAGLE-3's fused low, middle and high features): a real feature
is then F = (layers + 1) * H wide and fused to H before ``fc``; fed-back features stay H wide.
Not covered: several decoder layers in the head, and models other than Llama-style ones.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from .cache import cache_length, rollback
from .kernels import KernelLinear


@dataclass
class HeadConfig:
    """Shape of a draft head; defaults are filled from the target by :meth:`from_target`."""

    hidden_size: int = 576  # H: the target's hidden size (features are H-dimensional)
    intermediate_size: int = 1536  # the MLP's inner size (the target's)
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64
    rms_norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    draft_vocab: int = 8192  # V': how many of the most frequent training tokens the head can propose
    input_norms: bool = False  # RMS-normalise the embedding and the feature separately before fc (EAGLE-3)
    feature_layers: tuple[int, ...] = ()  # also read these target layers' outputs, fused (EAGLE-3); () = last only

    def __post_init__(self) -> None:
        self.feature_layers = tuple(int(i) for i in self.feature_layers)  # JSON gives a list

    @property
    def feature_size(self) -> int:
        """F: the width of a real feature the target hands the head, (len(feature_layers) + 1) * H."""
        return (len(self.feature_layers) + 1) * self.hidden_size

    @classmethod
    def from_target(cls, config, draft_vocab: int, input_norms: bool = False,
                    feature_layers: tuple[int, ...] = ()) -> "HeadConfig":
        """The target's layer shape (a transformers ``LlamaConfig``) with a ``draft_vocab``-token vocabulary."""
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return cls(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                   num_attention_heads=config.num_attention_heads,
                   num_key_value_heads=config.num_key_value_heads,
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
                   rms_norm_eps=float(config.rms_norm_eps), rope_theta=float(theta), draft_vocab=int(draft_vocab),
                   input_norms=bool(input_norms), feature_layers=tuple(feature_layers))

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    """Grouped-query attention with rotary positions; names match transformers' Llama so weights map."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, h, kv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kv * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                cache=None) -> torch.Tensor:
        """``x: (B, T, H)``, ``cos, sin: (B, T, head_dim)``, ``mask: (B or 1, 1, T, S)`` bool (True = attend)
        over the S = cached + T keys, or None for plain causal attention with no cache."""
        cfg = self.cfg
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, cfg.num_attention_heads, cfg.head_dim).transpose(1, 2)  # (B, h, T, d)
        k = self.k_proj(x).view(B, T, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)  # (B, kv, T, d)
        v = self.v_proj(x).view(B, T, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if cache is not None:
            k, v = cache.update(k, v, 0)  # (B, kv, S, d)
        rep = cfg.num_attention_heads // cfg.num_key_value_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if mask is None and cache is None:
            out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=T > 1)
        else:
            out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """One pre-norm decoder layer, Llama's shape and parameter names."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, cache=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DraftHead(nn.Module):
    """The trainable part: ``fc``, one decoder layer, a final norm, and the reduced vocabulary's ids.

    The frozen parts (token embedding, LM head rows) come from the target via
    :meth:`attach`; they are buffers, not parameters, and are never saved.
    """

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.fc = nn.Linear(2 * H, H, bias=True)
        if cfg.feature_layers:
            # EAGLE-3's fusion: each lower layer's output RMS-normalised (their scale grows with depth),
            # then [low..., last] -> H. It starts as the identity on the last feature.
            self.layer_norms = nn.ModuleList(RMSNorm(H, cfg.rms_norm_eps) for _ in cfg.feature_layers)
            self.fuse = nn.Linear(cfg.feature_size, H, bias=False)
            with torch.no_grad():
                self.fuse.weight.zero_()
                self.fuse.weight[:, -H:] = torch.eye(H)
        if cfg.input_norms:
            self.embed_norm = RMSNorm(H, cfg.rms_norm_eps)
            self.feature_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layer = DecoderLayer(cfg)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.register_buffer("vocab_ids", torch.zeros(cfg.draft_vocab, dtype=torch.long))  # (V',) token ids
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float) / cfg.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)
        self.register_buffer("embed", torch.zeros(0, H), persistent=False)  # (vocab, H), the target's
        self.register_buffer("lm_rows", torch.zeros(0, H), persistent=False)  # (V', H), the target's LM head rows

    def attach(self, target: nn.Module) -> "DraftHead":
        """Borrow the target's token embedding and the LM head rows of ``vocab_ids`` (frozen, shared)."""
        emb = target.get_input_embeddings().weight.detach()
        lm = target.get_output_embeddings().weight.detach()
        if lm.shape[0] <= int(self.vocab_ids.max()):
            raise ValueError(f"the head's vocabulary subset uses token id {int(self.vocab_ids.max())}, but the "
                             f"target has only {lm.shape[0]} tokens: this head was trained for another target "
                             "(run `make draft` to train one for this target)")
        if emb.shape[1] != self.cfg.hidden_size:
            raise ValueError(f"target hidden size {emb.shape[1]} != head's {self.cfg.hidden_size}: "
                             "this head was trained for another target (run `make draft`)")
        self.embed = emb
        self.lm_rows = lm[self.vocab_ids].clone()
        return self

    def init_from_target_layer(self, target: nn.Module, index: int = -1) -> None:
        """Start the decoder layer from the target's layer ``index`` and the norm from its final norm."""
        self.layer.load_state_dict(target.model.layers[index].state_dict())
        self.norm.load_state_dict(target.model.norm.state_dict())

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions: (B, T)`` -> ``cos, sin: (B, T, head_dim)``."""
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def fused(self, features: torch.Tensor) -> torch.Tensor:
        """``(..., F)`` real features (the target's, :attr:`HeadConfig.feature_size` wide) or ``(..., H)``
        predicted ones (the head's own, fed back) -> ``(..., H)``. Only a multi-layer head fuses."""
        H = self.cfg.hidden_size
        if features.shape[-1] == H:
            return features
        if features.shape[-1] != self.cfg.feature_size:
            raise ValueError(f"features of width {features.shape[-1]}: this head reads {self.cfg.feature_size} "
                             f"(layers {list(self.cfg.feature_layers)} and the last) or its own {H}")
        parts = features.split(H, dim=-1)
        lows = [norm(x) for norm, x in zip(self.layer_norms, parts[:-1])]
        return self.fuse(torch.cat(lows + [parts[-1]], dim=-1))

    def forward(self, features: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """``features: (B, T, F or H)`` f_t, ``next_tokens: (B, T)`` x_{t+1}, ``positions: (B, T)`` t.

        Returns the predicted next features ``f^_{t+1}: (B, T, H)``. With no mask and
        no cache, attention is causal over the T inputs. Real features of a multi-layer head
        are F wide and fused first (:meth:`fused`); its own predicted features are H wide.
        """
        dtype = self.fc.weight.dtype  # float32, or bfloat16 after set_precision (inputs arrive float32)
        features = self.fused(features.to(dtype))
        e = self.embed[next_tokens].to(dtype)
        if self.cfg.input_norms:
            e, features = self.embed_norm(e), self.feature_norm(features)
        x = self.fc(torch.cat([e, features], dim=-1))
        cos, sin = self.rotary(positions)
        return self.norm(self.layer(x, cos.to(dtype), sin.to(dtype), mask, cache))

    @property
    def precision(self) -> torch.dtype:
        """The dtype of the head's own weights and of its reduced LM head rows (see :meth:`set_precision`)."""
        return self.fc.weight.dtype

    def set_precision(self, dtype: torch.dtype) -> "DraftHead":
        """Run the head's weights (fc, the layer, the norms) and ``lm_rows`` in ``dtype`` (float32 or bfloat16).

        A head step reads about 36 MB of float32 weights to produce one to three rows: memory-bound, so
        halving the bytes is what makes it cheaper (:func:`specnb.head_precision.choose` measures it). The shared token embedding and the rotary frequencies stay float32 (the rows it gathers are
        cast); inputs are cast at the start of :meth:`forward` and :meth:`logits` returns float32 logits, so
        callers see the same types either way. Training keeps float32 weights (bfloat16 autocast).
        Exactness never depends on it: the target verifies every draft."""
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"a head runs float32 or bfloat16, not {dtype}")
        for child in self.children():  # fc, fuse, the norms, the layer; not this module's own buffers
            child.to(dtype)
        self.lm_rows = self.lm_rows.to(dtype)
        return self

    def logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """``predicted: (..., H)`` -> logits over the reduced vocabulary ``(..., V')``.

        Under :func:`specnb.kernels.use_kernels` (the target's kernels, set when a head is loaded) the
        product runs on the same library as the head's linear layers, from a packed copy of ``lm_rows``
        kept outside the module (no parameter, no state added). It is most of a head step: on an AMD
        EPYC (Zen 4), (1, 576) x (576, 8192) took 1.77 ms on MKL and 0.23 ms on oneDNN, and 6.0 against
        0.29 ms for the 3 rows of a tree level. Training (autograd) keeps torch's plain product.
        """
        kernels = getattr(self, "_specnb_kernels", None)
        if self.lm_rows.dtype != torch.float32:  # a bfloat16 head (set_precision): float32 logits out
            predicted = predicted.to(self.lm_rows.dtype)
        if kernels is None:
            out = predicted @ self.lm_rows.T
        else:
            lm = self.__dict__.get("_lm_product")
            if lm is None or lm.weight is not self.lm_rows:
                lm = KernelLinear.over(self.lm_rows, kernels)
                self.__dict__["_lm_product"] = lm  # bypasses Module.__setattr__: not a submodule
            lm.kernels = kernels
            out = lm(predicted)
        return out if self.lm_rows.dtype == torch.float32 else out.float()

    @property
    def trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def causal_mask(past: int, T: int) -> torch.Tensor:
    """``(1, 1, T, past + T)`` bool: query i (at position past + i) sees keys 0..past + i."""
    q = torch.arange(T)[:, None] + past
    return (torch.arange(past + T)[None, :] <= q)[None, None]


class HeadState:
    """The head's per-sequence state while drafting: its KV cache and the target features it has seen.

    Pair t is (f_t, x_{t+1}): the target's feature at position t and the token after it.
    ``real`` pairs (from the target's own features) stay in the cache; ``speculative`` pairs
    (fed with the head's own predicted features while drafting) are rolled back each round.
    """

    def __init__(self, head: DraftHead) -> None:
        from transformers import DynamicCache

        self.head = head
        self.cache = DynamicCache()
        self.features: list[torch.Tensor] = []  # the target's f_t, one (m, H) block per observation
        self.n_features = 0
        self.forwards = 0  # head forwards so far
        self.real = 0  # pairs in the cache built from the target's features
        self.speculative = 0  # pairs in the cache built from predicted features

    def observe(self, features: torch.Tensor) -> None:
        """Append the target's features ``(m, F)`` for the next m positions of the sequence."""
        F = self.head.cfg.feature_size
        if features.shape[-1] != F:
            raise ValueError(f"the target's features are {features.shape[-1]} wide but this head reads {F} (layers "
                             f"{list(self.head.cfg.feature_layers)} and the last hidden state): the loop must call "
                             "forward_features with layers=draft.feature_layers")
        self.features.append(features.detach().reshape(-1, F))
        self.n_features += self.features[-1].shape[0]

    def drop_speculative(self) -> None:
        rollback(self.cache, self.speculative)
        self.speculative = 0

    @torch.inference_mode()
    def catch_up(self, ids: list[int]) -> torch.Tensor | None:
        """Feed the real pairs the cache lacks, (f_t, x_{t+1}) for t = real .. n_pairs - 1; return
        ``f^: (H,)``, the feature predicted for the last token of ``ids`` (None: no new pair to feed)."""
        self.drop_speculative()
        if cache_length(self.cache) != self.real:
            raise RuntimeError(f"the head's KV cache holds {cache_length(self.cache)} positions but only "
                               f"{self.real} came from the target's features: stale speculative entries were "
                               "not rolled back (HeadState.drop_speculative)")
        n_pairs = min(self.n_features, len(ids) - 1)
        if n_pairs <= self.real:
            return None
        feats = torch.cat(self.features, dim=0) if len(self.features) > 1 else self.features[0]
        self.features = [feats]
        t = torch.arange(self.real, n_pairs)
        f = feats[self.real:n_pairs][None]  # (1, T, H)
        x = torch.tensor(ids[self.real + 1:n_pairs + 1])[None]  # (1, T)
        mask = causal_mask(self.real, len(t)) if self.real else None
        pred = self.head(f, x, t[None], mask, self.cache)[0, -1]  # (H,)
        self.forwards += 1
        self.real = n_pairs
        return pred

    @torch.inference_mode()
    def grow(self, parent_features: torch.Tensor, tokens: list[int], depths: list[int],
             ancestors: list[list[int]]) -> torch.Tensor:
        """Feed T tree nodes at once (chapter 8); returns their predicted features ``(T, H)``.

        Node r is the pair (``parent_features[r]``: the feature predicted at its parent, ``tokens[r]``)
        at position ``real + depths[r] - 1``; it sees every real pair, the speculative entries listed in
        ``ancestors[r]`` (slots returned by earlier calls, its ancestors') and itself. Its slot is
        ``speculative`` before the call plus r. ``parent_features: (T, H)``.
        """
        T = len(tokens)
        s0 = self.real + self.speculative
        mask = torch.zeros(1, 1, T, s0 + T, dtype=torch.bool)
        mask[..., :self.real] = True
        for r, slots in enumerate(ancestors):
            for slot in slots:
                mask[0, 0, r, self.real + slot] = True
            mask[0, 0, r, s0 + r] = True
        positions = torch.tensor([self.real + d - 1 for d in depths])[None]
        pred = self.head(parent_features[None], torch.tensor([tokens]), positions, mask, self.cache)[0]
        self.forwards += 1
        self.speculative += T
        return pred

    @torch.inference_mode()
    def draft(self, ids: list[int], k: int, pick, eos_token_id: int | None = None) -> list[int]:
        """Up to ``k`` drafts after ``ids``; ``pick(i, logits)`` chooses each one.

        ``logits: (V',)`` are the head's reduced-vocabulary logits for draft i (0-based);
        ``pick`` returns a token id, or None to stop the round there (dynamic drafting).
        The round also ends after ``eos_token_id``.
        Each call of the head is one draft forward (``self.forwards``).
        """
        head = self.head
        if k <= 0:
            return []
        root = self.catch_up(ids)
        if root is None:
            return []
        pred = root[None, None]  # (1, 1, H): f^ for the last token of ids
        out: list[int] = []
        pos = self.real  # the position whose feature `pred` predicts
        for i in range(k):
            token = pick(i, head.logits(pred[0, 0]))
            if token is None:
                break
            out.append(token)
            if i == k - 1 or token == eos_token_id:
                break
            # 2. Feed the head's own feature back: pair (f^_pos, token) at position pos.
            mask = causal_mask(self.real + self.speculative, 1)
            pred = head(pred, torch.tensor([[token]]), torch.tensor([[pos]]), mask, self.cache)
            self.forwards += 1
            self.speculative += 1
            pos += 1
        return out


def head_step_flops(cfg: HeadConfig) -> int:
    """Multiply-adds of one head step (one token): fc, the layer's projections and MLP, the reduced LM head."""
    H, I, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    attn = H * d * (cfg.num_attention_heads * 2 + cfg.num_key_value_heads * 2)
    return 2 * H * H + attn + 3 * H * I + cfg.draft_vocab * H


