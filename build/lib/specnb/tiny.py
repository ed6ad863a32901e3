"""Tiny random models built from a config in code: no file, no network, milliseconds per forward.

For unit tests and for exact small-vocabulary demonstrations. A tiny model's
argmax is as deterministic as a real one's, so exactness tests need nothing
bigger; what tiny models cannot tell you is anything about speed or acceptance
on real text.
"""
from __future__ import annotations

import copy

import torch


def tiny_llama(seed: int = 0, vocab_size: int = 96, hidden_size: int = 32, layers: int = 2,
               heads: int = 4, kv_heads: int = 2, context: int = 256) -> torch.nn.Module:
    """A LlamaForCausalLM with random weights (float32, eval mode)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=context, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Larger-than-default weights make logits spread out, so argmax ties are negligible.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    return model.eval()


def perturbed_copy(model: torch.nn.Module, noise: float, seed: int = 1) -> torch.nn.Module:
    """A copy of ``model`` with Gaussian noise added to every weight matrix: a draft
    that agrees with ``model`` some of the time (more often for smaller ``noise``)."""
    clone = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in clone.parameters():
            if p.dim() > 1:
                p.add_(noise * torch.randn(p.shape, generator=gen))
    return clone.eval()
