"""The study's real model pairs, measured on this machine when their weights can be had (chapters 4 and 5).

SmolLM2-360M/135M, gpt2-large/gpt2 and gpt2-large/distilgpt2 (:data:`specnb.models.PAIRS`)
need the Hugging Face hub once, or a local cache that holds them (as on Colab
after a first run). :func:`measure_hub_pairs` loads each pair through
:func:`specnb.models.load_pair`; a pair that cannot be loaded is *skipped* with
the loader's reason, never replaced by something else. A loaded pair goes
through chapter 4's sweep (:func:`specnb.sweep.run_sweep`, its draft model as the
one draft) for a, c and speedup, and through chapter 5's calibration on other
prompts (:func:`specnb.sweep.calibrate_sweep`) for an out-of-sample prediction.

Not covered: shape twins (cost only, :func:`specnb.models.load_twin_pair`), and
the study's own machine: these figures are this machine's.
"""
from __future__ import annotations

from .drafts import ModelDraft
from .models import ModelUnavailableError, load_pair
from .sweep import SweepConfig, calibrate_sweep, run_sweep, summarize, verify_costs

HUB_PAIRS = ("smollm2-360m/135m", "gpt2-large/gpt2", "gpt2-large/distilgpt2")


def hub_config(quick: bool) -> SweepConfig:
    """The sweep a hub pair gets: the study's k = 1, 2, 4, 6, one prompt per kind, no twins."""
    return SweepConfig(drafts=("hub",), ks=(1, 2, 4, 6), prompts_per_kind=1, max_new_tokens=16 if quick else 32,
                       repeats=1, model_prompts_per_kind=None, model_repeats=None, curve_repeats=3 if quick else 10,
                       twins=())


def measure_hub_pairs(pairs=HUB_PAIRS, quick: bool = True, progress: bool = True,
                      config: SweepConfig | None = None) -> dict[str, dict]:
    """pair -> ``{"skipped": reason}``, or ``{"results": sweep results, "rows": [Row, ...] (kinds pooled
    into "all" included), "calibration": {(draft, kind): Calibration}}``.

    Each row's ``predicted["refined, out of sample"]`` is set from the calibration
    (prompts the sweep did not use), as in chapter 5.
    """
    from .calibration import predict_speedup

    out: dict[str, dict] = {}
    config = config or hub_config(quick)
    for name in pairs:
        try:
            target, draft = load_pair(name)
        except ModelUnavailableError as err:
            out[name] = {"skipped": str(err)}
            continue
        draft_obj = ModelDraft(draft.model, name=f"{draft.name} drafting for {target.name}")
        results = run_sweep(target.model, target.tokenizer, config, label=name, progress=progress,
                            drafts={"hub": draft_obj})
        cals = calibrate_sweep(target.model, target.tokenizer, results, progress=progress,
                               drafts={"hub": draft_obj})
        verify = verify_costs(results)
        rows = summarize(results)
        for r in rows:
            if r.kind != "all":
                r.predicted["refined, out of sample"] = predict_speedup(cals[r.draft, r.kind], r.k, verify)
        out[name] = {"results": results, "rows": rows, "calibration": cals}
        del target, draft
    return out


def skipped_note(hub: dict[str, dict]) -> str:
    """One sentence per skipped pair, for the book."""
    return " ".join(f"{name}: skipped ({entry['skipped']})" for name, entry in hub.items() if "skipped" in entry)
