"""Which GEMM library runs a model's linear layers, chosen by measurement (chapter 1).

Almost all of a forward's arithmetic is ``x @ W^T`` with x of n rows (n = tokens fed, 1 for a
decode step, k+1 for a verify forward). torch's default for float32 on x86 is MKL's GEMM; it
re-reads and re-lays-out W for every call, and how its time grows with n depends on the CPU:

* on an AMD EPYC (Zen 5) build machine, MKL 2024.2 took twice as long at n = 2 as at n = 1 for
  every weight shape of the target, and T(n)/T(1) of the whole model was 1.48, 1.89, 1.45 for
  n = 2, 3, 4;
* on an AMD EPYC (Zen 3, AVX2 only) build machine, MKL took 1.5-1.9x as long at n = 2-9 as at
  n = 1 (T(1) 60-70 ms), oneDNN 1.0-1.4x, and oneDNN was faster at every n (``specnb
  profile-verify``: T(1) 54.1 against 63.7 ms);
* on an AMD EPYC (Zen 4, AVX-512) build machine, auto's timing of the target (median of 7): MKL
  T(n) = 59.1, 92.9, 109.8, 83.2, 76.7, 87.5 ms for n = 1, 2, 3, 4, 5, 9, oneDNN 41.2, 46.0, 39.9,
  39.7, 36.8, 43.2 ms; the chapter 7 head's (1, 576) x (576, 8192) product 1.77 ms on MKL, 0.23 ms
  on oneDNN;
* on an Intel Xeon (Sapphire Rapids) build machine, MKL is fastest of all at n <= 3
  (the 576x576 product: 13 us at n = 1, 9 us at n = 2) but jumps at n = 4 (36 us), and the
  49152x576 LM head costs 3.1 ms at n = 1, 6.6 ms at n = 4 and 12.0 ms at n = 9.

oneDNN with a weight reordered once into its own blocked layout
(``torch.ops.mkldnn._reorder_linear_weight`` + ``torch.ops.mkldnn._linear_pointwise``, what
inductor emits for CPU linears) grows gently with n: on the Xeon the LM head takes 2.6, 3.5, 3.8
and 5.0 ms at n = 1, 2, 4, 9. But each call has a fixed cost of about 10 us, so on the Xeon's small
decoder matrices it loses at n <= 3 (576x576: 23 us against 13 us), and a 1-token forward of the
target takes 40 ms through oneDNN against 33 ms through MKL.

Neither library streams W at full speed for 2 to 9 rows, which is what a verify forward needs, so
specnb has its own kernel for exactly that (:mod:`specnb.skinny`, C++ built at first use): each
block of 4 weight rows read once and multiplied with every row of x while in L1, the next block
prefetched meanwhile, sibling weights in one call. On the Xeon (family 6 model 167, 2 cores, session
of 2026-12-07), one product: 576x576 at n = 1, 5, 9: 6.4, 13.9, 21.7 us (MKL 12.1, 38.4, 48.3; oneDNN
24.0, 27.5, 38.0); 3072x576: 121, 130, 172 us (MKL 125, 243, 365; oneDNN 155, 158, 203). The whole
target, auto's interleaved timing, T(n) for n = 1, 2, 3, 4, 5, 9: MKL 32.5, 33.8, 36.1, 49.1, 51.0,
61.5 ms; oneDNN 43.3, 45.0, 45.7, 45.9, 47.7, 53.2 ms; skinny 32.4, 33.4, 35.4, 36.3, 37.5, 42.9 ms,
so T(5)/T(1) = 1.16 where the best the two libraries allowed was 44.4 / 32.8 = 1.35. The prefetch
is most of it: without it the same kernel gave T(5) = 43.8 ms, with one block ahead 36.1 ms, with
three 37.4 ms.

So this module offers four backends, and picks one by measuring the model at hand:

* ``mkl``: the linear layers as transformers leaves them (torch's default BLAS);
* ``onednn``: every linear layer through oneDNN with its weight prepacked once;
* ``mixed``: MKL for forwards of fewer than ``onednn_from`` rows, oneDNN from there on; the
  pointwise faster of the two curves where they cross once (as on the Xeon before the skinny kernel);
* ``skinny``: specnb's kernel for forwards of up to :data:`SKINNY_ROWS` rows (float32), oneDNN
  above (a prompt's prefill) and for other dtypes.

``SPECNB_KERNELS=auto|mkl|onednn|mixed|skinny`` chooses (default ``auto``). ``auto`` times T(n) for
n = 1..5 and 9 under MKL, oneDNN and the skinny kernel (where it can be built), interleaved on the
same cache, takes MKL, oneDNN or mixed by the rule below, and then the skinny kernel instead when
its T(n), averaged over those n, is lower (a few seconds; a model whose
rounds are slow, such as a 774M shape twin, stops after 3 interleaved repeats once 20 s have
passed, with one warm-up round instead of 3: 89 s -> about 35 s for gpt2-large's twin on a
2-core AMD EPYC). The rule between the libraries: oneDNN from the smallest n at which it is faster
there and at every larger n measured. auto caches the choice with its curves per machine, torch version and model shape in the specnb cache
(``kernels.json``). Every backend is applied to the model as a whole, so plain greedy and
speculative decoding on one model always run the same kernels; the label says which.

Tried and not kept (measured on the Xeon, 2 cores, torch 2.13): ``torch.utils.mkldnn.to_mkldnn``
(oneDNN without the blocked reorder; converts activations on every call: 576x576 at n = 2 took
79 us against 9 us for MKL, the LM head 5.4 ms against 3.1 ms); MKL's packed GEMM
(``torch.ops.mkl._mkl_linear`` with ``_mkl_reorder_linear_weight``): within 10% of plain MKL at every
shape and n; the LM head computed in blocks of 512 vocabulary rows (specnb's earlier workaround for
MKL's n = 4..12 jump): 6.8 ms at n = 9 against 5.0-5.5 ms through oneDNN, so it was removed (one
mechanism for fast verification, not two); ``torch.compile(model.forward, dynamic=True)`` on MKL:
T(1) 34.1 -> 30.4 ms and T(5) 54.2 -> 45.6 ms with the same argmax, but 224 s of compilation on
2 cores in every new process (each notebook is one), which costs more than it saves here.

Attention is part of the same choice. transformers' SDPA call copies every grouped KV head
(``repeat_kv``: the target has 3 KV heads for 9 query heads) whenever it passes a mask, which is
every forward of more than one token, i.e. every verify forward; torch's CPU SDPA takes grouped
heads with a mask (``enable_gqa=True``), so :func:`grouped_sdpa`, registered with transformers'
``AttentionInterface``, skips the copies: the same logits bit for bit, about 2 ms less per verify
forward of the target on the Xeon (T(5) 47.1 -> 45.0 ms under oneDNN, T(1) unchanged). Every
backend uses it (``attention="grouped"``); ``make(..., attention="repeat")`` keeps transformers'
call, as ``bench`` does for "generate as transformers leaves the model".

Sibling products are fused on oneDNN (:class:`FusedGroup`): q/k/v as one product and gate/up as
one (210 -> 120 linear calls per forward), without patching a module: the first sibling called
computes all of them from one packed weight and hands each later sibling its columns for the same
input tensor. oneDNN's per-call cost is what this saves: on an AMD EPYC (Zen 3, AVX2) build
machine, 20 interleaved repeats after 64 cached tokens, T(1) 58.4 -> 53.9 ms, T(2) 58.2 -> 54.3,
T(5) 69.1 -> 65.0, T(9) 78.9 -> 76.2 ms, logits bit-identical to the unfused products; on the Xeon
an earlier probe saved 0.7-1.7 ms per forward. ``make(..., fused=False)`` keeps one call per layer.

Also measured and not kept (Xeon, interleaved): a per-shape choice among MKL, MKL on a
weight stored transposed (``x @ W_t``, which MKL runs faster for the 576 x 576 and 192 x 576
products at 4-9 rows) and oneDNN, by shape and n: T(4), T(5), T(9) 43.3, 44.2, 52.2 -> 42.6, 43.4,
51.2 ms against mixed, T(1) unchanged, for a second copy of most weights; and a KV cache written
in place into a preallocated buffer instead of transformers' ``torch.cat`` per forward: logits
bit-identical, 0.3-1.3 ms less per forward after 64 cached tokens, 1.9-3.2 ms after 768.

What the rest of a forward costs (``profile_verify.linear_layers_stubbed``: the same forward with
every linear layer returning zeros, so only the products are missing; ``specnb profile-verify``
prints it): 6.9 ms at n = 1, 7.9-8.2 ms at n = 5 and 9.1-9.3 ms at n = 9 on the Xeon, against
whole forwards of 33.9 / 46.5 / 56.2 ms (MKL at n = 1, oneDNN above). So the products are 84-92%
of T(n)'s growth from n = 1 to 9, and T(5)/T(1) under 1.3 needs the products at 5 rows within
about 1.34x of MKL's at one row (27 ms): MKL's own take 1.61x that, oneDNN's 1.43x (only 1.08x
oneDNN's own one-row time, but that is 1.32x MKL's).
An earlier reading of torch.profiler's self times (14 ms outside the products at n = 1, 5 ms
more at n = 5) overstated both: the profiler adds its own cost to every small operator.

Tried on a later Xeon host (CPU family 6 model 167, AVX-512 with AMX, 2 cores, torch 2.13, this tree
with q/k/v and gate/up fused; session of 2026-12-06, night), none kept, to bring T(5)/T(1) under 1.3
there, where auto chose mixed from 4 rows and timed T(1) = 32.8 ms (MKL) and T(5) = 44.4 ms (oneDNN):

* oneDNN's instruction set capped with ``ONEDNN_MAX_CPU_ISA`` (one process each, T(1) and T(5) of
  the target, ms): default 40.3 / 41.5, AVX512_CORE_BF16 42.4 / 43.3, AVX512_CORE 41.9 / 43.2, AVX2
  47.8 / 57.4: the default is already the fastest;
* ``OMP_WAIT_POLICY=PASSIVE`` (MKL T(1) 31 -> 60 ms), ``ACTIVE`` and ``KMP_BLOCKTIME=0``: no gain;
* a batch-size hint to the reorder (``_reorder_linear_weight(w, n)``): the hint 1 made the 960 x 576
  product slower at n = 2 and 5 (69-74 us against 30-37 us), the hint 5 matched no hint;
* MKL on at most 3 rows per call (a 5-row product as 3 + 2, each call re-reading a weight that the
  480 MiB last-level cache may still hold): the 120 decoder products of a forward took 32.3 ms at
  n = 4 and 33.1 ms at n = 5, against 30.0 / 31.0 ms as one MKL call and 21.6 / 22.7 ms through oneDNN;
* ``W @ x^T`` on MKL (the weight as the left operand): 51 ms for the decoder products at every n >= 2.

Where T(5) goes there (per forward, wall-clock timers around every linear call, 15 repeats): T(1)
on MKL = 31.5 ms, of which the products 21.3 ms and the rest 10.2 ms; T(5) on oneDNN = 44.5 ms, the
products 30.9 ms and the rest 13.6 ms. MKL's one-row product is a matrix-vector kernel that no
multi-row kernel in reach matches (oneDNN's own one-row forward is 38.9-40.3 ms), so T(5)/T(1) <= 1.3
(T(5) <= 41 ms) needs 3.5 ms less in the five-row products or in the rest at five rows.

The chapter 7 head is run on its target's kernels (``head_io.load_head``): its linear layers like
the target's, and its logits over the reduced vocabulary (``lm_rows``, a buffer, not an
``nn.Linear``) through :meth:`KernelLinear.over`. Before that product was covered, it ran on MKL
whatever the target used, and on the Zen 4 machine it was most of a head step (1.55 -> 0.40 ms
for one row, 4.1 -> 0.59 ms for the three rows of a tree level, in the loaded head). Its weights may
also run in bfloat16 on the same kernels, chosen by timing a head step (:mod:`specnb.head_precision`).

Not covered: quantized int8 kernels, GPUs (nothing here runs on CUDA tensors; they keep
torch's defaults), and autograd through packed weights (a layer whose weight needs a gradient
runs torch's own ``F.linear``, so training is unaffected). A weight changed in place after
packing is repacked before its next use (its ``_version`` is checked on every call). oneDNN's
prepacked linear runs bfloat16 and float16 only with AVX-512 or AVX-NE-CONVERT
(:func:`onednn_supports` probes it once): on an AVX2-only CPU such as a Zen 3 EPYC a bfloat16 model
runs MKL, and its ``how`` says so.
"""
from __future__ import annotations

import copy
import json
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from . import skinny
from .skinny import MAX_ROWS as SKINNY_ROWS

ENV = "SPECNB_KERNELS"
CHOICES = ("auto", "mkl", "onednn", "mixed", "skinny")
NEVER = sys.maxsize  # onednn_from for pure MKL: no forward has that many rows
AUTO_NS = (1, 2, 3, 4, 5, 9)  # the n that auto times: decode steps and verify forwards of k = 1..4, 8
AUTO_BUDGET_S = 20.0  # auto's timing stops at 3 measured repeats or more once this has passed


@dataclass
class Kernels:
    """The kernels one model runs: oneDNN for forwards of at least ``onednn_from`` rows, else MKL."""

    backend: str  # "mkl", "onednn", "mixed" or "skinny"
    onednn_from: int  # rows from which a linear layer runs oneDNN (1: always; NEVER: never); skinny: 1, above its rows
    how: str = ""  # how it was chosen: "SPECNB_KERNELS=mkl", "auto (measured ...)", "fallback: ..."
    curves: dict = field(default_factory=dict)  # auto's medians in ms: {"mkl": {n: ms}, "onednn": {n: ms}}
    attention: str = "grouped"  # "grouped": SDPA on the KV heads as stored; "repeat": transformers' default
    fused: bool = True  # oneDNN runs q/k/v and gate/up as one product each (FusedGroup)

    @property
    def label(self) -> str:
        """One short phrase for figure labels, JSON and ``specnb info``."""
        if self.backend == "mixed":
            gemm = f"mixed kernels (MKL below {self.onednn_from} rows, oneDNN from {self.onednn_from})"
        elif self.backend == "skinny":
            gemm = f"skinny kernels (specnb's own up to {SKINNY_ROWS} rows, oneDNN above)"
        else:
            gemm = {"mkl": "MKL kernels (torch default)", "onednn": "oneDNN kernels (prepacked)"}[self.backend]
        fused = ", q/k/v and gate/up fused" if self.fused and self.backend != "mkl" else ""
        return gemm + fused + (", grouped-KV attention" if self.attention == "grouped" else "")


def from_label(label: str) -> Kernels:
    """The :class:`Kernels` whose :attr:`Kernels.label` is ``label`` (as recorded in a results JSON or
    card's machine), to rerun something on the kernels it was made with. Unknown text: ValueError."""
    import re

    m = re.fullmatch(r"(MKL kernels \(torch default\)|oneDNN kernels \(prepacked\)|"
                     r"mixed kernels \(MKL below (\d+) rows, oneDNN from \2\)|"
                     rf"skinny kernels \(specnb's own up to {SKINNY_ROWS} rows, oneDNN above\))"
                     r"(, q/k/v and gate/up fused)?(, grouped-KV attention)?", label.strip())
    if m is None:
        raise ValueError(f"not a kernels label: {label!r} (expected e.g. {make('mkl').label!r})")
    backend = ("mkl" if m[1].startswith("MKL") else "onednn" if m[1].startswith("oneDNN")
               else "skinny" if m[1].startswith("skinny") else "mixed")
    kernels = make(backend, int(m[2]) if m[2] else None, how=f"from the label {label.strip()!r}",
                   attention="grouped" if m[4] else "repeat", fused=bool(m[3]) or backend == "mkl")
    if kernels.label != label.strip():
        raise ValueError(f"kernels label {label!r} does not describe kernels this torch can run "
                         f"(it gives {kernels.label!r})")
    return kernels


def onednn_available() -> bool:
    """True when this torch build has oneDNN and its linear ops."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


_DTYPE_OK: dict = {}


def onednn_supports(dtype: torch.dtype) -> bool:
    """True when oneDNN's prepacked linear runs ``dtype`` on this CPU (probed once per dtype).

    float32 runs everywhere oneDNN does; bfloat16 and float16 need AVX-512 (BW/VL/DQ) or
    AVX-NE-CONVERT, which an AMD EPYC of the Zen 3 generation (AVX2 only) lacks."""
    if dtype not in _DTYPE_OK:
        try:
            with torch.inference_mode(False), torch.no_grad():
                w = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), None)
                torch.ops.mkldnn._linear_pointwise(torch.zeros(1, 8, dtype=dtype), w, None, "none", [], "")
            _DTYPE_OK[dtype] = True
        except RuntimeError:
            _DTYPE_OK[dtype] = False
    return _DTYPE_OK[dtype]


def _dtype_of(model: torch.nn.Module) -> torch.dtype | None:
    p = next(iter(model.parameters()), None)
    return None if p is None else p.dtype


def _for_dtype(kernels: Kernels, model: torch.nn.Module) -> Kernels:
    """``kernels``, or MKL saying why when oneDNN cannot run this model's dtype on this CPU; skinny
    kernels on a model that is not float32 become oneDNN (or that MKL), saying why."""
    dtype = _dtype_of(model)
    if kernels.backend == "skinny" and dtype not in (None, torch.float32):
        name = str(dtype).removeprefix("torch.")
        kernels = Kernels("onednn", 1, f"specnb's skinny kernels run float32 only, so this {name} model runs "
                                       f"skinny -> onednn", attention=kernels.attention, fused=kernels.fused)
    if kernels.backend == "mkl" or dtype is None or not onednn_available() or onednn_supports(dtype):
        return kernels
    name = str(dtype).removeprefix("torch.")
    return Kernels("mkl", NEVER, f"fallback: oneDNN has no {name} path on this CPU (it needs AVX-512 or "
                                 f"AVX-NE-CONVERT), so this {name} model runs {kernels.backend} -> mkl",
                   attention=kernels.attention, fused=kernels.fused)


def make(backend: str, onednn_from: int | None = None, how: str = "", attention: str = "grouped",
         fused: bool = True) -> Kernels:
    """A :class:`Kernels` for ``backend`` in mkl/onednn/mixed/skinny (mixed needs ``onednn_from`` >= 2).

    Without oneDNN in this torch build, onednn, mixed and skinny fall back to mkl and ``how`` says so;
    where specnb's skinny kernels cannot be built (:func:`specnb.skinny.unavailable`), skinny falls
    back to onednn, saying why.
    ``attention="repeat"`` keeps transformers' own SDPA call (what a user gets by default).
    """
    if backend not in CHOICES[1:]:
        raise ValueError(f"unknown kernel backend {backend!r}; valid: {', '.join(CHOICES)}")
    if attention not in ATTENTIONS:
        raise ValueError(f"unknown attention {attention!r}; valid: {', '.join(ATTENTIONS)}")
    if backend != "mkl" and not onednn_available():
        return Kernels("mkl", NEVER, f"fallback: this torch build has no oneDNN, {backend} -> mkl",
                       attention=attention)
    if backend == "skinny":
        why = skinny.unavailable()
        if why is not None:
            return Kernels("onednn", 1, f"fallback: specnb's skinny kernels do not run here ({why}), skinny -> onednn",
                           attention=attention, fused=fused)
        return Kernels("skinny", 1, how or f"specnb's skinny kernels ({skinny.isa()})", attention=attention, fused=fused)
    if backend == "mixed":
        if onednn_from is None or onednn_from < 2:
            raise ValueError(f"mixed kernels need onednn_from >= 2 (got {onednn_from}); use onednn for 1")
        return Kernels("mixed", int(onednn_from), how, attention=attention, fused=fused)
    return Kernels(backend, 1 if backend == "onednn" else NEVER, how, attention=attention, fused=fused)


# --- attention: grouped KV heads without copies ------------------------------------------------

ATTENTIONS = ("grouped", "repeat")
GROUPED_SDPA = "specnb_grouped_sdpa"  # the name registered with transformers' AttentionInterface


def grouped_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' SDPA attention, except that a masked CPU forward keeps the KV heads grouped.

    ``query: (batch, heads, q_len, d)``, ``key, value: (batch, kv_heads, kv_len, d)``,
    ``attention_mask: (batch, 1, q_len, kv_len)`` or None; returns ``((batch, q_len, heads, d), None)``.
    transformers copies every KV head ``heads / kv_heads`` times (``repeat_kv``) whenever a mask is
    given, which is every forward of more than one token (a verify forward); torch's CPU SDPA takes
    ``enable_gqa=True`` with a mask, so the copies are skipped: the same arithmetic on the same
    values (logits identical, checked in tests/test_kernels.py), about 2 ms less per verify forward
    of the target on the Xeon. Every other case goes to transformers' own function unchanged.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if (attention_mask is not None and query.device.type == "cpu" and getattr(module, "num_key_value_groups", 1) > 1
            and kwargs.get("position_bias") is None and kwargs.get("softcap") is None
            and not kwargs.get("output_attentions", False)):
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                             scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GROUPED_SDPA, grouped_sdpa)
    AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)


def _set_attention(model: torch.nn.Module, attention: str) -> None:
    """Switch a transformers model between transformers' SDPA and :func:`grouped_sdpa`; others untouched."""
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if not hasattr(model, "set_attn_implementation") or current not in ("sdpa", GROUPED_SDPA):
        return
    want = GROUPED_SDPA if attention == "grouped" else "sdpa"
    if current != want:
        if want == GROUPED_SDPA:
            _register_attention()
        model.set_attn_implementation(want)


class KernelLinear(torch.nn.Linear):
    """``nn.Linear`` whose forward runs oneDNN with a prepacked weight when its :class:`Kernels` say so.

    ``x: (..., in_features) -> (..., out_features)``; rows = x.numel() / in_features. The dense
    ``weight`` stays the Parameter (shared, not copied: tied weights stay tied); the packed copy
    is made on first oneDNN use and remade whenever ``weight`` changed in place.
    """

    kernels: Kernels

    @classmethod
    def wrap(cls, linear: torch.nn.Linear, kernels: Kernels) -> "KernelLinear":
        new = cls.over(linear.weight, kernels)  # the same Parameter objects
        new.bias = linear.bias
        return new

    @classmethod
    def over(cls, weight: torch.Tensor, kernels: Kernels) -> "KernelLinear":
        """A bias-free product ``x @ weight^T`` under ``kernels`` for a weight that no ``nn.Linear`` holds
        (the chapter 7 head's rows of the target's LM head, a buffer): the same rule and packing as
        :meth:`wrap`. The caller keeps it outside its module tree, so no parameter or state is added."""
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.out_features, new.in_features = weight.shape
        new.weight, new.bias = weight, None  # a Parameter is registered (wrap); a buffer stays a plain attribute
        new.kernels = kernels
        new._packed, new._packed_version = None, -1
        return new

    def _pack(self) -> torch.Tensor:
        w = self.weight.detach()
        version = -2 if w.is_inference() else w._version  # inference tensors keep no version counter
        if self._packed is None or self._packed_version != version or self._packed.dtype != w.dtype:
            with torch.inference_mode(False), torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
            self._packed_version = version
        return self._packed

    def __deepcopy__(self, memo: dict) -> "KernelLinear":
        """A copy without the packed weight (a cache: an opaque oneDNN tensor cannot be copied);
        the copy packs its own on first use. Without this, ``copy.deepcopy`` of a model that has run
        a oneDNN forward fails ("Cannot access storage of OpaqueTensorImpl")."""
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            new.__dict__[k] = None if k == "_packed" else copy.deepcopy(v, memo)
        new._packed_version = -1
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.numel() < self.kernels.onednn_from * self.in_features or x.device.type != "cpu"
                or (torch.is_grad_enabled() and (self.weight.requires_grad or x.requires_grad))
                or not onednn_supports(self.weight.dtype)):  # e.g. a copy cast to bfloat16 after use_kernels
            return F.linear(x, self.weight, self.bias)
        group = getattr(self, "_group", None)
        if group is not None and self.kernels.fused:
            return group.output(self, x)
        if _runs_skinny(self.kernels, x, self.weight):
            return skinny.linear(x, [self.weight], [self.bias])
        return torch.ops.mkldnn._linear_pointwise(x, self._pack(), self.bias, "none", [], "")


def _runs_skinny(kernels: Kernels, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this product runs specnb's skinny kernel: the backend says so, float32, at most
    :data:`SKINNY_ROWS` rows (a prompt's prefill runs oneDNN)."""
    return (kernels.backend == "skinny" and x.dtype == weight.dtype == torch.float32
            and x.numel() <= SKINNY_ROWS * weight.shape[1])


def _version(x: torch.Tensor) -> int:
    return -2 if x.is_inference() else x._version  # inference tensors keep no version counter


class FusedGroup:
    """Sibling linear layers that read the same input (q/k/v; gate/up), run as one oneDNN product.

    transformers calls ``q_proj(h)``, ``k_proj(h)``, ``v_proj(h)`` one after another on the same
    tensor ``h`` (and ``gate_proj(x)``, ``up_proj(x)``). The first member called with a new input
    computes ``x @ [W_1; W_2; ...]^T`` once, through one weight packed from all the members', keeps
    it, and hands each later member its columns when that member is called with the same tensor
    (identity checked, and its version where torch keeps one: inference tensors keep none); any
    other input, or a member called twice, is computed afresh. No module is patched, and
    every member still works alone. ``x: (..., in_features) -> (..., out_features of the member)``
    (a view into the fused output).
    """

    def __init__(self, members: list[KernelLinear]):
        self.members = members
        self.splits = [m.out_features for m in members]
        self._packed, self._versions, self._bias = None, None, None
        self._input, self._input_version, self._outputs, self._served = None, None, None, set()

    def __deepcopy__(self, memo: dict) -> "FusedGroup":
        """A copy of the group over the copied members, without the packed weight or a kept input."""
        new = FusedGroup.__new__(FusedGroup)
        memo[id(self)] = new
        FusedGroup.__init__(new, copy.deepcopy(self.members, memo))
        return new

    def _pack(self) -> torch.Tensor:
        versions = tuple(_version(m.weight.detach()) for m in self.members)
        if self._packed is None or self._versions != versions or self._packed.dtype != self.members[0].weight.dtype:
            with torch.inference_mode(False), torch.no_grad():
                w = torch.cat([m.weight.detach() for m in self.members])
                self._packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
                self._bias = (None if self.members[0].bias is None
                              else torch.cat([m.bias.detach() for m in self.members]))
            self._versions = versions
        return self._packed

    def output(self, member: KernelLinear, x: torch.Tensor) -> torch.Tensor:
        i = self.members.index(member)
        if not (x is self._input and self._input_version == _version(x) and i not in self._served):
            if _runs_skinny(member.kernels, x, member.weight):  # the members' own weights: no packed copy
                y = skinny.linear(x, [m.weight for m in self.members], [m.bias for m in self.members])
            else:
                y = torch.ops.mkldnn._linear_pointwise(x, self._pack(), self._bias, "none", [], "")
            self._input, self._input_version, self._served = x, _version(x), set()
            self._outputs = y.split(self.splits, dim=-1)
        self._served.add(i)
        out = self._outputs[i]
        if len(self._served) == len(self.members):  # every member served: let the tensors go
            self._input, self._outputs = None, None
        return out


FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # Llama, Qwen, Mistral names


def _link_groups(model: torch.nn.Module) -> None:
    """Give each set of :data:`FUSED_SIBLINGS` (same input width, all with or all without bias) one group."""
    for parent in model.modules():
        for names in FUSED_SIBLINGS:
            members = [getattr(parent, n, None) for n in names]
            if not all(isinstance(m, KernelLinear) for m in members) or getattr(members[0], "_group", None):
                continue
            if len({m.in_features for m in members}) == 1 and len({m.bias is None for m in members}) == 1:
                group = FusedGroup(members)
                for m in members:
                    m._group = group


_LAST: Kernels | None = None  # the kernels most recently applied in this process (for machine_info)


def in_use() -> Kernels | None:
    """The kernels most recently applied by :func:`use_kernels` in this process, or None."""
    return _LAST


def kernels_of(model: torch.nn.Module) -> Kernels | None:
    """The kernels ``model`` runs (None: never passed through :func:`use_kernels`)."""
    return getattr(model, "_specnb_kernels", None)


def use_kernels(model: torch.nn.Module, backend: str | Kernels | None = None, remember: bool = True) -> Kernels:
    """Run ``model``'s linear layers on ``backend`` (default: ``$SPECNB_KERNELS``, else auto).

    Replaces every plain ``nn.Linear`` by a :class:`KernelLinear` sharing its parameters (once),
    and points all of them at one :class:`Kernels`; calling again switches the whole model.
    ``auto`` needs a transformers causal LM (it times forwards); for other modules (the chapter 7
    head) pass the target's :class:`Kernels`. Returns the kernels now in use. ``remember=False``
    leaves :func:`in_use` (what an unnamed machine line prints) as it was: for a model's helper copy.
    """
    global _LAST
    if isinstance(backend, Kernels):
        kernels = backend
    else:
        name = (backend or os.environ.get(ENV) or "auto").strip().lower()
        if name not in CHOICES:
            raise ValueError(f"{ENV}={name!r} is not a kernel backend; valid: {', '.join(CHOICES)}")
        dtype = _dtype_of(model)
        if name != "mkl" and dtype is not None and onednn_available() and not onednn_supports(dtype):
            kernels = make("onednn")  # nothing to time: _for_dtype below turns it into MKL, saying why
        elif name == "auto":
            kernels = choose_for(model)
        elif name == "mixed":
            kernels = choose_for(model, allowed=("mixed",))
        else:
            kernels = make(name, how=f"{ENV}={name}" if os.environ.get(ENV) else f"asked for {name}")
    kernels = _for_dtype(kernels, model)
    _install(model, kernels)
    if remember:
        _LAST = kernels
    return kernels


@contextmanager
def using(model: torch.nn.Module, backend: str | Kernels):
    """Run ``model`` on ``backend`` inside the ``with`` block, then restore its own kernels."""
    before = kernels_of(model)
    use_kernels(model, backend if isinstance(backend, Kernels) else make(backend))
    try:
        yield kernels_of(model)
    finally:
        if before is not None:
            use_kernels(model, before)
        else:
            _install(model, make("mkl", attention="repeat"))
            del model._specnb_kernels


def _install(model: torch.nn.Module, kernels: Kernels) -> None:
    _set_attention(model, kernels.attention)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, KernelLinear):
                child.kernels = kernels
            elif type(child) is torch.nn.Linear:
                setattr(parent, name, KernelLinear.wrap(child, kernels))
    _link_groups(model)
    model._specnb_kernels = kernels


# --- auto: measure both curves on the model at hand, once per machine -------------------------

def _cache_file():
    from .models import cache_dir

    return cache_dir() / "kernels.json"


def machine_key(model: torch.nn.Module) -> str:
    """What the choice depends on: CPU, cores, torch threads, torch version, model shape and dtype."""
    from .env import _cpu_model

    cfg = model.config
    shape = "x".join(str(getattr(cfg, a, "?")) for a in ("hidden_size", "intermediate_size",
                                                         "num_hidden_layers", "vocab_size"))
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return (f"{_cpu_model()} | {os.cpu_count()} cores | {torch.get_num_threads()} threads | "
            f"torch {torch.__version__} | {type(model).__name__} {shape} {dtype} | grouped-KV attention | "
            "oneDNN q/k/v and gate/up fused | skinny kernels timed" + ("" if skinny.unavailable() is None else " (none here)"))


@torch.inference_mode()
def measure_curves(model: torch.nn.Module, ns=AUTO_NS, context_len: int = 64, repeats: int = 7,
                   warmup: int = 3, seed: int = 0, budget_s: float | None = None, min_repeats: int = 3,
                   stats: dict | None = None) -> dict:
    """T(n) in ms (median) under MKL, oneDNN and, where it runs, specnb's skinny kernels, interleaved:
    ``{"mkl": {n: ms}, "onednn": {n: ms}, "skinny": {n: ms}}`` (no "skinny" where :func:`specnb.skinny.unavailable`,
    or for a model that is not float32).

    One cache prefilled with ``context_len`` seeded random ids; each timing feeds n more ids with
    logits at every position (as a verify forward does), then rolls the cache back. Each follows an
    untimed one-token forward on the same backend (:func:`specnb.timing.lead_in_forward`: timed right
    after the other backend's largest forward, T(1) reads slow). Backends and n
    alternate inside each repeat, so a noisy machine's drift hits both alike. Leaves the model on
    MKL; the caller installs its choice.

    With ``budget_s``, a slow model is timed less: when the first round alone takes over a tenth of
    the budget, it is the only warm-up round, and the repeats stop once ``min_repeats`` are measured
    and ``budget_s`` seconds have passed. ``stats`` (a dict) receives the repeats and warm-up rounds run.
    """
    from .cache import forward, prefilled, rollback
    from .timing import lead_in_forward

    backends = {"mkl": make("mkl"), "onednn": make("onednn")}
    if skinny.unavailable() is None and _dtype_of(model) == torch.float32:  # its kernel is float32 only
        backends["skinny"] = make("skinny")
    times = {b: {n: [] for n in ns} for b in backends}
    _install(model, backends["mkl"])
    cache, new = prefilled(model, context_len, max(ns), seed)
    start, measured, r = time.perf_counter(), 0, 0
    while measured < repeats:
        t_round = time.perf_counter()
        keep = r >= warmup
        for b, kernels in backends.items():
            _install(model, kernels)
            for n in ns:
                lead_in_forward(model, new, cache)   # each timed forward follows a one-token step
                t0 = time.perf_counter()
                forward(model, new[:n], cache)
                dt = time.perf_counter() - t0
                rollback(cache, n)
                if keep:
                    times[b][n].append(dt)
        if budget_s is not None and r == 0 and time.perf_counter() - t_round > budget_s / 10:
            warmup = min(warmup, 1)  # a slow model: one round warmed it
        measured += keep
        r += 1
        if budget_s is not None and measured >= min_repeats and time.perf_counter() - start > budget_s:
            break
    _install(model, backends["mkl"])
    if stats is not None:
        stats.update(repeats=measured, warmup=r - measured)
    return {b: {n: float(np.median(t)) * 1e3 for n, t in per_n.items()} for b, per_n in times.items()}


def decide(curves: dict, allowed=("mkl", "onednn", "mixed", "skinny")) -> tuple[str, int]:
    """``(backend, onednn_from)`` from measured curves: oneDNN from the smallest n at which it is
    faster than MKL there and at every larger n measured (1: onednn; never: mkl; else mixed).
    ``allowed=("mixed",)`` forces a threshold of at least 2. Then, where ``curves`` has a "skinny"
    curve and skinny is allowed: skinny when its mean T(n) over the measured n is below the mean of
    the curve just chosen (the n are a decode step and verify forwards, so this is the faster verify curve)."""
    choice = _decide_mkl_onednn(curves, allowed)
    if "skinny" in curves and "skinny" in allowed:
        ns = sorted(curves["mkl"])
        backend, start = choice
        chosen = [curves["onednn"][n] if n >= start else curves["mkl"][n] for n in ns]
        if np.mean([curves["skinny"][n] for n in ns]) < np.mean(chosen):
            return "skinny", 1
    return choice


def _decide_mkl_onednn(curves: dict, allowed) -> tuple[str, int]:
    ns = sorted(curves["mkl"])
    start = NEVER
    for n in reversed(ns):
        if curves["onednn"][n] < curves["mkl"][n]:
            start = n
        else:
            break
    if allowed == ("mixed",):
        return "mixed", min(max(start, 2), max(ns)) if start != NEVER else max(ns)
    if start == NEVER:
        return "mkl", NEVER
    return ("onednn", 1) if start == ns[0] else ("mixed", start)


def measured_once(path, key: str, measure, remeasure: bool = False) -> dict:
    """``path``'s JSON entry for ``key`` (a machine), or ``measure()`` now, stored there atomically.

    The one cache of per-machine measurements: the kernels' curves here, the head's precision
    (:mod:`specnb.head_precision`). A cache that cannot be written is measured again next time."""
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        saved = {}
    if key in saved and not remeasure:
        return saved[key]
    saved[key] = entry = measure()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".partial")
        tmp.write_text(json.dumps(saved, indent=1) + "\n")
        tmp.replace(path)
    except OSError:
        pass
    return entry


def choose_for(model: torch.nn.Module, allowed=("mkl", "onednn", "mixed", "skinny"), remeasure: bool = False) -> Kernels:
    """auto: the kernels for ``model`` on this machine, from the cache or measured now (and cached)."""
    if not onednn_available():
        return make("onednn")  # -> the mkl fallback, saying why
    if not any(type(m) is torch.nn.Linear or isinstance(m, KernelLinear) for m in model.modules()):
        return make("mkl", how=f"nothing to choose: {type(model).__name__} has no nn.Linear layers "
                               "(GPT-2 uses its own Conv1D), so torch's default kernels run it")
    key = machine_key(model)

    def timed() -> dict:
        t0 = time.perf_counter()
        names = "MKL, oneDNN and specnb's skinny kernels" if skinny.unavailable() is None else "MKL and oneDNN"
        print(f"specnb kernels: timing {names} on this machine once ({key}) ...", file=sys.stderr)
        stats = {}
        curves = measure_curves(model, budget_s=AUTO_BUDGET_S, stats=stats)
        return {"curves": curves, "seconds": round(time.perf_counter() - t0, 1), **stats,
                "measured": time.strftime("%Y-%m-%d %H:%M")}

    entry = measured_once(_cache_file(), key, timed, remeasure)
    curves = {b: {int(n): ms for n, ms in c.items()} for b, c in entry["curves"].items()}
    backend, start = decide(curves, allowed)
    t = {b: ", ".join(f"{c[n]:.1f}" for n in sorted(c)) for b, c in curves.items()}
    reps = f", median of {entry['repeats']}" if "repeats" in entry else ""
    how = (f"auto, measured {entry['measured']}{reps}: T(n) for n = {', '.join(map(str, sorted(curves['mkl'])))} "
           f"MKL {t['mkl']} ms, oneDNN {t['onednn']} ms"
           + (f", skinny ({skinny.isa()}) {t['skinny']} ms" if "skinny" in t else ""))
    if backend == "skinny" and skinny.unavailable() is not None:  # a curve cached by a machine that could build it
        return make("skinny", how=how)  # -> onednn, saying why
    return Kernels(backend, start, how, curves)


def describe(kernels: Kernels | None) -> dict:
    """JSON-ready record of the kernels (for result files and cards)."""
    if kernels is None:
        return {"backend": "not set (torch default)"}
    d = asdict(kernels)
    d["label"] = kernels.label
    if d["onednn_from"] == NEVER:
        d["onednn_from"] = None
    return d
