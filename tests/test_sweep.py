"""The sweep of chapter 4: record bookkeeping, a tiny real sweep, JSON round trip, the CLI and plots."""
import json

import numpy as np
import pytest

from specnb import cli
from specnb.decode import DecodeResult, RoundStats
from specnb.sweep import (SweepConfig, load_results, position_test, run_record, run_sweep, save_results, summarize,
                          verify_costs)


def _result(rounds):
    tokens = sum(r.emitted for r in rounds)
    return DecodeResult(list(range(tokens)), 5, 1.0, len(rounds) + 1, rounds=rounds, t_prefill=0.2)


def test_run_record_counts_positions():
    # k = 3: rounds accepting 0, 2, 3 (bonus) and one round that drafted only 1 token and lost it.
    rounds = [RoundStats(3, 0, 1, False, 3, 0.1, 0.2), RoundStats(3, 2, 3, False, 3, 0.1, 0.2),
              RoundStats(3, 3, 4, True, 3, 0.1, 0.2), RoundStats(1, 0, 1, False, 1, 0.1, 0.2)]
    rec = run_record(_result(rounds), 3)
    assert rec["attempts"] == [4, 2, 2]  # position 2 is verified only where position 1 was accepted
    assert rec["accepts"] == [2, 2, 1]
    assert rec["drafted_hist"] == [0, 1, 0, 3]
    assert rec["bonus_rounds"] == 1 and rec["accepted"] == 5 and rec["drafted"] == 10
    assert rec["per_token"] == pytest.approx((1.0 - 0.2) / 9)


@pytest.fixture(scope="module")
def tiny_sweep(real):
    config = SweepConfig(drafts=("lookup", "exit2"), ks=(1, 3), kinds=("grounded", "prose"), prompts_per_kind=1,
                         max_new_tokens=8, repeats=2, model_prompts_per_kind=None, model_repeats=None,
                         curve_repeats=1, twins=())  # model drafts on every prompt and pass, as lookup
    return run_sweep(real.model, real.tokenizer, config, label=real.label, progress=False)


@pytest.mark.real
def test_tiny_sweep_is_exact_and_consistent(tiny_sweep, tmp_path):
    runs = tiny_sweep["runs"]
    assert len(runs) == 2 * 2 * 2 * 2  # repeats x prompts x drafts x ks
    assert all(r["identical"] for r in runs), "every speculative run must equal plain greedy"
    for r in runs:
        assert sum(r["accepts"]) == r["accepted"] and sum(r["drafted_hist"]) == r["rounds"]
        assert r["tokens"] == r["accepted"] + r["rounds"]  # each round: accepted drafts + the target's token
        assert r["speedup"] > 0 and r["c"] >= 0
        # c is the one in-loop measurement (costmodel.loop_c): draft seconds per round / k / paired T(1)
        assert r["c"] == pytest.approx(r["t_draft"] / r["rounds"] / r["k"] / r["greedy_per_token"])
    assert set(verify_costs(tiny_sweep)) == {1, 2, 3, 4} and verify_costs(tiny_sweep)[1] == 1
    rows = summarize(tiny_sweep)
    assert {(r.draft, r.k, r.kind) for r in rows} == {(d, k, kind) for d in ("lookup", "exit2") for k in (1, 3)
                                                     for kind in ("grounded", "prose", "all")}
    for row in rows:
        assert row.runs == (4 if row.kind == "all" else 2)
        assert set(row.predicted) == {"simple", "refined", "naive"}
        assert row.speedup_q1 <= row.speedup_q3
        # the book's range: per prompt the median over its repeats, then min and max over prompts
        sel = [r for r in runs if r["draft"] == row.draft and r["k"] == row.k and row.kind in (r["kind"], "all")]
        medians = {}
        for r in sel:
            medians.setdefault((r["kind"], r["prompt"]), []).append(r["speedup"])
        medians = [float(np.median(v)) for v in medians.values()]
        assert row.n_prompts == len(medians)
        assert (row.speedup_lo, row.speedup_hi) == (min(medians), max(medians))
    exit_rows = [r for r in rows if r.draft == "exit2"]
    assert all(r.c > 0.02 for r in exit_rows)  # a 2-layer model still runs the full LM head: c is not 0
    # JSON round trip keeps everything.
    path = save_results(tiny_sweep, tmp_path / "r.json")
    again = load_results(path)
    assert json.dumps([vars(r) for r in summarize(again)]) == json.dumps([vars(r) for r in rows])


@pytest.mark.real
def test_plot_command_redraws_from_json(tiny_sweep, tmp_path, capsys):
    path = save_results(tiny_sweep, tmp_path / "r.json")
    assert cli.main(["plot", str(path), "--out", str(tmp_path / "figs")]) == 0
    names = sorted(p.name for p in (tmp_path / "figs").iterdir())
    assert names == sorted(["acceptance_vs_k.png", "acceptance_by_position.png", "speedup_vs_k.png",
                            "cost_ratios.png", "predicted_vs_measured.png"])
    assert all((tmp_path / "figs" / n).stat().st_size > 10_000 for n in names)


def test_plot_and_load_errors(tmp_path):
    with pytest.raises(SystemExit, match="run `python -m specnb sweep"):
        cli.main(["plot", str(tmp_path / "missing.json")])
    (tmp_path / "old.json").write_text(json.dumps({"format": 0}))
    with pytest.raises(SystemExit, match="run the sweep again"):
        cli.main(["plot", str(tmp_path / "old.json")])


def test_sweep_config_errors():
    with pytest.raises(ValueError, match="ks must be"):
        SweepConfig(ks=(0, 2)).validate()
    with pytest.raises(ValueError, match="prompts of kind"):
        SweepConfig(prompts_per_kind=99).validate()
    with pytest.raises(SystemExit, match="unknown draft"):
        cli._drafts(None, ["medusa"])


@pytest.mark.real
def test_sweep_command_writes_json_then_plots(real, tmp_path, capsys):
    out = tmp_path / "sweep.json"
    args = ["sweep", "--out", str(out), "--drafts", "lookup", "--ks", "1", "2", "--kinds", "grounded",
            "--prompts-per-kind", "1", "--max-new-tokens", "6", "--repeats", "1", "--no-twins"]
    assert cli.main(args) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "identical 1/1" in printed
    results = load_results(out)
    assert results["config"]["ks"] == [1, 2] and results["twins"] == {}
    assert {"cpu", "cores", "torch", "transformers", "python"} <= set(results["machine"])
    assert cli.main(["plot", str(out)]) == 0  # default folder: next to the file
    assert len(list((tmp_path / "sweep_figures").glob("*.png"))) == 5


@pytest.fixture(scope="module")
def real_tokenizer():
    from transformers import AutoTokenizer

    from specnb.models import convert_offline_target

    return AutoTokenizer.from_pretrained(convert_offline_target())


@pytest.mark.parametrize("mode", ["exact", "skip-target"])
def test_identical_flag_catches_a_broken_loop(real_tokenizer, mode):
    # Negative control: the same sweep with a loop that never rolls the target cache back
    # (chapter 3's bug) must be flagged not identical; the exact loop on the same runs must not.
    from specnb.tiny import tiny_llama

    model = tiny_llama(seed=3, vocab_size=len(real_tokenizer), context=512)
    config = SweepConfig(drafts=("exit1",), ks=(2, 4), kinds=("prose", "grounded"), prompts_per_kind=1,
                         max_new_tokens=12, repeats=1, curve_repeats=1, twins=())
    runs = run_sweep(model, real_tokenizer, config, progress=False, rollback_mode=mode)["runs"]
    rejected = sum(r["drafted"] - r["accepted"] for r in runs)
    assert rejected > 0, "some drafts must be rejected, or the broken rollback has nothing to break"
    identical = [r["identical"] for r in runs]
    if mode == "exact":
        assert all(identical)
    else:
        assert not all(identical), "the sweep's identical flag missed a loop that skips the rollback"
        assert summarize({"runs": runs, "curve": {"median": {str(n): 1.0 for n in range(1, 6)}}})[0].identical < 2


@pytest.mark.real
def test_out_of_sample_calibration_uses_other_prompts(tiny_sweep, real):
    from specnb.prompts import by_kind
    from specnb.sweep import calibrate_sweep, calibration_prompts, errors_by, predict_out_of_sample

    config = SweepConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in tiny_sweep["config"].items()})
    for kind in config.kinds:
        cal = calibration_prompts(config, kind, 2)
        assert not set(cal) & set(by_kind(kind)[: config.prompts_per_kind]), "calibration prompts must be unseen"
    with pytest.raises(ValueError, match="prompts of kind 'prose' are left"):
        calibration_prompts(config, "prose", 10)
    cals = calibrate_sweep(real.model, real.tokenizer, tiny_sweep, n_prompts=1, c_repeats=2, progress=False)
    assert set(cals) == {(d, kind) for d in ("lookup", "exit2") for kind in ("grounded", "prose")}
    assert cals["exit2", "prose"].c > 0.02 and cals["lookup", "prose"].c is None
    rows = [r for r in summarize(tiny_sweep) if r.kind != "all"]
    predict_out_of_sample(rows, cals, verify_costs(tiny_sweep))
    assert all(r.predicted["refined, out of sample"] > 0 and r.predicted["simple, out of sample"] > 0 for r in rows)
    by = errors_by(rows, "refined, out of sample", key=lambda r: r.draft)
    assert set(by) == {"lookup", "exit2"} and all(v >= 0 for v in by.values())


def test_results_from_other_kernels_are_not_reused(tiny_sweep, tmp_path):
    """Chapter 5 reuses chapter 4's sweep only if it was measured here, on the same kernels."""
    from specnb.sweep import reusable

    results = load_results(save_results(tiny_sweep, tmp_path / "sweep.json"))
    assert reusable(results, SweepConfig(**results["config"])) is None
    results["machine"]["kernels"] = "some other kernels"
    assert "different kernels" in reusable(results, SweepConfig(**results["config"]))


def _position_runs(first, later):
    """Fabricated runs of one draft at k = 3: (accepted, attempts) at position 1 and at positions 2..3."""
    return [{"draft": "d", "k": 3, "attempts": [first[1], later[1], 0], "accepts": [first[0], later[0], 0]},
            {"draft": "other", "k": 3, "attempts": [50, 50, 50], "accepts": [0, 50, 50]}]


def test_position_test_pools_counts_and_matches_fisher():
    # Fisher's tea-tasting table (3, 1 / 1, 3): two-sided p = 34/70
    t = position_test(_position_runs((3, 4), (1, 4)), "d", 3)
    assert (t["n1"], t["x1"], t["n_later"], t["x_later"]) == (4, 3, 4, 1)
    assert t["a1"] == 0.75 and t["later"] == 0.25
    assert t["p_value"] == pytest.approx(34 / 70)
    assert position_test(_position_runs((10, 20), (10, 20)), "d", 3)["p_value"] == pytest.approx(1.0)
    assert position_test(_position_runs((5, 50), (45, 50)), "d", 3)["p_value"] < 1e-6
    assert np.isnan(position_test(_position_runs((1, 2), (0, 0)), "d", 3)["p_value"])


def test_model_drafts_run_on_the_first_prompt_of_a_kind_in_the_first_pass_only():
    """Full mode's default: early exits (a model draft per drafted token) run 1 prompt per kind, 1 pass;
    prompt lookup every prompt and pass."""
    c = SweepConfig()
    assert all(c.runs_draft("lookup", rep, i) for rep in range(c.repeats) for i in range(c.prompts_per_kind))
    assert c.runs_draft("exit8", 0, 0)
    assert not c.runs_draft("exit8", 1, 0) and not c.runs_draft("exit24", 0, 1)
