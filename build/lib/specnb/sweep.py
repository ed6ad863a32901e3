"""The measured sweep of chapter 4: acceptance, cost ratio c and speedup over k, per draft and kind of text.

:func:`run_sweep` runs, for every repeat and prompt, plain greedy and then each
draft at every k, with plain greedy again after each draft's block, so every
speculative run is paired with the two greedy runs around it (a noisy machine
slows both alike). Each run is recorded in full (round counts, acceptance by
draft position, draft and verify time); :func:`summarize` aggregates runs into
one row per (draft, k, kind). The results are a plain dict that
:func:`save_results` writes as JSON with the machine and library versions;
``python -m specnb sweep`` runs it and ``python -m specnb plot`` redraws every
figure from the file without measuring again.

It also measures, on this machine, the forward-time curve T(n) of the target
(for the refined cost model of chapter 5) and c of the hub pairs' shape twins
(random weights: cost only, nothing about acceptance).

Definitions used throughout (per configuration, summed over its runs):

* acceptance rate: accepted / drafted tokens (what the study of the hub pairs reports);
* a: accepted / verified drafts, a draft counting as verified when every draft
  before it in its round was accepted (Leviathan et al.'s per-token acceptance);
* a_i, acceptance by position: P(draft i accepted | drafts 1..i-1 accepted);
* c: draft time per round / (k * T1), T1 the paired greedy runs' time per token. The draft
  time includes a model draft's feed of the whole prompt into its own cache in round 1, and
  a round cut short by the budget or EOS (fewer than k drafted) is still divided by k;
* speedup: greedy time per token / speculative time per token, the target's prefill excluded
  from both (the same work in both loops; a model draft's own prompt feed is not excluded:
  it lands in round 1's draft time);
* the speedup's range: per prompt the median over its repeats, then the lowest and the
  highest of those medians over the configuration's prompts (:attr:`Row.speedup_lo`,
  :attr:`Row.speedup_hi`; no range from a single prompt).

Not covered: sampling mode (chapter 6), batches, and drafts that need training.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from .costmodel import loop_c, naive_speedup, refined_speedup, speedup
from .decode import DecodeResult, greedy, speculative_greedy
from .drafts import draft_from_name
from .env import machine_info
from .kernels import kernels_of
from .prompts import by_kind, encode
from .timing import cost_ratio, forward_time_curve

FORMAT = 1  # bumped when the JSON layout changes
TWIN_NS = (1, 2, 3, 5, 7)  # T(n) of the twin targets: verify of k = 1, 2, 4, 6 drafts


@dataclass
class SweepConfig:
    """What :func:`run_sweep` measures. Full mode is the book's; :meth:`quick` is for tests and CI."""

    drafts: tuple[str, ...] = ("lookup", "exit8", "exit16", "exit24")  # see drafts.draft_from_name
    ks: tuple[int, ...] = (1, 2, 3, 4, 6, 8)  # tokens drafted per round
    kinds: tuple[str, ...] = ("code", "prose", "grounded")  # kinds of text (specnb.prompts)
    prompts_per_kind: int = 2  # the first n prompts of each kind
    max_new_tokens: int = 32  # generated per run
    repeats: int = 3  # timed passes over every configuration
    # Model drafts (early exit) cost up to a target forward per drafted token, so a run of
    # theirs takes several times a prompt-lookup run: fewer prompts and passes (None: as above).
    # One pass: a second one cost 3.6 min of the full book build on the AMD EPYC Zen 4 and only
    # re-measured drafts that lose at every k (chapter 4 asserts a < c for each of their rows).
    model_prompts_per_kind: int | None = 1
    model_repeats: int | None = 1
    curve_repeats: int = 10  # repeats of T(n), n = 1..max(ks)+1
    context_len: int = 64  # cached tokens when T(n) and twin c are measured
    twins: tuple[str, ...] = ("smollm2-360m/135m", "gpt2-large/gpt2")  # hub pairs whose c is measured by twins
    twin_repeats: int = 10  # paired forwards per twin pair

    @classmethod
    def quick(cls) -> "SweepConfig":
        return cls(drafts=("lookup", "exit8", "exit24"), ks=(1, 2, 4, 8), prompts_per_kind=1, max_new_tokens=16,
                   repeats=1, model_prompts_per_kind=None, model_repeats=None, curve_repeats=3, twin_repeats=3)

    def runs_draft(self, name: str, repeat: int, prompt_index: int) -> bool:
        """Whether ``name`` is measured on the ``prompt_index``-th prompt of a kind in pass ``repeat``."""
        if name == "lookup":
            return True
        ppk = self.prompts_per_kind if self.model_prompts_per_kind is None else self.model_prompts_per_kind
        reps = self.repeats if self.model_repeats is None else self.model_repeats
        return repeat < reps and prompt_index < ppk

    def validate(self) -> None:
        if not self.ks or min(self.ks) < 1:
            raise ValueError(f"ks must be integers >= 1, got {self.ks}")
        if self.repeats < 1 or self.prompts_per_kind < 1 or self.max_new_tokens < 2:
            raise ValueError("repeats and prompts_per_kind must be >= 1, max_new_tokens >= 2")
        for kind in self.kinds:
            if len(by_kind(kind)) < self.prompts_per_kind:
                raise ValueError(f"only {len(by_kind(kind))} prompts of kind {kind!r}, "
                                 f"asked for {self.prompts_per_kind}")


def _greedy_per_token(g: DecodeResult) -> float:
    """Seconds per token after the prefill (whose forward also gave the first token)."""
    return (g.wall_time - g.t_prefill) / max(len(g.tokens) - 1, 1)


def pooled_positions(records: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """``(attempts, accepts)``, each ``(K,)``: by draft position (tree: depth), summed over
    :func:`run_record` dicts of any k (shorter records count zero at positions they lack)."""
    K = max((len(r["attempts"]) for r in records), default=0)
    attempts, accepts = np.zeros(K, dtype=np.int64), np.zeros(K, dtype=np.int64)
    for r in records:
        attempts[:len(r["attempts"])] += r["attempts"]
        accepts[:len(r["accepts"])] += r["accepts"]
    return attempts, accepts


def run_record(spec: DecodeResult, k: int) -> dict:
    """One speculative run as plain numbers: counts by draft position and times.

    For a tree run (:mod:`specnb.tree_decode`) a position is a depth: depth i+1 is verified when
    the walk reached depth i and the tree goes that deep; ``drafted`` counts nodes.
    """
    attempts, accepts, drafted_hist = [0] * k, [0] * k, [0] * (k + 1)
    depths = getattr(spec, "depths", None)
    for j, r in enumerate(spec.rounds):
        drafted_hist[r.drafted] += 1
        for i in range(depths[j] if depths is not None else r.drafted):
            # position i+1 is verified iff the i drafts before it were accepted
            if r.accepted >= i:
                attempts[i] += 1
                accepts[i] += r.accepted > i
    return {"tokens": len(spec.tokens), "rounds": len(spec.rounds), "drafted": spec.drafted,
            "accepted": spec.accepted, "bonus_rounds": sum(r.bonus for r in spec.rounds),
            "draft_forwards": spec.draft_forwards, "attempts": attempts, "accepts": accepts,
            "drafted_hist": drafted_hist, "t_draft": spec.t_draft, "t_verify": sum(r.t_target for r in spec.rounds),
            "t_prefill": spec.t_prefill, "wall": spec.wall_time,
            "per_token": (spec.wall_time - spec.t_prefill) / len(spec.tokens),
            **({"walks": [[list(r), list(o)] for r, o in spec.walks]} if hasattr(spec, "walks") else {})}


def run_sweep(model: torch.nn.Module, tokenizer, config: SweepConfig = SweepConfig(), label: str = "",
              progress: bool = True, rollback_mode: str = "exact", drafts: dict | None = None) -> dict:
    """Measure every (draft, k, prompt, repeat) of ``config`` on ``model``; return the results dict.

    Per prompt and repeat: greedy, then for each draft its runs at every k
    followed by greedy again. The draft order rotates and the k order reverses
    between passes, so no configuration always runs first or last.
    ``rollback_mode`` other than ``"exact"`` runs a deliberately broken loop
    (:data:`specnb.decode.ROLLBACKS`): a negative control for the ``identical`` flag.
    ``drafts`` maps names in ``config.drafts`` to ready-made drafts (e.g. a hub
    pair's draft model); other names go through :func:`specnb.drafts.draft_from_name`.
    """
    config.validate()
    started = _dt.datetime.now(_dt.timezone.utc)
    eos = tokenizer.eos_token_id
    prompts = [(kind, i, p) for kind in config.kinds for i, p in enumerate(by_kind(kind)[: config.prompts_per_kind])]
    drafts = {name: (drafts or {}).get(name) or draft_from_name(model, name) for name in config.drafts}
    ns = list(range(1, max(config.ks) + 2))
    curve = forward_time_curve(model, ns=ns, context_len=config.context_len, repeats=config.curve_repeats,
                               progress=progress)
    greedy(model, encode(tokenizer, prompts[0][2]), 4, eos)  # warm-up
    runs: list[dict] = []
    total = sum(config.runs_draft(name, rep, index) for rep in range(config.repeats) for _, index, _ in prompts
                for name in drafts) * len(config.ks)
    bar = tqdm(total=total, desc="sweep", disable=not progress)
    for rep in range(config.repeats):
        for pi, (kind, index, prompt) in enumerate(prompts):
            ids = encode(tokenizer, prompt)
            before = greedy(model, ids, config.max_new_tokens, eos)
            names = [name for name in drafts if config.runs_draft(name, rep, index)]
            shift = (rep + pi) % len(names)
            for name in names[shift:] + names[:shift]:
                ks = list(config.ks) if (rep + pi) % 2 == 0 else list(config.ks)[::-1]
                block = []
                for k in ks:
                    bar.set_postfix_str(f"{kind} {name} k={k}")
                    spec = speculative_greedy(model, drafts[name], ids, k, config.max_new_tokens, eos,
                                              rollback_mode=rollback_mode)
                    block.append((k, spec))
                    bar.update()
                after = greedy(model, ids, config.max_new_tokens, eos)
                t1 = (_greedy_per_token(before) + _greedy_per_token(after)) / 2
                for k, spec in block:
                    rec = {"draft": name, "draft_label": drafts[name].name, "k": k, "kind": kind,
                           "prompt": index, "repeat": rep, "identical": spec.tokens == before.tokens,
                           "greedy_per_token": t1, **run_record(spec, k)}
                    rec["speedup"] = t1 / rec["per_token"]
                    rec["c"] = loop_c(rec["t_draft"], rec["rounds"], k, t1)
                    runs.append(rec)
                before = after
    bar.close()
    twins = {}
    for pair in config.twins:
        from .models import load_twin_pair

        tw_target, tw_draft = load_twin_pair(pair)
        twins[pair] = {"target": tw_target.name, "draft": tw_draft.name,
                       "kernels": {"target": kernels_of(tw_target.model).label,
                                   "draft": kernels_of(tw_draft.model).label},
                       **cost_ratio(tw_target.model, tw_draft.model, context_len=config.context_len,
                                    repeats=config.twin_repeats, progress=progress)}
        twins[pair].pop("machine")
        tw_curve = forward_time_curve(tw_target.model, ns=TWIN_NS, context_len=config.context_len,
                                      repeats=config.twin_repeats, warmup=1, progress=progress)
        twins[pair]["target_curve"] = {str(n): tw_curve["median"][n] for n in TWIN_NS}
        del tw_target, tw_draft
    curve = {key: ({str(n): v for n, v in curve[key].items()} if isinstance(curve[key], dict) else curve[key])
             for key in ("ns", "context_len", "median", "q1", "q3", "min")}
    return {"format": FORMAT, "created": started.isoformat(timespec="seconds"),
            "elapsed_s": (_dt.datetime.now(_dt.timezone.utc) - started).total_seconds(),
            "model": label, "config": asdict(config), "machine": machine_info(model), "curve": curve,
            "runs": runs, "twins": twins}


def save_results(results: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1))
    return path


def load_results(path: str | Path) -> dict:
    """Read a results file written by :func:`save_results` (``python -m specnb sweep``)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no sweep results there; run `python -m specnb sweep --out {path}` first")
    results = json.loads(path.read_text())
    if results.get("format") != FORMAT:
        raise ValueError(f"{path}: results format {results.get('format')!r}, this specnb reads {FORMAT}; "
                         "run the sweep again")
    return results


def verify_costs(results: dict) -> dict[int, float]:
    """n -> T(n)/T(1) from the results' measured curve (medians)."""
    med = {int(n): t for n, t in results["curve"]["median"].items()}
    return {n: t / med[1] for n, t in med.items()}


@dataclass
class Row:
    """One configuration (draft, k, kind; kind "all" pools the kinds), summed over its runs."""

    draft: str
    draft_label: str
    k: int
    kind: str
    runs: int
    identical: int  # runs whose tokens equal plain greedy's
    acceptance_rate: float  # accepted / drafted
    a: float  # accepted / verified drafts
    a_pos: list[float]  # a_i: P(draft i accepted | drafts before it accepted); nan where never verified
    survival: list[float]  # s_i: fraction of rounds with at least i drafts accepted
    tokens_per_round: float
    c: float  # median over runs
    verify_cost: float  # mean over rounds of T(m+1)/T(1), m = tokens drafted that round (measured curve)
    speedup: float  # pooled: greedy time for these tokens / speculative time
    speedup_q1: float  # quartiles of the per-run speedups (runs are repeats nested in prompts; the book
    speedup_q3: float  # shows speedup_lo/hi instead)
    repeat_spread: float  # median over prompts of (max - min) / median of the speedup across repeats
    predicted: dict = field(default_factory=dict)  # model name -> predicted speedup
    drafted_hist: list = field(default_factory=list)  # drafted_hist[m]: rounds that drafted m tokens
    # per prompt the median speedup over its repeats; lo/hi: the lowest and highest of those medians
    speedup_lo: float = float("nan")
    speedup_hi: float = float("nan")
    n_prompts: int = 0  # prompts the configuration ran on (no range where 1)


def _nanratio(num, den) -> list[float]:
    return [float(n / d) if d else float("nan") for n, d in zip(num, den)]


def summarize(results: dict, pool_kinds: bool = True) -> list[Row]:
    """Aggregate the runs into rows, with each cost model's prediction (chapter 5)."""
    verify = verify_costs(results)
    groups: dict[tuple, list[dict]] = {}
    for run in results["runs"]:
        groups.setdefault((run["draft"], run["k"], run["kind"]), []).append(run)
        if pool_kinds:
            groups.setdefault((run["draft"], run["k"], "all"), []).append(run)
    rows = []
    for (draft, k, kind), runs in groups.items():
        tot = {key: sum(r[key] for r in runs) for key in ("drafted", "accepted", "rounds", "tokens")}
        attempts, accepts = pooled_positions(runs)
        hist = np.sum([r["drafted_hist"] for r in runs], axis=0)
        speedups = [r["speedup"] for r in runs]
        by_prompt: dict[tuple, list[float]] = {}
        for r in runs:
            by_prompt.setdefault((r["kind"], r["prompt"]), []).append(r["speedup"])
        spreads = [(max(v) - min(v)) / float(np.median(v)) for v in by_prompt.values() if len(v) > 1]
        a = float(tot["accepted"] / attempts.sum()) if attempts.sum() else float("nan")
        c = float(np.median([r["c"] for r in runs]))
        verify_cost = float(sum(h * verify[m + 1] for m, h in enumerate(hist)) / hist.sum())
        survival = (accepts / tot["rounds"]).tolist()
        row = Row(draft, runs[0]["draft_label"], k, kind, len(runs), sum(r["identical"] for r in runs),
                  tot["accepted"] / tot["drafted"] if tot["drafted"] else float("nan"), a,
                  _nanratio(accepts, attempts), survival, tot["tokens"] / tot["rounds"], c, verify_cost,
                  sum(r["greedy_per_token"] * r["tokens"] for r in runs) / sum(r["per_token"] * r["tokens"] for r in runs),
                  float(np.percentile(speedups, 25)), float(np.percentile(speedups, 75)),
                  float(np.median(spreads)) if spreads else float("nan"))
        row.drafted_hist = hist.astype(int).tolist()
        medians = [float(np.median(v)) for v in by_prompt.values()]
        row.speedup_lo, row.speedup_hi, row.n_prompts = min(medians), max(medians), len(medians)
        row.predicted = {
            "simple": float(speedup(a, c, k)),
            "refined": refined_speedup(survival, c, k, verify_cost),
            "naive": float(naive_speedup(a, k, 1 / c)) if c > 0 else float("inf"),
        }
        rows.append(row)
    rows.sort(key=lambda r: (r.draft, r.kind, r.k))
    return rows


def _hypergeom_pmf(x: int, n1: int, n2: int, m: int) -> float:
    return math.comb(n1, x) * math.comb(n2, m - x) / math.comb(n1 + n2, m)


def position_test(runs: list[dict], draft: str, k: int) -> dict:
    """Is acceptance at draft positions 2..k different from position 1? Counts pooled over ``runs``
    of ``draft`` at ``k`` (all kinds): a_1 = accepts / attempts at position 1, ``later`` = accepts /
    attempts summed over positions 2..k, and Fisher's exact test of the 2x2 table (accepted,
    rejected) x (position 1, positions 2..k), two-sided (twice the smaller one-sided tail, at
    most 1). ``p_value`` is nan when either group was never verified."""
    sel = [r for r in runs if r["draft"] == draft and r["k"] == k]
    attempts, accepts = pooled_positions(sel)
    n1, x1 = int(attempts[0]), int(accepts[0])
    n2, x2 = int(attempts[1:].sum()), int(accepts[1:].sum())
    out = {"a1": x1 / n1 if n1 else float("nan"), "later": x2 / n2 if n2 else float("nan"),
           "n1": n1, "x1": x1, "n_later": n2, "x_later": x2, "p_value": float("nan")}
    if n1 and n2:
        m = x1 + x2  # accepted in all; under the null, x1 is hypergeometric
        lo, hi = max(0, m - n2), min(n1, m)
        pmf = {x: _hypergeom_pmf(x, n1, n2, m) for x in range(lo, hi + 1)}
        p_low = sum(v for x, v in pmf.items() if x <= x1)
        p_high = sum(v for x, v in pmf.items() if x >= x1)
        out["p_value"] = float(min(1.0, 2 * min(p_low, p_high)))
    return out


def calibration_prompts(config: SweepConfig, kind: str, n: int = 1) -> list:
    """``n`` prompts of ``kind`` that no run of ``config`` uses (the sweep takes the first ones of each kind)."""
    used = max(config.prompts_per_kind, config.model_prompts_per_kind or 0)
    prompts = by_kind(kind)[used: used + n]
    if len(prompts) < n:
        raise ValueError(f"only {len(by_kind(kind)) - used} prompts of kind {kind!r} are left after the "
                         f"sweep's {used}; ask for fewer calibration prompts")
    return prompts


def calibrate_sweep(model: torch.nn.Module, tokenizer, results: dict, n_prompts: int = 1, c_repeats: int = 5,
                    progress: bool = True, drafts: dict | None = None) -> dict[tuple[str, str], "Calibration"]:
    """Chapter 5's out-of-sample calibration: (draft, kind) -> :class:`specnb.calibration.Calibration`.

    For every draft and kind of the sweep in ``results``: replay the draft at
    each of its k on ``n_prompts`` prompts of that kind which the sweep never
    ran (:func:`calibration_prompts`); a model draft's c comes from paired
    1-token forwards (:func:`specnb.timing.cost_ratio`), T(1) from the results'
    forward-time curve. Costs about one greedy run per calibration prompt.
    ``drafts`` as in :func:`run_sweep`.
    """
    from .calibration import calibrate

    config = SweepConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in results["config"].items()})
    t1 = results["curve"]["median"]["1"]
    cals = {}
    jobs = [(name, kind) for name in config.drafts for kind in config.kinds]
    drafts = {name: (drafts or {}).get(name) or draft_from_name(model, name) for name in config.drafts}
    cs = {name: cost_ratio(model, d.vocab_model(), context_len=config.context_len, repeats=c_repeats,
                           progress=False)["c"] for name, d in drafts.items() if d.vocab_model() is not None}
    ids = {kind: [encode(tokenizer, p) for p in calibration_prompts(config, kind, n_prompts)] for kind in config.kinds}
    texts = {kind: [greedy(model, x, config.max_new_tokens, tokenizer.eos_token_id).tokens for x in ids[kind]]
             for kind in config.kinds}  # the target's greedy text, once per prompt for all drafts
    for name, kind in tqdm(jobs, desc="calibration", disable=not progress):
        cals[name, kind] = calibrate(model, tokenizer, drafts[name], ids[kind], config.ks, config.max_new_tokens, t1,
                                     cs.get(name), greedy_tokens=texts[kind])
    return cals


def predict_out_of_sample(rows: list[Row], cals: dict, verify: dict[int, float],
                          key: str = "refined, out of sample", simple_key: str = "simple, out of sample") -> None:
    """Set ``row.predicted[key]`` (the refined model) and ``row.predicted[simple_key]`` (the simple model,
    :func:`specnb.calibration.simple_prediction`) for every row, both from the calibration of its (draft, kind)."""
    from .calibration import predict_speedup, simple_prediction

    for r in rows:
        r.predicted[key] = predict_speedup(cals[r.draft, r.kind], r.k, verify)
        r.predicted[simple_key] = simple_prediction(cals[r.draft, r.kind], r.k)


def prediction_errors(rows: list[Row], models=("simple", "refined", "naive")) -> dict[str, dict]:
    """Per model: relative errors (predicted / measured - 1) over rows, their median |error| and max |error|."""
    out = {}
    for m in models:
        errs = np.array([r.predicted[m] / r.speedup - 1 for r in rows])
        out[m] = {"errors": errs.tolist(), "median_abs": float(np.median(np.abs(errs))),
                  "mean_abs": float(np.mean(np.abs(errs))), "max_abs": float(np.max(np.abs(errs))),
                  "within_10pct": int(np.sum(np.abs(errs) < 0.10)), "rows": len(errs)}
    return out


def errors_by(rows: list[Row], model: str, key) -> dict:
    """Median |predicted / measured - 1| of ``model`` per group of rows, ``key(row)`` naming the group."""
    groups: dict = {}
    for r in rows:
        groups.setdefault(key(r), []).append(abs(r.predicted[model] / r.speedup - 1))
    return {name: float(np.median(v)) for name, v in groups.items()}


def rows_markdown(rows: list[Row], columns=("acceptance_rate", "a", "tokens_per_round", "c", "speedup")) -> str:
    """A markdown table of rows (the book renders it; also readable as text). The speedup column is the
    pooled speedup with, in brackets, the range over the configuration's prompts of each prompt's
    median speedup (none from a single prompt)."""
    from .booktext import table

    def fmt(r: Row, col: str) -> str:
        v = getattr(r, col)
        return ((f"{v:.2f}x ({r.speedup_lo:.2f}-{r.speedup_hi:.2f})" if r.n_prompts > 1 else f"{v:.2f}x")
                if col == "speedup"
                else f"{v:.3f}" if col == "c" else f"{v:.2f}")

    return table(["draft", "kind", "k"] + [c.replace("_", " ") for c in columns] + ["runs identical"],
                 [[r.draft_label, r.kind, r.k] + [fmt(r, c) for c in columns] + [f"{r.identical}/{r.runs}"]
                  for r in rows])


def book_results_path(quick: bool) -> Path:
    """Where chapter 4 writes its sweep and chapter 5 reads it: ``<specnb cache>/results/sweep-{quick,full}.json``."""
    from .models import cache_dir

    return cache_dir() / "results" / f"sweep-{'quick' if quick else 'full'}.json"


def reusable(results: dict, config: SweepConfig, max_age_hours: float = 12.0, model=None) -> str | None:
    """Why ``results`` may not stand in for a new sweep of ``config`` on this machine (None: it may).

    Reuse needs the same configuration, the same machine and library versions,
    and a measurement younger than ``max_age_hours``.
    """
    if results.get("format") != FORMAT:
        return "older results format"
    if results["config"] != json.loads(json.dumps(asdict(config))):
        return "different sweep configuration"
    here = machine_info(model)  # the kernels of the model that would rerun the sweep
    for key in ("cpu", "cores", "torch_threads", "gpu", "torch", "transformers", "kernels"):
        if results["machine"].get(key) != here.get(key):
            return f"measured with a different {key} ({results['machine'].get(key)} vs {here.get(key)})"
    age = _dt.datetime.now(_dt.timezone.utc) - _dt.datetime.fromisoformat(results["created"])
    if age.total_seconds() > max_age_hours * 3600:
        return f"measured {age.total_seconds() / 3600:.1f} h ago"
    return None


def reuse_or_run(model: torch.nn.Module, tokenizer, config: SweepConfig, path: str | Path, label: str = "",
                 max_age_hours: float = 12.0, progress: bool = True) -> tuple[dict, str]:
    """Read ``path`` if :func:`reusable` allows, else run the sweep and write it there.

    Returns ``(results, how)``, ``how`` saying which happened and why (chapter 5 prints it).
    """
    path = Path(path)
    if path.exists():
        try:
            results = load_results(path)
            why = reusable(results, config, max_age_hours, model)
        except (ValueError, KeyError) as err:
            why = str(err)
        if why is None:
            return results, f"reused {path} (measured {results['created']} on this machine)"
    else:
        why = "no results file yet"
    results = run_sweep(model, tokenizer, config, label=label, progress=progress)
    save_results(results, path)
    return results, f"measured now ({why}); wrote {path}"
