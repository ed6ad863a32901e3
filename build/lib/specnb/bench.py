"""Benchmarks that print ratios measured side by side in one run.

These machines are noisy, so absolute tokens per second drift from run to run;
what is comparable is a ratio of two loops timed alternately (A, B, A, B, ...) on
the same prompts in the same process. Nothing here is a timed test.

* :func:`baseline_vs_generate`: specnb's plain greedy loop against transformers'
  own ``generate`` (greedy), either on the same kernels (loop cost alone: the
  ratio should be close to 1, our baseline is no strawman) or with ``generate``
  on torch's default kernels (what a user gets from each).
* :func:`speculative_vs_greedy`: speculative greedy with a given draft against
  specnb's plain greedy.
* :func:`side_by_side`: one specnb draft against the transformers method that
  runs the same draft (``generate(prompt_lookup_num_tokens=k)``,
  ``generate(assistant_model=...)``, ``generate(assistant_early_exit=L)``), each
  loop also against its own plain greedy, every output checked equal to plain
  greedy, and each side's acceptance counted (transformers' from its own
  candidate generator), so draft quality and loop cost are told apart.
  :func:`bench_table` picks the best k per draft and kind (``specnb bench``).

Not covered: the sweep over k and drafts (chapter 4), sampling mode, batches.
"""
from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from .costmodel import loop_c
from .decode import greedy, speculative_greedy
from .drafts import Draft, ModelDraft, PromptLookupDraft
from .kernels import kernels_of, make, using
from .lookup_hf import HFPromptLookupDraft
from .prompts import Prompt, encode


@dataclass
class PairedTiming:
    """Tokens per second of two methods, timed alternately on the same prompts."""

    name_a: str
    name_b: str
    tps_a: list[float]  # one per (prompt, repeat)
    tps_b: list[float]
    identical: int  # runs where both produced the same tokens
    runs: int

    @property
    def ratios(self) -> list[float]:
        return [a / b for a, b in zip(self.tps_a, self.tps_b)]

    def summary(self) -> str:
        r = self.ratios
        q = statistics.quantiles(r, n=4) if len(r) >= 2 else [r[0]] * 3
        return (f"{self.name_a}: {statistics.median(self.tps_a):.2f} tok/s   "
                f"{self.name_b}: {statistics.median(self.tps_b):.2f} tok/s   "
                f"ratio {self.name_a}/{self.name_b}: median {statistics.median(r):.3f} "
                f"(quartiles {q[0]:.3f}-{q[2]:.3f}, {len(r)} paired runs); "
                f"identical tokens in {self.identical}/{self.runs}")


@torch.inference_mode()
def hf_generate(model, ids: list[int], max_new_tokens: int, eos_token_id: int | None) -> tuple[list[int], float]:
    """transformers' ``generate``, greedy; returns (new tokens, seconds)."""
    x = torch.tensor([ids])
    start = time.perf_counter()
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=eos_token_id, pad_token_id=eos_token_id)
    seconds = time.perf_counter() - start
    return out[0, len(ids):].tolist(), seconds


def baseline_vs_generate(model, tokenizer, prompts: list[Prompt], max_new_tokens: int = 64,
                         repeats: int = 3, generate_kernels: str | None = None) -> PairedTiming:
    """specnb greedy vs transformers ``generate``, alternating, after one warm-up of each.

    specnb runs on the model's own kernels (:mod:`specnb.kernels`). ``generate_kernels=None`` runs
    ``generate`` on the same kernels (the two loops' cost alone); ``"default"`` runs it as
    transformers leaves a model: torch's default GEMM (MKL) and transformers' own SDPA call, which
    copies the KV heads whenever it passes a mask, as in a verify (what a user of ``generate`` gets); ``"mkl"``/``"onednn"``/``"mixed"`` name
    a GEMM library with specnb's attention.
    """
    eos = tokenizer.eos_token_id
    ours_label = kernels_of(model).backend if kernels_of(model) is not None else "torch default"
    if generate_kernels == "default":
        theirs_kernels, theirs_label = make("mkl", attention="repeat"), "transformers defaults"
    else:
        theirs_kernels = generate_kernels or kernels_of(model) or "mkl"
        theirs_label = generate_kernels or ours_label

    def theirs(ids, n):
        with using(model, theirs_kernels):
            return hf_generate(model, ids, n, eos)

    warm = encode(tokenizer, prompts[0])
    greedy(model, warm, 4, eos)
    theirs(warm, 4)
    result = PairedTiming(f"specnb greedy [{ours_label}]", f"transformers generate [{theirs_label}]", [], [], 0, 0)
    for r in tqdm(range(repeats * len(prompts)), desc="baseline vs generate"):
        ids = encode(tokenizer, prompts[r % len(prompts)])
        order = (0, 1) if r % 2 == 0 else (1, 0)  # alternate who goes first
        for which in order:
            if which == 0:
                ours = greedy(model, ids, max_new_tokens, eos)
            else:
                hf_tokens, seconds = theirs(ids, max_new_tokens)
        result.tps_a.append(ours.tokens_per_second)
        result.tps_b.append(len(hf_tokens) / seconds)
        result.identical += ours.tokens == hf_tokens
        result.runs += 1
    return result


def speculative_vs_greedy(model, tokenizer, draft: Draft, prompts: list[Prompt], k: int,
                          max_new_tokens: int = 64, repeats: int = 3) -> PairedTiming:
    """Speculative greedy with ``draft`` vs specnb's plain greedy, alternating."""
    eos = tokenizer.eos_token_id
    result = PairedTiming(f"speculative ({draft.name}, k={k})", "plain greedy", [], [], 0, 0)
    for r in tqdm(range(repeats * len(prompts)), desc=f"{draft.name} k={k}"):
        ids = encode(tokenizer, prompts[r % len(prompts)])
        order = (0, 1) if r % 2 == 0 else (1, 0)
        for which in order:
            if which == 0:
                spec = speculative_greedy(model, draft, ids, k, max_new_tokens, eos)
            else:
                base = greedy(model, ids, max_new_tokens, eos)
        result.tps_a.append(spec.tokens_per_second)
        result.tps_b.append(base.tokens_per_second)
        result.identical += spec.tokens == base.tokens
        result.runs += 1
    return result


# ---------------------------------------------------------------------------------------------
# Side by side with transformers' own speculative decoding (chapter 9).

HF_METHODS = ("prompt_lookup", "assistant_model", "assistant_early_exit")


@dataclass
class HFRun:
    """One transformers ``generate`` call: new tokens, seconds, and its candidate generator's rounds."""

    tokens: list[int]
    seconds: float
    drafted: list[int] = field(default_factory=list)  # candidates per round
    accepted: list[int] = field(default_factory=list)  # n_matches per round (after transformers' own cropping)


@contextmanager
def _recording_rounds():
    """Count transformers' candidates and matches per round by wrapping its candidate generators."""
    from transformers.generation import candidate_generator as cg

    log: dict[str, list[int]] = {"drafted": [], "accepted": []}
    saved = []
    for cls in (cg.PromptLookupCandidateGenerator, cg.AssistedCandidateGenerator):
        own = {name: cls.__dict__.get(name) for name in ("get_candidates", "update_candidate_strategy")}
        get, update = cls.get_candidates, cls.update_candidate_strategy

        def get_candidates(self, input_ids, *args, _get=get, **kwargs):
            out = _get(self, input_ids, *args, **kwargs)
            log["drafted"].append(int(out[0].shape[1] - input_ids.shape[1]))
            return out

        def update_candidate_strategy(self, input_ids, scores, num_matches, _update=update):
            log["accepted"].append(int(num_matches))
            return _update(self, input_ids, scores, num_matches)

        cls.get_candidates, cls.update_candidate_strategy = get_candidates, update_candidate_strategy
        saved.append((cls, own))
    try:
        yield log
    finally:
        for cls, own in saved:
            for name, fn in own.items():
                if fn is None:
                    delattr(cls, name)
                else:
                    setattr(cls, name, fn)


@contextmanager
def _fixed_k(model, k: int):
    """Make transformers' assistant draft exactly k tokens a round: constant schedule, no confidence stop."""
    cfg = model.generation_config
    keys = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
    old = {key: getattr(cfg, key, None) for key in keys}
    cfg.num_assistant_tokens, cfg.num_assistant_tokens_schedule, cfg.assistant_confidence_threshold = k, "constant", 0.0
    try:
        yield
    finally:
        for key, value in old.items():
            setattr(cfg, key, value)


@torch.inference_mode()
def hf_speculative(model, ids: list[int], method: str, k: int, max_new_tokens: int, eos_token_id: int | None,
                   assistant=None, early_exit: int | None = None, max_ngram: int = 2) -> HFRun:
    """transformers' greedy speculative decoding by ``method`` (one of :data:`HF_METHODS`), k drafts a round.

    ``prompt_lookup``: ``prompt_lookup_num_tokens=k, max_matching_ngram_size=max_ngram``;
    ``assistant_model``: ``assistant`` (a model sharing the vocabulary) drafts;
    ``assistant_early_exit``: the target's own first ``early_exit`` layers draft.
    """
    if method not in HF_METHODS:
        raise ValueError(f"method must be one of {HF_METHODS}, got {method!r}")
    kwargs = {}
    owner = model
    if method == "prompt_lookup":
        kwargs = dict(prompt_lookup_num_tokens=k, max_matching_ngram_size=max_ngram)
    elif method == "assistant_model":
        if assistant is None:
            raise ValueError("assistant_model needs `assistant`, e.g. drafts.early_exit_model(model, 24)")
        kwargs, owner = dict(assistant_model=assistant), assistant
    else:
        if early_exit is None:
            raise ValueError("assistant_early_exit needs `early_exit`, the number of layers the draft keeps")
        kwargs = dict(assistant_early_exit=early_exit)
    x = torch.tensor([ids])
    with _fixed_k(owner, k), _recording_rounds() as log:
        start = time.perf_counter()
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos_token_id, pad_token_id=eos_token_id, **kwargs)
        seconds = time.perf_counter() - start
    return HFRun(out[0, len(ids):].tolist(), seconds, log["drafted"], log["accepted"])


def _verified(drafted: list[int], accepted: list[int]) -> int:
    """Draft positions the target judged: the accepted ones plus the first rejected one per round."""
    return sum(min(n + 1, m) for m, n in zip(drafted, accepted))


def budget_free_rounds(rounds, k: int, max_new_tokens: int) -> int:
    """How many leading rounds of a specnb run drafted without the token budget binding: specnb drafts
    ``min(k, budget - 1)`` while transformers drafts k (and crops afterwards), so only these rounds are
    comparable one to one. ``rounds``: the run's :class:`~specnb.decode.RoundStats`."""
    emitted = 0
    for j, r in enumerate(rounds):
        if max_new_tokens - emitted - 1 < k:
            return j
        emitted += r.emitted
    return len(rounds)


@dataclass
class SideBySide:
    """One specnb draft against one transformers method at one k, on the same prompts, timed alternately."""

    draft: str
    method: str  # the transformers method (HF_METHODS)
    kind: str
    k: int
    runs: int = 0
    identical: int = 0  # runs where specnb's and transformers' speculative outputs and transformers' greedy all equal specnb's greedy
    tps: dict = field(default_factory=lambda: {"specnb": [], "hf": [], "specnb greedy": [], "hf greedy": []})
    counts: dict = field(default_factory=lambda: {side: {"drafted": 0, "accepted": 0, "verified": 0, "rounds": 0}
                                                  for side in ("specnb", "hf")})
    draft_seconds: float = 0.0  # specnb's time in propose(), summed
    greedy_per_token: list = field(default_factory=list)
    rounds: dict = field(default_factory=lambda: {"specnb": [], "hf": []})  # per run: [(drafted, accepted), ...]
    budget_free: list = field(default_factory=list)  # per run: :func:`budget_free_rounds` of specnb's run

    def same_rounds(self) -> bool:
        """Whether, in every run, both loops drafted and accepted the same numbers of tokens in every round
        before the token budget bound specnb's draft (those after it may differ)."""
        return all(s[:n] == h[:n] for s, h, n in zip(self.rounds["specnb"], self.rounds["hf"], self.budget_free))

    def acceptance(self, side: str) -> float:
        """accepted / drafted for ``side`` ("specnb" or "hf")."""
        c = self.counts[side]
        return c["accepted"] / c["drafted"] if c["drafted"] else float("nan")

    def a(self, side: str) -> float:
        """a = accepted / verified drafts for ``side``."""
        c = self.counts[side]
        return c["accepted"] / c["verified"] if c["verified"] else float("nan")

    def speedup(self, side: str) -> float:
        """Median over runs of (side's speculative tok/s) / (side's own plain greedy tok/s)."""
        return statistics.median(s / g for s, g in zip(self.tps[side], self.tps[f"{side} greedy"]))

    @property
    def ratio(self) -> float:
        """Median over runs of specnb's speculative tok/s / transformers' speculative tok/s."""
        return statistics.median(s / h for s, h in zip(self.tps["specnb"], self.tps["hf"]))

    @property
    def c(self) -> float:
        """:func:`specnb.costmodel.loop_c` of specnb's loop: its draft seconds per round / k, against
        the median plain greedy seconds per token."""
        if not self.greedy_per_token:
            return float("nan")
        return loop_c(self.draft_seconds, self.counts["specnb"]["rounds"], self.k, statistics.median(self.greedy_per_token))


def side_by_side(model, tokenizer, draft: Draft, method: str, prompts: list[Prompt], k: int, max_new_tokens: int = 48,
                 repeats: int = 1, kind: str = "", early_exit: int | None = None, progress: bool = True,
                 rollback_mode: str = "exact", max_ngram: int = 2) -> SideBySide:
    """Time specnb's loop with ``draft`` against transformers' ``method`` on ``prompts``, each against its greedy.

    Per prompt and repeat, four runs in a rotating order: specnb greedy,
    transformers greedy, specnb speculative, transformers speculative. Every
    output must equal specnb's plain greedy tokens to count as identical. For
    ``assistant_model`` the assistant is ``draft.model``, so both loops run the
    same draft model; for ``assistant_early_exit``, ``early_exit`` layers.
    ``max_ngram`` is transformers' ``max_matching_ngram_size`` for ``prompt_lookup`` (give the
    specnb side ``HFPromptLookupDraft(max_ngram=...)`` with the same n to compare one rule).
    ``rollback_mode`` other than ``"exact"`` breaks specnb's loop on purpose (negative control).
    """
    eos = tokenizer.eos_token_id
    assistant = draft.vocab_model()
    if method == "assistant_early_exit" and early_exit is None:
        early_exit = assistant.config.num_hidden_layers if assistant is not None else None
    res = SideBySide(draft.name, method, kind, k)
    warm = encode(tokenizer, prompts[0])
    greedy(model, warm, 2, eos)
    hf_generate(model, warm, 2, eos)
    for r in tqdm(range(repeats * len(prompts)), desc=f"{draft.name} vs {method}, k={k}", disable=not progress):
        ids = encode(tokenizer, prompts[r % len(prompts)])
        order = [0, 1, 2, 3][r % 4:] + [0, 1, 2, 3][: r % 4]
        for which in order:
            if which == 0:
                base = greedy(model, ids, max_new_tokens, eos)
            elif which == 1:
                theirs_greedy, hf_greedy_s = hf_generate(model, ids, max_new_tokens, eos)
            elif which == 2:
                spec = speculative_greedy(model, draft, ids, k, max_new_tokens, eos, rollback_mode=rollback_mode)
            else:
                theirs = hf_speculative(model, ids, method, k, max_new_tokens, eos, assistant, early_exit, max_ngram)
        res.runs += 1
        res.identical += spec.tokens == theirs.tokens == theirs_greedy == base.tokens
        res.tps["specnb"].append(spec.tokens_per_second)
        res.tps["specnb greedy"].append(base.tokens_per_second)
        res.tps["hf"].append(len(theirs.tokens) / theirs.seconds)
        res.tps["hf greedy"].append(len(theirs_greedy) / hf_greedy_s)
        res.greedy_per_token.append(base.wall_time / len(base.tokens))
        res.draft_seconds += spec.t_draft
        res.budget_free.append(budget_free_rounds(spec.rounds, k, max_new_tokens))
        for side, drafted, accepted in (("specnb", [x.drafted for x in spec.rounds], [x.accepted for x in spec.rounds]),
                                        ("hf", theirs.drafted, theirs.accepted)):
            cnt = res.counts[side]
            cnt["drafted"] += sum(drafted)
            cnt["accepted"] += sum(accepted)
            cnt["verified"] += _verified(drafted, accepted)
            cnt["rounds"] += len(drafted)
            res.rounds[side].append(list(zip(drafted, accepted)))
    return res


def bench_drafts(model, names) -> list[tuple[Draft, str, int | None]]:
    """(specnb draft, transformers method, early-exit layers) for each short name:
    ``lookup-hf`` (transformers' n-gram rule on both sides), ``lookup`` (specnb's rule vs transformers'),
    ``exitN`` (an N-layer early exit: against ``assistant_model`` and ``assistant_early_exit``)."""
    from .drafts import early_exit_model

    out = []
    for name in names:
        if name == "lookup-hf":
            out.append((HFPromptLookupDraft(), "prompt_lookup", None))
        elif name == "lookup":
            out.append((PromptLookupDraft(), "prompt_lookup", None))
        elif name.startswith("exit") and name[4:].isdigit():
            layers = int(name[4:])
            draft = ModelDraft(early_exit_model(model, layers), name=f"early exit ({layers} layers)")
            out += [(draft, "assistant_model", None), (draft, "assistant_early_exit", layers)]
        else:
            raise ValueError(f"unknown bench draft {name!r}: use lookup-hf, lookup or exitN (e.g. exit24)")
    return out


def bench_table(model, tokenizer, drafts=("lookup-hf", "lookup", "exit24"), kinds=("code", "prose", "grounded"),
                ks=(1, 2, 4, 8), prompts_per_kind: int = 2, max_new_tokens: int = 48, repeats: int = 1,
                progress: bool = True) -> list[SideBySide]:
    """For each draft x kind, :func:`side_by_side` at every k; keep the k where specnb's speedup is best."""
    from .prompts import by_kind

    best = []
    for draft, method, layers in bench_drafts(model, drafts):
        for kind in kinds:
            prompts = by_kind(kind)[:prompts_per_kind]
            results = [side_by_side(model, tokenizer, draft, method, prompts, k, max_new_tokens, repeats, kind,
                                    layers, progress) for k in ks]
            best.append(max(results, key=lambda r: r.speedup("specnb")))
    return best


def table_markdown(rows: list[SideBySide], k_label: str = "best k") -> str:
    """``specnb bench``'s table: draft x kind -> a, c, best k, speedup, the transformers ratio."""
    from .booktext import table

    return table(["draft", "transformers method", "kind", "a specnb / transformers",
                  "accepted/drafted specnb / transformers", "c", k_label, "speedup specnb", "speedup transformers",
                  "specnb / transformers tok/s", "identical"],
                 [[r.draft, r.method, r.kind, f"{r.a('specnb'):.2f} / {r.a('hf'):.2f}",
                   f"{r.acceptance('specnb'):.2f} / {r.acceptance('hf'):.2f}", f"{r.c:.3f}", r.k,
                   f"{r.speedup('specnb'):.2f}x", f"{r.speedup('hf'):.2f}x", f"{r.ratio:.2f}", f"{r.identical}/{r.runs}"]
                  for r in rows])
