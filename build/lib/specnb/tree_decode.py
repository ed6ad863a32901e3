"""Speculative greedy decoding over token trees (chapter 8): one target forward per round.

Each round: (1) the draft proposes a :class:`specnb.tree.Tree` of at most ``n_nodes`` drafts
(cut to the token budget and after EOS); (2) the target scores the root and every node in one
forward with the tree mask and depth positions (:func:`specnb.tree.forward_tree`); (3) the
greedy walk accepts the longest root-to-node path whose every token is the target's argmax at
its parent, then the target's own token after it; (4) :func:`specnb.cache.keep_path` keeps the
accepted path's keys and values, moved into place, and drops the rest; (5) the draft is told
(a head also gets the target's features of the kept nodes).

The output equals :func:`specnb.decode.greedy`'s token for token; ``bug`` names a deliberately
broken variant (:data:`specnb.tree.TREE_BUGS`) that the same equality check must catch.
:func:`speculative_tree_sample` is the same loop with the multi-candidate rule of
:mod:`specnb.tree_sampling` in steps 1 and 3 (as chapter 6's loop is the chain's).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .cache import cache_length, keep_path, rollback
from .decode import DecodeResult, RoundStats, _margin, start_loop, validate
from .drafts import Draft
from .models import context_length
from .sampling import SamplingParams, sample_token, warp
from .tree import TREE_BUGS, Tree, forward_tree, greedy_walk
from .tree_sampling import multi_candidate_round


@dataclass
class TreeResult(DecodeResult):
    """A :class:`DecodeResult` of the tree loop; ``rounds[i].drafted`` counts the tree's nodes."""

    depths: list[int] = field(default_factory=list)  # each round's tree depth
    # Each round's walk: the rank (position among its siblings) of the accepted child at each depth,
    # and how many children each node the walk reached had (the last one's were all rejected).
    walks: list[tuple[list[int], list[int]]] = field(default_factory=list)

    @property
    def tokens_per_forward(self) -> float:
        """Emitted tokens per verify forward (EAGLE's "average acceptance length", tau)."""
        return self.tokens_per_round


class TreeGreedyRule:
    """Greedy on a tree: the draft's tree as proposed, walked while a child carries the target's argmax."""

    def propose(self, draft: Draft, ids: list[int], n_nodes: int) -> tuple[Tree, dict | None]:
        tree = draft.propose_tree(ids, n_nodes)
        if not isinstance(tree, Tree):
            raise TypeError(f"{draft.name}.propose_tree returned {type(tree).__name__}, not a specnb.tree.Tree")
        return tree, None

    def walk(self, tree: Tree, logits: torch.Tensor, qs, result: TreeResult) -> tuple[list[int], int]:
        """``logits: (N+1, vocab)`` -> (the accepted path, root first; the target's token after it)."""
        path, token = greedy_walk(tree, logits.argmax(dim=-1).tolist())
        result.margins += _margin(logits[path]).tolist()
        return path, token


class TreeSamplingRule:
    """Sampling on a tree: the draft samples each node's children and reports their q; at every node the
    walk reaches, the multi-candidate rule (or the naive one, a negative control) accepts a child or emits."""

    def __init__(self, params: SamplingParams, generator: torch.Generator, vocab: int, replacement: bool,
                 rule: str) -> None:
        self.params, self.generator, self.vocab, self.rule = params, generator, vocab, rule
        self.replacement = replacement  # how the draft drew each node's children

    def propose(self, draft: Draft, ids: list[int], n_nodes: int) -> tuple[Tree, dict]:
        return draft.propose_tree_sampled(ids, n_nodes, self.params, self.generator, self.vocab)

    def walk(self, tree: Tree, logits: torch.Tensor, qs: dict, result: TreeResult) -> tuple[list[int], int]:
        p = warp(logits, self.params)  # (N+1, vocab)
        path = [0]
        while True:
            kids = tree.children(path[-1])
            if not kids:
                return path, sample_token(p[path[-1]], self.generator)  # a leaf: the bonus token
            chosen, token = multi_candidate_round(p[path[-1]], qs[path[-1]], [tree.tokens[c - 1] for c in kids],
                                                  self.generator, self.replacement, self.rule)
            if chosen is None:
                return path, token
            path.append(kids[chosen])


def _check_n_nodes(n_nodes) -> None:
    if not isinstance(n_nodes, int) or isinstance(n_nodes, bool) or n_nodes < 1:
        raise ValueError(f"n_nodes must be an integer >= 1 (the most drafts a tree may hold), got {n_nodes!r}")


def _tree_loop(target: torch.nn.Module, draft: Draft, ids: list[int], n_nodes: int, max_new_tokens: int,
               eos_token_id: int | None, rule, result: TreeResult, bug: str = "exact") -> TreeResult:
    """The loop shared by tree greedy and tree sampling; ``rule`` proposes the tree and walks it (steps 1, 3)."""
    ctx = context_length(target)
    feats = draft.uses_features
    cache, start = start_loop(target, draft, ids, eos_token_id, result)
    while len(result.tokens) < max_new_tokens:
        budget = max_new_tokens - len(result.tokens)
        # 1. A tree of drafts, cut to what the budget can emit and after any EOS.
        t0 = time.perf_counter()
        forwards_before = draft.forwards
        tree, qs = rule.propose(draft, ids, n_nodes)
        if tree.size > n_nodes:
            raise ValueError(f"{draft.name} proposed {tree.size} nodes; at most n_nodes = {n_nodes} were asked for")
        tree = tree.within(budget - 1).cut_after_eos(eos_token_id)
        past = len(ids) - 1  # the root's position: the cache holds the sequence before it
        if bug == "exact" and cache_length(cache) != past:
            raise RuntimeError(f"the target's cache holds {cache_length(cache)} positions, the sequence "
                               f"before the root {past}: the last round's cleanup failed")
        if past + tree.size + 1 > ctx:
            raise ValueError(f"tree node {ctx - past} does not fit: the sequence holds {past + 1} of the model's "
                             f"{ctx} positions and the tree has {tree.size} nodes; propose a smaller tree")
        t1 = time.perf_counter()
        # 2. One target forward over the root and every node: logits (N+1, vocab).
        if feats:
            logits, hidden = forward_tree(target, ids[-1], tree, cache, features=draft.feature_layers or True, bug=bug,
                                          position=past)
        else:
            logits = forward_tree(target, ids[-1], tree, cache, bug=bug, position=past)
        t2 = time.perf_counter()
        # 3. Walk down the tree: the accepted path, then one token of the target's.
        path, token = rule.walk(tree, logits, qs, result)
        new = [tree.tokens[i - 1] for i in path[1:]] + [token]
        kids = [tree.children(node) for node in path]
        result.walks.append(([kids[j].index(path[j + 1]) for j in range(len(path) - 1)], [len(c) for c in kids]))
        # 4. Keep the root and the accepted path in the cache, moved into place.
        if bug == "path-not-moved":
            rollback(cache, tree.size + 1 - len(path))
        elif bug != "rejected-left-in-cache":  # that bug keeps every node, rejected ones included
            keep_path(cache, cache_length(cache) - tree.size - 1, path)
        n = len(path) - 1
        if eos_token_id is not None and eos_token_id in new:
            new = new[: new.index(eos_token_id) + 1]
            result.stop = "eos"
        ids = ids + new
        result.tokens += new
        result.margins = result.margins[: len(result.tokens)]
        result.target_forwards += 1
        result.depths.append(tree.depth)
        result.rounds.append(RoundStats(tree.size, n, len(new), tree.size > 0 and not kids[-1],
                                        draft.forwards - forwards_before, t1 - t0, t2 - t1))
        if result.stop == "eos":
            break
        # 5. The draft's turn: the target's features of the kept nodes, then the new sequence.
        if feats:
            draft.observe(hidden[path])  # (n+1, H)
        draft.update(ids, n)
    result.draft_forwards = draft.forwards
    result.wall_time = time.perf_counter() - start
    return result


@torch.inference_mode()
def speculative_tree_greedy(target: torch.nn.Module, draft: Draft, prompt_ids, n_nodes: int,
                            max_new_tokens: int, eos_token_id: int | None = None, bug: str = "exact"
                            ) -> TreeResult:
    """Speculative greedy decoding with trees of at most ``n_nodes`` drafts: output identical to greedy.

    A chain draft works too (its tree is a chain of up to ``n_nodes``). ``bug`` other than
    ``"exact"`` is a negative control: ``siblings-see-each-other``, ``sequential-positions``
    (both in the mask/positions), ``rejected-left-in-cache`` (no cleanup after the round),
    ``path-not-moved`` (the cache cut to the path's length without moving its entries).
    """
    if bug not in TREE_BUGS:
        raise ValueError(f"bug must be one of {TREE_BUGS}, got {bug!r}")
    _check_n_nodes(n_nodes)
    ids = validate(target, prompt_ids, max_new_tokens)
    return _tree_loop(target, draft, ids, n_nodes, max_new_tokens, eos_token_id, TreeGreedyRule(),
                      TreeResult([], len(ids), 0.0, 0), bug)


@torch.inference_mode()
def speculative_tree_sample(target: torch.nn.Module, draft, prompt_ids, n_nodes: int, max_new_tokens: int,
                            params: SamplingParams | None = None, seed: int = 0, eos_token_id: int | None = None,
                            rule: str = "multi-candidate") -> TreeResult:
    """Speculative sampling on trees: each emitted token has the distribution plain sampling gives it.

    Each round the draft samples a tree (``draft.propose_tree_sampled``: the children of every
    expanded node drawn from that node's q, which it reports); one target forward gives p at every
    node (``warp`` of its logits with ``params``); the walk applies the multi-candidate rule
    (:mod:`specnb.tree_sampling`) at each node it reaches, with that node's children as candidates:
    an accepted child is moved to, else the rule's token is emitted and the round ends; at a leaf the
    bonus token is drawn from p. The cache keeps the accepted path (:func:`specnb.cache.keep_path`).
    ``rule="naive"`` is the biased variant, kept as a negative control.
    """
    _check_n_nodes(n_nodes)
    if not hasattr(draft, "propose_tree_sampled"):
        raise ValueError(f"{draft.name} cannot sample a tree (no propose_tree_sampled): use a sampled tree draft "
                         "such as specnb.tree_drafts.SampledHeadTree")
    ids = validate(target, prompt_ids, max_new_tokens)
    tree_rule = TreeSamplingRule(params or SamplingParams(), torch.Generator().manual_seed(seed),
                                 target.config.vocab_size, draft.replacement, rule)
    return _tree_loop(target, draft, ids, n_nodes, max_new_tokens, eos_token_id, tree_rule,
                      TreeResult([], len(ids), 0.0, 0))
