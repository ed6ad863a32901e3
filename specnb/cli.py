"""Command line: ``python -m specnb {prepare,check,bench,info}``.

* ``prepare``: convert the offline model to safetensors once, and time a reload.
* ``check``: exactness of speculative greedy against plain greedy on varied prompts.
* ``bench``: specnb's greedy loop vs transformers ``generate``, and speculative vs
  plain greedy, as ratios measured side by side.
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
    return 0


def _drafts(model, names: list[str]):
    from .drafts import ModelDraft, PromptLookupDraft, early_exit_model

    out = []
    for name in names:
        if name == "lookup":
            out.append(PromptLookupDraft())
        elif name.startswith("exit"):
            layers = int(name[4:])
            out.append(ModelDraft(early_exit_model(model, layers), name=f"early exit ({layers} layers)"))
        elif name == "self":
            out.append(ModelDraft(model, name="target as its own draft"))
        else:
            raise SystemExit(f"unknown draft {name!r}: use lookup, self, or exitN (e.g. exit24)")
    return out


def _check(args) -> int:
    from .check import check_exactness
    from .env import machine_line
    from .models import load_offline_target
    from .prompts import PROMPTS

    target = load_offline_target()
    prompts = PROMPTS[: args.prompts]
    drafts = _drafts(target.model, args.drafts)
    print(f"{target.label}; {len(prompts)} prompts "
          f"({', '.join(sorted({p.kind for p in prompts}))}), k in {args.k}, {args.max_new_tokens} new tokens")
    print(machine_line())
    report = check_exactness(target.model, target.tokenizer, prompts, drafts, tuple(args.k), args.max_new_tokens)
    print(report.table())
    total = sum(report.total.values())
    matched = sum(report.matched.values())
    print(f"{matched}/{total} speculative runs identical to plain greedy")
    return 0 if report.all_match else 1


def _bench(args) -> int:
    from .bench import baseline_vs_generate, speculative_vs_greedy
    from .drafts import PromptLookupDraft
    from .env import machine_line
    from .models import load_offline_target
    from .prompts import PROMPTS, by_kind

    target = load_offline_target()
    print(f"{target.label}; {args.max_new_tokens} new tokens, {args.repeats} repeats")
    print(machine_line())
    prompts = [p for p in PROMPTS if p.kind in ("code", "prose")][: args.prompts]
    base = baseline_vs_generate(target.model, target.tokenizer, prompts, args.max_new_tokens, args.repeats)
    print(base.summary())
    if not args.skip_speculative:
        for kind in ("grounded", "prose"):
            timing = speculative_vs_greedy(target.model, target.tokenizer, PromptLookupDraft(),
                                           by_kind(kind)[: args.prompts], args.k, args.max_new_tokens, args.repeats)
            print(f"[{kind}] {timing.summary()}")
    return 0


def _info(args) -> int:
    import json

    from .env import machine_info

    print(json.dumps(machine_info(), indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specnb", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="convert the offline model to safetensors (once)")
    p.add_argument("--force", action="store_true", help="convert again even if cached")
    p.set_defaults(func=_prepare)
    p = sub.add_parser("check", help="speculative greedy == plain greedy, on the offline model")
    p.add_argument("--prompts", type=int, default=22, help="how many of the built-in prompts (max 22)")
    p.add_argument("--k", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--drafts", nargs="+", default=["lookup", "exit24"], help="lookup, self, exitN")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.set_defaults(func=_check)
    p = sub.add_parser("bench", help="tokens/s ratios measured side by side")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=4, help="k for the speculative rows")
    p.add_argument("--skip-speculative", action="store_true")
    p.set_defaults(func=_bench)
    p = sub.add_parser("info", help="machine and library versions")
    p.set_defaults(func=_info)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
