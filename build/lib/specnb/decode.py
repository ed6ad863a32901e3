"""Plain greedy decoding (the baseline) and speculative greedy decoding.

Both work on one sequence (batch 1) of token ids and return a
:class:`DecodeResult`: the generated tokens, forward counts, wall time and,
for speculative decoding, one :class:`RoundStats` per round.

Names follow the book's notation page: ``k`` drafted tokens per round (the paper's gamma,
Leviathan et al. 2023), ``n`` of them accepted (``n`` in their algorithm 1). ``DecodeResult.acceptance_rate`` is
accepted / drafted, the figure most write-ups report; the book's ``a`` (accepted per *verified*
draft, the notation page's) is ``DecodeResult.a``.
The numbered steps in :func:`speculative_greedy` are the ones the book uses.

Sampling mode (chapter 6): :func:`sample` and :func:`speculative_sample`, with the
rejection rule from ``sampling.py``. Not covered here: batches of sequences.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch

from .cache import forward, forward_features, new_cache, rollback
from .drafts import Draft
from .models import check_vocab_sizes, context_length
from .sampling import (DraftQ, Residual, SamplingParams, draft_distributions, overlap, residual, sample_token,
                       speculative_round, warp)

# The broken rollbacks of chapter 3, kept as negative controls.
ROLLBACKS = ("exact", "skip-target", "one-too-few")


@dataclass
class RoundStats:
    """One speculative round."""

    drafted: int  # tokens the draft proposed (after cutting at EOS and at the budget)
    accepted: int  # n: the longest prefix of them the target agreed with
    emitted: int  # tokens added to the output this round (accepted + 1, fewer at EOS/budget)
    bonus: bool  # all drafted tokens accepted, so the target's extra token came free
    draft_forwards: int  # draft model forwards this round (0 for prompt lookup)
    t_draft: float  # seconds spent proposing
    t_target: float  # seconds in the target's verify forward


@dataclass
class DecodeResult:
    """What a decoding loop returns."""

    tokens: list[int]  # generated tokens only (prompt excluded)
    prompt_len: int
    wall_time: float  # seconds, prefill included
    target_forwards: int  # prefill counted as one
    draft_forwards: int = 0
    stop: str = "max_new_tokens"  # or "eos"
    margins: list[float] = field(default_factory=list)  # target top1 - top2 logit at each emitted token
    rounds: list[RoundStats] = field(default_factory=list)
    t_prefill: float = 0.0

    @property
    def drafted(self) -> int:
        return sum(r.drafted for r in self.rounds)

    @property
    def accepted(self) -> int:
        return sum(r.accepted for r in self.rounds)

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted over the whole generation (nan if nothing was drafted). Not the book's
        ``a``: drafts after a round's first rejection are never verified but count as failures here."""
        return self.accepted / self.drafted if self.drafted else float("nan")

    @property
    def a(self) -> float:
        """The book's a: accepted / verified drafts (a draft is verified when every draft before it in
        its round was accepted; nan if nothing was verified)."""
        verified = sum(r.accepted + (r.accepted < r.drafted) for r in self.rounds)
        return self.accepted / verified if verified else float("nan")

    @property
    def tokens_per_round(self) -> float:
        return len(self.tokens) / len(self.rounds) if self.rounds else float("nan")

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.wall_time if self.wall_time > 0 else float("nan")

    @property
    def t_draft(self) -> float:
        return sum(r.t_draft for r in self.rounds)

    @property
    def t_target(self) -> float:
        return sum(r.t_target for r in self.rounds) + self.t_prefill


def _margin(logits: torch.Tensor) -> torch.Tensor:
    """``logits: (n, vocab)`` -> ``(n,)`` top-1 minus top-2 logit: how close the argmax was to a tie."""
    top2 = logits.float().topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


def validate(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int, k: int | None = None) -> list[int]:
    """Check the inputs of a decoding call; return the prompt as a list of ints."""
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() == 2:
            if prompt_ids.shape[0] != 1:
                raise ValueError(f"one sequence at a time: got a batch of {prompt_ids.shape[0]}")
            prompt_ids = prompt_ids[0]
        prompt_ids = prompt_ids.tolist()
    prompt_ids = [int(t) for t in prompt_ids]
    if not prompt_ids:
        raise ValueError("empty prompt: give at least one token (e.g. the tokenizer's BOS token, or some text)")
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
        raise ValueError(f"k must be an integer >= 1 (the number of tokens drafted per round), got {k!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    ctx = context_length(model)
    if len(prompt_ids) + max_new_tokens > ctx:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) = "
            f"{len(prompt_ids) + max_new_tokens} exceeds the model's context of {ctx} tokens: "
            "shorten the prompt or lower max_new_tokens")
    return prompt_ids


@torch.inference_mode()
def greedy(model: torch.nn.Module, prompt_ids, max_new_tokens: int, eos_token_id: int | None = None,
           record_margins: bool = False) -> DecodeResult:
    """Plain greedy decoding with a KV cache: one target forward per token.

    The prefill feeds the whole prompt (only its last position goes through the
    LM head); each later forward feeds one token. Stops after EOS (kept in the
    output) or ``max_new_tokens``.
    """
    ids = validate(model, prompt_ids, max_new_tokens)
    cache = new_cache(model)
    start = time.perf_counter()
    tokens: list[int] = []
    margins: list[float] = []
    todo = ids
    stop = "max_new_tokens"
    forwards = 0
    t_prefill = 0.0
    while len(tokens) < max_new_tokens:
        logits = forward(model, todo, cache, logits_to_keep=1)  # (1, vocab)
        forwards += 1
        if forwards == 1:
            t_prefill = time.perf_counter() - start
        token = int(logits[-1].argmax())
        if record_margins:
            margins.append(float(_margin(logits)[-1]))
        tokens.append(token)
        if token == eos_token_id:
            stop = "eos"
            break
        todo = [token]
    return DecodeResult(tokens, len(ids), time.perf_counter() - start, forwards, stop=stop,
                        margins=margins, t_prefill=t_prefill)


class GreedyRule:
    """Greedy acceptance: keep the longest prefix of drafts equal to the target's argmaxes, then its own token."""

    def propose(self, draft: Draft, ids: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        return draft.propose(ids, k), None

    def verify(self, logits: torch.Tensor, drafts: list[int], q: torch.Tensor | None,
               result: DecodeResult) -> tuple[int, int]:
        """``logits: (m+1, vocab)`` -> (n accepted, the target's token after them)."""
        g = logits.argmax(dim=-1).tolist()  # g[i]: the target's greedy token after ids + drafts[:i]
        n = 0
        while n < len(drafts) and drafts[n] == g[n]:
            n += 1
        result.margins += _margin(logits[: n + 1]).tolist()
        return n, g[n]


class SamplingRule:
    """The rejection rule of :mod:`specnb.sampling` (chapter 6): accept d_i with probability min(1, p/q)."""

    def __init__(self, params: SamplingParams, generator: torch.Generator, vocab: int,
                 residual_fn: Residual = residual, draft_q: DraftQ = draft_distributions) -> None:
        self.params, self.generator, self.vocab = params, generator, vocab
        self.residual_fn, self.draft_q = residual_fn, draft_q

    def propose(self, draft: Draft, ids: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        return draft.propose_sampled(ids, k, self.params, self.generator, self.vocab, self.draft_q)

    def verify(self, logits: torch.Tensor, drafts: list[int], q: torch.Tensor | None,
               result: DecodeResult) -> tuple[int, int]:
        p = warp(logits, self.params)  # (m+1, vocab)
        m = len(drafts)
        n, token = speculative_round(p, q, drafts, self.generator, self.residual_fn)
        result.overlaps += overlap(p[: min(n + 1, m)], q[: min(n + 1, m)]).tolist()
        return n, token


@dataclass
class Prefill:
    """The target's state after all but the last token of one prompt, kept for many runs on it.

    Runs that repeat one prompt (a distribution check draws hundreds of samples) can start from
    a copy of this state instead of prefilling again: the copy holds the very keys and values
    the prefill computed, so every token of the run is what a fresh prefill would give (a test
    checks this). Such a run's ``t_prefill`` is the original prefill's time and its
    ``wall_time`` leaves that prefill out: use it for tokens and distributions, not for speed.
    """

    ids: list[int]  # the whole prompt; the cache holds ids[:-1]
    cache: object  # DynamicCache, never mutated: each run gets a deep copy
    hidden: torch.Tensor | None  # (len(ids) - 1, F): the prefill's features, or None
    layers: tuple[int, ...] | None  # the feature layers ``hidden`` came from (None: no features)
    seconds: float  # the prefill's own time


@torch.inference_mode()
def prefill(target: torch.nn.Module, prompt_ids, draft: Draft | None = None) -> Prefill:
    """Prefill ``target`` on all but the last token of ``prompt_ids`` once, for :class:`Prefill`
    reuse; with a ``draft`` that reads features (a trained head), keep the features it reads."""
    ids = validate(target, prompt_ids, 1)
    cache = new_cache(target)
    layers = tuple(draft.feature_layers) if draft is not None and draft.uses_features else None
    start = time.perf_counter()
    hidden = None
    if len(ids) > 1:
        if layers is not None:
            _, hidden = forward_features(target, ids[:-1], cache, logits_to_keep=1, layers=layers)
        else:
            forward(target, ids[:-1], cache, logits_to_keep=1)
    return Prefill(list(ids), cache, hidden, layers, time.perf_counter() - start)


def start_loop(target: torch.nn.Module, draft: Draft, ids: list[int], eos_token_id: int | None,
               result: DecodeResult, prefilled: Prefill | None = None):
    """Step 0 of every speculative loop (chain or tree): check the draft's vocabulary, reset it, and
    prefill all but the last prompt token, handing the prefill's features to a draft that reads them.
    With ``prefilled`` (:func:`prefill` on the same prompt), start from a copy of its state instead.

    Invariant from here on: the target cache holds every token of ``ids`` except the last one.
    Returns ``(cache, start)`` with ``start`` the loop's ``perf_counter`` origin.
    """
    if draft.vocab_model() is not None:  # a draft running its own model, however wrapped
        check_vocab_sizes(target, draft.vocab_model())
    draft.reset(eos_token_id)
    fresh = prefilled is None
    if fresh:
        start = time.perf_counter()
        prefilled = prefill(target, ids, draft)
    else:
        if list(prefilled.ids) != list(ids):
            raise ValueError("prefilled holds the prefill of another prompt: call decode.prefill on this prompt")
        wanted = tuple(draft.feature_layers) if draft.uses_features else None
        if prefilled.layers != wanted:
            raise ValueError(f"prefilled kept the features of layers {prefilled.layers}, this draft reads {wanted}: "
                             "call decode.prefill(target, ids, draft) with this draft")
    # A reused prefill is copied, so that every run starts from the same state; its time is not this run's.
    cache = prefilled.cache if fresh else copy.deepcopy(prefilled.cache)
    if not fresh:
        start = time.perf_counter()
    if len(ids) > 1:
        if draft.uses_features:
            draft.observe(prefilled.hidden if fresh else prefilled.hidden.clone())  # (len(ids) - 1, F)
        result.target_forwards += 1
        result.t_prefill = prefilled.seconds
    return cache, start


def cut_drafts(drafts: list[int], budget: int, eos_token_id: int | None) -> list[int]:
    """The drafts a round may verify: at most ``budget - 1`` (the round adds one token of the
    target's, and the output may hold ``budget`` more) and none after an EOS. Used by the loop
    and by :func:`specnb.calibration.replay`, so that both cut alike."""
    drafts = drafts[: max(budget - 1, 0)]
    if eos_token_id is not None and eos_token_id in drafts:
        drafts = drafts[: drafts.index(eos_token_id) + 1]
    return drafts


def _speculative_loop(target: torch.nn.Module, draft: Draft, ids: list[int], k: int, max_new_tokens: int,
                      eos_token_id: int | None, rule, result: DecodeResult, rollback_mode: str = "exact",
                      prefilled: Prefill | None = None) -> DecodeResult:
    """The loop shared by greedy and sampling mode; ``rule`` proposes and accepts (steps 1 and 3).

    Drafts with ``uses_features`` (a trained head) get the target's last hidden states of
    every position it has kept: those of the prefill, then each round's n + 1 kept positions.
    """
    if draft.proposes_trees:
        raise ValueError(f"{draft.name} proposes token trees, which this chain loop cannot verify (it would "
                         "drop every branch but one): use specnb.tree_decode.speculative_tree_greedy")
    feats = draft.uses_features
    cache, start = start_loop(target, draft, ids, eos_token_id, result, prefilled)
    while len(result.tokens) < max_new_tokens:
        budget = max_new_tokens - len(result.tokens)
        # 1. Fetch candidates: never more than the budget leaves room for (the round adds one more).
        t0 = time.perf_counter()
        forwards_before = draft.forwards
        drafts, q = rule.propose(draft, ids, min(k, budget - 1))
        drafts = cut_drafts(drafts, budget, eos_token_id)
        if q is not None:
            q = q[: len(drafts)]
        t1 = time.perf_counter()
        # 2. One target forward on the last token and the drafts: logits (m+1, vocab).
        if feats:
            logits, hidden = forward_features(target, [ids[-1]] + drafts, cache, layers=draft.feature_layers)
        else:
            logits = forward(target, [ids[-1]] + drafts, cache)
        t2 = time.perf_counter()
        # 3. Accept n drafts and one token of the target's (correction, residual draw or bonus).
        m = len(drafts)
        n, token = rule.verify(logits, drafts, q, result)
        new = drafts[:n] + [token]
        # 4. Discard the keys/values of the m - n rejected drafts.
        if rollback_mode == "exact":
            rollback(cache, m - n)
        elif rollback_mode == "one-too-few":
            rollback(cache, max(m - n - 1, 0))
        if eos_token_id is not None and eos_token_id in new:
            new = new[: new.index(eos_token_id) + 1]
            result.stop = "eos"
        ids = ids + new
        result.tokens += new
        result.margins = result.margins[: len(result.tokens)]
        result.target_forwards += 1
        result.rounds.append(RoundStats(m, n, len(new), bool(m) and n == m, draft.forwards - forwards_before,
                                        t1 - t0, t2 - t1))
        if result.stop == "eos":
            break
        # 5. Let the draft roll back its own state (and see the target's features of what was kept).
        if feats:
            draft.observe(hidden[: n + 1])  # (n+1, H): ids[-1] of last round and the n accepted drafts
        draft.update(ids, n)
    result.draft_forwards = draft.forwards
    result.wall_time = time.perf_counter() - start
    return result


@torch.inference_mode()
def speculative_greedy(target: torch.nn.Module, draft: Draft, prompt_ids, k: int, max_new_tokens: int,
                       eos_token_id: int | None = None, rollback_mode: str = "exact",
                       prefilled: Prefill | None = None) -> DecodeResult:
    """Speculative greedy decoding: output identical to :func:`greedy` on ``target``.

    Each round: (1) the draft proposes up to k tokens d_1..d_k; (2) the target
    scores the last token and all k drafts in one forward, ``logits: (k+1, vocab)``,
    whose argmaxes g_0..g_k are its own greedy choices after each prefix;
    (3) accept the longest prefix with d_i == g_{i-1} (n tokens) and append
    g_n: the correction if n < k, the bonus token if n == k; (4) roll the
    target cache back by the k - n rejected positions; (5) tell the draft.

    ``rollback_mode`` other than ``"exact"`` is a deliberately broken variant
    (chapter 3) kept for negative controls: ``"skip-target"`` never crops the
    target cache, ``"one-too-few"`` crops one position fewer than it should.
    """
    if rollback_mode not in ROLLBACKS:
        raise ValueError(f"rollback_mode must be one of {ROLLBACKS}, got {rollback_mode!r}")
    ids = validate(target, prompt_ids, max_new_tokens, k)
    result = DecodeResult([], len(ids), 0.0, 0)
    return _speculative_loop(target, draft, ids, k, max_new_tokens, eos_token_id, GreedyRule(), result,
                             rollback_mode, prefilled)


# ---------------------------------------------------------------------------------------------
# Sampling mode (chapter 6): the same loops, with the rejection rule of specnb.sampling.


@dataclass
class SamplingResult(DecodeResult):
    """A :class:`DecodeResult` from a sampling loop, with what chapter 6 measures."""

    seed: int = 0
    overlaps: list[float] = field(default_factory=list)  # sum_x min(p_i, q_i) at every verified draft position

    @property
    def verified(self) -> int:
        """Draft positions the rule looked at: each accepted one plus the first rejected one per round."""
        return len(self.overlaps)

    @property
    def position_acceptance(self) -> float:
        """Accepted / verified: the measured counterpart of the mean overlap (nan if nothing was verified)."""
        return self.accepted / self.verified if self.verified else float("nan")

    @property
    def mean_overlap(self) -> float:
        return sum(self.overlaps) / len(self.overlaps) if self.overlaps else float("nan")


@torch.inference_mode()
def sample(model: torch.nn.Module, prompt_ids, max_new_tokens: int, params: SamplingParams = SamplingParams(),
           seed: int = 0, eos_token_id: int | None = None) -> SamplingResult:
    """Plain sampling with a KV cache, one forward per token: each token drawn from ``warp(logits, params)``.

    The baseline of chapter 6. Temperature 0 gives :func:`greedy`'s tokens.
    """
    ids = validate(model, prompt_ids, max_new_tokens)
    generator = torch.Generator().manual_seed(seed)
    cache = new_cache(model)
    start = time.perf_counter()
    result = SamplingResult([], len(ids), 0.0, 0, seed=seed)
    todo = ids
    while len(result.tokens) < max_new_tokens:
        logits = forward(model, todo, cache, logits_to_keep=1)  # (1, vocab)
        result.target_forwards += 1
        if result.target_forwards == 1:
            result.t_prefill = time.perf_counter() - start
        token = sample_token(warp(logits[-1], params), generator)
        result.tokens.append(token)
        if token == eos_token_id:
            result.stop = "eos"
            break
        todo = [token]
    result.wall_time = time.perf_counter() - start
    return result


@torch.inference_mode()
def speculative_sample(target: torch.nn.Module, draft: Draft, prompt_ids, k: int, max_new_tokens: int,
                       params: SamplingParams = SamplingParams(), seed: int = 0, eos_token_id: int | None = None,
                       residual_fn: Residual = residual, draft_q: DraftQ = draft_distributions,
                       rollback_mode: str = "exact", prefilled: Prefill | None = None) -> SamplingResult:
    """Speculative sampling: each emitted token has the distribution :func:`sample` would give it.

    The steps of :func:`speculative_greedy`, with the rule of :mod:`specnb.sampling`:
    (1) the draft samples up to k tokens from its warped q and reports ``q: (m, vocab)``;
    (2) one target forward gives ``logits: (m+1, vocab)``, warped with the same
    ``params`` into ``p: (m+1, vocab)``; (3) accept each draft with probability
    min(1, p/q), at the first rejection emit a token from norm(max(0, p - q)),
    else the bonus token from p[m]; (4) roll the target cache back by the m - n
    rejected positions; (5) tell the draft. One seeded generator drives the
    draft's draws and the rule's, so a seed reproduces a run.

    ``residual_fn`` and ``draft_q`` other than the defaults are the negative
    controls of :mod:`specnb.sampling` (``VARIANTS``): they break exactness on purpose, as
    ``rollback_mode`` other than ``"exact"`` does (see :func:`speculative_greedy`).
    ``prefilled`` (:func:`prefill` of this prompt) starts from a copy of a prefill done once.
    """
    if rollback_mode not in ROLLBACKS:
        raise ValueError(f"rollback_mode must be one of {ROLLBACKS}, got {rollback_mode!r}")
    ids = validate(target, prompt_ids, max_new_tokens, k)
    generator = torch.Generator().manual_seed(seed)
    rule = SamplingRule(params, generator, target.config.vocab_size, residual_fn, draft_q)
    result = SamplingResult([], len(ids), 0.0, 0, seed=seed)
    return _speculative_loop(target, draft, ids, k, max_new_tokens, eos_token_id, rule, result, rollback_mode,
                             prefilled)
