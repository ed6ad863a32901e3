"""The hub pairs' code path, offline: tiny models saved in a temporary Hugging Face cache under the real ids."""
import json
import os
import subprocess
import sys

import pytest

from specnb.models import PAIRS

COMMIT = "0" * 40


def _save(cache, model_id, model, tokenizer):
    repo = cache / f"models--{model_id.replace('/', '--')}"
    snap = repo / "snapshots" / COMMIT
    model.save_pretrained(snap, safe_serialization=True)
    tokenizer.save_pretrained(snap)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)
    assert (snap / "model.safetensors").exists() and not list(snap.glob("*.bin"))


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """One pair cached (tiny random Llamas, the offline model's tokenizer); gpt2-large/distilgpt2 left out."""
    from transformers import AutoTokenizer

    from specnb.models import convert_offline_target
    from specnb.tiny import perturbed_copy, tiny_llama

    tok = AutoTokenizer.from_pretrained(convert_offline_target())
    root = tmp_path_factory.mktemp("hf")
    cache = root / "hub"
    for pair in ("smollm2-360m/135m",):
        target = tiny_llama(seed=5, vocab_size=len(tok), context=512)
        _save(cache, PAIRS[pair].target, target, tok)
        _save(cache, PAIRS[pair].draft, perturbed_copy(target, 0.05, seed=2), tok)
    return root


SCRIPT = """
import json
from specnb.hubpairs import measure_hub_pairs, skipped_note
from specnb.models import hub_reachable
from specnb.sweep import SweepConfig
config = SweepConfig(drafts=("hub",), ks=(1, 3), kinds=("prose", "grounded"), prompts_per_kind=1, max_new_tokens=8,
                     repeats=1, model_prompts_per_kind=None, model_repeats=None, curve_repeats=1, twins=())
hub = measure_hub_pairs(("smollm2-360m/135m", "gpt2-large/distilgpt2"), config=config, progress=False)
out = {"reachable": hub_reachable(), "note": skipped_note(hub)}
for name, entry in hub.items():
    if "rows" in entry:
        out[name] = [dict(kind=r.kind, k=r.k, a=r.a, c=r.c, speedup=r.speedup, identical=r.identical, runs=r.runs,
                          oos=r.predicted.get("refined, out of sample")) for r in entry["rows"]]
import matplotlib
matplotlib.use("Agg")
from specnb import plots
measured = {name: entry for name, entry in hub.items() if "rows" in entry}
fig = plots.speedup_vs_k(measured["smollm2-360m/135m"]["results"], measured["smollm2-360m/135m"]["rows"])
plots.hub_pairs_overlay(fig, measured)   # chapter 4's figure: one dashed line per pair in each kind's panel
out["overlay"] = {ax.get_title(): [[line.get_label(), len(line.get_xdata())] for line in ax.get_lines()
                                   if "(hub)" in line.get_label()] for ax in fig.axes}
print("JSON" + json.dumps(out))
"""


def test_hub_pairs_measured_from_a_local_cache_and_skipped_when_absent(hub_cache):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(hub_cache), "HF_HUB_CACHE": str(hub_cache / "hub"),
           "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("JSON", 1)[1])
    assert out["reachable"] is False
    assert "smollm2-360m/135m: skipped" not in out["note"]
    assert "gpt2-large/distilgpt2: skipped" in out["note"] and "not in the local Hugging Face cache" in out["note"]
    for pair in ("smollm2-360m/135m",):
        rows = out[pair]
        assert {(r["kind"], r["k"]) for r in rows} == {(kind, k) for kind in ("prose", "grounded", "all")
                                                      for k in (1, 3)}
        assert all(r["identical"] == r["runs"] for r in rows), "every hub-pair run must equal plain greedy"
        assert all(0 <= r["a"] <= 1 and r["c"] > 0 and r["speedup"] > 0 for r in rows)
        assert all(r["oos"] > 0 for r in rows if r["kind"] != "all")
        assert any(0 < r["a"] < 1 for r in rows), "the perturbed draft should be right only some of the time"
    for kind in ("prose", "grounded"):   # chapter 4's speedup figure gets the measured pair in each kind's panel
        assert out["overlay"][kind] == [["smollm2-360m/135m (hub)", 2]], out["overlay"]
