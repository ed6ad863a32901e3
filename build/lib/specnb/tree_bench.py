"""Trees against chains with the same head (chapter 8): choose on calibration prompts, report on others.

:func:`tree_vs_chain` runs chain settings (the head, k drafts) and tree settings (the head's
EAGLE-2 dynamic tree and a static tree, at several node budgets) on the calibration half of
chapter 7's held-out prompts, paired with plain greedy; picks the best chain, the best static
tree and the best dynamic tree per kind by median paired speedup; then runs only those on the
report half, ``repeats`` passes. Every run is checked against plain greedy.

Reported per kind and family: tokens per target forward (tau, emitted / verify forwards),
acceptance by depth, and the median paired speedup with its quartiles.
"""
from __future__ import annotations

from dataclasses import dataclass

from .corpus import held_out_prompts
from .drafts import HeadDraft
from .paired import Setting, best_settings, paired_runs, setting_rows
from .tree_drafts import HeadTreeDraft, shape_from_branching

FAMILIES = ("chain", "static tree", "dynamic tree")


def family(setting: str) -> str:
    return "dynamic tree" if setting.startswith("dynamic") else "static tree" if setting.startswith("static") \
        else "chain"


def tree_drafts(head) -> dict:
    """The drafts compared: the chain head; static trees (3-1-1: the head's top 3 at depth 1, each followed by
    its top-1 chain; 2-2-1: top 2 under the root and under each child, then top 1), cut to the node budget in
    order of depth and rank (2 nodes of 3-1-1 = the top 2 at depth 1); EAGLE-2 dynamic trees."""
    return {"chain": HeadDraft(head, name="head, chain"),
            "static 3-1-1": HeadTreeDraft(head, shape_from_branching((3, 1, 1)), name="head, static tree 3-1-1"),
            "static 2-2-1": HeadTreeDraft(head, shape_from_branching((2, 2, 1)), name="head, static tree 2-2-1"),
            "dynamic d3": HeadTreeDraft(head, depth=3, branch=2, width=2, name="head, dynamic tree depth 3"),
            "dynamic d4": HeadTreeDraft(head, depth=4, branch=3, width=3, name="head, dynamic tree depth 4"),
            "dynamic d6": HeadTreeDraft(head, depth=6, branch=4, width=6, name="head, dynamic tree depth 6")}


def default_settings(quick: bool = False) -> list[Setting]:
    if quick:
        return [Setting("chain", 1), Setting("chain", 2), Setting("static 3-1-1", 5, tree=True),
                Setting("dynamic d3", 4, tree=True)]
    return ([Setting("chain", k) for k in (1, 2, 3, 4, 6)]  # past the trees' depth 3: the best chain must not sit at the grid's edge
            + [Setting("static 3-1-1", n, tree=True) for n in (2, 3, 5, 9)]
            + [Setting("static 2-2-1", n, tree=True) for n in (6, 10)]
            + [Setting("dynamic d3", n, tree=True) for n in (2, 3, 4, 6)]
            + [Setting("dynamic d4", n, tree=True) for n in (8, 12)]
            + [Setting("dynamic d6", 24, tree=True)])  # how far tokens per forward go when size is not the limit


@dataclass
class TreeBench:
    calibration: list[dict]
    report: list[dict]
    chosen: dict  # kind -> family -> setting label

    def rows(self) -> list[dict]:
        """One row per (kind, family) of the report runs."""
        summary = setting_rows(self.report)
        out = []
        for kind, per_family in self.chosen.items():
            for fam, label in per_family.items():
                s = summary[(kind, label)]
                out.append({"kind": kind, "family": fam, "setting": label, **s})
        return out

    def table(self) -> str:
        from .booktext import table

        return table(["kind", "family", "setting (chosen on calibration)", "tokens / forward",
                      "speedup (median, q1-q3)", "identical"],
                     [[r["kind"], r["family"], r["setting"], f"{r['tokens_per_round']:.2f}",
                       f"{r['speedup']:.2f} ({r['q1']:.2f}-{r['q3']:.2f})", f"{r['identical']}/{r['runs']}"]
                      for r in self.rows()])

    def ratios(self) -> dict:
        """Per kind: best tree's tokens per forward / best chain's, and speedup difference."""
        out = {}
        by = {(r["kind"], r["family"]): r for r in self.rows()}
        for kind in self.chosen:
            chain = by[(kind, "chain")]
            best = max((by[(kind, f)] for f in FAMILIES[1:] if (kind, f) in by), key=lambda r: r["speedup"])
            dyn = by.get((kind, "dynamic tree"), best)
            out[kind] = {"tau_ratio_dynamic": dyn["tokens_per_round"] / chain["tokens_per_round"],
                         "speedup_gain_dynamic": dyn["speedup"] - chain["speedup"],
                         "speedup_gain_best_tree": best["speedup"] - chain["speedup"]}
        return out

    def reach(self) -> dict:
        """Per kind, from the calibration runs: the dynamic setting with the most tokens per forward, its
        tokens per forward over the chosen chain's (on the same prompts) and both speedups."""
        cal = setting_rows(self.calibration)
        out = {}
        for kind, per_family in self.chosen.items():
            chain = cal[(kind, per_family["chain"])]
            dyn = [(label, r) for (k, label), r in cal.items() if k == kind and family(label) == "dynamic tree"]
            if not dyn:
                continue
            label, top = max(dyn, key=lambda x: x[1]["tokens_per_round"])
            out[kind] = {"setting": label, "tau": top["tokens_per_round"],
                         "tau_ratio": top["tokens_per_round"] / chain["tokens_per_round"],
                         "speedup": top["speedup"], "chain_speedup": chain["speedup"]}
        return out


def tree_vs_chain(model, tokenizer, head, kinds=("prose", "code"), n_cal: int = 4, n_report: int = 4,
                  max_new_tokens: int = 64, repeats: int = 3, settings: list[Setting] | None = None,
                  progress: bool = True) -> TreeBench:
    """Calibrate on the first ``n_cal`` held-out prompts of each kind, report on the next ``n_report``."""
    drafts = tree_drafts(head)
    settings = settings or default_settings()
    calib, report_prompts = [], []
    for kind in kinds:
        prompts = held_out_prompts(kind)
        if len(prompts) < n_cal + n_report:
            raise ValueError(f"only {len(prompts)} held-out {kind} prompts; need {n_cal} + {n_report}")
        calib += prompts[:n_cal]
        report_prompts += prompts[n_cal:n_cal + n_report]
    cal = paired_runs(model, tokenizer, calib, drafts, settings, max_new_tokens, 1, progress, "calibration")
    chosen: dict[str, dict[str, str]] = {}
    for fam in FAMILIES:
        in_family = [r for r in cal if family(r["draft"]) == fam]
        if in_family:
            for kind, label in best_settings(in_family).items():
                chosen.setdefault(kind, {})[fam] = label
    by_label = {s.label: s for s in settings}
    rep = []
    for kind in kinds:
        mine = [by_label[label] for label in chosen[kind].values()]
        rep += paired_runs(model, tokenizer, [p for p in report_prompts if p.kind == kind], drafts, mine,
                           max_new_tokens, repeats, progress, f"report ({kind})")
    return TreeBench(cal, rep, chosen)
