"""The speculative sampling rule (Leviathan et al. 2023, Chen et al. 2023), and its known wrong versions.

Names follow the paper and the book (chapter 6): ``p`` is the target's
next-token distribution, ``q`` the draft's, ``k`` the number of drafted tokens.
One round, given drafts t_1..t_k, ``p: (k+1, V)`` (row i: the target's
distribution after the prefix and t_1..t_i) and ``q: (k, V)`` (row i-1: the
distribution t_i was drawn from), for i = 1..k in turn:

1. accept t_i with probability ``min(1, p[i-1](t_i) / q[i-1](t_i))``;
2. at the first rejection, emit a token from ``norm(max(0, p[i-1] - q[i-1]))``
   (the *residual*) and end the round;
3. if all k are accepted, emit a bonus token from ``p[k]``.

The emitted tokens then have exactly the target's distribution, whatever q is,
provided the draft really sampled from the q it reports (chapter 6 proves it).
:func:`warp` turns logits into p or q (temperature, then top-k, then top-p), and
the same call must be used for both.

Negative controls, kept to show that the book's checks can fail (never use them):

* :func:`scalar_alpha_residual`: ``(p - alpha q)^+`` with the scalar
  ``alpha = min(1, p(t)/q(t))`` of the drafted token, as an interactive explainer of
  speculative decoding states the rule (chapter 6 shows exactly when it is biased);
* :func:`resample_from_p`: resample the target's p after a rejection;
* :func:`argmax_draft_softmax_report`: the draft picks its argmax but reports q;
* :func:`q_before_warp`: the draft samples from the warped q but reports the
  softmax of its raw logits (temperature 1, no top-k or top-p).

Not covered: tree drafts, batches, and typical-acceptance rules (which are not
exact by design). Probabilities are float64 throughout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

DTYPE = torch.float64


@dataclass(frozen=True)
class SamplingParams:
    """How logits become a distribution; the same params are applied to the target and the draft."""

    temperature: float = 1.0  # divides the logits; 0 means greedy (a one-hot at the argmax)
    top_k: int | None = None  # keep the k largest logits (ties at the k-th kept); None: no limit
    top_p: float | None = None  # keep the smallest most-likely set with mass >= top_p; None or 1: no limit

    def __post_init__(self) -> None:
        t = self.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not t >= 0 or t == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy), got {t!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or isinstance(self.top_k, bool)
                                       or self.top_k < 1):
            raise ValueError(f"top_k must be an integer >= 1 or None (no limit), got {self.top_k!r}")
        if self.top_p is not None and (isinstance(self.top_p, bool) or not 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] or None (no limit), got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def warp(logits: torch.Tensor, params: SamplingParams = SamplingParams()) -> torch.Tensor:
    """``logits: (..., V)`` -> probabilities ``(..., V)`` in float64: temperature, top-k, top-p.

    Temperature 0 gives a one-hot at the argmax (the first one at a tie, as
    ``torch.argmax``), so speculative sampling at temperature 0 is greedy.
    """
    x = logits.to(DTYPE)
    if params.greedy:
        return torch.nn.functional.one_hot(x.argmax(-1), x.shape[-1]).to(DTYPE)
    x = x / params.temperature
    if params.top_k is not None and params.top_k < x.shape[-1]:
        kth = x.topk(params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p is not None and params.top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass of the more likely tokens
        drop_sorted = before >= params.top_p  # the set already reached top_p without this token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def acceptance_probability(p_t: torch.Tensor, q_t: torch.Tensor) -> torch.Tensor:
    """``min(1, p(t) / q(t))`` elementwise (1 where q(t) = 0: only a wrong draft can draw such a t)."""
    safe_q = torch.where(q_t > 0, q_t, torch.ones_like(q_t))
    return torch.where(q_t > 0, (p_t / safe_q).clamp(max=1.0), torch.ones_like(p_t))


def _normalize(r: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    # All-zero only when p == q, where a rejection has probability 0: any fallback is never used.
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / torch.where(total > 0, total, torch.ones_like(total)), fallback)


def residual(p: torch.Tensor, q: torch.Tensor, t: int | torch.Tensor | None = None) -> torch.Tensor:
    """The correct residual ``norm(max(0, p - q))``: ``p, q: (V,)`` -> ``(V,)``. ``t`` is not used.

    Residual functions take the drafted token ``t`` (an int, or a ``(B,)`` tensor
    for B rejected drafts at once, giving ``(B, V)``), because wrong ones use it.
    """
    return _normalize((p - q).clamp(min=0.0), p)


residual.uses_draft_token = False


def scalar_alpha_residual(p: torch.Tensor, q: torch.Tensor, t: int | torch.Tensor) -> torch.Tensor:
    """NEGATIVE CONTROL (wrong): ``norm(max(0, p - alpha q))`` with the drafted token's scalar
    ``alpha = min(1, p(t)/q(t))``. Biased: p=(.5,.3,.2), q=(.2,.3,.5) emit (.41,.39,.20).
    Agrees with :func:`residual` when V = 2 or q is one-hot, so such tests cannot catch it."""
    alpha = acceptance_probability(p[t], q[t])[..., None]  # (1,) or (B, 1)
    return _normalize((p - alpha * q).clamp(min=0.0), p)


scalar_alpha_residual.uses_draft_token = True


def resample_from_p(p: torch.Tensor, q: torch.Tensor, t: int | None = None) -> torch.Tensor:
    """NEGATIVE CONTROL (wrong): after a rejection, draw from p itself. Biased towards tokens q overrates."""
    return p


resample_from_p.uses_draft_token = False


Residual = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
DraftQ = Callable[[torch.Tensor, SamplingParams], "tuple[torch.Tensor, torch.Tensor]"]


def draft_distributions(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The correct draft: ``(q_draw, q_report)``, the q it samples from and the q it tells the rule: the same."""
    q = warp(logits, params)
    return q, q


def argmax_draft_softmax_report(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """NEGATIVE CONTROL (wrong): drafts its argmax (a one-hot q) but reports the warped softmax q."""
    q = warp(logits, params)
    return torch.nn.functional.one_hot(q.argmax(-1), q.shape[-1]).to(DTYPE), q


def q_before_warp(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """NEGATIVE CONTROL (wrong): samples from the warped q, reports the softmax of the raw logits."""
    return warp(logits, params), warp(logits, SamplingParams(temperature=1.0))


class Variant(NamedTuple):
    """A rule: how the draft reports q, and which residual the target draws from after a rejection."""

    residual: Residual
    draft_q: DraftQ
    correct: bool


VARIANTS: dict[str, Variant] = {
    "correct": Variant(residual, draft_distributions, True),
    "scalar-alpha residual": Variant(scalar_alpha_residual, draft_distributions, False),
    "resample from p": Variant(resample_from_p, draft_distributions, False),
    "argmax draft, softmax q reported": Variant(residual, argmax_draft_softmax_report, False),
    "q reported before temperature/top-k": Variant(residual, q_before_warp, False),
}
WRONG_VARIANTS = [name for name, v in VARIANTS.items() if not v.correct]


def sample_token(dist: torch.Tensor, generator: torch.Generator) -> int:
    """One token id from ``dist: (V,)``."""
    return int(torch.multinomial(dist, 1, generator=generator))


def speculative_round(p: torch.Tensor, q: torch.Tensor, drafts: list[int], generator: torch.Generator,
                      residual_fn: Residual = residual) -> tuple[int, int]:
    """One round of the rule. ``p: (m+1, V)``, ``q: (m, V)``, ``drafts``: m token ids drawn from q.

    Returns ``(n, token)``: the first n drafts are accepted, then ``token`` is
    emitted (the residual draw at the first rejection, or the bonus from p[m]).
    """
    m = len(drafts)
    if p.shape[0] != m + 1 or q.shape[0] != m:
        raise ValueError(f"need p: (m+1, V) and q: (m, V) for m={m} drafts, got {tuple(p.shape)} and {tuple(q.shape)}")
    for i, t in enumerate(drafts):
        u = torch.rand((), generator=generator, dtype=DTYPE)
        if not u < acceptance_probability(p[i, t], q[i, t]):  # 1. accept with prob min(1, p/q)
            return i, sample_token(residual_fn(p[i], q[i], t), generator)  # 2. first rejection: residual
    return m, sample_token(p[m], generator)  # 3. all accepted: bonus token from the target


def overlap(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``sum_x min(p(x), q(x))``: the probability that the rule accepts a token drawn from q. ``(..., V) -> (...)``."""
    return torch.minimum(p, q).sum(-1)


@torch.no_grad()
def sample_first_tokens(p: torch.Tensor, q_draw: torch.Tensor, n: int, generator: torch.Generator,
                        q_report: torch.Tensor | None = None, residual_fn: Residual = residual) -> torch.Tensor:
    """``n`` independent first emitted tokens of a round, vectorized: ``p, q: (V,)`` -> ``(n,)`` token ids.

    The same rule as :func:`speculative_round` at its first position (whatever
    k is, the first emitted token depends only on p_0, q_0 and t_1), drawn n at
    a time so that empirical checks on a 49152-token vocabulary take a second.
    """
    q_report = q_draw if q_report is None else q_report
    t = torch.multinomial(q_draw, n, replacement=True, generator=generator)  # (n,)
    accept = torch.rand(n, generator=generator, dtype=DTYPE) < acceptance_probability(p[t], q_report[t])
    out = t.clone()
    rejected = (~accept).nonzero().squeeze(-1)
    if not len(rejected):
        return out
    u = torch.rand(len(rejected), generator=generator, dtype=DTYPE)
    if not getattr(residual_fn, "uses_draft_token", True):
        out[rejected] = _inverse_cdf(residual_fn(p, q_report, None), u)
        return out
    # A residual per drafted token: group the rejected draws by their drafted token.
    tokens, group = t[rejected].unique(return_inverse=True)
    order = group.argsort()
    ends = torch.bincount(group, minlength=len(tokens)).cumsum(0).tolist()
    for tok, start, end in zip(tokens.tolist(), [0] + ends[:-1], ends):
        where = order[start:end]
        out[rejected[where]] = _inverse_cdf(residual_fn(p, q_report, tok), u[where])
    return out


def _inverse_cdf(dist: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Tokens drawn from ``dist: (V,)`` by uniforms ``u: (n,)`` in [0, 1); zero-probability tokens are never drawn."""
    cdf = dist.cumsum(0)
    return torch.searchsorted(cdf, u * cdf[-1], right=True).clamp(max=len(dist) - 1)
