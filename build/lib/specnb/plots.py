"""Every figure of the book, each drawn by one function that returns it (the notebooks glue it).

Two kinds: the sweep's figures (chapters 4 and 5: ``acceptance_vs_k`` to ``predicted_vs_measured``,
``save_all``) take the dict that :func:`specnb.sweep.run_sweep` returns (or
:func:`specnb.sweep.load_results` reads back), so ``python -m specnb plot results.json`` redraws them
without measuring again; the others take the plain numbers their chapter measured (arrays and dicts:
T(n) curves, kernel curves, latencies, calibration rows, the head's card). Not covered:
interactive figures (see :mod:`specnb.widgets`).
"""
from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from .sweep import Row, summarize

MARKERS = "osD^v<>ph*"


def _caption(results: dict, width: int = 170) -> str:
    m, cfg = results["machine"], results["config"]
    where = m.get("gpu") or f"{m['cpu']}, {m['cores']} cores ({m['torch_threads']} torch threads)"
    text = (f"{results.get('model') or 'target'}; {cfg['max_new_tokens']} new tokens, {cfg['repeats']} repeat(s), "
            f"{cfg['prompts_per_kind']} prompt(s) per kind; measured {results['created'][:16]} on {where}; "
            f"torch {m['torch']}, transformers {m['transformers']}; {m.get('kernels', 'kernels not recorded')}")
    return textwrap.fill(text, width=width)


def _grid(results: dict, rows: list[Row]):
    kinds = list(results["config"]["kinds"])
    drafts = list(results["config"]["drafts"])
    labels = {r.draft: r.draft_label for r in rows}
    return kinds, drafts, labels


def _select(rows: list[Row], draft: str, kind: str) -> list[Row]:
    return sorted((r for r in rows if r.draft == draft and r.kind == kind), key=lambda r: r.k)


def _kind_panels(results: dict, rows: list[Row], draw, title: str, ylabel: str, xlabel: str, xticks,
                 legend_title: str | None = None, **ax_kw):
    """One panel per kind of text; ``draw(ax, j, draft, kind, label)`` draws draft number j in it."""
    kinds, drafts, labels = _grid(results, rows)
    fig, axes = plt.subplots(1, len(kinds), figsize=(4.2 * len(kinds), 3.8), sharey=True, squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        for j, draft in enumerate(drafts):
            draw(ax, j, draft, kind, labels[draft])
        ax.set(title=kind, xlabel=xlabel, xticks=xticks, **ax_kw)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(ylabel)
    axes[0][-1].legend(fontsize=8, title=legend_title, title_fontsize=7)
    fig.suptitle(title + "\n" + _caption(results), fontsize=8)
    fig.tight_layout()
    return fig


def acceptance_vs_k(results: dict, rows: list[Row] | None = None):
    """Acceptance rate (accepted / drafted, solid) and a (accepted / verified, dashed) against k,
    one panel per kind of text, one line per draft."""
    rows = rows or summarize(results)

    def draw(ax, j, draft, kind, label):
        sel = _select(rows, draft, kind)
        ks = [r.k for r in sel]
        line, = ax.plot(ks, [r.acceptance_rate for r in sel], marker=MARKERS[j], label=label)
        ax.plot(ks, [r.a for r in sel], linestyle="--", color=line.get_color(), alpha=0.6)

    return _kind_panels(results, rows, draw, "Acceptance against k", "acceptance", "k (drafted per round)",
                        results["config"]["ks"], "solid: accepted/drafted\ndashed: a = accepted/verified",
                        ylim=(0, 1))


def acceptance_by_position(results: dict, rows: list[Row] | None = None):
    """a_i = P(draft i accepted | drafts 1..i-1 accepted) at the largest k, one panel per kind."""
    rows = rows or summarize(results)
    k = max(results["config"]["ks"])

    def draw(ax, j, draft, kind, label):
        row = _select([r for r in rows if r.k == k], draft, kind)
        if row:
            ax.plot(np.arange(1, k + 1), row[0].a_pos, marker=MARKERS[j], label=label)

    return _kind_panels(results, rows, draw, "Acceptance by draft position",
                        "P(position i accepted | 1..i-1 accepted)", f"draft position i (k = {k})",
                        list(range(1, k + 1)), ylim=(0, 1.02))


def speedup_vs_k(results: dict, rows: list[Row] | None = None):
    """Measured speedup over plain greedy against k: the pooled speedup (markers and line) and, as an
    interval of its own, the range over the configuration's prompts of each prompt's median speedup
    over its repeats (:attr:`specnb.sweep.Row.speedup_lo` to ``speedup_hi``; none where one prompt ran).
    The pooled point need not lie inside that range."""
    rows = rows or summarize(results)
    n_drafts = len(results["config"]["drafts"])

    def draw(ax, j, draft, kind, label):
        sel = _select(rows, draft, kind)
        ks = np.array([r.k for r in sel]) + (j - n_drafts / 2) * 0.08
        line, = ax.plot(ks, [r.speedup for r in sel], marker=MARKERS[j], label=label)
        ranged = [(x, r) for x, r in zip(ks, sel) if r.n_prompts > 1]
        if ranged:
            xs = [x for x, _ in ranged]
            lo, hi = [r.speedup_lo for _, r in ranged], [r.speedup_hi for _, r in ranged]
            ax.vlines(xs, lo, hi, color=line.get_color(), linewidth=1.2)
            ax.plot(xs + xs, lo + hi, linestyle="none", marker="_", markersize=7, color=line.get_color())
        if j == 0:
            ax.axhline(1, color="black", linewidth=1, linestyle=":")

    return _kind_panels(results, rows, draw, "Wall-clock speedup against k (1 = plain greedy)",
                        "speedup over plain greedy (x)", "k (drafted per round)", results["config"]["ks"],
                        "bars: range over prompts of\neach prompt's median speedup")


def cost_ratios(results: dict, rows: list[Row] | None = None):
    """c of each draft (median over its runs) and of the shape twins of the hub pairs."""
    rows = rows or summarize(results)
    _, drafts, labels = _grid(results, rows)
    names, values = [], []
    for draft in drafts:
        names.append(labels[draft])
        values.append(float(np.median([r.c for r in rows if r.draft == draft and r.kind == "all"])))
    for pair, twin in results.get("twins", {}).items():
        names.append(f"{pair} (twins)")
        values.append(twin["c"])
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(names) + 1.6))
    ax.barh(names, values, color=["tab:blue"] * len(drafts) + ["tab:gray"] * (len(names) - len(drafts)))
    for y, v in enumerate(values):
        ax.text(v, y, f" {v:.3f}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel="c (draft time per drafted token / target forward time)", xlim=(0, max(1.0, max(values) * 1.15)))
    fig.suptitle("Cost ratio c\n" + _caption(results, width=110), fontsize=8)
    fig.tight_layout()
    return fig


def predicted_vs_measured(results: dict, rows: list[Row] | None = None, models=("simple", "refined", "naive")):
    """Each cost model's predicted speedup against the measured one, one panel per model (chapter 5)."""
    rows = rows or [r for r in summarize(results) if r.kind != "all"]
    drafts = list(results["config"]["drafts"])
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 4), squeeze=False)
    hi = max(max(r.speedup for r in rows), max(min(r.predicted[m], 4) for r in rows for m in models)) * 1.1
    for ax, model in zip(axes[0], models):
        for j, draft in enumerate(drafts):
            sel = [r for r in rows if r.draft == draft]
            ax.scatter([r.speedup for r in sel], [r.predicted[model] for r in sel], marker=MARKERS[j], s=18,
                       label=sel[0].draft_label if sel else draft)
        ax.plot([0, hi], [0, hi], color="black", linewidth=1)
        ax.fill_between([0, hi], [0, 0.9 * hi], [0, 1.1 * hi], color="tab:green", alpha=0.12, label="within 10%")
        ax.set(xlim=(0, hi), ylim=(0, hi), title=f"{model} model", xlabel="measured speedup (x)",
               ylabel="predicted speedup (x)", aspect="equal")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Cost models against measurement, one point per (draft, k, kind)\n" + _caption(results), fontsize=8)
    fig.tight_layout()
    return fig


SWEEP_FIGURES = {"acceptance_vs_k": acceptance_vs_k, "acceptance_by_position": acceptance_by_position,
                 "speedup_vs_k": speedup_vs_k, "cost_ratios": cost_ratios,
                 "predicted_vs_measured": predicted_vs_measured}


def save_all(results: dict, out_dir: str | Path) -> list[Path]:
    """Draw every figure of chapter 4 (and the prediction plot of chapter 5) into ``out_dir`` as PNG."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = summarize(results)
    paths = []
    for name, draw in SWEEP_FIGURES.items():
        fig = draw(results, [r for r in rows if r.kind != "all"] if name == "predicted_vs_measured" else rows)
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def error_table(errors: dict, models) -> str:
    """Chapter 5's error table as markdown, from :func:`specnb.sweep.prediction_errors`."""
    from .booktext import table

    return table(["model", "median abs error", "mean abs error", "max abs error", "configurations within 10%"],
                 [[m, f"{100 * e['median_abs']:.1f}%", f"{100 * e['mean_abs']:.1f}%", f"{100 * e['max_abs']:.0f}%",
                   f"{e['within_10pct']}/{e['rows']}"] for m, e in ((m, errors[m]) for m in models)])


def hub_pairs_overlay(fig, measured: dict, model: str = "refined, out of sample"):
    """Add the hub pairs of :func:`specnb.hubpairs.measure_hub_pairs` to a :func:`predicted_vs_measured`
    figure (its last panel, ``model``'s) or a :func:`speedup_vs_k` figure (panels by kind): one marker per pair."""
    axes = fig.axes
    for j, (name, entry) in enumerate(measured.items()):
        style = dict(marker="X", s=40, color=f"C{6 + j}", label=f"{name} (hub)")
        rows = [r for r in entry["rows"] if r.kind != "all"]
        if axes[-1].get_xlabel().startswith("measured"):
            axes[-1].scatter([r.speedup for r in rows], [r.predicted[model] for r in rows], **style)
        else:
            for ax in axes:
                sel = sorted((r for r in rows if r.kind == ax.get_title()), key=lambda r: r.k)
                ax.plot([r.k for r in sel], [r.speedup for r in sel], marker="X", color=style["color"], linestyle="--",
                        label=style["label"])
    for ax in axes:
        if ax.get_legend() is not None or ax is axes[-1]:
            ax.legend(fontsize=7)

# ---------------------------------------------------------------------------------------------
# Chapter 7: the trained draft head


def training_curve(card: dict):
    """The committed head's loss curve and training agreement, labelled with the machine it was trained on."""
    curve = card["loss_curve"]
    steps = [r["step"] for r in curve]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.4))
    ax.plot(steps, [r["ce"] for r in curve], label="cross-entropy (token)")
    ax.plot(steps, [r["reg"] for r in curve], label="smooth-L1 (feature)")
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_title("training loss")
    ax.legend()
    depth = len(curve[0]["agree"])
    for d in range(depth):
        bx.plot(steps, [r["agree"][d] for r in curve], label=f"draft position {d + 1}")
    bx.set_xlabel("optimizer step")
    bx.set_ylabel("agreement with the target (training batch)")
    bx.set_ylim(0, 1)
    bx.legend()
    m = card["machine"]
    fig.suptitle(textwrap.fill(f"trained {card['created'][:16]} on {m['cpu']}, {m['cores']} cores "
                               f"({m['torch_threads']} torch threads), torch {m['torch']}; "
                               f"{m.get('kernels', 'kernels not recorded (trained before specnb.kernels)')}", 120),
                 fontsize=9)
    fig.tight_layout()
    return fig

# ---------------------------------------------------------------------------------------------------------------
# Figures of chapters 1, 2, 3, 5 and 6 drawn from numbers the notebooks measured (one helper per figure).
# They take plain arrays and dicts, not a results file, and return the figure; the notebooks glue it.


def forward_time_curve(ns, ms: dict, context_len: int, machine: str):
    """Chapter 1: T(n) in ms (median, quartiles, fastest) and T(n)/T(1) on log axes.
    ``ms``: {"median", "q1", "q3", "min"} -> arrays over ``ns``."""
    ns = np.asarray(ns)
    t1 = ms["median"][0]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    err = [ms["median"] - ms["q1"], ms["q3"] - ms["median"]]
    ax.errorbar(ns, ms["median"], yerr=err, fmt="o-", capsize=3, label="measured T(n), median and quartiles")
    ax.plot(ns, ms["min"], "v", color="tab:blue", alpha=0.4, label="fastest of the repeats")
    ax.plot(ns, np.full(len(ns), t1), "--", color="tab:green", label="if verify were free: T(n) = T(1)")
    ax.plot(ns, ns * t1, ":", color="tab:red", label="linear: T(n) = n T(1)")
    ax.set(xlabel="tokens in one forward, n", ylabel="time of one forward (ms)", title="T(n)",
           ylim=(0, 1.3 * max(ms["median"].max(), 4 * t1)))
    ax.legend(fontsize=8, loc="upper left")
    bx.errorbar(ns, ms["median"] / t1, yerr=[e / t1 for e in err], fmt="o-", capsize=3, label="measured T(n) / T(1)")
    bx.plot(ns, np.ones(len(ns)), "--", color="tab:green", label="free verify")
    bx.plot(ns, ns, ":", color="tab:red", label="linear")
    bx.set(xlabel="tokens in one forward, n", ylabel="cost in target forwards, T(n) / T(1)",
           title="T(n) in units of T(1)", yscale="log", xscale="log")
    bx.minorticks_off()
    bx.set_xticks(list(ns), [str(n) for n in ns])
    bx.set_yticks([1, 2, 4, 8, 16], ["1", "2", "4", "8", "16"])
    bx.legend(fontsize=8, loc="upper left")
    fig.suptitle(f"One forward of SmolLM2-135M ({context_len} tokens cached): {machine}", fontsize=8)
    fig.tight_layout()
    return fig


def verify_breakdown(b: dict, machine: str):
    """Chapter 1: a forward of n tokens split into the decoder body and the LM head, under each kernel
    backend side by side; ``b`` from :func:`specnb.profile_verify.verify_breakdown`."""
    ns, backends = b["ns"], b["backends"]
    x = np.arange(len(ns))
    width = 0.8 / len(backends)
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for i, be in enumerate(backends):
        med = {p: np.array([b["median"][be][p][n] * 1e3 for n in ns]) for p in ("full", "body", "head")}
        off = (i - (len(backends) - 1) / 2) * width
        alpha = 1.0 if i == 0 else 0.55
        ax.bar(x + off, med["body"], width=width * 0.9, color="tab:blue", alpha=alpha,
               label=f"decoder body, {be}")
        ax.bar(x + off, med["head"], width=width * 0.9, bottom=med["body"], color="tab:orange", alpha=alpha,
               label=f"LM head, {be}")
        ax.plot(x + off, med["full"], "k_", markersize=16, markeredgewidth=2,
                label="whole forward, timed alone" if i == 0 else None)
    ax.set_xticks(x, [str(n) for n in ns])
    ax.set(xlabel="tokens in one forward, n (a verify of k drafts: n = k + 1)", ylabel="ms per forward")
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    ax.set_title(f"Where a forward's time goes (medians), left bars {backends[0]}, right {backends[-1]}:\n{machine}",
                 fontsize=8)
    fig.tight_layout()
    return fig


def kernel_curves(curves: dict, chosen: dict, gemm_rows: list[dict], machine: str):
    """Chapter 1: T(n) under each kernel backend and the one in use (left), and each weight shape's
    product time at n over its time at n = 1 (right). ``curves``: {backend: {n: ms}} (interleaved
    medians); ``chosen``: {"label": str, "ms": {n: ms}}; ``gemm_rows`` from
    :func:`specnb.profile_verify.gemm_table`."""
    colors = {"mkl": "tab:red", "onednn": "tab:blue", "skinny": "tab:green"}
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    for be, c in curves.items():
        ns = sorted(c)
        ax.plot(ns, [c[n] for n in ns], "o-", color=colors.get(be), label=f"{be} (interleaved with the others)")
    ns = sorted(chosen["ms"])
    ax.plot(ns, [chosen["ms"][n] for n in ns], "k--", marker="x", label=f"in use: {chosen['label']}")
    ax.set(xlabel="tokens in one forward, n", ylabel="T(n), ms (median)", title="T(n) by kernel backend")
    ax.set_ylim(0, None)
    ax.legend(fontsize=7, loc="lower right")
    styles = ["-", "--", ":", "-."]
    for i, row in enumerate(gemm_rows):
        for be, ms in row["ms"].items():
            ns = sorted(ms)
            bx.plot(ns, [ms[n] / ms[ns[0]] for n in ns], styles[i % len(styles)], marker="o", markersize=3,
                    color=colors.get(be), label=f"{'x'.join(map(str, row['shape']))} {be}")
    bx.axhline(1, color="grey", lw=0.5)
    bx.set(xlabel="rows of x, n", ylabel="time at n / time at n = 1",
           title="one x @ W.T per weight shape (W: out x in)")
    bx.legend(fontsize=6, ncol=2, loc="upper left")
    fig.suptitle(machine, fontsize=8)
    fig.tight_layout()
    return fig


def head_positions(before: dict, after: dict, title: str):
    """Held-out acceptance by draft position (given the positions before it) of an untrained and the trained head."""
    fig, ax = plt.subplots(figsize=(6, 3.4))
    depth = len(after["conditional"])
    x = np.arange(1, depth + 1)
    for off, (label, ev) in zip((-0.2, 0.2), (("untrained", before), ("trained", after))):
        vals = [v if v is not None else 0.0 for v in ev["conditional"]]
        ax.bar(x + off, vals, width=0.4, label=label)
    ax.set_xticks(x)
    ax.set_xlabel("draft position i")
    ax.set_ylabel("$a_i$: accepted / verified")
    ax.set_ylim(0, 1)
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    return fig

def decode_latency_hist(latencies_ms, paired_t1_ms, floor_ms: float, machine: str):
    """Chapter 1: per-token latency of plain decoding, its paired T(1), and the memory-bandwidth floor (ms)."""
    latencies_ms, paired_t1_ms = np.asarray(latencies_ms), np.asarray(paired_t1_ms)
    decode_ms, t1_ms = float(np.median(latencies_ms)), float(np.median(paired_t1_ms))
    fig, ax = plt.subplots(figsize=(8, 3.6))
    bins = np.linspace(0, 1.05 * max(latencies_ms.max(), paired_t1_ms.max()), 40)
    ax.hist(latencies_ms, bins=bins, color="tab:blue", alpha=0.6, label=f"plain decoding, {len(latencies_ms)} tokens")
    ax.hist(paired_t1_ms, bins=bins, color="tab:gray", alpha=0.5, label="T(1), paired with each step")
    ax.axvline(decode_ms, color="tab:blue", label=f"decoding median {decode_ms:.0f} ms")
    ax.axvline(t1_ms, color="black", linestyle="--", label=f"paired T(1) median {t1_ms:.0f} ms")
    ax.axvline(floor_ms, color="tab:red", linestyle=":", label=f"bandwidth floor {floor_ms:.0f} ms")
    ax.set(xlabel="time per forward (ms)", ylabel="forwards",
           title=f"Per-token latency of plain greedy decoding\n{machine}")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def calibration_grid(rows: dict, kinds, labels, title: str):
    """Median paired speedup of every setting on the calibration prompts, one panel per kind."""
    fig, axes = plt.subplots(1, len(kinds), figsize=(4 * len(kinds), 0.35 * len(labels) + 1.6), sharey=True)
    axes = np.atleast_1d(axes)
    for ax, kind in zip(axes, kinds):
        vals = [rows[(kind, lab)]["speedup"] if (kind, lab) in rows else np.nan for lab in labels]
        ax.barh(range(len(labels)), vals, color=["tab:green" if v >= 1 else "tab:red" for v in vals])
        ax.axvline(1.0, color="black", lw=0.8)
        ax.set_title(kind)
        ax.set_xlabel("paired speedup (median)")
    axes[0].set_yticks(range(len(labels)))
    axes[0].set_yticklabels(labels, fontsize=8)
    fig.tight_layout()
    return fig

def tokens_per_round(views, k: int, draft_name: str):
    """Chapter 2: accepted drafts and the target's token (correction or bonus) in each round of a run."""
    fig, ax = plt.subplots(figsize=(9, 2.8))
    r = np.arange(1, len(views) + 1)
    acc = np.array([len(v.accepted) for v in views])
    ax.bar(r, acc, color="#66bb6a", label="accepted drafts")
    ax.bar(r, [1] * len(views), bottom=acc, color=["#42a5f5" if v.kind == "bonus" else "#ffa726" for v in views],
           label="target token (orange: correction, blue: bonus)")
    ax.axhline(k + 1, color="gray", linestyle=":", label=f"most a round can emit (k + 1 = {k + 1})")
    ax.set(xlabel="round", ylabel="tokens emitted", title=f"Tokens per round, k = {k}, draft: {draft_name}")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    return fig


def stale_entries(rounds, diverges_at: int):
    """Chapter 3: stale entries left in a never-cropped target cache, per generated token, up to a divergence."""
    stale_at, count = [], 0
    for stats in rounds:
        stale_at += [count] * stats.emitted
        count += stats.drafted - stats.accepted
    fig, ax = plt.subplots(figsize=(8, 2.8))
    ax.step(np.arange(len(stale_at)), stale_at, where="post", label="stale entries in the target cache (skip-target)")
    ax.axvline(diverges_at, color="tab:red", linestyle="--", label=f"first divergence: token {diverges_at}")
    ax.set(xlabel="generated token", ylabel="stale entries", title="Stale keys and values pile up until an argmax flips")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _speedup_map(ax, A, C, best_s, alpha: float = 1.0, linewidths: float = 1.0):
    from matplotlib.colors import TwoSlopeNorm

    im = ax.pcolormesh(C, A, best_s, cmap="RdYlGn", shading="nearest", norm=TwoSlopeNorm(vmin=0, vcenter=1, vmax=4),
                       alpha=alpha)
    cs = ax.contour(C, A, best_s, levels=[1, 1.5, 2, 3], colors="black", linewidths=linewidths)
    ax.clabel(cs, fmt="%.1fx", fontsize=8)
    return im


def best_k_map(A, C, best_k, best_s, k_max: int = 16):
    """Chapter 5: the simple model's best k (left) and its speedup (right) over the (a, c) plane.
    ``best_k, best_s: (len(A), len(C))``."""
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.3))
    im = ax.pcolormesh(C, A, best_k, cmap="viridis", shading="nearest", vmin=1, vmax=k_max)
    fig.colorbar(im, ax=ax, label=f"best k (1..{k_max})")
    ax.set(xlabel="c (draft cost / target cost)", ylabel="a (acceptance per verified draft)",
           title="best k, simple model")
    fig.colorbar(_speedup_map(bx, A, C, best_s), ax=bx, label="speedup at the best k")
    for x in (ax, bx):
        x.plot([0, 0.98], [0, 0.98], "w--", linewidth=1)
    bx.set(xlabel="c (draft cost / target cost)", title="speedup at the best k (dashed: a = c)")
    fig.tight_layout()
    return fig


def wrong_formula(a: float, c: float, k: int, measured: float, label: str):
    """Chapter 5: the wrong formula (1 + ka)/(1 + ka c) and Leviathan's E/C against a, one measured point."""
    from . import costmodel as cm

    aa = np.linspace(0, 0.99, 100)
    fig, ax = plt.subplots(figsize=(7, 3.8))
    ax.plot(aa, cm.naive_speedup(aa, k, 1 / c), color="tab:red", label="(1 + ka)/(1 + ka c): wrong")
    ax.plot(aa, cm.speedup(aa, c, k), color="tab:blue", label="Leviathan E/C, verify = 1")
    ax.plot([a], [measured], "k*", ms=12, label=f"{label} ({measured}x)")
    ax.axhline(1, color="black", linestyle=":")
    ax.set(xlabel="a", ylabel="speedup (x)", title=f"c = {c}, k = {k}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def ac_map(A, C, best_s, offline: dict, hub: dict, production, machine: str):
    """Chapter 5: drafts on the (a, c) plane over the simple model's best speedup.
    ``offline``: label -> (a, c); ``hub``: label -> (a, c here, c of the study); ``production``: [(a, c, k)]."""
    fig, ax = plt.subplots(figsize=(8, 5.5))
    fig.colorbar(_speedup_map(ax, A, C, best_s, alpha=0.6, linewidths=0.8), ax=ax,
                 label="simple model: speedup at the best k")
    for name, (a_, c_) in offline.items():
        ax.plot(c_, a_, "o", color="tab:blue", ms=8)
        ax.annotate(name, (c_, a_), textcoords="offset points", xytext=(6, 4), fontsize=8)
    for name, (a_, c_here, c_study) in hub.items():
        ax.plot(c_here, a_, "s", color="tab:purple", ms=8)
        ax.plot(c_study, a_, "s", mfc="none", mec="tab:purple", ms=8)
        ax.annotate(f"{name} (twins here / study)", (c_here, a_), textcoords="offset points", xytext=(6, -12),
                    fontsize=8)
    for a_, c_, _ in production:
        ax.plot(c_, a_, "*", color="black", ms=12)
        ax.annotate(f"production: a={a_}, c={c_}", (c_, a_), textcoords="offset points", xytext=(6, 4), fontsize=8)
    ax.plot([0, 1], [0, 1], "k--", linewidth=0.8)
    ax.set(xlabel="c (draft cost / target cost)", ylabel="a (acceptance per verified draft)", xlim=(-0.02, 1.05),
           ylim=(0, 1), title="Drafts on the (a, c) map\n" + machine)
    ax.title.set_fontsize(8)
    fig.tight_layout()
    return fig


def residual_example(p, q, dists: dict):
    """Chapter 6: the exact output distribution of one round for each residual rule, beside p and q."""
    p, q = np.asarray(p), np.asarray(q)
    V = len(p)
    fig, ax = plt.subplots(figsize=(7, 3.2))
    width = 0.8 / (len(dists) + 1)
    xs = np.arange(V)
    ax.bar(xs, p, width, color="black", label="target p")
    for j, (name, dist) in enumerate(dists.items(), start=1):
        ax.bar(xs + j * width, np.asarray(dist), width, label=name)
    ax.bar(xs - width, q, width, color="lightgray", label="draft q")
    fmt = lambda v: "(" + ",".join(f"{x:.1f}".lstrip("0") for x in v) + ")"
    ax.set(xticks=xs + width, xticklabels=[f"token {i}" for i in range(V)], ylabel="probability",
           title=f"One round, exact: p={fmt(p)}, q={fmt(q)}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def empirical_deviations(p, empirical: dict, correct: dict, n_samples: int, title: str, top: int = 25):
    """Chapter 6: empirical frequency minus p on the ``top`` most likely tokens, one panel per rule.
    ``empirical``: name -> {"tokens": (n,), "chi2": result}; ``correct``: name -> bool."""
    import torch

    order = p.argsort(descending=True)[:top]
    pt = p[order].numpy()
    sigma = np.sqrt(pt * (1 - pt) / n_samples)
    fig, axes = plt.subplots(1, len(empirical), figsize=(15, 3.4), sharey=True, squeeze=False)
    for ax, (name, e) in zip(axes[0], empirical.items()):
        freq = torch.bincount(e["tokens"], minlength=len(p))[order].double().numpy() / n_samples
        ax.fill_between(range(top), -3 * sigma, 3 * sigma, color="lightgray", label="±3 standard errors")
        ax.bar(range(top), freq - pt, color="tab:green" if correct[name] else "tab:red")
        ax.set(title=f"{name}\nchi2 p-value {e['chi2'].p_value:.2g}", xlabel=f"{top} most likely tokens under p")
        ax.title.set_fontsize(8)
    axes[0][0].set_ylabel("empirical frequency - p")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def report_speedups(rows: dict, title: str):
    """Median paired speedup with quartiles per (kind, draft setting) on the report prompts."""
    keys = sorted(rows)
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(keys) + 1.4))
    med = [rows[k]["speedup"] for k in keys]
    err = np.array([[rows[k]["speedup"] - rows[k]["q1"] for k in keys], [rows[k]["q3"] - rows[k]["speedup"] for k in keys]])
    ax.barh(range(len(keys)), med, xerr=err, color=["tab:green" if m >= 1 else "tab:red" for m in med])
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_yticks(range(len(keys)))
    ax.set_yticklabels([f"{k[0]}: {k[1]}" for k in keys], fontsize=8)
    ax.set_xlabel("speedup over plain greedy (median, quartiles)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig


def split_half(records: list[dict], title: str):
    """Chapter 7: the refined model's prediction against the measured speedup, each (kind, setting) predicted
    from the other half of the calibration prompts (:func:`specnb.paired.split_half_predictions`)."""
    fig, ax = plt.subplots(figsize=(5.2, 4.2))
    kinds = sorted({r["kind"] for r in records})
    for j, kind in enumerate(kinds):
        sel = [r for r in records if r["kind"] == kind]
        ax.scatter([r["measured"] for r in sel], [r["predicted"] for r in sel], marker=MARKERS[j], label=kind)
    values = [v for r in records for v in (r["measured"], r["predicted"])] or [1.0]
    lo, hi = min(values + [1.0]) * 0.9, max(values + [1.0]) * 1.1
    ax.plot([lo, hi], [lo, hi], ":", color="gray", label="predicted = measured")
    ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="gray", alpha=0.15, label="within 10%")
    ax.set(xlim=(lo, hi), ylim=(lo, hi), xlabel="measured speedup (other half, median)", ylabel="predicted speedup")
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    return fig


def acceptance_vs_temperature(table: dict, drafts, temperatures, title: str, k: int):
    """Chapter 6: measured acceptance per verified draft against temperature and against the mean overlap.
    ``table``: (draft, T) -> {"acceptance", "overlap", "sd"}."""
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.8))
    for d, color in zip(drafts, ("tab:blue", "tab:orange", "tab:green", "tab:red")):
        rows = [table[(d, T)] for T in temperatures]
        ax.errorbar(temperatures, [r["acceptance"] for r in rows], yerr=[2 * r["sd"] for r in rows], fmt="o-",
                    color=color, capsize=3, label=f"{d}: measured accepted / verified")
        ax.plot(temperatures, [r["overlap"] for r in rows], "x--", color=color, label=f"{d}: mean sum min(p, q)")
        bx.scatter([r["overlap"] for r in rows], [r["acceptance"] for r in rows], color=color, label=d)
    ax.set(xlabel="temperature", ylabel="acceptance per verified draft", ylim=(0, 1),
           title=f"Acceptance vs temperature (k = {k}, bars: 2 std. errors)")
    bx.plot([0, 1], [0, 1], ":", color="gray", label="acceptance = overlap")
    bx.set(xlabel="mean sum min(p, q) at verified positions", ylabel="measured acceptance", xlim=(0, 1), ylim=(0, 1),
           title="Acceptance follows the overlap")
    for x in (ax, bx):
        x.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def tree_and_mask(tree, labels: list[str], accepted: list[int] | None = None, title: str = ""):
    """A token tree drawn by depth (left) and its attention mask over the tree's nodes (right).

    ``tree``: a :class:`specnb.tree.Tree`; ``labels``: N+1 strings, the root's first; ``accepted``:
    the nodes of the accepted path (highlighted), root first.
    """
    depths = tree.depths()
    n = tree.size + 1
    rows: dict[int, list[int]] = {}
    for i, d in enumerate(depths):
        rows.setdefault(d, []).append(i)
    y = {}
    for d, nodes in rows.items():
        for j, i in enumerate(nodes):
            y[i] = -(j - (len(nodes) - 1) / 2)
    acc = set(accepted or ())
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.8), gridspec_kw={"width_ratios": [1.25, 1]})
    for i, p in enumerate(tree.parents, start=1):
        ax.plot([depths[p], depths[i]], [y[p], y[i]], color="0.6", lw=1, zorder=1)
    for i in range(n):
        on = i in acc
        ax.text(depths[i], y[i], f"{i}: {labels[i]}", ha="center", va="center", fontsize=8, zorder=2,
                bbox=dict(boxstyle="round", fc="#cfe8cf" if on else "white", ec="green" if on else "0.4"))
    ax.set_xlim(-0.5, max(depths) + 0.5)
    ax.set_ylim(min(y.values()) - 0.7, max(y.values()) + 0.7)
    ax.set_xticks(range(max(depths) + 1))
    ax.set_xlabel("depth (position id = cache length + depth)")
    ax.set_yticks([])
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    ax.set_title("the tree (green: the accepted path)", fontsize=9)
    bx.imshow(tree.ancestry().numpy(), cmap="Greens", vmin=0, vmax=1.4)
    bx.set_xticks(range(n))
    bx.set_yticks(range(n))
    bx.set_xlabel("key: node")
    bx.set_ylabel("query: node")
    bx.set_title("mask over the tree's nodes (every node also sees the cache)", fontsize=9)
    if title:
        fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    return fig


def trees_vs_chain(rows: list[dict], title: str):
    """Tokens per target forward and paired speedup of the best chain, static and dynamic tree, per kind.

    ``rows``: :meth:`specnb.tree_bench.TreeBench.rows` (kind, family, tokens_per_round, speedup, q1, q3).
    """
    kinds = sorted({r["kind"] for r in rows})
    families = [f for f in ("chain", "static tree", "dynamic tree") if any(r["family"] == f for r in rows)]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    x = np.arange(len(kinds))
    w = 0.8 / len(families)
    for j, fam in enumerate(families):
        sel = [next(r for r in rows if r["kind"] == k and r["family"] == fam) for k in kinds]
        axes[0].bar(x + (j - (len(families) - 1) / 2) * w, [r["tokens_per_round"] for r in sel], w, label=fam)
        med = np.array([r["speedup"] for r in sel])
        err = np.array([[r["speedup"] - r["q1"] for r in sel], [r["q3"] - r["speedup"] for r in sel]])
        axes[1].bar(x + (j - (len(families) - 1) / 2) * w, med, w, yerr=err, capsize=3, label=fam)
    axes[0].set_ylabel("tokens per target forward")
    axes[1].set_ylabel("paired speedup (median, quartiles)")
    axes[1].axhline(1.0, color="0.3", lw=0.8, ls="--")
    for ax in axes:
        ax.set_xticks(x)
        ax.set_xticklabels(kinds)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    return fig


def learning_curve(curve: dict, machine: str):
    """Chapter 7: held-out a_1 and a_2|1 against training tokens (log axis), overall and for prose."""
    rows = curve["rows"]
    x = [r["training_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.plot(x, [r["a1"] for r in rows], "o-", label="$a_1$, all held-out prompts")
    ax.plot(x, [r["by_kind"].get("prose", {}).get("a1", float("nan")) for r in rows], "s--", label="$a_1$, prose")
    ax.plot(x, [r["a2_given_1"] for r in rows], "^-", label="$a_{2|1}$, all held-out prompts")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("training tokens (log scale)")
    ax.set_ylabel("held-out agreement")
    ax.set_ylim(0, max(0.6, max(r["a1"] for r in rows) + 0.1))
    ax.legend(fontsize=8)
    ax.set_title(textwrap.fill(machine, 90), fontsize=8)
    fig.tight_layout()
    return fig
