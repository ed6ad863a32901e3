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
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .cache import cache_length, forward, forward_features, keep_path, new_cache, rollback
from .decode import DecodeResult, RoundStats, _margin, validate
from .drafts import Draft
from .models import check_vocab_sizes, context_length
from .tree import TREE_BUGS, Tree, forward_tree, greedy_walk


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
    if not isinstance(n_nodes, int) or isinstance(n_nodes, bool) or n_nodes < 1:
        raise ValueError(f"n_nodes must be an integer >= 1 (the most drafts a tree may hold), got {n_nodes!r}")
    ids = validate(target, prompt_ids, max_new_tokens)
    if draft.vocab_model() is not None:
        check_vocab_sizes(target, draft.vocab_model())
    ctx = context_length(target)
    feats = draft.uses_features
    draft.reset(eos_token_id)
    result = TreeResult([], len(ids), 0.0, 0)
    cache = new_cache(target)
    start = time.perf_counter()
    if len(ids) > 1:  # invariant: the cache holds every token of ids but the last
        if feats:
            _, hidden = forward_features(target, ids[:-1], cache, logits_to_keep=1)
            draft.observe(hidden)
        else:
            forward(target, ids[:-1], cache, logits_to_keep=1)
        result.target_forwards += 1
        result.t_prefill = time.perf_counter() - start
    while len(result.tokens) < max_new_tokens:
        budget = max_new_tokens - len(result.tokens)
        # 1. A tree of drafts, cut to what the budget can emit and after any EOS.
        t0 = time.perf_counter()
        forwards_before = draft.forwards
        tree = draft.propose_tree(ids, n_nodes)
        if not isinstance(tree, Tree):
            raise TypeError(f"{draft.name}.propose_tree returned {type(tree).__name__}, not a specnb.tree.Tree")
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
            logits, hidden = forward_tree(target, ids[-1], tree, cache, features=True, bug=bug, position=past)
        else:
            logits = forward_tree(target, ids[-1], tree, cache, bug=bug, position=past)
        t2 = time.perf_counter()
        # 3. Walk down the tree while a child carries the target's argmax.
        g = logits.argmax(dim=-1).tolist()
        path, token = greedy_walk(tree, g)
        result.margins += _margin(logits[path]).tolist()
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
        result.rounds.append(RoundStats(tree.size, n, len(new), tree.size > 0 and not tree.children(path[-1]),
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
def speculative_tree_sample(target: torch.nn.Module, draft, prompt_ids, n_nodes: int, max_new_tokens: int,
                            params=None, seed: int = 0, eos_token_id: int | None = None,
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
    from .sampling import SamplingParams, sample_token, warp
    from .tree_sampling import multi_candidate_round

    params = params or SamplingParams()
    if not isinstance(n_nodes, int) or isinstance(n_nodes, bool) or n_nodes < 1:
        raise ValueError(f"n_nodes must be an integer >= 1 (the most drafts a tree may hold), got {n_nodes!r}")
    if not hasattr(draft, "propose_tree_sampled"):
        raise ValueError(f"{draft.name} cannot sample a tree (no propose_tree_sampled): use a sampled tree draft "
                         "such as specnb.tree_drafts.SampledHeadTree")
    ids = validate(target, prompt_ids, max_new_tokens)
    ctx = context_length(target)
    vocab = target.config.vocab_size
    generator = torch.Generator().manual_seed(seed)
    feats = draft.uses_features
    draft.reset(eos_token_id)
    result = TreeResult([], len(ids), 0.0, 0)
    cache = new_cache(target)
    start = time.perf_counter()
    if len(ids) > 1:
        if feats:
            _, hidden = forward_features(target, ids[:-1], cache, logits_to_keep=1)
            draft.observe(hidden)
        else:
            forward(target, ids[:-1], cache, logits_to_keep=1)
        result.target_forwards += 1
        result.t_prefill = time.perf_counter() - start
    while len(result.tokens) < max_new_tokens:
        budget = max_new_tokens - len(result.tokens)
        t0 = time.perf_counter()
        forwards_before = draft.forwards
        tree, qs = draft.propose_tree_sampled(ids, n_nodes, params, generator, vocab)
        tree = tree.within(budget - 1).cut_after_eos(eos_token_id)
        past = len(ids) - 1
        if past + tree.size + 1 > ctx:
            raise ValueError(f"tree node {ctx - past} does not fit: the sequence holds {past + 1} of the model's "
                             f"{ctx} positions and the tree has {tree.size} nodes; propose a smaller tree")
        t1 = time.perf_counter()
        if feats:
            logits, hidden = forward_tree(target, ids[-1], tree, cache, features=True, position=past)
        else:
            logits = forward_tree(target, ids[-1], tree, cache, position=past)
        t2 = time.perf_counter()
        p = warp(logits, params)  # (N+1, vocab)
        path, ranks, offered = [0], [], []
        while True:
            node = path[-1]
            kids = tree.children(node)
            offered.append(len(kids))
            if not kids:
                token = sample_token(p[node], generator)  # a leaf: the bonus token
                break
            chosen, token = multi_candidate_round(p[node], qs[node], [tree.tokens[c - 1] for c in kids], generator,
                                                  draft.replacement, rule)
            if chosen is None:
                break
            path.append(kids[chosen])
            ranks.append(chosen)
        new = [tree.tokens[i - 1] for i in path[1:]] + [token]
        keep_path(cache, past, path)
        n = len(path) - 1
        if eos_token_id is not None and eos_token_id in new:
            new = new[: new.index(eos_token_id) + 1]
            result.stop = "eos"
        ids = ids + new
        result.tokens += new
        result.target_forwards += 1
        result.depths.append(tree.depth)
        result.walks.append((ranks, offered))
        result.rounds.append(RoundStats(tree.size, n, len(new), tree.size > 0 and not tree.children(path[-1]),
                                        draft.forwards - forwards_before, t1 - t0, t2 - t1))
        if result.stop == "eos":
            break
        if feats:
            draft.observe(hidden[path])
        draft.update(ids, n)
    result.draft_forwards = draft.forwards
    result.wall_time = time.perf_counter() - start
    return result
