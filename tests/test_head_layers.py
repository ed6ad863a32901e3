"""A head that reads several target layers (EAGLE-3's fused low/middle/high features), on tiny models:
the features the loop hands over, exactness in the chain and tree loops, training equals drafting,
and the data cut for heads that read fewer layers."""
import pytest
import torch

from specnb import train_head as th
from specnb.cache import forward_features, new_cache
from specnb.decode import greedy, speculative_greedy
from specnb.drafts import HeadDraft, HybridDraft, PromptLookupDraft
from specnb.head import HeadState
from specnb.head_data import Sequence, for_layers
from specnb.tree_decode import speculative_tree_greedy
from specnb.tree_drafts import HeadTreeDraft

LAYERS = (1,)  # the tiny target has 2 decoder layers: layer 1's output, then the last hidden state
N_NEW = 24


def test_features_hold_the_layers_then_the_last_hidden_state(target):
    ids = [5, 9, 2, 40, 7]
    H = target.config.hidden_size
    logits0, h0 = forward_features(target, ids, new_cache(target))
    logits1, h1 = forward_features(target, ids, new_cache(target), layers=LAYERS)
    assert h0.shape == (5, H) and h1.shape == (5, 2 * H)
    torch.testing.assert_close(h1[:, -H:], h0)
    torch.testing.assert_close(logits1, logits0)
    with torch.inference_mode():
        out = target.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    torch.testing.assert_close(h1[:, :H], out.hidden_states[1][0])  # layer 1's output, before any norm
    assert not torch.allclose(h1[:, :H], h0)


def test_layers_outside_the_decoder_are_refused(target):
    L = target.config.num_hidden_layers
    for bad in ((0,), (L,)):
        with pytest.raises(ValueError, match="feature layers must be in 1"):
            forward_features(target, [1, 2], new_cache(target), layers=bad)


@pytest.fixture(scope="module")
def layered_data(target):
    gen = torch.Generator().manual_seed(7)
    encoded = [torch.randint(0, target.config.vocab_size, (int(n),), generator=gen).tolist()
               for n in torch.randint(3, 12, (40,), generator=gen)]
    return th.generate_ids(target, encoded, 40, 8, None, "tiny data", layers=LAYERS)


@pytest.fixture(scope="module")
def layered(target, layered_data):
    cfg = th.TrainConfig(depth=2, epochs=100, seq_len=64, batch_tokens=512, lr=3e-3, warmup=5, draft_vocab=96,
                         soft_labels=False, feature_layers=LAYERS, bf16=False)
    head = th.new_head(target, th.draft_vocabulary(layered_data[:32], 96), cfg)
    fresh = th.evaluate(head, layered_data[:8], 2)
    th.train(head, layered_data[:32], cfg, target.config.vocab_size, progress=False)
    return head, fresh, th.evaluate(head, layered_data[:8], 2)


def test_generated_data_carries_every_layer(target, layered_data):
    H = target.config.hidden_size
    s = layered_data[0]
    assert s.features.shape == (len(s.tokens), 2 * H)
    _, h = forward_features(target, s.tokens.tolist(), new_cache(target), layers=LAYERS)
    torch.testing.assert_close(s.features.float(), h, atol=2e-2, rtol=2e-2)  # stored in float16


def test_a_fresh_layered_head_is_the_single_layer_head(target, layered_data):
    """fuse starts as the identity on the last hidden state: before training, the lower layer has no say."""
    cfg = th.TrainConfig(draft_vocab=96, feature_layers=LAYERS)
    vocab = th.draft_vocabulary(layered_data[:32], 96)
    torch.manual_seed(0)
    multi = th.new_head(target, vocab, cfg)
    torch.manual_seed(0)  # fc is created first in both heads: the same random start
    single = th.new_head(target, vocab, th.TrainConfig(draft_vocab=96))
    s = layered_data[3]
    H = target.config.hidden_size
    x, pos = s.tokens[None, 1:], torch.arange(len(s.tokens) - 1)[None]
    with torch.no_grad():
        torch.testing.assert_close(multi(s.features[None, :-1].float(), x, pos),
                                   single(s.features[None, :-1, -H:].float(), x, pos))


def test_layered_head_learns(layered):
    _, fresh, after = layered
    assert after["agree"][0] > fresh["agree"][0] + 0.3 and after["agree"][0] > 0.5, (fresh, after)


def test_layered_head_keeps_chain_and_tree_greedy_exact(target, prompts, layered):
    head = layered[0]
    assert HeadDraft(head).feature_layers == LAYERS
    for ids in prompts:
        base = greedy(target, ids, N_NEW).tokens
        for k in (1, 3, 6):
            for draft in (HeadDraft(head), HybridDraft(PromptLookupDraft(), HeadDraft(head))):
                assert speculative_greedy(target, draft, ids, k, N_NEW).tokens == base, (draft.name, k)
        for n_nodes in (4, 10):
            assert speculative_tree_greedy(target, HeadTreeDraft(head), ids, n_nodes, N_NEW).tokens == base


def test_the_loop_hands_the_layered_head_its_features(target, layered_data, layered):
    """On continuations it learned, the layered head is accepted in the decoding loop: the loop
    gives it the features (lower layer and last) it was trained on. Handed only the last hidden
    state it would refuse them (wrong width), never draft from them silently."""
    head = layered[0]
    rates = [speculative_greedy(target, HeadDraft(head), s.tokens[:s.prompt_len].tolist(), 3, N_NEW).acceptance_rate
             for s in layered_data[:8]]
    assert sum(rates) / len(rates) > 0.3, rates
    H = target.config.hidden_size
    with pytest.raises(ValueError, match="layers=draft.feature_layers"):
        HeadState(head).observe(layered_data[0].features[:4, -H:].float())


def test_layered_training_passes_equal_drafting(target, layered_data, layered):
    head = layered[0]
    s = layered_data[33]
    preds = th.chained_forward(head, s.features[None].float(), s.tokens[None], 3)
    chain = [head.logits(p[0]) for p in preds]
    state = HeadState(head)
    for i in (4, 9, 20):
        state.observe(s.features[state.n_features:i + 1].float())
        got = []

        def pick(j, logits):
            got.append(logits)
            return int(s.tokens[i + j + 2])

        state.draft(s.tokens[:i + 2].tolist(), 3, pick)
        for d in range(3):
            torch.testing.assert_close(got[d], chain[d][i], rtol=1e-4, atol=1e-4)


def test_data_cut_to_fewer_layers():
    H = 4
    blocks = [torch.full((3, H), float(v)) for v in (1, 2, 3)]  # layers 5, 9, then the last hidden state
    seq = Sequence(torch.arange(3), torch.cat(blocks, 1), torch.arange(3), "generated", 1)
    data = {"generated": [seq], "teacher": [seq], "held_out": [seq], "feature_layers": (5, 9)}
    assert for_layers(data, (5, 9)) is data
    assert for_layers(data, (9,))["held_out"][0].features.unique().tolist() == [2.0, 3.0]
    last = for_layers(data, ())
    assert last["teacher"][0].features.shape == (3, H) and last["teacher"][0].features.unique().tolist() == [3.0]
    assert last["feature_layers"] == ()
    with pytest.raises(ValueError, match="build it with feature_layers"):
        for_layers(data, (7,))
