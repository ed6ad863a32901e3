"""Open conversations for the draft head (chapter 7): user turns written by the target itself.

The template prompts of :mod:`specnb.corpus` ask about a few hundred subjects in a few dozen
phrasings. A head trained on the answers to them learns those answers well (validation a_1 on
prose 0.47) and prompts phrased otherwise less well (held-out prose 0.35). Magpie (Xu et al.
2024, "Magpie: Alignment Data Synthesis from Scratch by Prompting Aligned LLMs with Nothing",
https://arxiv.org/abs/2406.08464) gets varied user turns from an instruction-tuned model by
giving it only its chat template up to the user's message: aligned models "can generate a user
query when we input only the pre-query templates up to the position reserved for user messages,
thanks to their auto-regressive nature" (the paper's abstract). Here the target does that:

* :func:`user_header_ids`: the chat template up to where the user's text goes, ``(L,)`` ids
  (for SmolLM2: the default system turn, then ``<|im_start|>user\\n``).
* :func:`sample_user_turns`: ``n`` distinct user turns, sampled (temperature 1, nucleus 0.98,
  seeded per batch) from that header by a bfloat16 copy of the target, kept only when the
  target closed the turn itself (``<|im_end|>`` within ``max_tokens``) and it has at least
  ``min_words`` words.
* :func:`generate_open_ids`: those turns through the chat template, answered greedily as the
  template prompts are (:func:`specnb.head_data.generate_ids`), in the format of
  :func:`specnb.head_data.save_training_ids`, committed as ``specnb/data/draft_open_ids.npz``.

Described conversations: Magpie's turns from the bare header mostly ask for help with a task
("Can you provide a list of...", "I'm considering a job offer..."), while the prose the book measures
describes and explains. :data:`OPENERS` steer the sampling: batch ``b`` starts every user turn with
opener ``b mod len(OPENERS)`` ("Describe", "Explain how", ...) and the target writes the rest, so the
subjects stay the target's own; they are committed apart, as ``specnb/data/draft_described_ids.npz``.

The answers are the target's greedy continuations, so the head's labels are exactly what the
target decodes; only the questions are sampled. Held-out prompts are written by hand; any open
conversation sharing an 8-token n-gram with one is dropped by ``build_data`` like any other
training document.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

OPEN_IDS_FILE = Path(__file__).parent / "data" / "draft_open_ids.npz"
DESCRIBED_IDS_FILE = Path(__file__).parent / "data" / "draft_described_ids.npz"
IDS_FILES = {"open": OPEN_IDS_FILE, "described": DESCRIBED_IDS_FILE}  # each Magpie set's committed ids, in training order
OPENERS = ("Describe", "Explain how", "Tell me about", "What is", "How does", "Why do", "Write a paragraph about",
           "What was", "Can you describe", "Can you explain why", "Give an overview of", "What happens when",
           "Write a short story about", "How did", "What are", "Imagine")
TEMPERATURE, TOP_P = 1.0, 0.98
_MARK = "\x00USER\x00"


def user_header_ids(tokenizer) -> list[int]:
    """The chat template's ids up to where a user's message starts, ``(L,)``."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False,
                                         add_generation_prompt=False)
    if _MARK not in text:
        raise ValueError("this tokenizer's chat template does not place the user's text verbatim: "
                         "open conversations need a chat model's template")
    head = text[:text.index(_MARK)]
    return [int(t) for t in tokenizer(head, add_special_tokens=False)["input_ids"]]


@torch.inference_mode()
def sample_user_turns(model, tokenizer, n: int, seed: int = 0, batch: int = 64, max_tokens: int = 64,
                      min_words: int = 4, temperature: float = TEMPERATURE, top_p: float = TOP_P,
                      openers: tuple[str, ...] = ("",)) -> tuple[list[str], dict]:
    """``n`` distinct user turns sampled from :func:`user_header_ids` by ``model`` (batch ``b`` seeded
    with ``seed + b``, its turns begun with ``openers[b % len(openers)]``; ``""``: Magpie's bare header),
    and counts of what was drawn and why turns were dropped."""
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    if not openers:
        raise ValueError("openers must hold at least one opener ('' for none)")
    header_ids = user_header_ids(tokenizer)
    end = tokenizer.eos_token_id
    seen: set[str] = set()
    out: list[str] = []
    counts = {"drawn": 0, "unfinished": 0, "short": 0, "repeated": 0, "surplus": 0}  # surplus: usable, not needed
    bar = tqdm(total=n, desc="open user turns", unit="turn")
    b = 0
    while len(out) < n:
        if b > 20 + 4 * n // batch:
            raise RuntimeError(f"only {len(out)} usable user turns after {counts['drawn']} draws ({counts}): "
                               "this model does not write user turns from its chat template")
        opener = openers[b % len(openers)]
        opener_ids = [int(t) for t in tokenizer(opener, add_special_tokens=False)["input_ids"]] if opener else []
        torch.manual_seed(seed + b)
        x = torch.tensor([header_ids + opener_ids]).repeat(batch, 1)
        gen = model.generate(x, attention_mask=torch.ones_like(x), do_sample=True, temperature=temperature,
                             top_p=top_p, top_k=0, max_new_tokens=max_tokens, eos_token_id=end, pad_token_id=end)
        b += 1
        for row in gen[:, x.shape[1]:].tolist():
            counts["drawn"] += 1
            if end not in row:
                counts["unfinished"] += 1
                continue
            text = (opener + tokenizer.decode(row[:row.index(end)], skip_special_tokens=True)).strip()
            if len(text.split()) < min_words:
                counts["short"] += 1
            elif text in seen:
                counts["repeated"] += 1
            elif len(out) < n:
                seen.add(text)
                out.append(text)
                bar.update(1)
            else:
                counts["surplus"] += 1
    bar.close()
    return out, counts


def generate_open_ids(target, tokenizer, n: int, new_tokens: int, seed: int = 0, batch: int | None = None,
                      openers: tuple[str, ...] = ("",)) -> dict:
    """``n`` open conversations: sampled user turns (:func:`sample_user_turns`, begun with ``openers``)
    answered greedily by a bfloat16 copy of the target, as :func:`specnb.head_data.generate_training_ids`
    returns them, with the user turns' texts under ``"texts"`` and the sampling settings and counts in ``"meta"``."""
    from .env import machine_info
    from .head_data import GEN_BATCH, GEN_DTYPE, generate_ids, in_dtype
    from .prompts import chat_ids

    batch = batch or GEN_BATCH
    fast = in_dtype(target, GEN_DTYPE)
    t0 = time.perf_counter()
    texts, counts = sample_user_turns(fast, tokenizer, n, seed, batch, openers=openers)
    t1 = time.perf_counter()
    encoded = [chat_ids(tokenizer, [{"role": "user", "content": t}]) for t in texts]
    seqs = generate_ids(fast, encoded, new_tokens, batch, tokenizer.eos_token_id, "open conversations")
    out = {"ids": [s.tokens.tolist() + [int(s.labels[-1])] for s in seqs],
           "prompt_lens": [s.prompt_len for s in seqs], "prompt_index": list(range(len(seqs))),
           "turn": [1] * len(seqs), "texts": texts}
    steered = any(openers)
    out["meta"] = {"what": "described conversations (Magpie, each user turn begun with an opener)" if steered
                   else "open conversations (Magpie: user turns sampled from the chat template's user header)",
                   **({"openers": list(openers)} if steered else {}),
                   "dtype": str(GEN_DTYPE).replace("torch.", ""), "batch": batch, "new_tokens": new_tokens,
                   "seed": seed, "temperature": TEMPERATURE, "top_p": TOP_P, "prompts": len(texts), "follow_ups": 0,
                   "draws": counts, "seconds_user_turns": round(t1 - t0, 1),
                   "seconds": round(time.perf_counter() - t0, 1),
                   "new_token_count": int(sum(len(x) - p for x, p in zip(out["ids"], out["prompt_lens"]))),
                   "machine": machine_info(target)}
    return out
