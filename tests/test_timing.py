"""T(n) curves: the order of forwards they time (no timing asserted: tests do not time)."""
from specnb import timing
from specnb.tiny import tiny_llama


def _recording(real, fed: list):
    """``real`` (a forward), appending the number of ids each call feeds to ``fed``."""
    def recording(model, ids, cache, **kwargs):
        fed.append(len(ids))
        return real(model, ids, cache, **kwargs)

    return recording


def _recorded(monkeypatch, **kw):
    fed = []
    monkeypatch.setattr(timing, "forward", _recording(timing.forward, fed))
    curve = timing.forward_time_curve(tiny_llama(seed=0), ns=(1, 3, 5), repeats=2, warmup=1, progress=False, **kw)
    return fed, curve


def test_every_timed_forward_follows_a_one_token_lead_in(monkeypatch):
    """Timed right after a round's largest forwards, T(1) read 10% slow on an Intel Xeon; the lead-in
    puts a one-token forward before each timed one, so every n is timed after the same step."""
    fed, curve = _recorded(monkeypatch)
    assert fed == [1, 1, 1, 3, 1, 5] * 3, fed
    assert set(curve["median"]) == {1, 3, 5} and all(len(t) == 2 for t in curve["times"].values())


def test_without_the_lead_in_the_round_robin_is_bare(monkeypatch):
    fed, _ = _recorded(monkeypatch, lead_in=False)
    assert fed == [1, 3, 5] * 3, fed


def test_the_kernels_timing_leads_in_too(monkeypatch):
    """auto's curves (kernels.measure_curves): each timed forward, on either backend, after a one-token one."""
    from specnb import cache, kernels

    fed = []
    recording = _recording(cache.forward, fed)
    monkeypatch.setattr(cache, "forward", recording)
    monkeypatch.setattr(timing, "forward", recording)
    curves = kernels.measure_curves(tiny_llama(seed=0), ns=(1, 3), context_len=8, repeats=1, warmup=0)
    assert len(curves) in (2, 3)   # MKL, oneDNN and, where it can be built, the skinny kernel
    assert fed == [8] + [1, 1, 1, 3] * len(curves), fed   # the prefill, then one round per backend
