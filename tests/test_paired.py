"""Chapter 7's paired runs: one record per run, grouped rows, settings chosen on calibration prompts."""
import pytest

from specnb import costmodel as cm
from specnb.paired import Setting, best_settings, paired_runs, position_acceptance, setting_rows


def _rec(kind, setting, k, speedup, rounds, t_draft, g, attempts, accepts, identical=True):
    return {"kind": kind, "setting": setting, "k": k, "speedup": speedup, "rounds": rounds, "t_draft": t_draft,
            "greedy_per_token": g, "attempts": attempts, "accepts": accepts, "accepted": sum(accepts),
            "drafted": rounds * k, "tokens": rounds + sum(accepts), "identical": identical}


def test_setting_rows_pool_counts_and_use_the_one_in_loop_c():
    recs = [_rec("prose", "head, k=2", 2, 1.1, 10, 0.2, 0.04, [10, 6], [6, 3]),
            _rec("prose", "head, k=2", 2, 1.3, 20, 0.5, 0.06, [20, 12], [12, 6]),
            _rec("prose", "lookup, k=4", 4, 0.9, 5, 0.01, 0.05, [2, 1, 0, 0], [1, 0, 0, 0], identical=False)]
    rows = setting_rows(recs)
    head = rows[("prose", "head, k=2")]
    assert head["runs"] == 2 and head["identical"] == 2
    assert head["a"] == pytest.approx((6 + 3 + 12 + 6) / (10 + 6 + 20 + 12))  # accepted / verified
    assert head["c"] == pytest.approx(cm.loop_c(0.7, 30, 2, 0.05))  # pooled draft time, mean paired T(1)
    assert head["speedup"] == pytest.approx(1.2) and head["q1"] <= head["speedup"] <= head["q3"]
    assert rows[("prose", "lookup, k=4")]["identical"] == 0
    assert best_settings(recs) == {"prose": "head, k=2"}
    assert position_acceptance(recs[:2]) == pytest.approx([18 / 30, 9 / 18])
    with pytest.raises(ValueError, match="mixes k"):
        setting_rows(recs, by=("kind",))  # two settings with different k in one group


@pytest.mark.real
def test_paired_runs_are_exact_and_recorded(real):
    from specnb.drafts import PromptLookupDraft
    from specnb.prompts import by_kind

    prompts = by_kind("grounded")[:2]
    drafts = {"lookup": PromptLookupDraft()}
    settings = [Setting("lookup", 2), Setting("lookup", 4, schedule=True)]
    runs = paired_runs(real.model, real.tokenizer, prompts, drafts, settings, 8, repeats=1, progress=False)
    assert len(runs) == len(prompts) * len(settings)
    assert all(r["identical"] for r in runs), "every paired run must equal plain greedy"
    assert {r["setting"] for r in runs} == {"lookup, k=2", "lookup, k=4 (+2/-1)"}
    rows = setting_rows(runs)
    assert sum(r["runs"] for r in rows.values()) == len(runs)
    assert all(0 <= r["c"] < 0.05 for r in rows.values()), "prompt lookup runs no model"


@pytest.mark.real
def test_tree_bench_chooses_per_family_on_calibration_and_reports_on_other_prompts(real):
    from specnb.head_io import load_head
    from specnb.tree_bench import FAMILIES, default_settings, family, tree_vs_chain

    head, _ = load_head(real.model)
    bench = tree_vs_chain(real.model, real.tokenizer, head, ("prose",), n_cal=1, n_report=1, max_new_tokens=8,
                          repeats=1, settings=default_settings(quick=True), progress=False)
    assert set(bench.chosen["prose"]) == set(FAMILIES)
    assert all(family(label) == fam for fam, label in bench.chosen["prose"].items())
    assert len(bench.calibration) == 4 and len(bench.report) == 3  # every setting once; the 3 chosen once
    assert {r["setting"] for r in bench.report} == set(bench.chosen["prose"].values())
    assert all(r["identical"] for r in bench.calibration + bench.report), "tree and chain runs equal plain greedy"
    rows = bench.rows()
    assert [r["family"] for r in rows] == list(FAMILIES) and bench.table().count("\n") == 1 + len(rows)
    r = bench.ratios()["prose"]
    by = {x["family"]: x for x in rows}
    assert r["tau_ratio_dynamic"] == pytest.approx(by["dynamic tree"]["tokens_per_round"] / by["chain"]["tokens_per_round"])


def test_paired_runs_bracket_every_run_between_two_greedy_runs_of_its_prompt(monkeypatch):
    """R passes of S settings cost R * S + 1 greedy runs per prompt, and each speculative run's speedup uses
    the greedy runs either side of it (a fake clock: each greedy run is slower than the one before)."""
    import specnb.paired as paired_mod
    from specnb.decode import DecodeResult
    from specnb.prompts import Prompt

    log, clock = [], iter(range(1, 1000))

    def fake_greedy(model, ids, n, eos):
        t = float(next(clock))
        log.append(("greedy", ids[0], t))
        return DecodeResult(tokens=[1] * n, prompt_len=len(ids), wall_time=t * n, target_forwards=n)

    def fake_spec(model, draft, ids, k, n, eos):
        log.append(("spec", ids[0], k))
        return DecodeResult(tokens=[1] * n, prompt_len=len(ids), wall_time=float(n), target_forwards=n)

    class Tok:
        eos_token_id = 0

    monkeypatch.setattr(paired_mod, "greedy", fake_greedy)
    monkeypatch.setattr(paired_mod, "speculative_greedy", fake_spec)
    monkeypatch.setattr(paired_mod, "encode", lambda tok, p: [int(p.text)])
    prompts = [Prompt("prose", "7"), Prompt("prose", "8")]
    settings = [Setting("d", 1), Setting("d", 2), Setting("d", 3)]
    runs = paired_runs(None, Tok(), prompts, {"d": object()}, settings, 4, repeats=2, progress=False)
    assert len(runs) == 2 * 2 * 3
    body = log[1:]                                   # after the warm-up run
    for pid in (7, 8):
        mine = [e for e in body if e[1] == pid]
        assert [e[0] for e in mine] == ["greedy"] + ["spec", "greedy"] * 6, "R * S + 1 greedy runs per prompt"
        assert [e[2] for e in mine if e[0] == "spec"] == [1, 2, 3, 3, 2, 1], "odd passes run the settings reversed"
    for i, r in enumerate(runs):                     # greedy runs at clock t take t s a token (the fake's wall / n)
        greedy_ts = [e[2] for e in body if e[0] == "greedy" and e[1] == (7 if i < 6 else 8)]
        j = i % 6
        assert r["greedy_per_token"] == pytest.approx((greedy_ts[j] * 4 / 3 + greedy_ts[j + 1] * 4 / 3) / 2)
        assert r["repeat"] == j // 3 and r["identical"]
