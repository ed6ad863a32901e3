"""Token trees (chapter 8) on tiny models: tree greedy == plain greedy, and each broken part caught.

The oracle draft below knows the target's greedy continuation and builds trees around it on
purpose (the right branch first, last, absent; EOS inside a branch; trees deeper than the budget),
so every path of the acceptance walk and the cache cleanup is exercised.
"""
import copy

import numpy as np

import pytest
import torch

from specnb.cache import cache_length, forward, keep_path, new_cache
from specnb.decode import greedy, speculative_greedy
from specnb.drafts import Draft, HeadDraft, PromptLookupDraft
from specnb.head import HeadState
from specnb.tree import TREE_BUGS, Tree, forward_tree, greedy_walk
from specnb.tree_decode import speculative_tree_greedy
from specnb.tree_drafts import HeadTreeDraft, LookupTreeDraft, chain_shape, check_shape, shape_from_branching

N_NEW = 24


class OracleTree(Draft):
    """Trees built around the target's own greedy continuation ``ref`` of ``prompt``.

    ``layout`` names the shape: "right-first" (the right chain first, a wrong sibling at each level),
    "right-last" (two wrong siblings with their own children before the right one), "all-wrong"
    (every token off by one), "deep" (a right chain of 12 under wrong siblings).
    """

    def __init__(self, prompt, ref, vocab, layout):
        super().__init__()
        self.prompt, self.ref, self.vocab, self.layout = list(prompt), list(ref), vocab, layout
        self.name = f"oracle tree ({layout})"

    def propose(self, ids, k):
        raise AssertionError("the tree loop must call propose_tree")

    def propose_tree(self, ids, n_nodes):
        done = len(ids) - len(self.prompt)
        right = self.ref[done:done + 12]
        off = lambda t, j=1: (t + j) % self.vocab  # noqa: E731
        tokens, parents = [], []

        def add(token, parent):
            tokens.append(token)
            parents.append(parent)
            return len(tokens)

        if self.layout == "all-wrong":
            a = add(off(right[0]), 0)
            add(off(right[0], 2), 0)
            add(off(right[1] if len(right) > 1 else right[0]), a)
        elif self.layout == "right-first":
            node = 0
            for t in right[:4]:
                nxt = add(t, node)
                add(off(t), node)
                node = nxt
        elif self.layout == "right-last":
            node = 0
            for t in right[:3]:
                w1 = add(off(t), node)
                add(off(t, 3), w1)
                w2 = add(off(t, 2), node)
                add(t, w2)  # the right token's value under a wrong branch: must not be accepted
                node = add(t, node)
        elif self.layout == "deep":
            add(off(right[0]), 0)
            node = 0
            for t in right:
                node = add(t, node)
        tree = Tree(tokens, parents)
        return tree.subtree(range(1, min(tree.size, n_nodes) + 1))


LAYOUTS = ("right-first", "right-last", "all-wrong", "deep")


def _ref(target, ids, n=N_NEW, eos=None):
    return greedy(target, ids, n, eos).tokens


# --- the tree itself -------------------------------------------------------------------------

def test_tree_structure():
    t = Tree([10, 11, 12, 13], [0, 0, 1, 1])
    assert t.depths() == [0, 1, 1, 2, 2] and t.depth == 2
    assert t.children(0) == [1, 2] and t.children(1) == [3, 4] and t.children(2) == []
    assert t.path(4) == [0, 1, 4] and t.path_tokens(4) == [10, 13]
    a = t.ancestry()
    assert a[3].tolist() == [True, True, False, True, False]  # node 3 sees the root, node 1, itself
    assert not a[2, 1] and not a[1, 2]  # siblings never see each other
    assert Tree.chain([5, 6, 7]).is_chain() and not t.is_chain()
    assert t.within(1).tokens == (10, 11)
    assert t.cut_after_eos(10).tokens == (10, 11)  # EOS's children dropped
    assert t.subtree([2]).parents == (0,)


@pytest.mark.parametrize("parents,node", [([0, 2], 2), ([0, -1], 2), ([1], 1)])
def test_a_parent_that_is_not_an_earlier_node_is_named(parents, node):
    with pytest.raises(ValueError, match=f"node {node} .*parent must be an earlier node"):
        Tree(list(range(len(parents))), parents)


def test_greedy_walk_takes_the_child_with_the_targets_token():
    t = Tree([10, 11, 12, 13], [0, 0, 2, 2])
    assert greedy_walk(t, [11, 50, 13, 60, 70]) == ([0, 2, 4], 70)  # right branch is the second child
    assert greedy_walk(t, [99, 0, 0, 0, 0]) == ([0], 99)  # nothing accepted: the correction


@pytest.mark.parametrize("attention", ["grouped", "repeat"])
def test_tree_forward_gives_each_node_its_paths_logits(target, prompts, attention):
    from specnb.kernels import kernels_of, make, use_kernels

    model = copy.deepcopy(target)
    use_kernels(model, make("mkl", attention=attention))
    ids = prompts[3]
    tree = Tree([3, 4, 7, 8, 9, 10], [0, 0, 1, 1, 2, 5])
    cache = new_cache(model)
    forward(model, ids[:-1], cache)
    logits = forward_tree(model, ids[-1], tree, cache)
    assert logits.shape == (tree.size + 1, model.config.vocab_size)
    for node in range(tree.size + 1):
        ref = forward(model, ids + tree.path_tokens(node), new_cache(model))[-1]
        torch.testing.assert_close(logits[node], ref, rtol=1e-5, atol=1e-5)
    assert kernels_of(model).attention == attention


def test_keep_path_moves_the_accepted_entries_into_place(target, prompts):
    ids = prompts[3]
    tree = Tree([3, 4, 7, 8, 9, 10], [0, 0, 1, 1, 2, 5])
    cache = new_cache(target)
    forward(target, ids[:-1], cache)
    forward_tree(target, ids[-1], tree, cache)
    keep_path(cache, len(ids) - 1, [0, 2, 5])
    assert cache_length(cache) == len(ids) + 2
    after = forward(target, [11], cache)[-1]
    ref = forward(target, ids + [4, 9, 11], new_cache(target))[-1]
    torch.testing.assert_close(after, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="must start at node 0"):
        keep_path(cache, 0, [1, 2])


# --- exactness -----------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
def test_tree_greedy_equals_greedy_for_every_layout(target, prompts, baselines, layout):
    for ids, ref in zip(prompts, baselines):
        for n_nodes in (1, 3, 16):
            out = speculative_tree_greedy(target, OracleTree(ids, ref, 96, layout), ids, n_nodes, N_NEW)
            assert out.tokens == ref, (layout, n_nodes, ids)
    if layout == "right-first":
        assert out.tokens_per_forward > 3  # the right chain of 4 is found at the first child
    if layout == "right-last":
        assert max(r.accepted for r in out.rounds) == 3  # found behind two wrong siblings and a decoy
    if layout == "all-wrong":
        assert all(r.accepted == 0 for r in out.rounds)


def test_budget_ends_inside_a_branch(target, prompts, baselines):
    ids, ref = prompts[2], baselines[2]
    for n_new in (1, 2, 5, 13):
        out = speculative_tree_greedy(target, OracleTree(ids, ref, 96, "deep"), ids, 16, n_new)
        assert out.tokens == ref[:n_new]
        assert all(r.emitted <= n_new for r in out.rounds)


def test_eos_inside_a_branch(target, prompts):
    ids = prompts[4]
    long = _ref(target, ids, 40)
    eos = long[9]  # a token the target emits: tree greedy must stop exactly where greedy stops
    ref = _ref(target, ids, 40, eos)
    for layout in ("deep", "right-first", "right-last"):
        out = speculative_tree_greedy(target, OracleTree(ids, long, 96, layout), ids, 16, 40, eos)
        assert out.tokens == ref and out.stop == "eos" and out.tokens[-1] == eos


@pytest.mark.parametrize("bug", TREE_BUGS[1:])
def test_each_broken_tree_part_is_caught_by_the_equality(target, prompts, baselines, bug):
    """The same comparison as above, with one part broken: it must fail on some prompt and layout."""
    caught = []
    for layout in ("right-last", "right-first"):
        for ids, ref in zip(prompts, baselines):
            out = speculative_tree_greedy(target, OracleTree(ids, ref, 96, layout), ids, 16, N_NEW, bug=bug)
            caught.append(out.tokens != ref)
    assert any(caught), f"{bug} went unnoticed"
    exact = [speculative_tree_greedy(target, OracleTree(ids, ref, 96, "right-last"), ids, 16, N_NEW).tokens == ref
             for ids, ref in zip(prompts, baselines)]
    assert all(exact)


def test_chain_drafts_run_in_the_tree_loop(target, noisy_draft_model, prompts, baselines):
    from specnb.drafts import ModelDraft

    for ids, ref in zip(prompts, baselines):
        for draft in (ModelDraft(noisy_draft_model), PromptLookupDraft()):
            tree = speculative_tree_greedy(target, draft, ids, 4, N_NEW)
            chain = speculative_greedy(target, draft, ids, 4, N_NEW)
            assert tree.tokens == chain.tokens == ref
            assert [r.accepted for r in tree.rounds] == [r.accepted for r in chain.rounds]


# --- tree drafts ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def head(target):
    from tests.test_head import random_head

    return random_head(target, v=96, seed=2)


def tree_drafts(head):
    return [HeadTreeDraft(head), HeadTreeDraft(head, depth=3, branch=2, width=4),
            HeadTreeDraft(head, shape_from_branching((3, 2, 1))), HeadTreeDraft(head, chain_shape(4)),
            LookupTreeDraft(), LookupTreeDraft(2, 1, branches=2)]


def test_tree_drafts_keep_greedy_exact(target, prompts, baselines, head):
    """Each real tree draft, at three node budgets, reproduces plain greedy; and each had drafts accepted
    (a draft that is never right would pass the equality without testing the walk or the cache move), and some
    round kept two drafts or more."""
    deep = 0   # rounds that kept two drafts or more: the cache move then shifts several entries
    for draft in tree_drafts(head):
        accepted = 0
        for ids, ref in zip(prompts, baselines):
            for n_nodes in (1, 5, 12):
                out = speculative_tree_greedy(target, draft, ids, n_nodes, N_NEW)
                assert out.tokens == ref, (draft.name, n_nodes)
                assert all(r.drafted <= n_nodes for r in out.rounds)
                accepted += out.accepted
                deep += sum(r.accepted >= 2 for r in out.rounds)
        assert accepted > 0, f"{draft.name}: no draft accepted, so this test checked no accepted path"
    assert deep > 0, "no round kept two drafts, so no multi-entry cache move was checked"


def test_head_static_chain_shape_drafts_what_the_chain_head_drafts(target, prompts, head):
    ids = prompts[4]
    chain, tree = HeadDraft(head), HeadTreeDraft(head, chain_shape(4))
    for d in (chain, tree):
        d.reset(None)
        cache = new_cache(target)
        from specnb.cache import forward_features
        _, hidden = forward_features(target, ids[:-1], cache)
        d.observe(hidden)
    assert list(tree.propose_tree(ids, 4).tokens) == chain.propose(ids, 4)


def test_head_tree_nodes_see_only_their_ancestors(target, prompts, head):
    """Node (1, 0) of a static tree is the head's top token after its parent, the second-ranked root
    child, as chain drafting with that first token forced finds it; siblings do not leak into it."""
    from specnb.cache import forward_features

    ids = prompts[4]
    shape = ((0,), (1,), (0, 0), (1, 0), (1, 0, 0))
    draft = HeadTreeDraft(head, shape)
    draft.reset(None)
    _, hidden = forward_features(target, ids[:-1], new_cache(target))
    draft.observe(hidden)
    tree = draft.propose_tree(ids, 5)
    assert tree.parents == (0, 0, 1, 2, 4)
    state = HeadState(head)
    state.observe(hidden)

    def forced(i, logits):
        if i == 0:
            return int(head.vocab_ids[int(torch.topk(logits, 2).indices[1])])
        return int(head.vocab_ids[int(logits.argmax())])

    assert state.draft(ids, 3, forced) == [tree.tokens[1], tree.tokens[3], tree.tokens[4]]


def test_dynamic_tree_keeps_the_best_scored_nodes(target, prompts, head):
    from specnb.cache import forward_features

    ids = prompts[4]
    _, hidden = forward_features(target, ids[:-1], new_cache(target))

    def tree(n_nodes):
        draft = HeadTreeDraft(head, depth=4, branch=3, width=3)
        draft.reset(None)
        draft.observe(hidden)
        return draft.propose_tree(ids, n_nodes)

    small, big = tree(4), tree(12)
    assert small.size == 4 and big.size == 12
    assert _paths(small) <= _paths(big)  # a bigger budget keeps the best nodes, as nodes (paths), not token values
    assert big.depth >= 2


def _paths(tree) -> set[tuple[int, ...]]:
    """Each node as the tokens of its path from the root: a node's identity, whatever its index."""
    return {tuple(tree.path_tokens(i)) for i in range(1, tree.size + 1)}

def _fresh_tree(head, hidden, ids, n_nodes, **kw):
    draft = HeadTreeDraft(head, **kw)
    draft.reset(None)
    draft.observe(hidden)
    tree = draft.propose_tree(ids, n_nodes)
    return tree, draft.state.forwards


def test_static_tree_grows_only_the_nodes_it_keeps(target, prompts, head):
    """A static tree cut to n nodes is the first n nodes of the whole shape, and a level whose nodes would
    all be cut is never fed: 3-1-1 needs catch_up alone for 3 nodes, one more forward for 4-6, two for 7-9."""
    from specnb.cache import forward_features

    ids = prompts[4]
    _, hidden = forward_features(target, ids[:-1], new_cache(target))
    shape = shape_from_branching((3, 1, 1))
    whole, _ = _fresh_tree(head, hidden, ids, 9, shape=shape)
    for n in range(1, 10):
        tree, forwards = _fresh_tree(head, hidden, ids, n, shape=shape)
        assert tree.tokens == whole.tokens[:n] and tree.parents == whole.parents[:n], n
        assert forwards == 1 + (n > 3) + (n > 6), (n, forwards)


def test_dynamic_tree_skips_nodes_whose_children_cannot_be_kept(target, prompts, head, monkeypatch):
    """Pruning the levels of a dynamic tree never loses a node worth keeping: with a budget of 2 the tree
    is the top 2 nodes by score whatever is fed, and at most as many rows are fed as without pruning."""
    from specnb.cache import forward_features
    from specnb.head import HeadState

    ids = prompts[4]
    _, hidden = forward_features(target, ids[:-1], new_cache(target))
    fed = []
    real_grow = HeadState.grow
    monkeypatch.setattr(HeadState, "grow", lambda self, f, tokens, *a: fed.append(len(tokens)) or real_grow(
        self, f, tokens, *a))
    small, forwards = _fresh_tree(head, hidden, ids, 2, depth=4, branch=3, width=3)
    big, _ = _fresh_tree(head, hidden, ids, 12, depth=4, branch=3, width=3)
    assert small.size == 2 and forwards <= 2 and fed[:forwards - 1] == [1] * (forwards - 1), fed  # one row a grow
    # the two best nodes: the head's top root child, then the better of its second root child and its top
    # grandchild; a big budget keeps both as the same nodes (paths), not merely the same token values
    assert small.tokens[0] == big.tokens[0] and small.parents[0] == 0
    assert _paths(small) <= _paths(big), (small, big)


def test_lookup_tree_branches_on_several_matches():
    d = LookupTreeDraft(max_ngram=2, min_ngram=1, branches=3)
    d.reset(None)
    ids = [1, 2, 7, 8, 1, 2, 5, 6, 9, 1, 2, 5, 3, 1, 2]
    tree = d.propose_tree(ids, 8)
    assert sorted(tree.tokens[i - 1] for i in tree.children(0)) == [5, 7]  # two branches under "1 2"
    five = next(i for i in tree.children(0) if tree.tokens[i - 1] == 5)
    assert sorted(tree.tokens[i - 1] for i in tree.children(five)) == [3, 6]
    assert tree.children(0)[0] == five  # supported by two matches: first


# --- bad input -------------------------------------------------------------------------------

def test_chain_loop_refuses_a_tree_draft(target, prompts, head):
    with pytest.raises(ValueError, match="proposes token trees.*speculative_tree_greedy"):
        speculative_greedy(target, LookupTreeDraft(), prompts[2], 4, 8)


def test_bad_tree_arguments(target, prompts, head):
    with pytest.raises(ValueError, match="n_nodes must be an integer >= 1"):
        speculative_tree_greedy(target, LookupTreeDraft(), prompts[2], 0, 8)
    with pytest.raises(ValueError, match="static|shape path"):
        check_shape([(0,), (1, 0)])

    class Greedy(Draft):
        def propose(self, ids, k):
            return []

        def propose_tree(self, ids, n_nodes):
            return Tree(range(n_nodes + 2), range(n_nodes + 2))

    with pytest.raises(ValueError, match="proposed 6 nodes; at most n_nodes = 4"):
        speculative_tree_greedy(target, Greedy(), prompts[2], 4, 8)


def test_a_tree_past_the_context_names_the_node(prompts):
    from specnb.tiny import tiny_llama

    small = tiny_llama(seed=0, context=32)

    class Wide(Draft):
        def propose(self, ids, k):
            return []

        def propose_tree(self, ids, n_nodes):
            return Tree([1] * n_nodes, [0] * n_nodes)  # all at depth 1

    ids = list(range(1, 25))
    with pytest.raises(ValueError, match="tree node 9 does not fit"):
        speculative_tree_greedy(small, Wide(), ids, 12, 4)


# --- the cost model extended to trees ----------------------------------------------------------

def test_rank_acceptance_counts_only_what_was_offered():
    from specnb.tree_costmodel import rank_acceptance

    records = [{"walks": [[[1, 0], [3, 1, 2]],  # rank 1 at depth 1, rank 0 at depth 2, then rejected
                          [[], [3]],  # nothing at depth 1
                          [[0], [3, 0]]]}]  # rank 0 at depth 1, then a leaf
    A = rank_acceptance(records, depths=3, ranks=3)
    assert A[0].tolist() == [1 / 3, 1 / 3, 0.0]
    assert A[1, 0] == 1.0 and np.isnan(A[1, 1])  # depth 2 offered one child once, and it was taken
    assert A[2, 0] == 0.0 and A[2, 1] == 0.0 and np.isnan(A[2, 2])


def test_expected_tokens_of_a_chain_is_chapter_5s_E_and_of_a_fan_adds_the_ranks():
    from specnb.costmodel import expected_tokens as chain_E
    from specnb.tree_costmodel import expected_tokens, predict_speedup

    A = np.array([[0.5, 0.2, 0.1], [0.4, 0.1, 0.05], [0.3, 0.1, 0.0]])
    assert expected_tokens(chain_shape(3), A) == pytest.approx(1 + 0.5 + 0.5 * 0.4 + 0.5 * 0.4 * 0.3)
    fan = shape_from_branching((3,))
    assert expected_tokens(fan, A) == pytest.approx(1.8)
    assert expected_tokens(fan, A, n_nodes=2) == pytest.approx(1.7)
    assert predict_speedup(fan, A, 3, {4: 1.2}, 0.1) == pytest.approx(1.8 / 1.3)
    with pytest.raises(ValueError, match="depth 4, rank 0"):
        expected_tokens(chain_shape(4), A)
    assert chain_E(0.5, 3) == pytest.approx(expected_tokens(chain_shape(3), np.full((3, 1), 0.5)))


def test_tree_runs_record_their_walks(target, prompts, baselines):
    from specnb.sweep import run_record
    from specnb.tree_costmodel import rank_acceptance

    ids, ref = prompts[3], baselines[3]
    out = speculative_tree_greedy(target, OracleTree(ids, ref, 96, "right-last"), ids, 16, N_NEW)
    rec = run_record(out, 16)
    assert len(rec["walks"]) == len(out.rounds)
    for (taken, offered), r in zip(rec["walks"], out.rounds):
        assert len(taken) == r.accepted and all(t == 2 for t in taken)  # the right child is the third
    A = rank_acceptance([rec], depths=3, ranks=3)
    assert A[0, 2] == 1.0 and A[0, 0] == 0.0
