"""The verify breakdown (specnb.profile_verify) and the blocked LM head it measures, on tiny models."""
import pytest
import torch

from specnb.cache import forward, forward_features, lm_head_logits, new_cache
from specnb.profile_verify import breakdown_table, op_table, verify_breakdown


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n", [1, 3, 9])
def test_blocked_lm_head_gives_the_same_logits(n, bias):
    torch.manual_seed(0)
    head = torch.nn.Linear(32, 1000, bias=bias)  # 1000 rows: the last block is partial
    hidden = torch.randn(n, 32)
    assert torch.equal(lm_head_logits(head, hidden, block=128, blocked_ns=range(1, 10)), head(hidden))
    assert torch.equal(lm_head_logits(head, hidden, block=None), head(hidden))
    assert torch.equal(lm_head_logits(head, hidden), head(hidden))  # the defaults the decoding loops use


@pytest.mark.parametrize("n", [1, 3, 5, 9, 17])
def test_verify_forwards_give_the_models_own_logits(target, prompts, n):
    """specnb's forward and forward_features (the LM head blocked for some n) equal the model's own forward."""
    ids = list(prompts[-1]) * 2  # 40 ids
    prefix, new = ids[:-n], ids[-n:]
    own_cache, ours_cache, feat_cache = new_cache(target), new_cache(target), new_cache(target)
    for c in (own_cache, ours_cache, feat_cache):
        forward(target, prefix, c, logits_to_keep=1)
    with torch.inference_mode():
        own = target(input_ids=torch.tensor([new]), past_key_values=own_cache, use_cache=True).logits[0]
    ours = forward(target, new, ours_cache)
    feats, hidden = forward_features(target, new, feat_cache)
    assert hidden.shape == (n, target.config.hidden_size)
    assert torch.allclose(own, ours, atol=1e-5, rtol=0) and torch.equal(own.argmax(-1), ours.argmax(-1))
    assert torch.allclose(own, feats, atol=1e-5, rtol=0) and torch.equal(own.argmax(-1), feats.argmax(-1))


def test_verify_breakdown_and_op_table_run(target):
    b = verify_breakdown(target, ns=(1, 3), context_len=8, repeats=2, warmup=1, progress=False)
    assert set(b["median"]) == {"full", "specnb", "body", "head", "head_blocked"}
    assert all(t > 0 for part in b["median"].values() for t in part.values())
    assert b["equal"] == {1: True, 3: True}
    assert "specnb/T1" in breakdown_table(b)
    ops = op_table(target, 3, context_len=8, repeats=1, top=5)
    assert 0 < len(ops) <= 5 and all(ms > 0 and 0 < share <= 1 for _, ms, share in ops)
