"""A trained draft head on disk (chapter 7): where it lives, how it is written, how it is loaded.

A checkpoint is ``draft_head.safetensors`` (fp16; safetensors only, never a pickle) plus
``draft_head.json`` (the card): config, data sizes and sources, seed, steps, loss curve,
validation curve, held-out agreement, machine, versions, and the target's fingerprint.
Loading checks the card (format, fingerprint) before it reads the weights, and every failure
is a :class:`HeadUnavailableError` that says how to get a usable head (``make draft``).
Inference needs only this module and ``head.py``; training lives in ``train_head.py``.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from .head import DraftHead, HeadConfig
from .kernels import kernels_of, use_kernels
from .models import cache_dir

HEAD_NAME = "draft_head"
FORMAT = 1


class HeadUnavailableError(RuntimeError):
    """No usable trained head: missing, corrupt, or trained for another target."""


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
        "(or `specnb train-draft`) to train one (45 minutes on 2 cores of an Intel Xeon, about an hour on an "
        "AMD EPYC Zen 4)")


def load_head(target, folder: Path | None = None, precision: str | None = None) -> tuple[DraftHead, dict]:
    """Load a head for ``target``: check its card (format, target fingerprint) before the weights.

    The head runs on the target's kernels, in ``precision`` (float32, bfloat16, or auto: measured,
    see :mod:`specnb.head_precision`; default ``$SPECNB_HEAD_PRECISION``, else auto). The choice and
    how it was made are ``head.precision_label`` and ``head.precision_how``."""
    from . import head_precision
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
    head_precision.requested(precision)  # an unknown value stops here, before any work
    try:
        state = load_file(str(weights))
        state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
        head = _build(cfg, state, target)
    except Exception as e:  # safetensors raises several types on truncated or foreign files
        raise HeadUnavailableError(f"the draft head's weights {weights} are missing or corrupt ({e}): "
                                   "run `make draft` to retrain it") from None
    kernels = kernels_of(target)
    name, how = head_precision.choose(head, lambda: _build(cfg, state, target), kernels, precision)
    head.set_precision(head_precision.DTYPES[name])
    head.precision_how = how
    head.precision_label = f"{name} head"  # for figure labels and printed lines
    return head, card


def _build(cfg: HeadConfig, state: dict, target) -> DraftHead:
    """A float32 head from ``state``, attached to ``target`` and on its kernels (one backend per run)."""
    head = DraftHead(cfg)
    head.load_state_dict(state)
    head.attach(target)
    head.eval()
    if kernels_of(target) is not None:
        use_kernels(head, kernels_of(target), remember=False)
    return head
