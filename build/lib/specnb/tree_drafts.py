"""Drafts that propose token trees (chapter 8); verify them with :mod:`specnb.tree_decode`.

* :class:`HeadTreeDraft`: the trained head of chapter 7, expanded level by level (one head
  forward per depth, every node of that level in it, each seeing only its own ancestors).
  ``shape="dynamic"`` is EAGLE-2's dynamic tree (Li et al. 2024, arXiv:2406.16858): the top
  ``branch`` children of the ``width`` best nodes of each level, scored by cumulative draft
  log-probability, and the ``n_nodes`` best of all of them kept. A static shape (as in Medusa,
  Cai et al. 2024, arXiv:2401.10774) is a list of rank paths: ``(0,)`` the head's top token,
  ``(1,)`` its second, ``(0, 2)`` the third child of the top token, and so on.
* :class:`LookupTreeDraft`: prompt lookup with several earlier matches as branches; a node
  supported by more matches comes first.
"""
from __future__ import annotations

import numpy as np
import torch

from .drafts import HeadDraft, PromptLookupDraft
from .tree import Tree


def chain_shape(k: int) -> tuple[tuple[int, ...], ...]:
    """The static shape of a chain of k top-1 drafts: (0,), (0, 0), ..."""
    return tuple((0,) * d for d in range(1, k + 1))


def shape_from_branching(branching) -> tuple[tuple[int, ...], ...]:
    """A full static shape: ``branching[d]`` children under every node of depth d (e.g. (3, 2, 1))."""
    paths: list[tuple[int, ...]] = []
    level = [()]
    for b in branching:
        level = [p + (r,) for p in level for r in range(b)]
        paths += level
    return tuple(paths)


def check_shape(shape) -> tuple[tuple[int, ...], ...]:
    """Validate a static shape (every path's parent path present, ranks >= 0); sorted by depth."""
    paths = tuple(sorted({tuple(int(r) for r in p) for p in shape}, key=lambda p: (len(p), p)))
    have = set(paths)
    for p in paths:
        if not p or min(p) < 0:
            raise ValueError(f"shape path {p} must be a non-empty tuple of ranks >= 0")
        if len(p) > 1 and p[:-1] not in have:
            raise ValueError(f"shape path {p} has no parent path {p[:-1]} in the shape")
    return paths


def feed_level(state, nodes: list, parent_of, root, token_of, depth_of, feat: dict, slot: dict) -> torch.Tensor:
    """Feed one level of a tree to the head (:meth:`specnb.head.HeadState.grow`); returns ``(len(nodes), H)``.

    Each node is the pair (the feature predicted at its parent, its token), masked to its ancestors'
    speculative entries (``slot``: node -> slot, for the nodes fed so far; the root has none). Records
    each node's slot and predicted feature in ``slot`` and ``feat`` (``feat[root]`` must be set).
    """
    ancestors = []
    for c in nodes:
        chain, p = [], parent_of(c)
        while p != root:
            chain.append(slot[p])
            p = parent_of(p)
        ancestors.append(chain)
    base = state.speculative
    pred = state.grow(torch.stack([feat[parent_of(c)] for c in nodes]), [token_of(c) for c in nodes],
                      [depth_of(c) for c in nodes], ancestors)
    for r, c in enumerate(nodes):
        slot[c], feat[c] = base + r, pred[r]
    return pred


class HeadTreeDraft(HeadDraft):
    """The chapter 7 head, drafting a tree: EAGLE-2's dynamic tree, or a static shape."""

    proposes_trees = True

    def __init__(self, head, shape="dynamic", depth: int = 4, branch: int = 3, width: int = 3,
                 name: str | None = None) -> None:
        super().__init__(head)
        if shape == "dynamic":
            if depth < 1 or branch < 1 or width < 1:
                raise ValueError(f"a dynamic tree needs depth, branch, width >= 1, got {depth}, {branch}, {width}")
            self.shape = None
        else:
            self.shape = check_shape(shape)
        self.depth, self.branch, self.width = depth, branch, width
        self.name = name or (f"head, dynamic tree (depth {depth}, top-{branch} of {width})" if self.shape is None
                             else f"head, static tree ({len(self.shape)} nodes)")

    def propose_tree(self, ids: list[int], n_nodes: int) -> Tree:
        if self.state is None:
            self.reset(self.eos_token_id)
        return self._counting(self.state, lambda: self._grow(ids, n_nodes))

    def _logprobs(self, pred: torch.Tensor) -> torch.Tensor:
        """``pred: (T, H)`` -> log-probabilities over the head's reduced vocabulary ``(T, V')``."""
        return torch.log_softmax(self.head.logits(pred).float(), dim=-1)

    def _grow(self, ids: list[int], n_nodes: int) -> Tree:
        state, vocab_ids, eos = self.state, self.head.vocab_ids, self.eos_token_id
        root = state.catch_up(ids)
        if root is None or n_nodes < 1:
            return Tree.empty()
        # Candidate nodes: token, parent (candidate index, -1 = root), depth, score, rank path.
        tok: list[int] = []
        par: list[int] = []
        dep: list[int] = []
        score: list[float] = []
        rank: list[tuple[int, ...]] = []
        slot: dict[int, int] = {}  # candidate -> its speculative slot in the head's cache, once fed
        feat: dict[int, torch.Tensor] = {-1: root}  # candidate -> the feature predicted at it

        def add_children(node: int, lp: torch.Tensor, ranks) -> list[int]:
            top = torch.topk(lp, max(ranks) + 1)
            new = []
            for r in ranks:
                tok.append(int(vocab_ids[int(top.indices[r])]))
                par.append(node)
                dep.append(dep[node] + 1 if node >= 0 else 1)
                score.append((score[node] if node >= 0 else 0.0) + float(top.values[r]))
                rank.append((rank[node] if node >= 0 else ()) + (r,))
                new.append(len(tok) - 1)
            return new

        # A static tree grows only the first n_nodes paths of its shape (in depth and rank order, closed under
        # ancestors): a level whose nodes would all be cut is never fed (3-1-1 at 5 nodes: one head
        # forward after catch_up instead of two). A branch that ends in EOS leaves its slots empty.
        shape = set(self.shape[:n_nodes]) if self.shape is not None else None
        max_depth = self.depth if shape is None else max(len(p) for p in shape)

        def wanted(prefix: tuple[int, ...]) -> list[int]:
            if shape is None:
                return list(range(self.branch))
            return sorted(p[-1] for p in shape if len(p) == len(prefix) + 1 and p[:-1] == prefix)

        frontier = add_children(-1, self._logprobs(root[None])[0], wanted(()))
        for _ in range(1, max_depth):
            grow = [c for c in frontier if tok[c] != eos and wanted(rank[c])]
            if shape is None:
                grow = sorted(grow, key=lambda c: -score[c])[: self.width]
                # A child scores at most its parent, so it can make the final cut only if fewer than
                # n_nodes - 1 candidates already score above its parent (the parent is ahead of it too).
                # Feeding the others would grow nodes the cut below always drops; skipping them keeps
                # every node the cut would have kept and leaves their width to nodes that can still win.
                grow = [c for c in grow if sum(x > score[c] for x in score) + 1 < n_nodes]
            if not grow:
                break
            pred = feed_level(state, grow, lambda c: par[c], -1, lambda c: tok[c], lambda c: dep[c], feat, slot)
            lps = self._logprobs(pred)
            frontier = []
            for r, c in enumerate(grow):
                frontier += add_children(c, lps[r], wanted(rank[c]))
        # Keep the n_nodes best: by cumulative log-probability (dynamic; a child never beats its
        # parent, so the set is closed under ancestors) or in shape order (static).
        if shape is None:
            order = sorted(range(len(tok)), key=lambda c: (-score[c], dep[c], c))
            keep = sorted(order[:n_nodes], key=lambda c: (dep[c], -score[c], c))
        else:
            keep = sorted(range(len(tok)), key=lambda c: (dep[c], rank[c]))[:n_nodes]
        index = {-1: 0}
        tokens, parents = [], []
        for c in keep:
            if par[c] not in index:  # equal scores can put a child before its parent: skip it
                continue
            index[c] = len(tokens) + 1
            tokens.append(tok[c])
            parents.append(index[par[c]])
        return Tree(tokens, parents)


class SampledHeadTree(HeadDraft):
    """Sampling mode on a tree (chapter 8): the head draws ``branching[d]`` children of every node at depth d.

    Each expanded node's children are drawn from ``q = warp(head logits)`` over the full vocabulary
    (zero outside the head's V'), independently or without replacement, in draw order; the q of every
    expanded node is returned for the multi-candidate rule (:func:`specnb.tree_sampling.multi_candidate_round`).
    """

    proposes_trees = True

    def __init__(self, head, branching=(2, 2, 1), replacement: bool = True, name: str | None = None) -> None:
        super().__init__(head)
        if not branching or min(branching) < 1:
            raise ValueError(f"branching must list at least one count >= 1 per depth, got {branching!r}")
        self.branching, self.replacement = tuple(int(b) for b in branching), replacement
        self.name = name or (f"head, sampled tree {'-'.join(map(str, self.branching))}"
                             f" ({'independent' if replacement else 'without replacement'})")

    def propose_tree(self, ids, n_nodes):
        raise TypeError(f"{self.name} samples its tree: use specnb.tree_decode.speculative_tree_sample")

    def propose_tree_sampled(self, ids: list[int], n_nodes: int, params, generator: torch.Generator,
                             vocab_size: int) -> tuple[Tree, dict[int, torch.Tensor]]:
        """A tree of at most ``n_nodes`` sampled drafts and ``{node: q (vocab,)}`` for every node with children."""
        if self.state is None:
            self.reset(self.eos_token_id)
        return self._counting(self.state, lambda: self._grow_sampled(ids, n_nodes, params, generator, vocab_size))

    def _grow_sampled(self, ids, n_nodes, params, generator, vocab_size):
        from .sampling import warp
        from .tree_sampling import draw_candidates

        state, vocab_ids, eos = self.state, self.head.vocab_ids, self.eos_token_id
        root = state.catch_up(ids)
        tokens: list[int] = []
        parents: list[int] = []
        qs: dict[int, torch.Tensor] = {}
        if root is None or n_nodes < 1:
            return Tree.empty(), qs

        def q_of(pred: torch.Tensor) -> torch.Tensor:
            full = torch.full((vocab_size,), float("-inf"))  # float32 whatever the head's precision
            full[vocab_ids] = self.head.logits(pred)
            return warp(full, params)

        depth_of = {0: 0}
        feat = {0: root}
        slot: dict[int, int] = {}
        frontier = [0]
        for d, b in enumerate(self.branching):
            grown = []
            for node in frontier:
                if len(tokens) >= n_nodes:
                    break
                q = q_of(feat[node])
                m = min(b, n_nodes - len(tokens), int((q > 0).sum()))
                if m < 1:
                    continue
                qs[node] = q
                for t in draw_candidates(q, m, generator, self.replacement):
                    tokens.append(t)
                    parents.append(node)
                    depth_of[len(tokens)] = d + 1
                    grown.append(len(tokens))
            if d + 1 == len(self.branching) or len(tokens) >= n_nodes:
                break
            frontier = [c for c in grown if tokens[c - 1] != eos]
            if not frontier:
                break
            feed_level(state, frontier, lambda c: parents[c - 1], 0, lambda c: tokens[c - 1], depth_of.__getitem__,
                       feat, slot)
        return Tree(tokens, parents), qs


class LookupTreeDraft(PromptLookupDraft):
    """Prompt lookup with up to ``branches`` earlier matches merged into a trie.

    Matches of the longest n-gram come first, then shorter ones, the most recent first within
    each; the kept nodes are those supported by the most matches (ties: the shallower).
    """

    proposes_trees = True

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, branches: int = 4, name: str | None = None) -> None:
        super().__init__(max_ngram, min_ngram)
        if branches < 1:
            raise ValueError(f"branches must be >= 1, got {branches}")
        self.branches = branches
        self.name = name or f"prompt lookup tree (n<={max_ngram}, {branches} matches)"

    def continuations(self, ids: list[int], length: int) -> list[list[int]]:
        """Up to ``branches`` distinct continuations of earlier matches, each up to ``length`` tokens."""
        seq = np.asarray(ids)
        L = len(seq)
        out: list[list[int]] = []
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            pattern = seq[L - n:]
            windows = np.lib.stride_tricks.sliding_window_view(seq[:L - 1], n)
            for s in np.flatnonzero((windows == pattern).all(axis=1))[::-1]:
                cont = [int(t) for t in seq[s + n:s + n + length]]
                if self.eos_token_id is not None and self.eos_token_id in cont:
                    cont = cont[:cont.index(self.eos_token_id) + 1]
                if cont and cont not in out:
                    out.append(cont)
                if len(out) == self.branches:
                    return out
        return out

    def propose_tree(self, ids: list[int], n_nodes: int) -> Tree:
        conts = self.continuations(ids, n_nodes)
        nodes: dict[tuple[int, ...], int] = {}  # token path -> support
        first: dict[tuple[int, ...], int] = {}  # token path -> insertion order
        for c in conts:
            for d in range(1, len(c) + 1):
                key = tuple(c[:d])
                nodes[key] = nodes.get(key, 0) + 1
                first.setdefault(key, len(first))
        keep = sorted(nodes, key=lambda p: (-nodes[p], len(p), first[p]))[:n_nodes]
        keep.sort(key=lambda p: (len(p), first[p]))
        index = {(): 0}
        tokens, parents = [], []
        for p in keep:
            if p[:-1] in index:
                index[p] = len(tokens) + 1
                tokens.append(p[-1])
                parents.append(index[p[:-1]])
        return Tree(tokens, parents)

