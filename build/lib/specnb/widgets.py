"""The cost-model explorer of chapter 5: sliders for a, c and k that redraw the speedup curve.

Two forms of one figure:

* :func:`explorer_html`: a self-contained HTML + JavaScript figure. Every state
  is computed here in Python (by :mod:`specnb.costmodel`) and embedded as a
  table; the script only looks values up and draws SVG. It works in the static
  book with no kernel, and in JupyterLab or Colab.
* :func:`explorer_widget`: the same with ipywidgets sliders and matplotlib, for
  a live kernel, at any a and c (not only grid points).

Both draw two curves over k: the simple model (verify costs 1 target forward)
and, when a measured T(n) is given, the same with verify costing T(k+1)/T(1).
Not covered: per-position acceptance (the sliders take a single a).
"""
from __future__ import annotations

import json
import uuid
from collections.abc import Mapping

import numpy as np

from .costmodel import optimal_k, speedup

A_GRID = np.round(np.arange(0.0, 0.951, 0.05), 3)  # 20 values
C_GRID = np.round(np.arange(0.0, 1.001, 0.025), 3)  # 41 values


def _verify_list(verify: Mapping[int, float] | None, k_max: int) -> list[float]:
    if verify is None:
        return [1.0] * k_max
    missing = [k + 1 for k in range(1, k_max + 1) if k + 1 not in verify]
    if missing:
        raise ValueError(f"verify costs T(n)/T(1) needed for n = {missing}")
    return [float(verify[k + 1]) for k in range(1, k_max + 1)]


def speedup_table(verify: Mapping[int, float] | None = None, k_max: int = 8, a_grid=A_GRID, c_grid=C_GRID):
    """``(len(a_grid), len(c_grid), k_max)`` array of E/C for k = 1..k_max (``verify``: n -> T(n)/T(1))."""
    ks = np.arange(1, k_max + 1)
    v = np.array(_verify_list(verify, k_max))
    return speedup(np.asarray(a_grid)[:, None, None], np.asarray(c_grid)[None, :, None], ks, v)


def explorer_html(verify: Mapping[int, float] | None = None, k_max: int = 8, a0: float = 0.5, c0: float = 0.1,
                  k0: int = 4, note: str = "") -> str:
    """The static explorer: sliders a, c, k; curves of speedup over k; the optimum marked.

    ``verify`` (n -> T(n)/T(1) for n = 2..k_max+1, measured) adds the second curve.
    """
    tables = {"simple": np.round(speedup_table(None, k_max), 4).tolist()}
    if verify is not None:
        tables["measured"] = np.round(speedup_table(verify, k_max), 4).tolist()
    data = {"a": A_GRID.tolist(), "c": C_GRID.tolist(), "kmax": k_max, "tables": tables,
            "a0": int(np.abs(A_GRID - a0).argmin()), "c0": int(np.abs(C_GRID - c0).argmin()), "k0": k0}
    uid = "sx" + uuid.uuid4().hex[:8]
    return f"""
<div id="{uid}" style="font-family: sans-serif; font-size: 13px; max-width: 640px">
  <div>a (acceptance) <input type="range" class="a" min="0" max="{len(A_GRID) - 1}" step="1">
       <span class="av"></span></div>
  <div>c (cost ratio) <input type="range" class="c" min="0" max="{len(C_GRID) - 1}" step="1">
       <span class="cv"></span></div>
  <div>k (drafted per round) <input type="range" class="k" min="1" max="{k_max}" step="1">
       <span class="kv"></span></div>
  <svg width="620" height="300" style="border: 1px solid #ddd; margin-top: 4px"></svg>
  <div class="out" style="margin-top: 4px"></div>
  <div style="color: #666; font-size: 11px">{note}</div>
</div>
<script>
(function() {{
  const D = {json.dumps(data)};
  const root = document.getElementById("{uid}");
  const [sa, sc, sk] = ["a", "c", "k"].map(n => root.querySelector("input." + n));
  sa.value = D.a0; sc.value = D.c0; sk.value = D.k0;
  const svg = root.querySelector("svg"), W = 620, H = 300, L = 50, R = 130, T = 12, B = 36;
  const colors = {{simple: "#1f77b4", measured: "#d62728"}};
  const names = {{simple: "verify = 1 (Leviathan)", measured: "verify = T(k+1)/T(1) measured"}};
  function el(tag, attrs, text) {{
    const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    svg.appendChild(e); return e;
  }}
  function draw() {{
    const ia = +sa.value, ic = +sc.value, k = +sk.value;
    root.querySelector(".av").textContent = D.a[ia].toFixed(2);
    root.querySelector(".cv").textContent = D.c[ic].toFixed(3);
    root.querySelector(".kv").textContent = k;
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    let ymax = 1.5;
    for (const m in D.tables) for (const v of D.tables[m][ia][ic]) ymax = Math.max(ymax, v * 1.1);
    const x = kk => L + (kk - 1) / (D.kmax - 1) * (W - L - R), y = v => H - B - v / ymax * (H - T - B);
    el("line", {{x1: L, x2: W - R, y1: y(1), y2: y(1), stroke: "#000", "stroke-dasharray": "3,3"}});
    el("line", {{x1: L, x2: L, y1: T, y2: H - B, stroke: "#000"}});
    el("line", {{x1: L, x2: W - R, y1: H - B, y2: H - B, stroke: "#000"}});
    for (let kk = 1; kk <= D.kmax; kk++) el("text", {{x: x(kk), y: H - B + 14, "text-anchor": "middle", "font-size": 11}}, kk);
    el("text", {{x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle", "font-size": 11}}, "k");
    for (let t = 0; t <= ymax; t += ymax > 4 ? 1 : 0.5)
      el("text", {{x: L - 6, y: y(t) + 4, "text-anchor": "end", "font-size": 11}}, t.toFixed(1));
    el("text", {{x: 12, y: (T + H - B) / 2, "font-size": 11, transform: `rotate(-90 12 ${{(T + H - B) / 2}})`,
                 "text-anchor": "middle"}}, "speedup E/C (x)");
    const lines = [];
    let row = 0;
    for (const m in D.tables) {{
      const v = D.tables[m][ia][ic];
      el("polyline", {{points: v.map((s, i) => x(i + 1) + "," + y(s)).join(" "), fill: "none",
                       stroke: colors[m], "stroke-width": 2}});
      const best = v.indexOf(Math.max(...v));
      el("circle", {{cx: x(best + 1), cy: y(v[best]), r: 6, fill: "none", stroke: colors[m], "stroke-width": 2}});
      el("circle", {{cx: x(k), cy: y(v[k - 1]), r: 3.5, fill: colors[m]}});
      el("text", {{x: W - R + 6, y: T + 14 + 30 * row, fill: colors[m], "font-size": 11}}, names[m]);
      el("text", {{x: W - R + 6, y: T + 28 + 30 * row++, fill: colors[m], "font-size": 11}},
         "best k=" + (best + 1) + ": " + v[best].toFixed(2) + "x");
      lines.push(names[m] + ": " + v[k - 1].toFixed(2) + "x at k=" + k + " (best k=" + (best + 1) + ", " +
                 v[best].toFixed(2) + "x" + (v[best] <= 1 ? ": never pays" : "") + ")");
    }}
    root.querySelector(".out").innerHTML = lines.join("<br>");
  }}
  [sa, sc, sk].forEach(s => s.addEventListener("input", draw));
  draw();
}})();
</script>
"""


def explorer_widget(verify: Mapping[int, float] | None = None, k_max: int = 8):
    """ipywidgets version for a live kernel: continuous a and c sliders, matplotlib redraw."""
    import ipywidgets as w
    import matplotlib.pyplot as plt

    ks = np.arange(1, k_max + 1)
    v = np.array(_verify_list(verify, k_max))

    def show(a=0.5, c=0.1, k=4):
        fig, ax = plt.subplots(figsize=(6.5, 3.4))
        curves = [("verify = 1 (Leviathan)", np.ones(k_max), "tab:blue")]
        if verify is not None:
            curves.append(("verify = T(k+1)/T(1) measured", v, "tab:red"))
        for name, vv, color in curves:
            s = speedup(a, c, ks, vv)
            best = int(s.argmax())
            ax.plot(ks, s, color=color, label=f"{name}: best k={ks[best]}, {s[best]:.2f}x")
            ax.plot(ks[best], s[best], "o", mfc="none", mec=color, ms=10)
            ax.plot(k, s[k - 1], "o", color=color)
        ax.axhline(1, color="black", linestyle=":")
        ax.set(xlabel="k", ylabel="speedup E/C (x)", xticks=ks, title=f"a = {a:.2f}, c = {c:.3f}")
        ax.legend(fontsize=8)
        plt.show()

    return w.interactive(show, a=w.FloatSlider(value=0.5, min=0, max=0.99, step=0.01),
                         c=w.FloatSlider(value=0.1, min=0, max=1, step=0.005, readout_format=".3f"),
                         k=w.IntSlider(value=4, min=1, max=k_max))


def optimum_map(a_grid, c_grid, k_max: int = 16, verify: Mapping[int, float] | None = None):
    """(best k, best speedup) over an (a, c) grid: arrays of shape ``(len(a_grid), len(c_grid))``."""
    return optimal_k(np.asarray(a_grid)[:, None], np.asarray(c_grid)[None, :], k_max, verify)
