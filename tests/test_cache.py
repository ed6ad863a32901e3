"""The rollback helper against the cache semantics of transformers 4.x and 5.x."""
import pytest
import torch

from specnb.cache import cache_keyword, cache_length, forward, new_cache, rollback


class FakeLayerCache:
    """Mimics DynamicCache.crop: 4.x (n >= 0 = keep n, so crop(0) empties it; negative = remove -n)
    or 5.x (positive raises, 0 does nothing)."""

    def __init__(self, length: int, version: int):
        self.length, self.version = length, version

    def get_seq_length(self):
        return self.length

    def crop(self, n):
        if n >= 0:
            if self.version == 5:
                if n > 0:
                    raise ValueError("positive crop not supported")
                return
            self.length = min(self.length, n)
        else:
            self.length -= abs(n)


class BrokenCache(FakeLayerCache):
    def crop(self, n):  # silently does nothing
        pass


@pytest.mark.parametrize("version", [4, 5])
@pytest.mark.parametrize("n_remove", [0, 1, 3, 10])
def test_rollback_removes_exactly_n_in_both_semantics(version, n_remove):
    cache = FakeLayerCache(10, version)
    rollback(cache, n_remove)
    assert cache.get_seq_length() == 10 - n_remove


def test_fake_4x_crop_zero_empties_the_cache():
    """The hazard the helper's n_remove == 0 skip avoids: in 4.x, crop(-0) is crop(0), "keep nothing"."""
    c4, c5 = FakeLayerCache(10, 4), FakeLayerCache(10, 5)
    c4.crop(-0)
    c5.crop(-0)
    assert (c4.get_seq_length(), c5.get_seq_length()) == (0, 10)


def test_the_5x_fake_behaves_as_the_installed_cache(target):
    """The fakes stand for transformers' DynamicCache: on a real one, crop(0) keeps everything,
    a positive crop raises and crop(-1) removes one position, as the 5.x fake does."""
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("the installed transformers is 4.x; the 4.x fake stands for it")
    cache, fake = new_cache(target), FakeLayerCache(4, 5)
    forward(target, [5, 17, 2, 40], cache)
    for n in (0, -1):
        cache.crop(n)
        fake.crop(n)
        assert cache_length(cache) == fake.get_seq_length()
    with pytest.raises(ValueError, match="positive"):
        cache.crop(2)
    with pytest.raises(ValueError):
        fake.crop(2)


def test_rollback_refuses_silent_failure():
    with pytest.raises(RuntimeError, match="rollback failed"):
        rollback(BrokenCache(10, 5), 2)


def test_rollback_rejects_bad_counts():
    with pytest.raises(ValueError, match="n_remove must be >= 0"):
        rollback(FakeLayerCache(3, 5), -1)
    with pytest.raises(ValueError, match="cannot remove"):
        rollback(FakeLayerCache(3, 5), 4)


def test_real_dynamic_cache_rollback_matches_recomputation(target):
    """After writing 5 tokens and rolling back 3, the next logits equal those of a cache that never saw them."""
    ids = [5, 17, 2, 40]
    cache = new_cache(target)
    forward(target, ids, cache)
    forward(target, [1, 2, 3, 4, 5], cache)
    rollback(cache, 3)
    assert cache_length(cache) == len(ids) + 2
    after_rollback = forward(target, [9], cache)
    clean = new_cache(target)
    expected = forward(target, ids + [1, 2, 9], clean)[-1:]
    torch.testing.assert_close(after_rollback, expected, rtol=1e-5, atol=1e-5)
    # Negative control: without the rollback the logits differ.
    stale = new_cache(target)
    forward(target, ids + [1, 2, 3, 4, 5], stale)
    assert not torch.allclose(forward(target, [9], stale), expected, atol=1e-3)


def test_cache_keyword_follows_forward_signature(target):
    assert cache_keyword(target) == "cache"  # transformers 5.x

    class Old4x(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, use_cache=None):
            pass

    assert cache_keyword(Old4x()) == "past_key_values"
