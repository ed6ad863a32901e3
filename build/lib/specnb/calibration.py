"""Out-of-sample inputs for chapter 5's refined cost model: calibrate a draft on other prompts, then predict.

The refined model (:func:`specnb.costmodel.refined_speedup`) needs, for a draft
at a given k: the survival s_i = P(a round keeps at least i drafts), the
tokens the draft proposes per round (for the verify cost T(m+1)/T(1)), and the
draft's cost per round. Taken from the very runs it predicts, those inputs make
the prediction in-sample. Here they come from elsewhere:

* **acceptance** from *calibration prompts* that the predicted runs never use.
  With greedy decoding the output is the target's greedy text, so a round can
  be replayed without the target: :func:`replay` runs the loop's steps 1, 3
  and 5 (propose, accept the longest prefix that agrees with the greedy text,
  update the draft) against the target's greedy continuation of the prompt.
  A model draft is replayed from one teacher-forced forward
  (:class:`TeacherForcedDraft`): its argmax after each true prefix is what it
  would propose there, since an accepted chain *is* the true prefix;
* **c** from a separate timing: :func:`specnb.timing.cost_ratio` (paired
  1-token forwards) for a model draft, the replayed ``propose`` calls for a
  draft without a model (prompt lookup);
* **T(n)** from :func:`specnb.timing.forward_time_curve` (random tokens, a fixed
  context), measured apart from any run.

:func:`calibrate` does all three for one draft on a list of prompts;
:func:`predict_speedup` predicts its speedup at a k for runs it has not seen.
Nothing is fitted: the formula has no free constant, and no input is computed
from the runs being predicted.

Not covered: sampling mode (acceptance there is random, see chapter 6), and
drafts whose proposals need the target's verify forward (a feature-level head):
replay those with real runs (:meth:`Calibration.from_records`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .cache import forward, new_cache
from .costmodel import draft_cost_per_round, refined_speedup, speedup
from .decode import cut_drafts, greedy
from .drafts import Draft, ModelDraft
from .sweep import pooled_positions


class TeacherForcedDraft(Draft):
    """A model draft replayed from one forward over the prompt and the target's greedy text.

    ``argmax[t]`` is the draft's greedy token after ``sequence[:t+1]``, shape
    ``(len(sequence),)``. Proposing after a prefix of length L returns
    ``argmax[L-1 : L-1+k]``: exactly the real draft's chain as long as it agrees
    with the greedy text; past its first disagreement the tokens differ from the
    real draft's, but those are rejected either way, and a model draft proposes
    k tokens every round, so the counts are the same.
    """

    def __init__(self, model: torch.nn.Module, sequence: list[int], name: str = "teacher-forced draft") -> None:
        super().__init__()
        self.name = name
        with torch.inference_mode():
            logits = forward(model, list(sequence), new_cache(model))  # (len(sequence), vocab)
        self.argmax = logits.argmax(dim=-1).tolist()
        self.sequence = list(sequence)

    def propose(self, ids: list[int], k: int) -> list[int]:
        # Near the end of a text that stops at EOS it proposes fewer than k (it cannot know the draft
        # model's tokens past the text); those would all come after a rejection, so acceptance is unchanged.
        if ids != self.sequence[:len(ids)]:
            raise ValueError("TeacherForcedDraft replays one sequence: ids must be a prefix of it")
        out = self.argmax[len(ids) - 1: len(ids) - 1 + k]
        if self.eos_token_id is not None and self.eos_token_id in out:
            out = out[:out.index(self.eos_token_id) + 1]
        return out


@dataclass
class Replayed:
    """The rounds of one replayed run: what the loop would have drafted and accepted."""

    drafted: list[int]  # m per round
    accepted: list[int]  # n per round
    t_propose: list[float]  # seconds in propose() per round (meaningful for drafts that run for real)
    tokens: int


def replay(draft: Draft, prompt_ids: list[int], greedy_tokens: list[int], k: int, max_new_tokens: int,
           eos_token_id: int | None = None) -> Replayed:
    """The rounds :func:`specnb.decode.speculative_greedy` would run, with the target's argmaxes
    read from ``greedy_tokens`` (the target's greedy output for ``prompt_ids``) instead of computed.

    Same budget and EOS rules as the loop. Exact wherever the loop's output is
    greedy's (float32 here; chapter 2 counts near-ties in lower precision).
    """
    ids, out = list(prompt_ids), []
    ended_by_eos = eos_token_id is not None and bool(greedy_tokens) and greedy_tokens[-1] == eos_token_id
    rec = Replayed([], [], [], 0)
    draft.reset(eos_token_id)
    while len(out) < max_new_tokens and len(out) < len(greedy_tokens):
        budget = max_new_tokens - len(out)
        t0 = time.perf_counter()
        drafts = draft.propose(ids, min(k, budget - 1))  # 1. fetch candidates
        rec.t_propose.append(time.perf_counter() - t0)
        drafts = cut_drafts(drafts, budget, eos_token_id)
        g = greedy_tokens[len(out): len(out) + len(drafts) + 1]  # 2. the target's choices, known
        if len(g) < len(drafts) + 1 and not ended_by_eos:
            raise ValueError("greedy_tokens ends before the budget: generate it with the same max_new_tokens")
        n = 0  # (greedy text that ends with EOS: the drafts disagree with it at or before its end)
        while n < len(drafts) and n < len(g) and drafts[n] == g[n]:  # 3. longest agreeing prefix
            n += 1
        new = drafts[:n] + g[n:n + 1]  # + the target's token (none left when every draft, EOS included, matched)
        stop = eos_token_id is not None and eos_token_id in new
        if stop:
            new = new[: new.index(eos_token_id) + 1]
        ids, out = ids + new, out + new
        rec.drafted.append(len(drafts))
        rec.accepted.append(n)
        if stop:
            break
        draft.update(ids, n)  # 5. the draft rolls back its own state
    rec.tokens = len(out)
    return rec


def _pooled(accepts, attempts) -> float:
    """Accepted / verified drafts over all positions (counts, not a mean of per-position rates); nan if none."""
    total = float(np.sum(attempts))
    return float(np.sum(accepts)) / total if total else float("nan")


@dataclass
class KStats:
    """Calibration at one k, pooled over the calibration prompts' rounds."""

    k: int
    rounds: int
    survival: list[float]  # s_i, i = 1..k: fraction of rounds keeping at least i drafts
    a_pos: list[float]  # a_i = P(draft i accepted | drafts before it accepted), nan where never verified
    drafted_hist: list[int]  # rounds that drafted m tokens, m = 0..k
    draft_cost: float  # draft time per round in target forwards (T(1) units)
    a: float = float("nan")  # accepted / verified drafts, pooled over positions (the simple model's a)


@dataclass
class Calibration:
    """What :func:`calibrate` measured for one draft (and one kind of text)."""

    draft: str
    stats: dict[int, KStats]  # k -> calibration at that k
    c: float | None  # cost ratio from a separate timing (model drafts), else None
    prompts: int  # calibration prompts used
    tokens: int  # greedy tokens replayed per k, summed over prompts
    note: str = ""
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_rounds(cls, draft: str, rounds: dict[int, list[tuple[int, int, float]]], c: float | None,
                    t1: float, prompts: int, tokens: int, note: str = "") -> "Calibration":
        """``rounds[k]``: (drafted m, accepted n, draft seconds) per calibration round at k; ``t1`` = T(1) in s.

        The draft cost per round is ``c * m`` averaged over rounds when ``c`` is
        given (a model draft: one forward per drafted token), else the measured
        draft seconds per round / ``t1`` (:func:`specnb.costmodel.draft_cost_per_round`).
        """
        stats = {}
        for k, rs in sorted(rounds.items()):
            m = np.array([r[0] for r in rs])
            n = np.array([r[1] for r in rs])
            attempts = np.array([np.sum((n >= i) & (m > i)) for i in range(k)])
            accepts = np.array([np.sum(n > i) for i in range(k)])
            cost = float(c * m.mean()) if c is not None else draft_cost_per_round(sum(r[2] for r in rs), len(rs), t1)
            stats[k] = KStats(k, len(rs), (accepts / len(rs)).tolist(),
                              [float(a / t) if t else float("nan") for a, t in zip(accepts, attempts)],
                              np.bincount(m, minlength=k + 1).tolist(), cost, _pooled(accepts, attempts))
        return cls(draft, stats, c, prompts, tokens, note)

    @classmethod
    def from_records(cls, draft: str, records: list[dict], t1: float, note: str = "real calibration runs") -> "Calibration":
        """From :func:`specnb.sweep.run_record` dicts of *other* runs (e.g. a draft that cannot be
        replayed, such as one needing the target's features): their per-position counts and draft time.
        Only the k values present in ``records`` can then be predicted."""
        stats = {}
        for k in sorted({r["k"] for r in records}):
            rs = [r for r in records if r["k"] == k]
            rounds = sum(r["rounds"] for r in rs)
            attempts, accepts = pooled_positions(rs)
            stats[k] = KStats(k, rounds, (accepts / rounds).tolist(),
                              [float(a / t) if t else float("nan") for a, t in zip(accepts, attempts)],
                              np.sum([r["drafted_hist"] for r in rs], axis=0).tolist(),
                              draft_cost_per_round(sum(r["t_draft"] for r in rs), rounds, t1),
                              _pooled(accepts, attempts))
        return cls(draft, stats, None, len({(r.get("kind"), r.get("prompt")) for r in records}),
                   sum(r["tokens"] for r in records), note)


def predict_speedup(cal: Calibration, k: int, verify: dict[int, float]) -> float:
    """The refined model's speedup at ``k``, every input from ``cal`` and the measured T(n)/T(1) ``verify``.

    ``E / (draft cost per round + mean T(m+1)/T(1))``, with ``E = 1 + sum_i s_i``
    (:func:`specnb.costmodel.refined_speedup` with ``k*c`` = the calibrated draft cost).
    """
    if k not in cal.stats:
        raise KeyError(f"{cal.draft}: not calibrated at k = {k} (calibrated: {sorted(cal.stats)}); "
                       "calibrate at that k first")
    st = cal.stats[k]
    verify_cost = sum(h * verify[m + 1] for m, h in enumerate(st.drafted_hist)) / sum(st.drafted_hist)
    return refined_speedup(st.survival, st.draft_cost / k, k, verify_cost)


def simple_prediction(cal: Calibration, k: int) -> float:
    """The simple model's speedup at ``k`` (E/C, a verify costing one forward) fed only ``cal``'s inputs.

    a = accepted / verified drafts pooled over the calibration rounds at ``k`` (:attr:`KStats.a`), c = the
    calibrated draft cost per round / k. The simple model given the same information as
    :func:`predict_speedup`: comparing the two out of sample compares the models, not their inputs.
    A draft never verified at ``k`` (a = nan) predicts E = 1.
    """
    if k not in cal.stats:
        raise KeyError(f"{cal.draft}: not calibrated at k = {k} (calibrated: {sorted(cal.stats)}); "
                       "calibrate at that k first")
    st = cal.stats[k]
    a = 0.0 if st.a != st.a else st.a
    return float(speedup(a, st.draft_cost / k, k))


@torch.inference_mode()
def calibrate(target: torch.nn.Module, tokenizer, draft: Draft, prompt_ids: list[list[int]], ks, max_new_tokens: int,
              t1: float, c: float | None = None, greedy_tokens: list[list[int]] | None = None) -> Calibration:
    """Replay ``draft`` at every k of ``ks`` on the target's greedy text of each prompt in ``prompt_ids``.

    ``t1`` is T(1) in seconds (from the forward-time curve). ``c`` is the draft's
    cost ratio from a separate timing: required for a :class:`~specnb.drafts.ModelDraft`
    (it is replayed teacher-forced, so its replay time says nothing), ignored otherwise.
    ``greedy_tokens``: the target's greedy output for each prompt, if already computed
    (several drafts calibrated on the same prompts share it).
    """
    if draft.vocab_model() is not None and not isinstance(draft, ModelDraft):
        raise ValueError(f"{draft.name!r} wraps a model draft: calibration replays model drafts teacher-forced, "
                         "which a wrapper (a schedule, a recorder) would change; calibrate the inner ModelDraft")
    if isinstance(draft, ModelDraft) and c is None:
        raise ValueError("a model draft is replayed teacher-forced: pass its c, measured with "
                         "specnb.timing.cost_ratio(target, draft.model)")
    eos = tokenizer.eos_token_id
    rounds: dict[int, list[tuple[int, int, float]]] = {k: [] for k in ks}
    tokens = 0
    for i, ids in enumerate(prompt_ids):
        g = greedy_tokens[i] if greedy_tokens is not None else greedy(target, ids, max_new_tokens, eos).tokens
        tokens += len(g)
        replayer = TeacherForcedDraft(draft.model, ids + g, draft.name) if isinstance(draft, ModelDraft) else draft
        for k in ks:
            rec = replay(replayer, ids, g, k, max_new_tokens, eos)
            rounds[k] += list(zip(rec.drafted, rec.accepted, rec.t_propose))
    return Calibration.from_rounds(draft.name, rounds, c if isinstance(draft, ModelDraft) else None, t1,
                                   len(prompt_ids), tokens)
