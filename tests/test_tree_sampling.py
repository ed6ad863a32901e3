"""Sampling on a tree node (chapter 8): the multi-candidate rule keeps p exactly, the naive rule does not.

Exact checks enumerate every candidate draw (specnb.tree_sampling.round_distribution); the sampler
code is then checked against those exact distributions with chapter 6's chi-square test, whose
false-alarm rate and power are measured here too.
"""
import pytest
import torch

from specnb.distcheck import chi_square_test, rejection_rate
from specnb.tree_sampling import draw_candidates, multi_candidate_round, round_distribution

DTYPE = torch.float64


def pair(seed, V=5, zeros=False):
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(V, generator=g, dtype=DTYPE) ** 3
    q = torch.rand(V, generator=g, dtype=DTYPE) ** 3
    if zeros:
        p[0] = 0.0  # a token the target never emits, the draft likes
        q[-1] = 0.0  # a token the draft never proposes, the target likes
        q[0] += 0.5
    return p / p.sum(), q / q.sum()


CASES = [(s, z) for s in range(6) for z in (False, True)]


@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("replacement", [True, False])
@pytest.mark.parametrize("seed,zeros", CASES)
def test_multi_candidate_rule_outputs_p_exactly(m, replacement, seed, zeros):
    p, q = pair(seed, zeros=zeros)
    out = round_distribution(p, q, m, replacement)
    assert abs(float(out.sum()) - 1) < 1e-12
    assert float((out - p).abs().max()) < 1e-12


@pytest.mark.parametrize("replacement", [True, False])
def test_naive_rule_is_exact_for_one_candidate_and_biased_for_more(replacement):
    worst = {}
    for m in (1, 2, 3):
        tv = []
        for seed, zeros in CASES:
            p, q = pair(seed, zeros=zeros)
            tv.append(0.5 * float((round_distribution(p, q, m, replacement, "naive") - p).abs().sum()))
        worst[m] = max(tv)
    assert worst[1] < 1e-12  # one candidate: chapter 6's rule
    assert worst[2] > 0.02 and worst[3] > worst[2]  # each extra candidate adds bias


def _draws(p, q, m, replacement, rule, n):
    def draw(generator):
        out = []
        for _ in range(n):
            cands = draw_candidates(q, m, generator, replacement)
            out.append(multi_candidate_round(p, q, cands, generator, replacement, rule)[1])
        return torch.tensor(out)
    return draw


@pytest.mark.parametrize("replacement", [True, False])
def test_sampler_code_matches_the_enumeration_and_the_test_catches_the_naive_rule(replacement):
    p, q = pair(3, V=6, zeros=True)
    m, n, trials = 3, 1500, 30
    exact = round_distribution(p, q, m, replacement)
    naive = round_distribution(p, q, m, replacement, "naive")
    assert 0.5 * float((naive - p).abs().sum()) > 0.03
    false_alarm = rejection_rate(_draws(p, q, m, replacement, "multi-candidate", n), exact, trials, seed=1)
    naive_fits_its_own = rejection_rate(_draws(p, q, m, replacement, "naive", n), naive, trials, seed=2)
    power = rejection_rate(_draws(p, q, m, replacement, "naive", n), p, trials, seed=3)
    assert false_alarm <= 0.1 and naive_fits_its_own <= 0.1  # the code does what the enumeration says
    assert power >= 0.9  # and the chi-square test sees the naive rule's bias at this sample size


def test_without_replacement_draws_distinct_candidates():
    g = torch.Generator().manual_seed(0)
    q = torch.tensor([0.7, 0.2, 0.1, 0.0], dtype=DTYPE)
    for _ in range(50):
        c = draw_candidates(q, 3, g, replacement=False)
        assert sorted(c) == [0, 1, 2]
    with pytest.raises(ValueError, match="cannot draw 4 distinct candidates"):
        draw_candidates(q, 4, g, replacement=False)
    with pytest.raises(ValueError, match="rule must be one of"):
        round_distribution(q, q, 2, rule="first-pass")


# --- the whole loop on a tree: speculative_tree_sample --------------------------------------------

from specnb.tree_decode import speculative_tree_sample  # noqa: E402
from specnb.tree_drafts import SampledHeadTree  # noqa: E402


@pytest.fixture(scope="module")
def tiny_head(target):
    from tests.test_head import random_head

    return random_head(target, v=96, seed=2)


@pytest.mark.parametrize("replacement", [True, False])
def test_tree_sampling_at_temperature_zero_is_greedy(target, prompts, baselines, tiny_head, replacement):
    from specnb.sampling import SamplingParams

    for ids, ref in zip(prompts[1:], baselines[1:]):
        out = speculative_tree_sample(target, SampledHeadTree(tiny_head, (2, 2, 1), replacement), ids, 6, 24,
                                      SamplingParams(temperature=0.0), seed=3)
        assert out.tokens == ref


def _two_token_marginals(target, ids, params):
    """Exact distributions of the first and second sampled tokens after ``ids`` (float64)."""
    from specnb.cache import forward, new_cache
    from specnb.sampling import warp

    with torch.inference_mode():
        p1 = warp(forward(target, ids, new_cache(target))[-1], params).double()
        V = len(p1)
        batch = torch.tensor([ids + [x] for x in range(V)])
        p2_given = warp(target(input_ids=batch).logits[:, -1], params).double()  # (V, V)
    return p1, p1 @ p2_given


def test_tree_sampling_follows_the_target_and_the_naive_rule_is_caught(target, prompts, tiny_head):
    from specnb.sampling import SamplingParams

    params = SamplingParams(temperature=1.0)
    ids = prompts[2]
    p1, p2 = _two_token_marginals(target, ids, params)
    n = 1200

    def run(rule, replacement):
        firsts, seconds, deep = [], [], 0
        for seed in range(n):
            out = speculative_tree_sample(target, SampledHeadTree(tiny_head, (3, 2), replacement), ids, 9, 3,
                                          params, seed=seed, rule=rule)
            firsts.append(out.tokens[0])
            seconds.append(out.tokens[1])
            deep += out.rounds[0].accepted >= 2
        return torch.tensor(firsts), torch.tensor(seconds), deep

    for replacement in (True, False):
        f, s, deep = run("multi-candidate", replacement)
        assert chi_square_test(f, p1).p_value > 1e-3 and chi_square_test(s, p2).p_value > 1e-3
        assert deep > 0  # some second tokens came from depth 2 of a tree
    f, s, _ = run("naive", True)
    assert min(chi_square_test(f, p1).p_value, chi_square_test(s, p2).p_value) < 1e-6


def test_tree_sampling_refuses_a_draft_that_cannot_sample_a_tree(target, prompts):
    from specnb.tree_drafts import LookupTreeDraft

    with pytest.raises(ValueError, match="cannot sample a tree"):
        speculative_tree_sample(target, LookupTreeDraft(), prompts[2], 4, 8)
