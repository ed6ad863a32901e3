"""The trained draft head (chapter 7) on tiny models: exactness through the shared loop, training
equals drafting (the chain mask), a stale head cache caught, training that learns, and checkpoints."""
import json

import pytest
import torch

from specnb import head_io
from specnb import train_head as th
from specnb.decode import greedy, sample, speculative_greedy, speculative_sample
from specnb.drafts import HeadDraft, HeuristicK, HybridDraft, PromptLookupDraft
from specnb.head import DraftHead, HeadConfig, HeadState
from specnb.sampling import SamplingParams
from specnb.tiny import tiny_llama

N_NEW = 24


def random_head(target, v: int = 64, seed: int = 0) -> DraftHead:
    torch.manual_seed(seed)
    head = DraftHead(HeadConfig.from_target(target.config, v))
    head.vocab_ids.copy_(torch.randperm(target.config.vocab_size)[:v].sort().values)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    return head.attach(target).eval()


@pytest.fixture(scope="module")
def tiny_data(target, prompts):
    """The tiny target's own greedy continuations of 40 random prompts, with features."""
    gen = torch.Generator().manual_seed(7)
    encoded = [torch.randint(0, target.config.vocab_size, (int(n),), generator=gen).tolist()
               for n in torch.randint(3, 12, (40,), generator=gen)]
    return th.generate_ids(target, encoded, 40, 8, None, "tiny data")


@pytest.fixture(scope="module")
def trained(target, tiny_data):
    """A head trained on 32 of the tiny sequences (training-time test, depth 2) until it has them by heart.

    A random tiny target's continuations are close to noise, so this head memorizes rather
    than generalizes: enough to show that training, evaluation and drafting agree. Hard labels:
    a random target's softmax is nearly flat, so its argmax is what there is to learn.
    """
    cfg = th.TrainConfig(depth=2, epochs=100, seq_len=64, batch_tokens=512, lr=3e-3, warmup=5, draft_vocab=96,
                         init_from_last_layer=True, soft_labels=False)
    head = th.new_head(target, th.draft_vocabulary(tiny_data[:32], 96), cfg)
    before = th.evaluate(head, tiny_data[:8], 3)
    log = th.train(head, tiny_data[:32], cfg, target.config.vocab_size, progress=False)
    return head, before, th.evaluate(head, tiny_data[:8], 3), log


def all_drafts(head):
    return [HeadDraft(head), HeadDraft(head, threshold=0.3), HybridDraft(PromptLookupDraft(), HeadDraft(head)),
            HeuristicK(HeadDraft(head), 2)]


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_head_drafts_keep_greedy_exact(target, prompts, trained, k):
    head = trained[0]
    for ids in prompts:
        base = greedy(target, ids, N_NEW).tokens
        for draft in all_drafts(head) + all_drafts(random_head(target)):
            result = speculative_greedy(target, draft, ids, k, N_NEW)
            assert result.tokens == base, (draft.name, k, ids)


def test_trained_head_is_accepted_in_the_loop(target, tiny_data, trained):
    """On continuations it learned, the trained head's drafts are accepted in the decoding loop and a
    random head's are not: the loop hands the head the features it was trained on."""
    head = trained[0]
    held = [s.tokens[:s.prompt_len].tolist() for s in tiny_data[:8]]
    acc = {name: [] for name in ("trained", "random")}
    for ids in held:
        for name, h in (("trained", head), ("random", random_head(target))):
            acc[name].append(speculative_greedy(target, HeadDraft(h), ids, 3, N_NEW).acceptance_rate)
    assert sum(acc["trained"]) / len(held) > 0.3 > sum(acc["random"]) / len(held), acc


def test_eos_inside_a_head_draft(target, prompts, trained):
    head = trained[0]
    ids = prompts[3]
    base = greedy(target, ids, N_NEW).tokens
    eos = base[5]  # a token the target emits: generation must stop right after it
    result = speculative_greedy(target, HeadDraft(head), ids, 4, N_NEW, eos_token_id=eos)
    assert result.tokens == base[:base.index(eos) + 1] and result.stop == "eos"


def test_training_learns(trained):
    """Agreement on the learned continuations rises from chance (about 1/96) to most positions at
    draft position 1, and at position 2, drafted from the head's own fed-back feature."""
    head, before, after, log = trained
    assert before["agree"][0] < 0.1 and after["agree"][0] > 0.5, (before, after)
    assert after["chain"][1] > 0.3, after
    assert log["curve"][-1]["ce"] < log["curve"][0]["ce"]


def test_token_batches_cover_each_window_once_within_the_budget_with_less_padding():
    """batch_by="tokens": every window of an epoch lands in exactly one batch, no batch pads past
    batch_tokens (a single window longer than it excepted), and on mixed lengths far fewer padded
    positions than random windows a step."""
    import numpy as np

    rng = np.random.default_rng(0)
    lengths = np.concatenate([np.full(300, 256), rng.integers(8, 256, 500)])
    order = rng.permutation(len(lengths))
    batches = th.token_batches(order, lengths, 2048, np.random.default_rng(1))
    got = np.concatenate(batches)
    assert sorted(got.tolist()) == list(range(len(lengths)))
    padded = [len(b) * -(-int(lengths[b].max()) // 32) * 32 for b in batches]
    assert max(padded) <= 2048
    random_windows = [8 * int(lengths[order[i:i + 8]].max()) for i in range(0, len(order), 8)]
    waste, random_waste = 1 - lengths.sum() / sum(padded), 1 - lengths.sum() / sum(random_windows)
    assert waste < random_waste / 2, (waste, random_waste)  # here about 0.11 against 0.30


def test_training_learns_with_token_batches(target, tiny_data):
    """The same tiny task as the trained fixture, batched by tokens: it learns too, in fewer steps."""
    cfg = th.TrainConfig(depth=2, epochs=100, seq_len=128, batch_tokens=512, lr=3e-3, warmup=5, draft_vocab=96,
                         batch_by="tokens")  # windows: 4 a step; tokens: 8 of these ~50-token sequences
    head = th.new_head(target, th.draft_vocabulary(tiny_data[:32], 96), cfg)
    log = th.train(head, tiny_data[:32], cfg, target.config.vocab_size, progress=False)
    windows_steps = len(th._windows(tiny_data[:32], cfg.seq_len)) * cfg.epochs / (cfg.batch_tokens // cfg.seq_len)
    assert log["steps"] < windows_steps  # short sequences: several windows share a step
    assert th.evaluate(head, tiny_data[:8], 2)["agree"][0] > 0.5
    with pytest.raises(ValueError, match="batch_by"):
        th.train(head, tiny_data[:4], th.TrainConfig(batch_by="tokenz"), target.config.vocab_size, progress=False)


def _chain_logits(head, seq, depth):
    preds = th.chained_forward(head, seq.features[None].float(), seq.tokens[None], depth)
    return [head.logits(p[0]) for p in preds]  # each (T-1, V')


def _drafting_logits(head, seq, i, depth, state=None):
    """Draft ``depth`` tokens after position i (teacher-forced: the true tokens are fed back)."""
    state = state or HeadState(head)
    state.observe(seq.features[state.n_features:i + 1].float())
    got = []

    def pick(j, logits):
        got.append(logits)
        return int(seq.tokens[i + j + 2]) if i + j + 2 < len(seq.tokens) else 0

    state.draft(seq.tokens[:i + 2].tolist(), depth, pick)
    return got, state


def test_training_passes_equal_drafting(target, tiny_data, trained):
    """chained_forward (how the head is trained and evaluated) computes exactly what HeadState
    computes when it drafts: same logits at every depth, from several start positions, in one
    sequence whose state carries over between rounds."""
    head = trained[0]
    seq = tiny_data[33]
    chain = _chain_logits(head, seq, 3)
    state = None
    for i in (4, 9, 10, 20):
        got, state = _drafting_logits(head, seq, i, 3, state)
        for d in range(3):
            torch.testing.assert_close(got[d], chain[d][i], rtol=1e-4, atol=1e-4)


def test_stale_head_cache_is_caught(target, tiny_data, trained, monkeypatch):
    """Negative control: a head that forgets to crop its speculative keys/values cannot draft the
    next round silently: its masks are sized from what it believes the cache holds, so the
    mismatch raises, naming the cause, instead of attending to stale entries."""
    head = trained[0]
    seq = tiny_data[33]
    monkeypatch.setattr(HeadState, "drop_speculative", lambda self: setattr(self, "speculative", 0))
    _, state = _drafting_logits(head, seq, 4, 3)
    with pytest.raises(RuntimeError, match="stale speculative entries were not rolled back"):
        _drafting_logits(head, seq, 9, 3, state)


def test_wrong_training_mask_is_caught(target, tiny_data, trained, monkeypatch):
    """Negative control: plain causal attention across the chained passes (a tempting shortcut)
    does not compute what drafting computes at depth 2."""
    head = trained[0]
    seq = tiny_data[33]
    monkeypatch.setattr(th, "chain_mask", lambda T, d: torch.ones(1, 1, T, (d + 1) * T, dtype=torch.bool).tril(T * d))
    chain = _chain_logits(head, seq, 2)
    got, _ = _drafting_logits(head, seq, 9, 2)
    torch.testing.assert_close(got[0], chain[0][9], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(got[1], chain[1][9], rtol=1e-4, atol=1e-4)


def test_batched_evaluation_counts_what_one_window_at_a_time_counts(target, tiny_data, trained):
    """evaluate() pads windows of different lengths on the right and runs them together: every count
    equals the one-window-at-a-time count, for the trained head and a random one (whose argmax
    flips on small changes)."""
    seqs = tiny_data[:16]
    assert len({len(s.tokens) for s in seqs}) > 3  # groups mix lengths, so padding is exercised
    for head in (trained[0], random_head(target)):
        one = th.evaluate(head, seqs, 3, batch=1)
        assert one["positions"] > 300 and 0 < one["agree"][0] < 1
        for batch in (5, 16):
            assert th.evaluate(head, seqs, 3, batch=batch) == one


def test_padding_seen_by_evaluation_is_caught(target, tiny_data, monkeypatch):
    """Negative control: masks that let a position see later ones (so the padding too) make the batched
    counts differ from one window at a time, in the very comparison the test above makes."""
    monkeypatch.setattr(th, "chain_mask", lambda T, d: torch.ones(1, 1, T, (d + 1) * T, dtype=torch.bool))
    head, seqs = random_head(target), tiny_data[:16]
    assert th.evaluate(head, seqs, 3, batch=16) != th.evaluate(head, seqs, 3, batch=1)


def _first_tokens(target, head, draft_q, runs, params, ids):
    from specnb.sampling import draft_distributions

    return torch.tensor([speculative_sample(target, HeadDraft(head), ids, 2, 2, params, seed=s,
                                            draft_q=draft_q or draft_distributions).tokens[0]
                         for s in range(runs)])


def test_head_sampling_is_exact_in_distribution(target, tiny_data, trained):
    """Sampling mode with the head: the first emitted token (an accepted draft or a residual draw)
    follows the target's p (chi-square, false-alarm rate 1e-3); a head that drafts by argmax but
    reports its softmax (a wrong variant) is rejected by the same test. The context is one the head
    learned, so its drafts are often accepted and the wrong variant's bias is large."""
    from specnb.cache import forward, new_cache
    from specnb.distcheck import chi_square_test
    from specnb.sampling import VARIANTS, warp

    head = trained[0]
    ids = tiny_data[1].tokens[:tiny_data[1].prompt_len + 3].tolist()
    params = SamplingParams(temperature=1.0)
    p = warp(forward(target, ids, new_cache(target), logits_to_keep=1)[-1], params)
    good = chi_square_test(_first_tokens(target, head, None, 800, params, ids), p)
    bad = chi_square_test(_first_tokens(target, head, VARIANTS["argmax draft, softmax q reported"].draft_q,
                                        800, params, ids), p)
    assert good.p_value > 1e-3 > bad.p_value, (good, bad)


# ---------------------------------------------------------------------------------------------
# checkpoints: the card is checked before the weights; every failure names `make draft`


def _saved(target, tmp_path, head):
    card = {"format": th.FORMAT, "target_fingerprint": th.target_fingerprint(target),
            "config": {"head": head.cfg.to_dict(), "train": {}}}
    return th.save_head(head, card, tmp_path / "h")


def _snapshot(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_checkpoint_round_trip(target, tmp_path, trained):
    head = trained[0]
    folder = _saved(target, tmp_path, head)
    loaded, card = th.load_head(target, folder)
    assert card["target_fingerprint"] == th.target_fingerprint(target)
    saved, back = head.state_dict(), loaded.state_dict()
    assert set(saved) == set(back) and saved  # a missing or extra tensor fails here, not silently in a zip
    for key, value in saved.items():
        assert back[key].shape == value.shape, key
        assert torch.allclose(value.float(), back[key].float(), atol=2e-3, rtol=1e-2), key


@pytest.mark.parametrize("damage", ["no card", "bad json", "no weights", "truncated weights", "other target",
                                    "old format"])
def test_bad_checkpoints_name_make_draft(target, tmp_path, trained, damage):
    folder = _saved(target, tmp_path, trained[0])
    card_path, weights = folder / "draft_head.json", folder / "draft_head.safetensors"
    if damage == "no card":
        card_path.unlink()
    elif damage == "bad json":
        card_path.write_text("{not json")
    elif damage == "no weights":
        weights.unlink()
    elif damage == "truncated weights":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "other target":
        pass
    elif damage == "old format":
        card_path.write_text(json.dumps({**json.loads(card_path.read_text()), "format": 0}))
    before = _snapshot(folder)
    model = tiny_llama(seed=5, vocab_size=target.config.vocab_size) if damage == "other target" else target
    with pytest.raises(th.HeadUnavailableError, match="make draft"):
        th.load_head(model, folder)
    assert _snapshot(folder) == before  # nothing was changed


def test_vocabulary_that_does_not_fit_the_target(target):
    head = DraftHead(HeadConfig.from_target(target.config, 8))
    head.vocab_ids.copy_(torch.arange(8) + target.config.vocab_size - 4)
    with pytest.raises(ValueError, match="another target"):
        head.attach(target)


def test_no_head_anywhere_names_make_draft(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECNB_CACHE", str(tmp_path))
    monkeypatch.setattr(head_io, "packaged_dir", lambda: tmp_path / "nowhere")
    with pytest.raises(th.HeadUnavailableError, match="make draft"):
        th.find_head()


def test_threshold_must_be_a_probability(target):
    with pytest.raises(ValueError, match="threshold"):
        HeadDraft(random_head(target), threshold=1.5)


class LaggingFeatures(HeadDraft):
    """Negative control: the head is handed every feature one position late (f_{t-1} where f_t belongs)."""

    def reset(self, eos_token_id=None):
        super().reset(eos_token_id)
        self._last = None

    def observe(self, features):
        first = self._last if self._last is not None else features[:1]
        self._last = features[-1:]
        super().observe(torch.cat([first, features[:-1]]))


def test_features_off_by_one_position_keep_greedy_exact_but_lose_acceptance(target, tiny_data, trained):
    """Greedy stays exact whatever the draft proposes, so only acceptance can reveal a loop that hands
    the head the wrong position's features: the lagging variant must lose most of its acceptance."""
    head = trained[0]
    held = [s.tokens[:s.prompt_len].tolist() for s in tiny_data[:8]]
    acc = {"right": [], "lagging": []}
    for ids in held:
        base = greedy(target, ids, N_NEW).tokens
        for name, draft in (("right", HeadDraft(head)), ("lagging", LaggingFeatures(head))):
            result = speculative_greedy(target, draft, ids, 3, N_NEW)
            assert result.tokens == base, name
            acc[name].append(result.acceptance_rate)
    right, lagging = sum(acc["right"]) / len(held), sum(acc["lagging"]) / len(held)
    assert lagging < 0.5 * right, acc


def test_the_schedule_and_the_threshold_really_act(target, tiny_data, trained):
    """HeuristicK's k goes +2 after a fully accepted round and -1 (not below 1) after any other, round by
    round; a higher confidence threshold drafts fewer tokens (it ends rounds early), and the output stays
    plain greedy's throughout."""
    head = trained[0]

    class Tracked(HeuristicK):
        def update(self, ids, n_accepted):
            super().update(ids, n_accepted)
            self.history.append(self.k)

    grew = shrank = 0
    for seq in tiny_data[:8]:
        ids = seq.tokens[:seq.prompt_len].tolist()
        sched = Tracked(HeadDraft(head), k_start=1)
        sched.history = []
        result = speculative_greedy(target, sched, ids, 16, N_NEW)
        assert result.tokens == greedy(target, ids, N_NEW).tokens
        before = 1
        for r, after in zip(result.rounds[:-1], sched.history):  # the last round may be cut by the budget
            full = r.drafted > 0 and r.accepted == r.drafted
            assert after == (before + 2 if full else max(1, before - 1)), (r, before, after)
            grew += after > before
            shrank += after < before
            before = after
    assert grew and shrank, "the tiny data must exercise both directions of the schedule"
    drafted = {}
    for threshold in (0.0, 0.5, 0.9, 0.99):
        drafted[threshold] = 0
        for seq in tiny_data[:8]:
            ids = seq.tokens[:seq.prompt_len].tolist()
            result = speculative_greedy(target, HeadDraft(head, threshold=threshold), ids, 4, N_NEW)
            assert result.tokens == greedy(target, ids, N_NEW).tokens
            drafted[threshold] += result.drafted
    counts = list(drafted.values())
    assert counts == sorted(counts, reverse=True) and counts[-1] < counts[0], drafted  # it cuts rounds


@pytest.mark.parametrize("mode", ["skip-target", "one-too-few"])
def test_broken_rollback_in_sampling_mode_is_caught(target, prompts, mode):
    """Sampling mode shares the loop's rollback: a broken one must change the seeded output (same seed,
    same draws), as it changes greedy's."""
    from specnb.drafts import ModelDraft
    from specnb.tiny import perturbed_copy

    draft_model = perturbed_copy(target, noise=0.02, seed=1)
    params = SamplingParams(temperature=0.5)
    changed = 0
    for ids in prompts:
        right = speculative_sample(target, ModelDraft(draft_model), ids, 4, N_NEW, params, seed=3)
        broken = speculative_sample(target, ModelDraft(draft_model), ids, 4, N_NEW, params, seed=3,
                                    rollback_mode=mode)
        changed += right.tokens != broken.tokens
    assert changed > 0


def test_soft_labels_are_the_targets_softmax_over_the_draft_vocabulary(target, tiny_data):
    """With soft labels the token loss is the cross-entropy against softmax(lm_rows @ f_{t+1}): it equals
    that distribution's entropy when the head predicts f_{t+1} exactly, and is larger otherwise; a
    position whose target token is outside V' is left out."""
    head = th.new_head(target, th.draft_vocabulary(tiny_data[:8], 64), th.TrainConfig())
    vocab = target.config.vocab_size
    label_index = torch.full((vocab,), -1, dtype=torch.long)
    label_index[head.vocab_ids] = torch.arange(len(head.vocab_ids))
    s = tiny_data[0]
    feats, labels = s.features[None].float(), s.labels[None]
    valid = torch.ones_like(labels, dtype=torch.bool)
    exact = [feats[:, 1:].clone()]  # a "prediction" equal to the target's next features
    ce, _, agree = th.loss_terms(head, exact, feats, labels, valid, label_index, soft=True)
    keep = label_index[labels[0, 1:]] >= 0
    q = torch.softmax(head.logits(feats[0, 1:][keep]), -1)
    entropy = -(q * q.clamp_min(1e-30).log()).sum(-1).mean()
    assert torch.allclose(ce, entropy, atol=1e-5), (float(ce), float(entropy))
    assert agree[0] == float((head.vocab_ids[head.logits(feats[0, 1:]).argmax(-1)] == labels[0, 1:]).float().mean())
    wrong = [feats[:, 1:].flip(1)]
    assert th.loss_terms(head, wrong, feats, labels, valid, label_index, soft=True)[0] > ce + 0.1
    # the hard loss on the same exact prediction is -log of the target's top probability (its argmax is the label)
    hard = th.loss_terms(head, exact, feats, labels, valid, label_index, soft=False)[0]
    assert torch.allclose(hard, -q.max(-1).values.log().mean(), atol=1e-5) and hard <= ce


def test_hard_loss_is_the_mean_over_real_positions_inside_the_draft_vocabulary(target, tiny_data):
    """The hard cross-entropy of every pass is the mean over positions that are real (not padding) and whose
    label is in V', as the explicit ``logits[keep]`` form computes it; padding and out-of-V' positions change
    nothing; ``with_agree=False`` skips the agreement and leaves the loss as it was."""
    head = th.new_head(target, th.draft_vocabulary(tiny_data[:8], 48), th.TrainConfig())
    label_index = torch.full((target.config.vocab_size,), -1, dtype=torch.long)
    label_index[head.vocab_ids] = torch.arange(len(head.vocab_ids))
    a, b = tiny_data[0], tiny_data[1]
    T = max(len(a.tokens), len(b.tokens))
    feats, tokens, labels, valid = th._batch([a, b], [(0, 0, len(a.tokens)), (1, 0, len(b.tokens))], T)
    assert (~valid).any(), "the test needs a padded row"
    torch.manual_seed(0)
    preds = [torch.randn(2, T - 1, target.config.hidden_size) for _ in range(2)]
    ce, reg, agree = th.loss_terms(head, preds, feats, labels, valid, label_index, decay=0.8)
    want, wsum = 0.0, 0.0
    for d, p in enumerate(preds):
        m = T - 1 - d
        y, ok = labels[:, d + 1:d + 1 + m], valid[:, d + 1:d + 1 + m]
        keep = ok & (label_index[y] >= 0)
        assert (ok & ~keep).any(), "the test needs a real position whose label is outside V'"
        want += 0.8 ** d * torch.nn.functional.cross_entropy(head.logits(p[:, :m])[keep], label_index[y][keep])
        wsum += 0.8 ** d
    assert torch.allclose(ce, want / wsum, atol=1e-5), (float(ce), float(want / wsum))
    assert len(agree) == 2
    ce2, reg2, agree2 = th.loss_terms(head, preds, feats, labels, valid, label_index, decay=0.8, with_agree=False)
    assert agree2 == [] and torch.equal(ce2, ce) and torch.equal(reg2, reg)


def test_loading_a_head_does_not_import_the_trainer():
    # inference (drafts.draft_from_name, the tree bench) reads a head through head_io alone
    import subprocess
    import sys

    code = ("import sys, specnb.head_io, specnb.drafts, specnb.tree_drafts; "
            "assert 'specnb.train_head' not in sys.modules, 'loading a head imported the trainer'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_reused_prefill_gives_the_tokens_of_a_fresh_one(target, prompts, tiny_data, trained, monkeypatch):
    """``decode.prefill`` once, then many seeded runs from copies of it (chapter 7's distribution
    check does this): every run's tokens, rounds and forward count equal a fresh run's, for the head
    (which reads the prefill's features) and for a model draft; the copy is never mutated, so the
    same object serves every run; a prefill of another prompt, or without the head's features, is
    refused. A cache handed out without copying (the broken variant) changes the tokens."""
    from specnb import decode
    from specnb.drafts import ModelDraft
    from specnb.tiny import perturbed_copy

    head = trained[0]
    ids = tiny_data[1].tokens[:tiny_data[1].prompt_len + 3].tolist()
    params = SamplingParams(temperature=1.0)
    for draft in (HeadDraft(head), ModelDraft(perturbed_copy(target, noise=0.02, seed=1))):
        pre = decode.prefill(target, ids, draft)
        for s in range(6):
            fresh = speculative_sample(target, draft, ids, 3, 8, params, seed=s)
            reused = speculative_sample(target, draft, ids, 3, 8, params, seed=s, prefilled=pre)
            assert reused.tokens == fresh.tokens, (draft.name, s)
            assert [(r.drafted, r.accepted) for r in reused.rounds] == [(r.drafted, r.accepted) for r in fresh.rounds]
            assert reused.target_forwards == fresh.target_forwards
        g = speculative_greedy(target, draft, ids, 3, 8, prefilled=pre)
        assert g.tokens == greedy(target, ids, 8).tokens
    with pytest.raises(ValueError, match="another prompt"):
        speculative_sample(target, HeadDraft(head), list(prompts[0]), 2, 4, params,
                           prefilled=decode.prefill(target, ids, HeadDraft(head)))
    with pytest.raises(ValueError, match="features of layers"):
        speculative_sample(target, HeadDraft(head), ids, 2, 4, params, prefilled=decode.prefill(target, ids))
    # negative control: the loop writes into a cache it was handed without a copy
    pre = decode.prefill(target, ids, HeadDraft(head))
    monkeypatch.setattr(decode.copy, "deepcopy", lambda c: c)
    runs = [speculative_sample(target, HeadDraft(head), ids, 3, 8, params, seed=0, prefilled=pre).tokens
            for _ in range(2)]
    assert runs[1] != runs[0]


def test_a_retrained_head_inherits_the_recipe_studies_only_for_the_same_recipe():
    """`make draft` writes a new card into the specnb cache, which chapter 7 then reads: the packaged card's
    recipe studies are copied into it (and named as copied) only when the recipe is the same, and a card
    without them stops chapter 7 with the command that measures them, never a KeyError."""
    import copy
    import json

    from specnb import head_study
    from specnb import train_head as th

    ref = json.loads((th.packaged_dir() / "draft_head.json").read_text())
    # `make draft` trains TrainConfig(): the packaged head's recipe, so its card inherits the studies
    # (fields added to TrainConfig after that head was trained are absent from its card, at their defaults)
    defaults = json.loads(json.dumps(th.asdict(th.TrainConfig())))
    assert {k: v for k, v in defaults.items() if k in ref["config"]["train"]} == ref["config"]["train"]
    fresh = {k: copy.deepcopy(v) for k, v in ref.items() if k not in th.STUDY_KEYS}
    fresh["created"] = "later"
    fresh["config"]["train"] = defaults   # what `make draft` writes: every field of TrainConfig()
    newer = sorted(set(defaults) - set(ref["config"]["train"]))
    for k in newer:   # a field newer than the packaged card, set off its default: another recipe, nothing carried
        changed = {k: copy.deepcopy(v) for k, v in fresh.items()}
        changed["config"] = {**fresh["config"], "train": {**defaults, k: 1 if defaults[k] == 0 else None}}
        assert th.carry_studies(changed, ref, "x") == [], k
    assert th.carry_studies(fresh, ref, "specnb/data/draft_head.json") == list(th.STUDY_KEYS)
    assert all(fresh[k] == ref[k] for k in th.STUDY_KEYS)
    assert fresh["studies_from"] == {"card": "specnb/data/draft_head.json", "created": ref["created"],
                                     "machine": ref["machine"]}
    assert head_study.require_studies(fresh) is fresh
    other = {k: copy.deepcopy(v) for k, v in ref.items() if k not in th.STUDY_KEYS}
    other["config"]["train"]["lr"] = other["config"]["train"]["lr"] / 2
    assert th.carry_studies(other, ref, "x") == [] and "studies_from" not in other
    with pytest.raises(th.HeadUnavailableError, match="--ablation --learning-curve --compare-layers 2 15 27 --recipe-levers"):
        head_study.require_studies(other)
    del other["validation_gap"]
    with pytest.raises(th.HeadUnavailableError, match="--validation-gap"):
        head_study.require_studies(other)


def test_linear_cross_entropy_matches_the_plain_form_in_loss_gradient_and_argmax():
    """LinearCrossEntropy (the training loss, logits in row blocks, gradient formed in forward) gives the
    loss, the gradient with respect to its input and the argmax of the plain form (logits, cross_entropy,
    autograd): exactly up to rounding in float32, to bfloat16's precision under autocast; rows marked -100
    get no gradient. A block size that does not divide N exercises the last, short block."""
    torch.manual_seed(0)
    N, H, V = 203, 32, 300
    W = torch.randn(V, H) * 0.3
    y = torch.randint(0, V, (N,))
    y[::5] = -100
    for autocast, tol in ((False, 1e-6), (True, 2e-2)):
        x = torch.randn(N, H, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            plain = torch.nn.functional.cross_entropy((x @ W.T).float(), y, ignore_index=-100)
        plain.backward()
        g_plain, x.grad = x.grad.clone(), None
        dtype = torch.bfloat16 if autocast else torch.float32
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            fused, top = th.LinearCrossEntropy.apply(x, W, y, dtype, True, 64)
        fused.backward()
        assert abs(float(fused) - float(plain)) <= tol * float(plain)
        assert float((x.grad - g_plain).abs().max()) <= tol * float(g_plain.abs().max())
        assert x.grad.dtype == torch.float32 and not x.grad[y < 0].any()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            assert (top == (x @ W.T).argmax(-1)).float().mean() >= (0.99 if autocast else 1.0)
    # negative control: a gradient that forgets the one-hot term is caught by the same comparison
    x = torch.randn(N, H, requires_grad=True)
    torch.nn.functional.cross_entropy(x @ W.T, y, ignore_index=-100).backward()
    wrong = (torch.softmax(x @ W.T, -1) * (y >= 0)[:, None] / (y >= 0).sum()) @ W
    assert float((wrong - x.grad).abs().max()) > 1e-6 * float(x.grad.abs().max()) * 100
