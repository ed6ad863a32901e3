import pytest
import torch

from specnb.tiny import perturbed_copy, tiny_llama

VOCAB = 96


@pytest.fixture(scope="session")
def target():
    return tiny_llama(seed=0, vocab_size=VOCAB)


@pytest.fixture(scope="session")
def noisy_draft_model(target):
    # Agrees with the target on some tokens, not all (checked in the tests that use it).
    return perturbed_copy(target, noise=0.02, seed=1)


@pytest.fixture(scope="session")
def prompts():
    gen = torch.Generator().manual_seed(123)
    return [torch.randint(0, VOCAB, (int(n),), generator=gen).tolist() for n in (1, 3, 7, 12, 20)]


@pytest.fixture(scope="session")
def real():
    """The real offline model (converted once; later loads take under a second)."""
    from specnb.models import load_offline_target

    return load_offline_target()


@pytest.fixture(autouse=True)
def _one_thread():
    """Tests check tokens, not speed. With two threads on two cores, any other busy process makes
    PyTorch's thread pool stall (measured here: a 4-token forward of the real model went from
    0.13 s to 4.1 s while another process held one core); one thread stays predictable."""
    torch.set_num_threads(1)
    yield


@pytest.fixture(scope="session")
def baselines(target, prompts):
    """Plain greedy tokens for each prompt, computed once."""
    from specnb.decode import greedy

    torch.set_num_threads(1)
    return [greedy(target, ids, 24).tokens for ids in prompts]
