"""Draft strategies behind one small interface: propose k tokens, then hear what was kept.

A draft sees the whole sequence (prompt + generated, as token ids) and returns
up to k proposed next tokens. After the target verifies them, the decoding loop
calls :meth:`Draft.update` with the new sequence and how many were accepted, so a
draft with state (a KV cache) can roll it back. The interface is the one of
transformers' ``CandidateGenerator``: get candidates, update.

Drafts here:

* :class:`ModelDraft`: a smaller causal LM with its own KV cache (also the
  target itself, for tests: a draft that is always right).
* :class:`PromptLookupDraft`: copy the continuation of the last n-gram's earlier
  occurrence in the context (no model, near-zero cost).

Sampling mode (chapter 6) adds :meth:`Draft.propose_sampled`, which also returns
the q each token was drawn from: a softmax for :class:`ModelDraft`, a one-hot
for deterministic drafts such as prompt lookup.

Not covered here: drafts that share the target's cache (early exit with shared
KV), and tree drafts (several candidates per position).
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import torch

from .cache import cache_length, forward, new_cache, rollback
from .kernels import kernels_of, use_kernels
from .sampling import DTYPE, DraftQ, SamplingParams, draft_distributions, sample_token


class Draft(ABC):
    """Interface every draft implements."""

    name: str = "draft"
    uses_features: bool = False  # True: the loop hands it the target's hidden states (see observe)
    feature_layers: tuple[int, ...] = ()  # which lower target layers those features also hold (cache.decoder_features)
    proposes_trees: bool = False  # True: only the tree loop (specnb.tree_decode) can verify what it proposes

    def __init__(self) -> None:
        self.forwards = 0  # draft model forwards since reset()
        self.eos_token_id: int | None = None

    def reset(self, eos_token_id: int | None = None) -> None:
        """Start a new sequence (drop any cache)."""
        self.forwards = 0
        self.eos_token_id = eos_token_id

    def _counting(self, inner, call):
        """``call()``, with the forwards it made on ``inner`` (anything with a ``forwards`` count: a wrapped
        draft, a head's state) added to this draft's count."""
        before = inner.forwards
        out = call()
        self.forwards += inner.forwards - before
        return out

    @abstractmethod
    def propose(self, ids: list[int], k: int) -> list[int]:
        """Up to ``k`` proposed tokens to follow ``ids``. May return fewer (even none)."""

    def propose_tree(self, ids: list[int], n_nodes: int):
        """Up to ``n_nodes`` drafts after ``ids`` as a :class:`specnb.tree.Tree` (chapter 8).

        This default is the chain of :meth:`propose`; tree drafts (``specnb.tree_drafts``) branch.
        """
        from .tree import Tree

        return Tree.chain(self.propose(ids, n_nodes))

    def update(self, ids: list[int], n_accepted: int) -> None:
        """``ids`` is the sequence after the round; ``n_accepted`` drafted tokens were kept."""

    def vocab_model(self) -> torch.nn.Module | None:
        """The model whose token ids this draft proposes, if it runs one of its own: its vocabulary must be
        the target's, and the loops check it. None for drafts that copy ids from the context or predict
        over the target's own vocabulary (prompt lookup, the trained head). Wrappers delegate."""
        return None

    def observe(self, features: torch.Tensor) -> None:
        """The target's last hidden states ``(m, H)`` for the next m positions of the sequence.

        Called only for drafts with ``uses_features``: once after the prefill (all prompt
        tokens but the last) and after every round (the n + 1 positions the target kept).
        """

    def propose_sampled(self, ids: list[int], k: int, params: SamplingParams, generator: torch.Generator,
                        vocab_size: int, draft_q: DraftQ = draft_distributions) -> tuple[list[int], torch.Tensor]:
        """Sampling mode (chapter 6): up to ``k`` tokens and ``q: (m, vocab)``, the distributions they were drawn from.

        This default suits deterministic drafts (prompt lookup): each token is
        the only one the draft could have proposed, so its q is one-hot, which is
        exactly the q it samples from. ``params`` and ``draft_q`` do not apply.
        """
        tokens = self.propose(ids, k)
        q = torch.nn.functional.one_hot(torch.tensor(tokens, dtype=torch.long), vocab_size).to(DTYPE)
        return tokens, q.reshape(len(tokens), vocab_size)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ModelDraft(Draft):
    """A draft model with its own KV cache, drafting greedily (argmax).

    ``faulty_rollback=True`` is the bug of chapter 3 on the draft side: after a
    rejection the draft believes its cache matches the sequence but never crops it,
    so stale keys and values stay in it. Kept for negative controls only.
    """

    def __init__(self, model: torch.nn.Module, name: str = "model draft", faulty_rollback: bool = False) -> None:
        super().__init__()
        self.model = model
        self.name = name
        self.faulty_rollback = faulty_rollback
        self.cache = None
        self.cached: list[int] = []  # the tokens whose keys/values the cache is believed to hold

    def vocab_model(self) -> torch.nn.Module:
        return self.model

    def reset(self, eos_token_id: int | None = None) -> None:
        super().reset(eos_token_id)
        self.cache = new_cache(self.model)
        self.cached = []

    def propose(self, ids: list[int], k: int) -> list[int]:
        if self.cache is None:
            self.reset(self.eos_token_id)
        if k <= 0:
            return []
        # Feed what the cache lacks (at least the last token), then draft one token per forward.
        todo = ids[len(self.cached):]
        assert todo and self.cached == ids[:len(self.cached)], "draft cache out of sync with the sequence"
        out: list[int] = []
        for _ in range(k):
            logits = forward(self.model, todo, self.cache, logits_to_keep=1)  # (1, vocab)
            self.forwards += 1
            self.cached += todo
            token = int(logits[-1].argmax())
            out.append(token)
            if token == self.eos_token_id:
                break
            todo = [token]
        return out

    def propose_sampled(self, ids: list[int], k: int, params: SamplingParams, generator: torch.Generator,
                        vocab_size: int | None = None,
                        draft_q: DraftQ = draft_distributions) -> tuple[list[int], torch.Tensor]:
        """Sampling mode (chapter 6): draw each token from ``q = warp(logits, params)`` and return
        ``(tokens, q: (m, vocab))``. Same cache handling as :meth:`propose`.

        ``draft_q`` maps the draft's logits to (the q it samples from, the q it
        reports); anything but the default is a negative control from
        :mod:`specnb.sampling` that breaks exactness on purpose.
        """
        if self.cache is None:
            self.reset(self.eos_token_id)
        vocab_size = vocab_size or self.model.config.vocab_size
        if k <= 0:
            return [], torch.zeros(0, vocab_size, dtype=DTYPE)
        todo = ids[len(self.cached):]
        assert todo and self.cached == ids[:len(self.cached)], "draft cache out of sync with the sequence"
        out: list[int] = []
        qs: list[torch.Tensor] = []
        for _ in range(k):
            logits = forward(self.model, todo, self.cache, logits_to_keep=1)  # (1, vocab)
            self.forwards += 1
            self.cached += todo
            q_draw, q_report = draft_q(logits[-1], params)  # (vocab,) each
            token = sample_token(q_draw, generator)
            out.append(token)
            qs.append(q_report)
            if token == self.eos_token_id:
                break
            todo = [token]
        return out, torch.stack(qs)

    def update(self, ids: list[int], n_accepted: int) -> None:
        # The cache holds the old sequence plus the drafts fed back in; keep only
        # what agrees with the new sequence minus its last token (not yet fed).
        keep = _common_prefix(self.cached, ids[:-1])
        if not self.faulty_rollback:
            rollback(self.cache, len(self.cached) - keep)
        self.cached = self.cached[:keep]


class PromptLookupDraft(Draft):
    """Prompt lookup decoding: find the last n tokens earlier in the context, propose what followed.

    Tries n = ``max_ngram`` down to ``min_ngram`` and takes the most recent earlier
    match that has a continuation. Costs no model forward: strong when the output
    copies from the prompt (editing, code), weak on free prose.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, name: str | None = None) -> None:
        super().__init__()
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.name = name or f"prompt lookup (n<={max_ngram})"

    def propose(self, ids: list[int], k: int) -> list[int]:
        if k <= 0:
            return []
        seq = np.asarray(ids)
        L = len(seq)
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            pattern = seq[L - n:]
            windows = np.lib.stride_tricks.sliding_window_view(seq[:L - 1], n)  # (L-n, n): starts 0..L-n-1
            starts = np.flatnonzero((windows == pattern).all(axis=1))
            if len(starts):
                start = int(starts[-1]) + n  # most recent match; continuation starts after it
                out = [int(t) for t in seq[start:start + k]]
                if self.eos_token_id is not None and self.eos_token_id in out:
                    out = out[:out.index(self.eos_token_id) + 1]
                return out
        return []


def early_exit_model(model: torch.nn.Module, n_layers: int) -> torch.nn.Module:
    """The first ``n_layers`` decoder layers of ``model``, then its final norm and LM head.

    Raw, untrained early exit (no weights are learned): chapter 4 measures how rarely it
    agrees with the full model at shallow depths and what it costs at deep ones.
    It shares no cache with the target: wrap it in :class:`ModelDraft`.
    Works for Llama-style models (``model.model.layers``).
    """
    import copy

    total = model.config.num_hidden_layers
    if not 1 <= n_layers <= total:
        raise ValueError(f"n_layers must be in 1..{total}, got {n_layers}")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = n_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:n_layers]
    small = type(model)(config)
    state = {key: value for key, value in model.state_dict().items()
             if not key.startswith("model.layers.") or int(key.split(".")[2]) < n_layers}
    missing, unexpected = small.load_state_dict(state, strict=False)
    missing = [m for m in missing if m != "lm_head.weight" or not config.tie_word_embeddings]
    if missing or unexpected:
        raise RuntimeError(f"early exit: weights did not map ({missing=}, {unexpected=})")
    small = small.to(next(model.parameters()).dtype).eval()
    if kernels_of(model) is not None:
        use_kernels(small, kernels_of(model))  # the target's kernels: one backend per run
    return small


def draft_from_name(model: torch.nn.Module, name: str) -> Draft:
    """A draft for ``model`` by short name: ``lookup`` (prompt lookup), ``exitN`` (raw early exit
    at N layers, e.g. ``exit24``), ``self`` (the target drafting for itself: always right),
    ``head`` (chapter 7's trained head; ``head@0.4`` stops a round below top probability 0.4)
    or ``hybrid`` (prompt lookup where the context has a match, else the head; ``hybrid@0.4``); tree drafts
    (chapter 8, verified by :func:`specnb.tree_decode.speculative_tree_greedy`): ``tree-head`` (EAGLE-2's
    dynamic tree from the head), ``tree-static`` (the head's top 3, each followed by its top-1 chain),
    ``tree-lookup`` (prompt lookup with several matches)."""
    if name == "lookup":
        return PromptLookupDraft()
    if name.startswith("exit") and name[4:].isdigit():
        layers = int(name[4:])
        return ModelDraft(early_exit_model(model, layers), name=f"early exit ({layers} layers)")
    if name == "self":
        return ModelDraft(model, name="target as its own draft")
    base, _, thr = name.partition("@")
    if base in ("head", "hybrid"):
        from .head_io import load_head

        try:
            threshold = float(thr) if thr else 0.0
        except ValueError:
            raise ValueError(f"bad threshold in {name!r}: use e.g. head@0.4") from None
        head_draft = HeadDraft(load_head(model)[0], threshold)
        return head_draft if base == "head" else HybridDraft(PromptLookupDraft(), head_draft,
                                                            name=f"lookup, else {head_draft.name}")
    if name in ("tree-head", "tree-static"):
        from .head_io import load_head
        from .tree_drafts import HeadTreeDraft, shape_from_branching

        head = load_head(model)[0]
        return (HeadTreeDraft(head, depth=4, branch=3, width=3) if name == "tree-head"
                else HeadTreeDraft(head, shape_from_branching((3, 1, 1))))
    if name == "tree-lookup":
        from .tree_drafts import LookupTreeDraft

        return LookupTreeDraft()
    raise ValueError(f"unknown draft {name!r}: use lookup, self, exitN (e.g. exit24), head, head@0.4, hybrid, "
                     "or the tree drafts tree-head (dynamic), tree-static, tree-lookup")


class HeadDraft(Draft):
    """A trained draft head (chapter 7): drafts from the target's own features, fed back k times.

    ``threshold`` > 0 is dynamic drafting (EAGLE-2, transformers'
    ``assistant_confidence_threshold``): the round stops before a draft whose top
    probability under the head is below it. Load a head with
    :func:`specnb.head_io.load_head`.
    """

    uses_features = True

    def __init__(self, head, threshold: float = 0.0, name: str | None = None) -> None:
        super().__init__()
        if not 0.0 <= threshold < 1.0:
            raise ValueError(f"threshold must be in [0, 1), got {threshold!r}")
        self.head = head
        self.feature_layers = head.cfg.feature_layers
        self.threshold = threshold
        self.name = name or ("trained head" + (f" (stop below p = {threshold:g})" if threshold else ""))
        self.state = None

    def reset(self, eos_token_id: int | None = None) -> None:
        from .head import HeadState

        super().reset(eos_token_id)
        self.state = HeadState(self.head)

    def observe(self, features: torch.Tensor) -> None:
        self.state.observe(features)

    def _run(self, ids: list[int], k: int, pick) -> list[int]:
        if self.state is None:
            self.reset(self.eos_token_id)
        return self._counting(self.state, lambda: self.state.draft(ids, k, pick, self.eos_token_id))

    def propose(self, ids: list[int], k: int) -> list[int]:
        vocab_ids = self.head.vocab_ids

        def pick(i: int, logits: torch.Tensor) -> int | None:
            j = int(logits.argmax())
            if self.threshold and i > 0 and float(torch.softmax(logits, -1)[j]) < self.threshold:
                return None
            return int(vocab_ids[j])

        return self._run(ids, k, pick)

    def propose_sampled(self, ids: list[int], k: int, params: SamplingParams, generator: torch.Generator,
                        vocab_size: int, draft_q: DraftQ = draft_distributions) -> tuple[list[int], torch.Tensor]:
        """Sampling mode: each draft drawn from q = warp of the head's logits (zero outside its
        reduced vocabulary), and that q reported, ``(m, vocab)``."""
        qs: list[torch.Tensor] = []
        vocab_ids = self.head.vocab_ids

        def pick(i: int, logits: torch.Tensor) -> int | None:
            full = torch.full((vocab_size,), float("-inf"), dtype=logits.dtype)
            full[vocab_ids] = logits
            q_draw, q_report = draft_q(full, params)
            if self.threshold and i > 0 and float(q_draw.max()) < self.threshold:
                return None
            token = sample_token(q_draw, generator)
            qs.append(q_report)
            return token

        tokens = self._run(ids, k, pick)
        q = torch.stack(qs[:len(tokens)]) if tokens else torch.zeros(0, vocab_size, dtype=DTYPE)
        return tokens, q

    def update(self, ids: list[int], n_accepted: int) -> None:
        self.state.drop_speculative()


class HybridDraft(Draft):
    """Prompt lookup where the context has a match, the trained head where it has none (chapter 7).

    The head sees the target's features every round either way, so it is ready
    whenever lookup finds nothing.
    """

    uses_features = True

    def __init__(self, lookup: "PromptLookupDraft", head: HeadDraft, name: str = "lookup, else head") -> None:
        super().__init__()
        self.lookup, self.head_draft, self.name = lookup, head, name
        self.feature_layers = head.feature_layers
        self.used: list[str] = []  # which draft proposed, per round

    def reset(self, eos_token_id: int | None = None) -> None:
        super().reset(eos_token_id)
        self.lookup.reset(eos_token_id)
        self.head_draft.reset(eos_token_id)
        self.used = []

    def observe(self, features: torch.Tensor) -> None:
        self.head_draft.observe(features)

    def propose(self, ids: list[int], k: int) -> list[int]:
        out = self.lookup.propose(ids, k)
        if out:
            self.used.append("lookup")
            return out
        out = self._counting(self.head_draft, lambda: self.head_draft.propose(ids, k))
        self.used.append("head")
        return out

    def propose_sampled(self, ids, k, params, generator, vocab_size, draft_q=draft_distributions):
        out = self.lookup.propose(ids, k)
        if out:
            self.used.append("lookup")
            q = torch.nn.functional.one_hot(torch.tensor(out, dtype=torch.long), vocab_size).to(DTYPE)
            return out, q.reshape(len(out), vocab_size)
        out, q = self._counting(self.head_draft, lambda: self.head_draft.propose_sampled(
            ids, k, params, generator, vocab_size, draft_q))
        self.used.append("head")
        return out, q

    def update(self, ids: list[int], n_accepted: int) -> None:
        self.lookup.update(ids, n_accepted)
        self.head_draft.update(ids, n_accepted)


class HeuristicK(Draft):
    """transformers' "heuristic" schedule around any draft: k grows by 2 after a round where every
    draft was accepted and shrinks by 1 (not below 1) otherwise. The loop's k is the cap."""

    def __init__(self, draft: Draft, k_start: int = 4) -> None:
        super().__init__()
        self.draft, self.k_start, self.k = draft, k_start, k_start
        self.uses_features, self.feature_layers = draft.uses_features, draft.feature_layers
        self.name = f"{draft.name}, k +2/-1"
        self._last = 0

    def reset(self, eos_token_id: int | None = None) -> None:
        super().reset(eos_token_id)
        self.draft.reset(eos_token_id)
        self.k = self.k_start

    def vocab_model(self) -> torch.nn.Module | None:
        return self.draft.vocab_model()

    def observe(self, features: torch.Tensor) -> None:
        self.draft.observe(features)

    def propose(self, ids: list[int], k: int) -> list[int]:
        out = self._counting(self.draft, lambda: self.draft.propose(ids, min(self.k, k)))
        self._last = len(out)
        return out

    def propose_sampled(self, ids, k, params, generator, vocab_size, draft_q=draft_distributions):
        out, q = self._counting(self.draft, lambda: self.draft.propose_sampled(
            ids, min(self.k, k), params, generator, vocab_size, draft_q))
        self._last = len(out)
        return out, q

    def update(self, ids: list[int], n_accepted: int) -> None:
        self.draft.update(ids, n_accepted)
        self.k = self.k + 2 if self._last and n_accepted == self._last else max(1, self.k - 1)
