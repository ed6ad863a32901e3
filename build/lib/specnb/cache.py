"""The KV cache: create one, run a forward through it, and roll it back.

Speculative decoding writes k+1 tokens into the target's cache each round and
keeps only n+1 of them; the rest must be removed before the next round, or the
model attends to tokens that were never generated (chapter 3). Everything that
touches a cache's length goes through :func:`rollback`.

transformers changed two things between 4.x and 5.x, and this module hides both:

* ``DynamicCache.crop(n)``: in 4.x a positive n meant "keep n tokens" and a
  negative n meant "remove -n tokens"; in 5.x a positive n raises. Removing by
  a negative count works in both, so :func:`rollback` only ever passes that.
* the model keyword: 4.x takes ``past_key_values=``, 5.x takes ``cache=`` (the
  old name still works with a deprecation warning). :func:`cache_keyword`
  picks the one the model's ``forward`` declares.

Not covered: static caches, and sliding-window layers past their window
(5.x's ``DynamicSlidingWindowLayer`` refuses to roll back there unless it was
told to record past states); :func:`rollback` checks the length it gets and
raises if a layer did not shrink as asked.
"""
from __future__ import annotations

import inspect
from functools import lru_cache

import torch


def new_cache(model: torch.nn.Module):
    """An empty dynamic cache suited to ``model`` (layer types from its config in 5.x)."""
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # 4.x: DynamicCache() takes no config
        return DynamicCache()


@lru_cache(maxsize=None)
def _forward_params(cls: type) -> frozenset[str]:
    return frozenset(inspect.signature(cls.forward).parameters)


def cache_keyword(model: torch.nn.Module) -> str:
    """``"cache"`` for transformers 5.x models, ``"past_key_values"`` for 4.x."""
    params = _forward_params(type(model))
    return "cache" if "cache" in params else "past_key_values"


def cache_length(cache) -> int:
    """Number of token positions held in the cache."""
    return int(cache.get_seq_length())


def rollback(cache, n_remove: int) -> None:
    """Remove the last ``n_remove`` positions from every layer of ``cache``.

    Uses ``crop(-n_remove)``, which removes tokens in transformers 4.x and 5.x
    alike, and checks the result: a cache that did not shrink by exactly
    ``n_remove`` raises instead of silently holding stale keys and values.
    """
    if n_remove < 0:
        raise ValueError(f"n_remove must be >= 0, got {n_remove}")
    if n_remove == 0:
        return
    before = cache_length(cache)
    if n_remove > before:
        raise ValueError(f"cannot remove {n_remove} positions from a cache that holds {before}")
    cache.crop(-n_remove)
    after = cache_length(cache)
    if after != before - n_remove:
        raise RuntimeError(f"cache rollback failed: asked to go from {before} to {before - n_remove} "
                           f"positions, cache reports {after}")


@torch.inference_mode()
def keep_path(cache, start: int, keep: list[int]) -> None:
    """After a tree verify forward: keep the entries at ``start + keep[j]``, moved to ``start + j``.

    The cache holds ``start`` positions of the sequence, then the N + 1 nodes of a token tree
    (:mod:`specnb.tree`). ``keep`` lists the accepted path's nodes (ascending, the root 0 first);
    every layer's keys and values at those offsets are copied into place, in order, and the cache
    is cut to ``start + len(keep)`` through :func:`rollback` (which checks the length). For a
    chain, keep = 0..n and nothing moves.
    """
    if not keep or keep[0] != 0 or any(b <= a for a, b in zip(keep, keep[1:])):
        raise ValueError(f"keep must start at node 0 (the root) and increase, got {keep}")
    total = cache_length(cache)
    if start + keep[-1] >= total:
        raise ValueError(f"node {keep[-1]} is past the cache's end ({total} positions, tree from {start})")
    if keep != list(range(len(keep))):
        layers = getattr(cache, "layers", None)
        if layers is None or not all(hasattr(layer, "keys") for layer in layers):
            raise NotImplementedError(f"{type(cache).__name__} has no per-layer keys/values to move; "
                                      "token trees need transformers' DynamicCache")
        src = torch.tensor(keep) + start
        for layer in layers:
            n = len(keep)
            layer.keys[:, :, start:start + n] = layer.keys.index_select(2, src)
            layer.values[:, :, start:start + n] = layer.values.index_select(2, src)
    rollback(cache, total - start - len(keep))


@torch.inference_mode()
def forward(model: torch.nn.Module, token_ids: list[int], cache, logits_to_keep: int = 0) -> torch.Tensor:
    """Feed ``token_ids`` (appended after what ``cache`` holds) and return logits.

    Returns ``logits: (n, vocab)`` where n = len(token_ids), or n = logits_to_keep
    when that is positive (only the last positions go through the LM head).
    The cache grows by len(token_ids) positions; positions are inferred from its length.
    Which GEMM library runs the linear layers is the model's (:mod:`specnb.kernels`).
    """
    x = torch.tensor([token_ids], dtype=torch.long)  # (1, n)
    kwargs = {cache_keyword(model): cache, "use_cache": True}
    if logits_to_keep and "logits_to_keep" in _forward_params(type(model)):
        kwargs["logits_to_keep"] = logits_to_keep
    out = model(input_ids=x, **kwargs)
    logits = out.logits[0]  # (n, vocab)
    if logits_to_keep:
        logits = logits[-logits_to_keep:]
    return logits


def prefilled(model: torch.nn.Module, context_len: int, n_new: int, seed: int = 0, vocab: int | None = None):
    """A cache holding ``context_len`` seeded random token ids, and ``n_new`` more ids to time with.

    The timing functions (chapter 1's T(n), c, the verify breakdown, the kernels' choice) all start
    from such a cache. ``vocab`` bounds the ids (default: the model's); the same seed gives the same ids,
    so two models prefilled with one seed and vocab see the same context.
    Returns ``(cache, new_ids: list[int] of length n_new)``.
    """
    gen = torch.Generator().manual_seed(seed)
    vocab = vocab or model.config.vocab_size
    context = torch.randint(0, vocab, (context_len,), generator=gen).tolist()
    new = torch.randint(0, vocab, (n_new,), generator=gen).tolist()
    cache = new_cache(model)
    forward(model, context, cache, logits_to_keep=1)
    return cache, new


def _decoder_and_head(model: torch.nn.Module):
    """The model's decoder stack and LM head (transformers' ``get_decoder`` / ``get_output_embeddings``)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
    return decoder, model.get_output_embeddings()


def decoder_features(decoder: torch.nn.Module, layers: tuple[int, ...] = (), **inputs) -> torch.Tensor:
    """Run ``decoder`` (a transformers decoder stack) on ``inputs``; its features ``(B, n, F)``.

    ``layers=()``: the last hidden states (after the final norm, what the LM head reads), F = H.
    Otherwise the outputs of the listed decoder layers (1-based; ``hidden_states[i]``, before any
    norm) then the last hidden states, concatenated: F = (len(layers) + 1) * H, the last H columns
    always the last hidden states (EAGLE-3's low, middle and high features).
    """
    if not layers:
        return decoder(**inputs).last_hidden_state
    out = decoder(**inputs, output_hidden_states=True)
    L = len(out.hidden_states) - 1
    if any(not 1 <= i < L for i in layers):
        raise ValueError(f"feature layers must be in 1..{L - 1} (the decoder has {L} layers), got {list(layers)}")
    return torch.cat([out.hidden_states[i] for i in layers] + [out.last_hidden_state], dim=-1)


@torch.inference_mode()
def forward_features(model: torch.nn.Module, token_ids: list[int], cache, logits_to_keep: int = 0,
                     layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`forward`, also returning the features a draft head reads (:func:`decoder_features`).

    Returns ``logits: (n or logits_to_keep, vocab)`` and ``hidden: (n, F)`` for all n fed
    tokens (F = H with no ``layers``). The logits are the LM head applied to the last hidden
    states, as the model's own forward computes them. A draft head (chapter 7) drafts from these.
    """
    decoder, lm_head = _decoder_and_head(model)
    x = torch.tensor([token_ids], dtype=torch.long)  # (1, n)
    hidden = decoder_features(decoder, layers, input_ids=x, **{cache_keyword(decoder): cache, "use_cache": True})[0]
    last = hidden[:, -model.config.hidden_size:] if layers else hidden  # (n, H)
    logits = lm_head(last[-logits_to_keep:] if logits_to_keep else last)
    return logits, hidden
