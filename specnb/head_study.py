"""Chapter 7's studies of the head's recipe: the ablation table (one lever at a time) and the learning curve.

Every run trains on the same cached data (``head_data.build_data``), keeps the same validation split
for early stopping, and is judged on the same held-out continuations: held-out a_1 (agreement at
draft position 1) and a_2|1 (position 2 given a right position 1), overall and per kind of text.

* :func:`ablation`: the base recipe, then each lever changed alone (``LEVERS``), then the best
  combination of the levers that helped; on ``fraction`` of the training data so that the table
  fits one sitting (the fraction is recorded with it).
* :func:`learning_curve`: the chosen recipe at several shares of the training data (nested subsets).

``specnb head-study`` runs them and writes the results into a head's card (``draft_head.json``),
where chapter 7 reads them.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, replace
from pathlib import Path

from .head_data import FLOAT32_PRECISION, for_layers
from .train_head import TrainConfig, evaluate_by_kind, recorded_recipe, train_on, validation_gap_rows

# The ablation's base: the recipe before the study (soft labels, one pass, learning rate 1e-3). The
# committed head's recipe (``TrainConfig()``) is this base plus the levers the study's combined row
# chose at 1/8 of the data (hard labels, depth 2, lr 3e-3); chapter 7 asserts that it is.
ABLATION_BASE: dict = {"soft_labels": True, "depth": 1, "lr": 1e-3}

# Each lever as a change to the ablation's base, with the words the table shows.
LEVERS: dict[str, tuple[str, dict]] = {
    "hard labels": ("cross-entropy against the target's argmax only (base: its softmax over V')",
                    {"soft_labels": False}),
    "EAGLE-1 loss": ("1.0 x feature regression + 0.1 x cross-entropy, uniform noise 0.1 on input features",
                     {"reg_weight": 1.0, "ce_weight": 0.1, "noise": 0.1}),
    "depth 2": ("training-time test: 2 chained passes, weights 1, 0.8", {"depth": 2}),
    "depth 3": ("training-time test: 3 chained passes, weights 1, 0.8, 0.64", {"depth": 3}),
    "lr 3e-3": ("learning rate 3e-3 (base 1e-3)", {"lr": 3e-3}),
    "lr 3e-4": ("learning rate 3e-4 (base 1e-3)", {"lr": 3e-4}),
    "weight decay 0.01": ("AdamW weight decay 0.01 (base 0)", {"weight_decay": 0.01}),
    "input norms": ("separate RMS norms on the embedding and the feature before fc (EAGLE-3)", {"input_norms": True}),
    "V' 4096": ("reduced vocabulary of 4,096 tokens (base 8,192)", {"draft_vocab": 4096}),
    "V' 16384": ("reduced vocabulary of 16,384 tokens (base 8,192)", {"draft_vocab": 16384}),
}


# Levers on the committed recipe itself (``TrainConfig()``), on one smaller data set: which change to make
# next, with what it costs. "seed 1" is the same recipe with another seed (initialisation, window order,
# validation split): a change smaller than the seed's is not told apart from noise.
RECIPE_LEVERS: dict[str, tuple[str, dict]] = {
    "seed 1": ("the same recipe with seed 1 (base: seed 0): the noise floor of one comparison", {"seed": 1}),
    "4 epochs": ("4 passes over the data (base 2): twice the training steps and time", {"epochs": 4.0}),
    "batch 1024": ("1,024 tokens per step (base 2,048): twice the updates for the same compute", {"batch_tokens": 1024}),
    "lr 6e-3": ("learning rate 6e-3 (base 3e-3)", {"lr": 6e-3}),
    "fc identity": ("fc starts as [0 | I]: the layer first sees the target's own feature (base: random fc)",
                    {"init_fc_identity": True}),
}


def recipe_levers(target, data: dict, base: TrainConfig, levers: list[str] | None = None,
                  progress: bool = True) -> dict:
    """The committed recipe ``base`` on ``data``, then each of :data:`RECIPE_LEVERS` changed alone.

    Returns ``{"base": config, "rows": [...], "noise": |a_1(seed 1) - a_1(base)|}`` (``noise`` None
    without the seed row); each row as :func:`ablation`'s, with its training seconds.
    """
    from tqdm.auto import tqdm

    names = levers or list(RECIPE_LEVERS)
    unknown = [n for n in names if n not in RECIPE_LEVERS]
    if unknown:
        raise ValueError(f"unknown recipe levers {unknown}; choose from {list(RECIPE_LEVERS)}")
    rows = [_row("committed recipe", "the committed head's recipe (TrainConfig()) on this data", base, target, data,
                 progress)]
    for name in tqdm(names, desc="recipe levers", unit="run", disable=not progress):
        what, change = RECIPE_LEVERS[name]
        rows.append(_row(name, what, replace(base, **change), target, data, progress))
    seed = next((r for r in rows if r["name"] == "seed 1"), None)
    return {"base": asdict(base), "rows": rows,
            "noise": None if seed is None else abs(seed["a1"] - rows[0]["a1"])}


def recipe_levers_markdown(study: dict, kinds=("prose", "code")) -> str:
    """The recipe-lever study as a markdown table: a_1, its change against the committed recipe, a_2|1,
    a_1 per kind, steps and training-and-evaluation seconds."""
    from .booktext import table

    base = study["rows"][0]["a1"]
    rows = [[r["name"], r["what"], f"{r['a1']:.3f}", "" if i == 0 else f"{r['a1'] - base:+.3f}",
             "-" if r["a2_given_1"] is None else f"{r['a2_given_1']:.3f}"]
            + [f"{r['by_kind'][k]['a1']:.3f}" if k in r["by_kind"] else "-" for k in kinds]
            + [f"{r['steps']:,}", f"{r['seconds']:.0f}"] for i, r in enumerate(study["rows"])]
    return table(["recipe", "change", "a_1", "vs committed", "a_2|1"] + [f"a_1 {k}" for k in kinds]
                 + ["steps", "seconds"], rows)


def _result(name: str, what: str, overall: dict, by_kind: dict, sizes: dict, draft_vocab: int, kept_step: int,
            steps: int, validation: list[dict], seconds: float) -> dict:
    """One row of a study: held-out a_1, a_2|1 and chains (overall and by kind), data and training sizes."""
    return {"name": name, "what": what, "a1": overall["agree"][0], "a2_given_1": overall["conditional"][1],
            "chain": overall["chain"], "by_kind": {k: {"a1": v["agree"][0], "a2_given_1": v["conditional"][1]}
                                                   for k, v in by_kind.items()},
            "training_tokens": sizes["training_tokens"], "coverage": sizes["vocab_coverage_held_out"],
            "draft_vocab": draft_vocab, "kept_step": kept_step, "steps": steps,
            "validation_best_a1": max((v["a1"] for v in validation), default=None), "seconds": round(seconds, 1)}


def _row(name: str, what: str, cfg: TrainConfig, target, data: dict, progress: bool) -> dict:
    """Train ``cfg`` on ``data`` (cut to its feature layers) and evaluate it on the held-out continuations."""
    t0 = time.perf_counter()
    data = for_layers(data, cfg.feature_layers)
    head, log, sizes = train_on(target, data, cfg, progress)
    overall, by_kind = evaluate_by_kind(head, data["held_out"], cfg)
    return _result(name, what, overall, by_kind, sizes, len(head.vocab_ids), log["kept_step"], log["steps"],
                   log["validation"], time.perf_counter() - t0)


def ablation(target, data: dict, base: TrainConfig, fraction: float, levers: list[str] | None = None,
             progress: bool = True) -> dict:
    """``base`` with :data:`ABLATION_BASE`, each lever alone, and the levers that beat it combined; all at ``fraction``.

    The combined row names its levers (``"levers"``), one per group (the best depth, lr, V').
    """
    from tqdm.auto import tqdm

    base = replace(base, **ABLATION_BASE, train_fraction=fraction)
    names = levers or list(LEVERS)
    rows = [_row("base", base_words(asdict(base)), base, target, data, progress)]
    for name in tqdm(names, desc="ablation", unit="run", disable=not progress):
        what, change = LEVERS[name]
        rows.append(_row(name, what, replace(base, **change), target, data, progress))
    helped = [r["name"] for r in rows[1:] if r["a1"] > rows[0]["a1"] + 0.005]
    # one lever per group (depth, lr, V'): the best of each
    chosen: dict[str, str] = {}
    for name in helped:
        group = name.split()[0]
        if group not in chosen or next(r for r in rows if r["name"] == name)["a1"] > \
                next(r for r in rows if r["name"] == chosen[group])["a1"]:
            chosen[group] = name
    if len(chosen) > 1:
        change = {}
        for name in chosen.values():
            change.update(LEVERS[name][1])
        rows.append(_row("combined", "the levers that beat the base, together: " + ", ".join(chosen.values()),
                         replace(base, **change), target, data, progress))
        rows[-1]["levers"] = list(chosen.values())
    return {"fraction": fraction, "base": asdict(base), "rows": rows}


def learning_curve(target, data: dict, cfg: TrainConfig, fractions=(0.125, 0.25, 0.5, 1.0),
                   progress: bool = True, full: dict | None = None) -> dict:
    """Held-out a_1 and a_2|1 against training tokens: ``cfg`` at each share of the training documents.

    ``full``: the card of a head trained with exactly ``cfg`` on all the data (``make draft``); its
    own held-out figures are the share-1 point instead of training the same head again.
    """
    rows = []
    for f in fractions:
        if f == 1.0 and full is not None:
            want = json.loads(json.dumps({**asdict(cfg), "train_fraction": 1.0}))  # tuples as the card's lists
            recorded = recorded_recipe(full["config"]["train"])  # fields newer than the card: at defaults
            if any(recorded[k] != v for k, v in want.items()):
                raise ValueError("the card's head was trained with another recipe than this learning curve's")
            rows.append(_result("1", "all the training documents (the committed head itself)", full["held_out"],
                                full["held_out_by_kind"], full["data"], full["config"]["head"]["draft_vocab"],
                                full["kept_step"], full["steps"], full["validation_curve"],
                                full["seconds"]["training"]))
        else:
            rows.append(_row(f"{f:g}", f"{f:g} of the training documents", replace(cfg, train_fraction=f), target,
                             data, progress))
    return {"recipe": asdict(cfg), "rows": rows}


def compare_layers(target, data: dict, cfg: TrainConfig, layer_sets: list[tuple[int, ...]],
                   progress: bool = True) -> list[dict]:
    """``cfg`` reading each of ``layer_sets`` (``()``: the last hidden state only) on the same ``data``,
    whose features hold every layer asked for (built with their union as ``feature_layers``)."""
    return [_row("last hidden state only" if not layers else "fused layers " + ", ".join(map(str, layers)) + " + last",
                 f"target layers {list(layers)} and the last hidden state, fused (EAGLE-3)" if layers else
                 "the last hidden state only", replace(cfg, feature_layers=tuple(layers)), target, data, progress)
            for layers in layer_sets]


def compare_feature_dtypes(target, tokenizer, cfg: TrainConfig, folder: Path, dtypes=("float32", "bfloat16"),
                           progress: bool = True) -> dict:
    """``cfg`` trained on the same ids and text with features and labels from each of ``dtypes``'
    teacher-forced passes, judged on the same float32 held-out continuations: what the faster pass
    costs in agreement, beside its label agreement with the float32 target and its seconds."""
    from dataclasses import replace

    from .head_data import build_data

    rows = []
    for name in dtypes:
        c = replace(cfg, feature_dtype=name)
        data, seconds = build_data(target, tokenizer, c, folder)
        row = _row(f"{name} features", f"features and labels from a {name} teacher-forced pass", c, target, data,
                   progress)
        row["feature_seconds"] = round(seconds["generated"] + seconds["teacher"], 1)
        row["data_reused"] = data["reused"]
        row["feature_precision"] = data.get("feature_precision", FLOAT32_PRECISION)
        rows.append(row)
    return {"recipe": asdict(cfg), "rows": rows}


def validation_gap(target, tokenizer, head, card: dict) -> dict:
    """The committed head on its own validation split, by kind of text, beside its held-out figures.

    The validation conversations are answers to training prompts that training never saw; their prompts
    share templates and subjects with training prompts. The held-out prompts are phrased and chosen
    apart from them. The gap between the two, per kind, separates generalising to new answers from
    generalising to new ways of asking. The split is rebuilt as ``train_on`` draws it: the committed ids
    (template conversations, then open and described ones: :func:`specnb.head_data.training_conversations`), less those
    sharing an 8-gram with the held-out data, then ``split_validation`` with the card's fraction and seed; only those conversations get float32 features (a minute, not the whole data).
    """
    from .head_data import _load_seqs, data_key, features, shared_ngrams, template_ngrams, training_conversations
    from .head_io import head_dir, target_fingerprint
    from .train_head import TrainConfig, generate, held_out_set, split_validation

    tc = card["config"]["train"]
    cfg = TrainConfig(**{"open_conversations": 0, "described_conversations": 0,  # cards from before them lack them
                         **{k: tuple(v) if k == "feature_layers" else v for k, v in tc.items()
                            if k in TrainConfig.__dataclass_fields__}})
    ids = training_conversations(cfg)
    path = head_dir() / "data" / target_fingerprint(target) / f"{data_key(cfg, 'held_out')}.safetensors"
    held = _load_seqs(path) if path.exists() else generate(target, tokenizer, held_out_set(cfg), cfg.new_tokens, 16,
                                                            "held-out data", cfg.feature_layers)
    held_docs = [s.tokens.tolist() + [int(s.labels[-1])] for s in held]
    bad = set(shared_ngrams(ids["ids"], held_docs, template_ngrams(tokenizer), tokenizer.all_special_ids))
    kept = [i for i in range(len(ids["ids"])) if i not in bad]
    val = split_validation(kept, cfg.val_fraction, cfg.seed)[1]   # indices into the committed ids
    assert len(val) == card["data"]["validation_sequences"], "the validation split must be the one training used"
    seqs = features(target, [ids["ids"][i] for i in val], "generated", [ids["prompt_lens"][i] for i in val],
                    desc="features of the validation conversations", layers=cfg.feature_layers)
    kinds = [ids["kinds"][i] for i in val]
    return validation_gap_rows(head, seqs, kinds, card["held_out"]["agree"][0], card["held_out_by_kind"])


def require_studies(card: dict) -> dict:
    """``card`` itself when it holds every recipe study chapter 7 shows; otherwise a clear error naming
    what is missing and the command that measures it."""
    from .head_io import HeadUnavailableError
    from .train_head import STUDY_KEYS

    missing = [k for k in (*STUDY_KEYS, "validation_gap") if k not in card]
    if missing:
        flags = {"ablation": "--ablation", "learning_curve": "--learning-curve", "fused_layers": "--compare-layers 2 15 27",
                 "recipe_levers": "--recipe-levers", "feature_precision": "--feature-precision",
                 "validation_gap": "--validation-gap"}
        raise HeadUnavailableError(
            f"this head's card has no {', '.join(missing)} (a head trained with a recipe other than the packaged "
            f"one's does not inherit its studies): run `specnb head-study {' '.join(flags[k] for k in missing)}` "
            "to measure them for this recipe (hours on 2 cores), or remove the head from the specnb cache to "
            "read the packaged one")
    return card


def write_into_card(folder: Path, key: str, value: dict) -> Path:
    """Add ``value`` under ``key`` to the card ``folder/draft_head.json`` (the rest unchanged)."""
    path = Path(folder) / "draft_head.json"
    if not path.exists():
        raise FileNotFoundError(f"no head card at {path} to record {key!r} in: train a head there first "
                                "(`make draft`), or pass --into a folder that holds one")
    card = json.loads(path.read_text())
    card[key] = value
    path.write_text(json.dumps(card, indent=1) + "\n")
    return path


CARRIED_STUDIES = ("ablation", "fused_layers", "recipe_levers", "feature_precision", "data_mix")  # each records its recipe and data

DATA_MIX_KEYS = ("max_prompts", "open_conversations", "described_conversations", "teacher_chars")  # what data, not how


def _mix_row(card: dict, name: str) -> dict:
    """One head, trained by ``train-draft`` on all its data, as a row of :func:`data_mix`."""
    tc = card["config"]["train"]
    row = _result(name, "a head trained by `specnb train-draft` on all of its data", card["held_out"],
                  card["held_out_by_kind"], card["data"], card["config"]["head"]["draft_vocab"], card["kept_step"],
                  card["steps"], card["validation_curve"], card["seconds"]["training"])
    row["data"] = {k: tc.get(k, 0) for k in DATA_MIX_KEYS}
    row["positions"] = card["held_out"].get("positions")   # the held-out positions scored (the same set for both)
    row["make_draft_seconds"] = round(sum(card["seconds"].values()), 1)   # every stage, features included
    row["generated_by_kind"] = card["data"].get("generated_by_kind")
    row["created"], row["machine"] = card["created"], card["machine"]
    return row


def data_mix(committed: dict, other: dict) -> dict:
    """Two heads trained on all of their data with the same recipe and different data mixes (the TrainConfig
    fields of :data:`DATA_MIX_KEYS`), side by side on the same held-out prompts: rows ``committed`` and
    ``other``, and the fields that differ. A clear error when anything but the data differs."""
    a, b = committed["config"]["train"], other["config"]["train"]
    how = sorted(k for k in set(a) | set(b) if k not in DATA_MIX_KEYS and a.get(k) != b.get(k))
    if how:
        raise ValueError(f"the two heads differ in how they were trained ({', '.join(how)}), not only in their "
                         "data: a data-mix study compares data mixes under one recipe")
    differs = [k for k in DATA_MIX_KEYS if a.get(k, 0) != b.get(k, 0)]
    if not differs:
        raise ValueError("the two heads were trained on the same data mix: nothing to compare")
    if committed["target_fingerprint"] != other["target_fingerprint"]:
        raise ValueError("the two heads were trained for different targets")
    return {"differs": differs, "rows": [_mix_row(committed, "committed"), _mix_row(other, "other")]}


def carry_recipe_studies(folder: Path, source: Path) -> list[str]:
    """Copy into the card in ``folder`` the studies of the card ``source`` that record their own recipe and
    data (:data:`CARRIED_STUDIES`: they ran on data of their own, not on the head's), and say where they came
    from under ``studies_carried``. The learning curve and the validation gap belong to one head and data
    set, and are measured again (``--learning-curve``, ``train-draft``). Returns the keys copied."""
    ref = json.loads(Path(source).read_text())
    keys = [k for k in CARRIED_STUDIES if k in ref]
    if not keys:
        raise ValueError(f"{source} holds none of the studies {', '.join(CARRIED_STUDIES)}")
    for k in keys:
        write_into_card(folder, k, ref[k])
    write_into_card(folder, "studies_carried", {"from": str(source), "keys": keys, "created": ref.get("created"),
                                                "head_machine": ref.get("machine")})
    return keys


def combined_levers(study: dict) -> list[str]:
    """The lever names of the ablation's combined row (read from its words where the row predates ``levers``)."""
    row = next(r for r in study["rows"] if r["name"] == "combined")
    return row.get("levers") or row["what"].split(": ", 1)[1].split(", ")


def recipe_change(study: dict) -> dict:
    """The TrainConfig fields the combined row changes from the ablation's base, with their values."""
    change: dict = {}
    for name in combined_levers(study):
        change.update(LEVERS[name][1])
    return change


def base_words(base: dict) -> str:
    """What the ablation's base recipe is, in words (from its config)."""
    passes = "one pass" if base["depth"] == 1 else f"{base['depth']} chained passes"
    return (f"the ablation's base: {'soft' if base['soft_labels'] else 'hard'} labels, {passes}, "
            f"lr {base['lr']:g}")


def ablation_markdown(study: dict, kinds=("prose", "code", "grounded")) -> str:
    """The ablation as a markdown table: a_1, a_2|1, change of a_1 against the base, a_1 per kind."""
    from .booktext import table

    base = study["rows"][0]["a1"]
    rows = [[r["name"], base_words(study["base"]) if r["name"] == "base" else r["what"], f"{r['a1']:.3f}", "" if r["name"] == "base" else f"{r['a1'] - base:+.3f}",
             "-" if r["a2_given_1"] is None else f"{r['a2_given_1']:.3f}"]
            + [f"{r['by_kind'][k]['a1']:.3f}" if k in r["by_kind"] else "-" for k in kinds] for r in study["rows"]]
    return table(["recipe", "change", "a_1", "vs base", "a_2|1"] + [f"a_1 {k}" for k in kinds], rows)
