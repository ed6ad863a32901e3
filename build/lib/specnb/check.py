"""Exactness check: does speculative greedy reproduce plain greedy, token for token?

Runs plain greedy once per prompt, then speculative greedy for every draft and k,
and compares. A mismatch is reported with its position, the two tokens, and the
target's logit margin (top-1 minus top-2) there in each run: a tiny margin means a
float near-tie between a 1-token and a (k+1)-token forward (chapter 2); a
large one means a bug.

:func:`compare_backends` asks the same question of the kernels (:mod:`specnb.kernels`): does plain
greedy give the same tokens on MKL and on oneDNN? Two libraries sum in different orders, so a
near-tie can flip; each divergence is reported with both runs' logit margins there.

Not covered: sampling (exactness in distribution is chapter 6).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tqdm.auto import tqdm

from .decode import greedy, speculative_greedy
from .drafts import Draft
from .kernels import using
from .prompts import Prompt, encode
from .tree_decode import speculative_tree_greedy


@dataclass
class Mismatch:
    prompt_index: int
    kind: str
    draft: str
    k: int
    position: int  # index into the generated tokens of the first difference
    greedy_token: int
    spec_token: int
    greedy_margin: float  # plain greedy's top1 - top2 logit at that position
    spec_margin: float  # the verify forward's top1 - top2 logit at that position


@dataclass
class CheckReport:
    total: dict = field(default_factory=dict)  # (draft, k) -> runs
    matched: dict = field(default_factory=dict)  # (draft, k) -> runs identical to greedy
    acceptance: dict = field(default_factory=dict)  # (draft, k) -> list of per-run acceptance rates
    mismatches: list[Mismatch] = field(default_factory=list)
    prompts: int = 0
    ended_by_eos: int = 0  # prompts whose plain greedy run stopped at EOS, not at max_new_tokens

    @property
    def all_match(self) -> bool:
        return not self.mismatches

    def table(self) -> str:
        w = max([28] + [len(draft) for draft, _ in self.total])
        lines = [f"{'draft':<{w}} {'k':>2}  {'identical':>9}  {'accepted/drafted':>16}"]
        for key in self.total:
            draft, k = key
            accs = [a for a in self.acceptance[key] if a == a]
            mean_a = sum(accs) / len(accs) if accs else float("nan")
            lines.append(f"{draft:<{w}} {k:>2}  {self.matched[key]:>4}/{self.total[key]:<4}  {mean_a:16.3f}")
        for m in self.mismatches:
            lines.append(f"MISMATCH prompt {m.prompt_index} ({m.kind}) draft={m.draft} k={m.k}: position {m.position}, "
                         f"greedy {m.greedy_token} vs speculative {m.spec_token}; target logit margin there "
                         f"{m.greedy_margin:.4f} (1-token forward) / {m.spec_margin:.4f} (verify forward)")
        return "\n".join(lines)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where a and b differ (or where one ends), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check_exactness(model, tokenizer, prompts: list[Prompt], drafts: list[Draft], ks=(1, 2, 4, 8),
                    max_new_tokens: int = 32, progress: bool = True, rollback_mode: str = "exact") -> CheckReport:
    """Compare speculative greedy with plain greedy on every prompt, draft and k.

    ``rollback_mode`` is passed to :func:`specnb.decode.speculative_greedy`; anything but ``"exact"`` is a
    deliberately broken loop, for negative controls: the check must then report mismatches. Tree drafts
    run the tree loop with at most k nodes; for them ``rollback_mode`` names one of
    :data:`specnb.tree.TREE_BUGS`.
    """
    report = CheckReport()
    eos = tokenizer.eos_token_id
    jobs = len(prompts) * (1 + len(drafts) * len(ks))
    bar = tqdm(total=jobs, desc="exactness", disable=not progress)
    for i, prompt in enumerate(prompts):
        ids = encode(tokenizer, prompt)
        base = greedy(model, ids, max_new_tokens, eos, record_margins=True)
        report.prompts += 1
        report.ended_by_eos += base.stop == "eos"
        bar.update()
        for draft in drafts:
            for k in ks:
                key = (draft.name, k)
                if draft.proposes_trees:  # chapter 8: k is the tree's node budget
                    spec = speculative_tree_greedy(model, draft, ids, k, max_new_tokens, eos, bug=rollback_mode)
                else:
                    spec = speculative_greedy(model, draft, ids, k, max_new_tokens, eos, rollback_mode=rollback_mode)
                report.total[key] = report.total.get(key, 0) + 1
                report.acceptance.setdefault(key, []).append(spec.acceptance_rate)
                pos = first_difference(base.tokens, spec.tokens)
                if pos is None:
                    report.matched[key] = report.matched.get(key, 0) + 1
                else:
                    report.matched.setdefault(key, 0)
                    report.mismatches.append(Mismatch(
                        i, prompt.kind, draft.name, k, pos,
                        base.tokens[pos] if pos < len(base.tokens) else -1,
                        spec.tokens[pos] if pos < len(spec.tokens) else -1,
                        base.margins[pos] if pos < len(base.margins) else float("nan"),
                        spec.margins[pos] if pos < len(spec.margins) else float("nan")))
                bar.update()
    bar.close()
    return report


@dataclass
class BackendDivergence:
    prompt_index: int
    kind: str
    position: int  # index into the generated tokens of the first difference
    tokens: dict  # backend -> its token there
    margins: dict  # backend -> its top1 - top2 logit there


def compare_backends(model, tokenizer, prompts: list[Prompt], max_new_tokens: int = 32,
                     backends=("mkl", "onednn", "skinny"), progress: bool = True) -> tuple[int, list[BackendDivergence]]:
    """Plain greedy on each backend for every prompt: ``(prompts identical on all, divergences)``.

    A backend that cannot run here (skinny without a C++ compiler) is left out rather than run as its fallback.

    The model's own kernels are restored afterwards.
    """
    from .skinny import unavailable

    backends = tuple(b for b in backends if b != "skinny" or unavailable() is None)
    eos = tokenizer.eos_token_id
    same, out = 0, []
    for i, prompt in enumerate(tqdm(prompts, desc="greedy per backend", disable=not progress)):
        ids = encode(tokenizer, prompt)
        runs = {}
        for b in backends:
            with using(model, b):
                runs[b] = greedy(model, ids, max_new_tokens, eos, record_margins=True)
        first = runs[backends[0]]
        positions = [first_difference(first.tokens, r.tokens) for r in runs.values()]
        positions = [p for p in positions if p is not None]
        if not positions:
            same += 1
            continue
        pos = min(positions)
        out.append(BackendDivergence(
            i, prompt.kind, pos, {b: r.tokens[pos] if pos < len(r.tokens) else -1 for b, r in runs.items()},
            {b: r.margins[pos] if pos < len(r.margins) else float("nan") for b, r in runs.items()}))
    return same, out


def backends_text(same: int, total: int, divergences: list[BackendDivergence]) -> str:
    """:func:`compare_backends`'s result as lines of text."""
    lines = [f"plain greedy identical under every backend on {same}/{total} prompts"]
    for d in divergences:
        lines.append(f"BACKENDS DIFFER prompt {d.prompt_index} ({d.kind}) at position {d.position}: "
                     + ", ".join(f"{b} token {d.tokens[b]} (margin {d.margins[b]:.4f})" for b in d.tokens))
    return "\n".join(lines)
