"""Paired speedup of drafts on a list of prompts: choose settings on calibration prompts, report on others.

Chapter 7 asks one question of a draft: on text it was not trained on, how much
faster than plain greedy is it, with the draft's settings (k, a confidence
threshold) chosen *before* the reported runs? :func:`paired_runs` times every
(draft, setting) on every prompt between two plain-greedy runs of the same prompt
(a noisy machine slows both alike) and checks each output against plain greedy;
:func:`best_settings` picks, per kind of text, the setting with the highest
median paired ratio on calibration prompts; :func:`setting_rows` gives the median and
quartiles of the paired ratio on the report prompts, for those settings only.

Definitions as in :mod:`specnb.sweep` (chapter 4): speedup = greedy time per token /
speculative time per token, prefill excluded from both; a = accepted / verified drafts.
Not covered: sampling mode (see :func:`sampled_speedup`), batches.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from .costmodel import loop_c
from .decode import DecodeResult, greedy, sample, speculative_greedy, speculative_sample
from .drafts import Draft, HeuristicK
from .prompts import Prompt, encode
from .sampling import SamplingParams
from .sweep import _greedy_per_token, pooled_positions, run_record
from .tree_decode import speculative_tree_greedy


@dataclass(frozen=True)
class Setting:
    """One way to run a draft: ``k`` drafted tokens at most, and the +2/-1 schedule or not."""

    draft: str  # a key of the drafts dict
    k: int
    schedule: bool = False  # transformers' +2/-1 heuristic (k is then the cap; it starts at 4 or k)
    tree: bool = False  # run the tree loop (chapter 8) with at most k nodes per tree

    @property
    def label(self) -> str:
        if self.tree:
            return f"{self.draft}, {self.k} nodes"
        return f"{self.draft}, k={self.k}" + (" (+2/-1)" if self.schedule else "")


def _draft_for(drafts: dict[str, Draft], s: Setting) -> Draft:
    d = drafts[s.draft]
    return HeuristicK(d, min(4, s.k)) if s.schedule else d


def paired_runs(model: torch.nn.Module, tokenizer, prompts: list[Prompt], drafts: dict[str, Draft],
                settings: list[Setting], max_new_tokens: int, repeats: int = 1, progress: bool = True,
                desc: str = "paired runs") -> list[dict]:
    """Every setting on every prompt, ``repeats`` passes; each run paired with greedy before and after it.

    Per prompt: one greedy run, then for each pass every setting (in reverse order on odd passes), each
    followed by a greedy run of the same prompt; a speculative run's speedup is against the mean of the
    greedy runs either side of it, so each greedy run between two speculative runs serves both (a prompt
    with S settings and R passes costs R * S + 1 greedy runs, not R * (S + 1)).

    Returns one record per run: kind, prompt index, repeat, setting label, the paired
    speedup, whether the output equals plain greedy, and :func:`specnb.sweep.run_record`'s counts.
    """
    eos = tokenizer.eos_token_id
    encoded = [encode(tokenizer, p) for p in prompts]
    greedy(model, encoded[0], 4, eos)  # warm-up
    out: list[dict] = []
    bar = tqdm(total=repeats * len(prompts) * len(settings), desc=desc, disable=not progress)
    for pi, (prompt, ids) in enumerate(zip(prompts, encoded)):
        before = greedy(model, ids, max_new_tokens, eos)
        for rep in range(repeats):
            for s in (settings if rep % 2 == 0 else settings[::-1]):
                if s.tree:
                    spec = speculative_tree_greedy(model, drafts[s.draft], ids, s.k, max_new_tokens, eos)
                else:
                    spec = speculative_greedy(model, _draft_for(drafts, s), ids, s.k, max_new_tokens, eos)
                after = greedy(model, ids, max_new_tokens, eos)
                g = (_greedy_per_token(before) + _greedy_per_token(after)) / 2
                rec = run_record(spec, s.k)
                rec.update(kind=prompt.kind, prompt=pi, repeat=rep, setting=s.label, draft=s.draft, k=s.k,
                           schedule=s.schedule, tree=s.tree, identical=spec.tokens == before.tokens,
                           greedy_per_token=g, speedup=g / ((spec.wall_time - spec.t_prefill) / len(spec.tokens)))
                out.append(rec)
                before = after
                bar.update(1)
    bar.close()
    return out


def setting_rows(records: list[dict], by: tuple[str, ...] = ("kind", "setting")) -> dict[tuple, dict]:
    """Median and quartiles of the paired speedup, a, accepted/drafted and c, grouped by ``by``.

    c is :func:`specnb.costmodel.loop_c` of the group's pooled draft time and rounds, against the
    mean of the paired greedy seconds per token (a group is one setting, so one k)."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault(tuple(r[b] for b in by), []).append(r)
    out = {}
    for key, rs in groups.items():
        s = np.array([r["speedup"] for r in rs])
        attempts = sum(sum(r["attempts"]) for r in rs)
        accepts = sum(sum(r["accepts"]) for r in rs)
        drafted = sum(r["drafted"] for r in rs)
        t_draft = sum(r["t_draft"] for r in rs)
        g = np.mean([r["greedy_per_token"] for r in rs])
        if len({r["k"] for r in rs}) > 1:
            raise ValueError(f"group {key} mixes k = {sorted({r['k'] for r in rs})}: c is per k; group by setting")
        out[key] = {"runs": len(rs), "speedup": float(np.median(s)), "q1": float(np.quantile(s, 0.25)),
                    "q3": float(np.quantile(s, 0.75)), "a": accepts / attempts if attempts else float("nan"),
                    "accepted_per_drafted": sum(r["accepted"] for r in rs) / drafted if drafted else float("nan"),
                    "tokens_per_round": sum(r["tokens"] for r in rs) / sum(r["rounds"] for r in rs),
                    "c": loop_c(t_draft, sum(r["rounds"] for r in rs), rs[0]["k"], g),
                    "identical": sum(r["identical"] for r in rs)}
    return out


def best_settings(records: list[dict]) -> dict[str, str]:
    """Per kind of text, the setting label with the highest median paired speedup in ``records``."""
    rows = setting_rows(records)
    best: dict[str, tuple[float, str]] = {}
    for (kind, label), row in rows.items():
        if kind not in best or row["speedup"] > best[kind][0]:
            best[kind] = (row["speedup"], label)
    return {kind: label for kind, (_, label) in best.items()}


def position_acceptance(records: list[dict]) -> list[float]:
    """a_i: accepted / verified at each draft position, pooled over ``records``."""
    att, acc = pooled_positions(records)
    return [float(a / t) if t else float("nan") for a, t in zip(acc, att)]


def pair_speedup(base: DecodeResult, spec: DecodeResult) -> float:
    """One paired speedup: plain decoding's seconds per token over the speculative loop's, prefill left out.

    Plain decoding's prefill also yields its first token, so its steady time covers
    ``len(tokens) - 1`` tokens; the speculative loop's prefill stops before the prompt's last
    token, so every one of its tokens comes after it.
    """
    return _greedy_per_token(base) / ((spec.wall_time - spec.t_prefill) / len(spec.tokens))


def sampled_speedup(model: torch.nn.Module, tokenizer, prompts: list[Prompt], draft: Draft, k: int,
                    params: SamplingParams, max_new_tokens: int, seeds: int = 1, progress: bool = True) -> list[dict]:
    """Sampling mode: speculative sampling against plain sampling, paired per prompt and seed.

    The outputs differ run by run (they are random); what must hold is their distribution,
    which chapter 6's checks test. Each record has the paired speedup and acceptance.
    """
    eos = tokenizer.eos_token_id
    out = []
    for prompt in tqdm(prompts, desc="sampling", disable=not progress):
        ids = encode(tokenizer, prompt)
        for seed in range(seeds):
            base = sample(model, ids, max_new_tokens, params, seed, eos)
            spec = speculative_sample(model, draft, ids, k, max_new_tokens, params, seed, eos)
            out.append({"kind": prompt.kind, "seed": seed, "speedup": pair_speedup(base, spec),
                        "a": spec.position_acceptance, "accepted": spec.accepted, "verified": spec.verified,
                        "tokens_per_round": spec.tokens_per_round})
    return out


def split_half_predictions(runs: list[dict], verify: dict[int, float], t1: float) -> list[dict]:
    """The refined model judged out of sample on every (kind, setting) of calibration ``runs``.

    For each kind with at least two prompts, its prompts are split in two halves; the
    per-position acceptance and draft cost of one half's runs of a setting
    (:meth:`specnb.calibration.Calibration.from_records`) predict the median paired
    speedup measured on the other half's runs of that setting, and the other way round.
    ``verify``: T(n)/T(1) from a separate timing; ``t1``: T(1) in seconds.

    Returns one record per (kind, setting, predicted half): kind, setting, k, predicted,
    measured, error = predicted / measured - 1.
    """
    from .calibration import Calibration, predict_speedup

    out = []
    for kind in sorted({r["kind"] for r in runs}):
        prompts = sorted({r["prompt"] for r in runs if r["kind"] == kind})
        if len(prompts) < 2:
            continue
        halves = (set(prompts[: len(prompts) // 2]), set(prompts[len(prompts) // 2:]))
        for setting in sorted({r["setting"] for r in runs if r["kind"] == kind}):
            rs = [r for r in runs if r["kind"] == kind and r["setting"] == setting]
            for fit, held in (halves, halves[::-1]):
                cal = Calibration.from_records(setting, [r for r in rs if r["prompt"] in fit], t1)
                measured = float(np.median([r["speedup"] for r in rs if r["prompt"] in held]))
                predicted = predict_speedup(cal, rs[0]["k"], verify)
                out.append(dict(kind=kind, setting=setting, k=rs[0]["k"], predicted=predicted, measured=measured,
                                error=predicted / measured - 1))
    return out
