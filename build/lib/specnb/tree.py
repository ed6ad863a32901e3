"""Token trees (chapter 8): many guesses verified in one target forward.

A tree of drafts hangs from the **root**, node 0: the last token of the sequence, which the
target has not seen yet (the loops' invariant: its cache holds every token but the last).
Node i >= 1 is the draft token ``tokens[i-1]``, and its parent is node ``parents[i-1]``, an
earlier node. A chain of k drafts is the tree with parents 0, 1, ..., k-1.

One forward verifies the whole tree (SpecInfer, Miao et al. 2023; Medusa, Cai et al. 2024):

* the target is fed the root and all N drafts, N + 1 tokens;
* position ids by **depth**: node i sits at position ``past + depth(i)``, as it would in the
  sequence made of its own path;
* a 4D attention mask in which node i sees the whole cache, its ancestors and itself, and no
  other node (no sibling, no cousin);
* so the logits at node i are the target's logits after the sequence ``ids + path(i)``.

Greedy acceptance walks down from the root: at node i the target's token is ``g_i`` =
argmax of its logits; if a child of i carries ``g_i``, the walk moves there; when none does,
``g_i`` is emitted (the correction, or the bonus at a leaf). Afterwards the cache holds the
``past + N + 1`` entries of the forward; :func:`specnb.cache.keep_path` keeps the root and the
accepted path, moved into place, and drops every other entry.

Each of those four parts has a deliberately broken variant kept for the negative controls
(``TREE_BUGS``): siblings that see each other, sequential position ids, rejected entries left in
the cache, the accepted path's entries not moved into place.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

TREE_BUGS = ("exact", "siblings-see-each-other", "sequential-positions", "rejected-left-in-cache",
             "path-not-moved")


@dataclass(frozen=True)
class Tree:
    """Draft tokens and their parents; node 0 is the root (the sequence's last token, not stored).

    ``tokens[i-1]`` is node i's token, ``parents[i-1]`` its parent, an earlier node (0..i-1).
    Parents before children is the only ordering rule; siblings may come in any order.
    """

    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    def __init__(self, tokens, parents) -> None:
        object.__setattr__(self, "tokens", tuple(int(t) for t in tokens))
        object.__setattr__(self, "parents", tuple(int(p) for p in parents))
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"a tree needs one parent per token: got {len(self.tokens)} tokens and "
                             f"{len(self.parents)} parents")
        for i, p in enumerate(self.parents, start=1):
            if not 0 <= p < i:
                raise ValueError(f"node {i} (token {self.tokens[i - 1]}) has parent {p}: a parent must be an "
                                 f"earlier node, 0 (the root: the sequence's last token) to {i - 1}")

    @classmethod
    def chain(cls, tokens) -> "Tree":
        """k drafts in a row: parents 0, 1, ..., k-1."""
        return cls(tokens, range(len(tokens)))

    @classmethod
    def empty(cls) -> "Tree":
        return cls((), ())

    @property
    def size(self) -> int:
        """N: the number of draft nodes (the forward feeds N + 1 tokens)."""
        return len(self.tokens)

    def depths(self) -> list[int]:
        """Depth of nodes 0..N (the root has depth 0)."""
        d = [0]
        for p in self.parents:
            d.append(d[p] + 1)
        return d

    @property
    def depth(self) -> int:
        """The longest root-to-leaf path, in drafts."""
        return max(self.depths())

    def children(self, node: int) -> list[int]:
        """The children of ``node``, in the tree's order."""
        return [i for i, p in enumerate(self.parents, start=1) if p == node]

    def path(self, node: int) -> list[int]:
        """Nodes from the root to ``node``, both included."""
        out = [node]
        while out[-1] != 0:
            out.append(self.parents[out[-1] - 1])
        return out[::-1]

    def path_tokens(self, node: int) -> list[int]:
        """The draft tokens on the path to ``node`` (the root's token excluded)."""
        return [self.tokens[i - 1] for i in self.path(node)[1:]]

    def is_chain(self) -> bool:
        return self.parents == tuple(range(self.size))

    def ancestry(self) -> torch.Tensor:
        """``(N+1, N+1)`` bool: entry [i, j] is True when node j is node i or one of its ancestors."""
        n = self.size + 1
        m = torch.zeros(n, n, dtype=torch.bool)
        m[0, 0] = True
        for i, p in enumerate(self.parents, start=1):
            m[i] = m[p]
            m[i, i] = True
        return m

    def subtree(self, keep) -> "Tree":
        """The tree of the draft nodes in ``keep`` (1-based; each one's parent must be kept too), renumbered."""
        keep = sorted(set(int(i) for i in keep))
        new_index = {0: 0}
        tokens, parents = [], []
        for i in keep:
            p = self.parents[i - 1]
            if p not in new_index:
                raise ValueError(f"node {i} is kept without its parent {p}")
            new_index[i] = len(tokens) + 1
            tokens.append(self.tokens[i - 1])
            parents.append(new_index[p])
        return Tree(tokens, parents)

    def within(self, max_depth: int) -> "Tree":
        """The nodes at depth <= ``max_depth`` (a round can emit at most budget - 1 drafts)."""
        d = self.depths()
        return self.subtree(i for i in range(1, self.size + 1) if d[i] <= max_depth)

    def cut_after_eos(self, eos_token_id: int | None) -> "Tree":
        """Drop every descendant of a node that drafts EOS (nothing follows EOS)."""
        if eos_token_id is None or eos_token_id not in self.tokens:
            return self
        dead = set()
        for i, p in enumerate(self.parents, start=1):
            if p in dead or (p and self.tokens[p - 1] == eos_token_id):
                dead.add(i)
        return self.subtree(i for i in range(1, self.size + 1) if i not in dead)


def tree_inputs(tree: Tree, past: int, bug: str = "exact", position: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids ``(1, N+1)`` and the additive attention mask ``(1, 1, N+1, past+N+1)`` (0 or -inf).

    ``past``: entries in the cache, all visible; ``position``: the root's position (default ``past``).
    ``bug`` other than ``"exact"`` is a negative control (see :data:`TREE_BUGS`).
    """
    n = tree.size + 1
    start = past if position is None else position
    if bug == "sequential-positions":
        positions = torch.arange(n) + start
    else:
        positions = torch.tensor(tree.depths()) + start
    sees = torch.ones(n, past + n, dtype=torch.bool)
    if bug == "siblings-see-each-other":
        sees[:, past:] = torch.ones(n, n, dtype=torch.bool).tril()
    else:
        sees[:, past:] = tree.ancestry()
    mask = torch.zeros(n, past + n).masked_fill(~sees, float("-inf"))
    return positions[None], mask[None, None]


def greedy_walk(tree: Tree, g: list[int]) -> tuple[list[int], int]:
    """Greedy acceptance on a tree: ``g[i]`` is the target's argmax at node i.

    Returns (the accepted path, the root first; the target's token after its last node). At each
    node the walk takes the first child carrying ``g[node]``.
    """
    children: dict[int, list[int]] = {}
    for i, p in enumerate(tree.parents, start=1):
        children.setdefault(p, []).append(i)
    path = [0]
    while True:
        node = path[-1]
        nxt = next((c for c in children.get(node, ()) if tree.tokens[c - 1] == g[node]), None)
        if nxt is None:
            return path, g[node]
        path.append(nxt)


@torch.inference_mode()
def forward_tree(model: torch.nn.Module, root: int, tree: Tree, cache, features: bool | tuple = False,
                 bug: str = "exact", position: int | None = None):
    """One target forward over the root and the tree's N drafts, appended after what ``cache`` holds.

    Returns ``logits: (N+1, vocab)``, row i the target's logits after ``ids + path(i)``; with
    ``features=True`` also ``hidden: (N+1, H)``, the last hidden states (for a draft head); a tuple of
    layers, those layers' outputs too (:func:`specnb.cache.decoder_features`, ``(N+1, F)``).
    The cache grows by N + 1 entries, in node order; :func:`specnb.cache.keep_path` cleans it up.
    ``position`` is the root's position id (default: the cache's length, right when the cache
    holds exactly the sequence before the root).
    """
    from .cache import _decoder_and_head, cache_keyword, cache_length, decoder_features

    if bug not in TREE_BUGS:
        raise ValueError(f"bug must be one of {TREE_BUGS}, got {bug!r}")
    past = cache_length(cache)
    positions, mask = tree_inputs(tree, past, bug, position)
    dtype = next(model.parameters()).dtype
    x = torch.tensor([[root, *tree.tokens]], dtype=torch.long)  # (1, N+1)
    if features is not False:
        decoder, lm_head = _decoder_and_head(model)
        layers = () if features is True else tuple(features)
        hidden = decoder_features(decoder, layers, input_ids=x, position_ids=positions,
                                  attention_mask=mask.to(dtype), **{cache_keyword(decoder): cache,
                                                                   "use_cache": True})[0]  # (N+1, F)
        return lm_head(hidden[:, -model.config.hidden_size:]), hidden
    out = model(input_ids=x, position_ids=positions, attention_mask=mask.to(dtype),
                **{cache_keyword(model): cache, "use_cache": True})
    return out.logits[0]
