"""Watch speculative greedy decoding round by round (chapter 2).

:class:`RecordingDraft` wraps any draft and remembers what it proposed each
round; :func:`trace_rounds` joins that with a :class:`~specnb.decode.DecodeResult`
into one :class:`RoundView` per round: accepted drafts, the rejected draft token,
the target's correction, or the bonus token. :func:`rounds_html` renders a run
as static HTML (it shows in the built book, where no kernel runs), and
:func:`stepper` is an ipywidgets control that steps through the same views.

Not covered: sampling mode (a rejected draft there is a coin flip, not a mismatch).
"""
from __future__ import annotations

import html
from dataclasses import dataclass

from .decode import DecodeResult
from .drafts import Draft
from .sampling import draft_distributions

COLOURS = {"accepted": "#c8e6c9", "rejected": "#ffcdd2", "correction": "#ffe0b2", "bonus": "#bbdefb"}


class RecordingDraft(Draft):
    """Delegates to ``inner`` and records each round's proposal (after nothing else: the
    decoding loop may still cut it at EOS or at the token budget)."""

    def __init__(self, inner: Draft) -> None:
        super().__init__()
        self.inner = inner
        self.name = inner.name
        self.uses_features = inner.uses_features  # a trained head still gets the target's features
        self.feature_layers = inner.feature_layers
        self.proposals: list[list[int]] = []

    def reset(self, eos_token_id: int | None = None) -> None:
        super().reset(eos_token_id)
        self.inner.reset(eos_token_id)
        self.proposals = []

    def propose(self, ids: list[int], k: int) -> list[int]:
        out = self.inner.propose(ids, k)
        self.forwards = self.inner.forwards
        self.proposals.append(list(out))
        return out

    def update(self, ids: list[int], n_accepted: int) -> None:
        self.inner.update(ids, n_accepted)

    def observe(self, features) -> None:
        self.inner.observe(features)

    def vocab_model(self):
        return self.inner.vocab_model()

    def propose_sampled(self, ids, k, params, generator, vocab_size, draft_q=draft_distributions):
        out, q = self.inner.propose_sampled(ids, k, params, generator, vocab_size, draft_q)
        self.forwards = self.inner.forwards
        self.proposals.append(list(out))
        return out, q


@dataclass
class RoundView:
    """One round, as the visualizer shows it."""

    accepted: list[int]  # drafts the target agreed with
    rejected: int | None  # the first draft it disagreed with (None if all agreed or none drafted)
    target_token: int  # the correction (after a rejection) or the bonus (all accepted)
    kind: str  # "correction" or "bonus" ("correction" also when nothing was drafted)
    drafted: int


def trace_rounds(result: DecodeResult, recorder: RecordingDraft) -> list[RoundView]:
    """Round views of a run made with ``recorder`` as the draft."""
    views, pos = [], 0
    for stats, proposal in zip(result.rounds, recorder.proposals):
        emitted = result.tokens[pos:pos + stats.emitted]
        pos += stats.emitted
        drafted = proposal[: stats.drafted]
        accepted = emitted[: stats.accepted]
        assert accepted == drafted[: stats.accepted], "trace does not match the run"
        rejected = drafted[stats.accepted] if stats.accepted < stats.drafted else None
        if len(emitted) > stats.accepted:
            target_token = emitted[stats.accepted]
        else:  # the round stopped at an accepted EOS: no target token was emitted
            target_token = None
        views.append(RoundView(accepted, rejected, target_token, "bonus" if stats.bonus else "correction",
                               stats.drafted))
    return views


def _span(text: str, kind: str, strike: bool = False) -> str:
    style = f"background:{COLOURS[kind]};border-radius:3px;padding:0 1px;white-space:pre-wrap"
    if strike:
        style += ";text-decoration:line-through"
    return f'<span title="{kind}" style="{style}">{html.escape(text)}</span>'


def legend_html() -> str:
    return " ".join(_span(name, name, strike=name == "rejected") for name in COLOURS)


def round_html(view: RoundView, tokenizer) -> str:
    """One round: accepted drafts, the struck-out rejected draft, then the target's token."""
    parts = [_span(tokenizer.decode([t]), "accepted") for t in view.accepted]
    if view.rejected is not None:
        parts.append(_span(tokenizer.decode([view.rejected]), "rejected", strike=True))
    if view.target_token is not None:
        parts.append(_span(tokenizer.decode([view.target_token]), view.kind))
    return "".join(parts)


def forwards_saved(views: list[RoundView], prefill: bool = True) -> tuple[int, int, int]:
    """(speculative target forwards, plain greedy's, saved) for the tokens of ``views``, prefill included
    on both sides. Plain greedy's prefill emits its first token, so it needs one forward per token; the
    speculative loop prefills all but the prompt's last token (``prefill``: the prompt had more than one
    token, as :func:`specnb.decode.speculative_greedy` counts it) and then needs one forward per round."""
    tokens = sum(len(v.accepted) + (v.target_token is not None) for v in views)
    spec = len(views) + int(prefill)
    return spec, tokens, tokens - spec


def rounds_html(views: list[RoundView], tokenizer, prompt_text: str = "", upto: int | None = None,
                prefill: bool = True) -> str:
    """The whole run (or its first ``upto`` rounds) as HTML, with running counts (``prefill``: see
    :func:`forwards_saved`)."""
    shown = views if upto is None else views[:upto]
    spec, tokens, saved = forwards_saved(shown, prefill)
    body = "".join(round_html(v, tokenizer) + '<span style="color:#999">|</span>' for v in shown)
    counts = (f"{len(shown)} rounds, {tokens} tokens: {tokens / max(len(shown), 1):.2f} tokens per round; "
              f"{spec} target forwards{' with the prefill' if prefill else ''}, where plain greedy would have "
              f"used {tokens} (prefill included on both sides), so {saved} were saved")
    prompt = f'<span style="color:#666;white-space:pre-wrap">{html.escape(prompt_text)}</span>' if prompt_text else ""
    return (f'<div style="font-family:monospace;font-size:13px;line-height:1.7">{legend_html()}<br>'
            f"{prompt}{body}<br><i>{counts}</i></div>")


def stepper(views: list[RoundView], tokenizer, prompt_text: str = ""):
    """An ipywidgets slider that shows the run up to round r (needs a live kernel)."""
    import ipywidgets as widgets

    out = widgets.HTML(rounds_html(views, tokenizer, prompt_text, upto=1))
    slider = widgets.IntSlider(value=1, min=1, max=len(views), description="round")

    def show(change):
        out.value = rounds_html(views, tokenizer, prompt_text, upto=change["new"])

    slider.observe(show, names="value")
    return widgets.VBox([slider, out])
