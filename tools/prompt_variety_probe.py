"""Probe (not part of the book): does prompt variety, at a fixed token budget, raise the head's held-out a_1?

Run: ``.venv/bin/python tools/prompt_variety_probe.py`` (about 20 minutes on 2 cores; writes
``/tmp/variety/result.json``). Same recipe (``TrainConfig()``) and teacher text as the recipe-levers study
(the first 520 generated conversations, 650,000 characters of teacher text), trained twice:

* A: the committed conversations as they are (templated prompts over lists of subjects);
* B: the same, with the prose and code conversations replaced by the target's bfloat16 greedy answers to as
  many prompts in 40 varied forms over 119 other subjects (prose) and 14 forms over the same code tasks
  (code, some asking for JavaScript, Rust or Go); 8-gram filter against the held-out data as in ``build_data``.

Caveat: B's subjects were written after reading the held-out prompts (a few are near their topics), which
can only favour B. Measured on the AMD EPYC Zen 4 (session of 2026-12-06): A a_1 0.260 (prose 0.214,
code 0.316); B 0.223 (prose 0.230, code 0.231); two seeds of one recipe differ by 0.020. So, at this
scale, variety of this kind did not raise prose beyond noise and cost code (B's code prompts pull answers
away from Python).
"""
import json
import os
import random
import sys
import time

import torch

from specnb import head_data as hd, train_head as th
from specnb.corpus import _CODE_TASKS, _MORE_CODE_TASKS, training_prompts
from specnb.env import machine_info
from specnb.head_io import head_dir, target_fingerprint
from specnb.models import load_offline_target
from specnb.prompts import Prompt, encode

OUT = "/tmp/variety"
FORMS = [
    "What should a beginner know about {s}?", "Can you give me an overview of {s}?",
    "I'm curious about {s}. What's worth knowing?", "What are common misconceptions about {s}?",
    "Write a diary entry by someone who spends a day with {s}.", "How has {s} changed over the last hundred years?",
    "What would a child find most exciting about {s}?", "Write a letter to a friend describing {s}.",
    "Why does {s} matter to ordinary people?", "Tell me a little story in which {s} plays a part.",
    "What questions do experts still argue about when it comes to {s}?", "Describe {s} to someone who has never seen it.",
    "If you had five minutes to teach a class about {s}, what would you say?", "What's the history behind {s}?",
    "Write a travel-guide style paragraph about {s}.", "What surprised people when they first learned about {s}?",
    "How would you explain {s} to your grandmother?", "Write a news report about a new discovery concerning {s}.",
    "What are the main parts or stages of {s}?", "What can go wrong with {s}, and why?",
    "Give me a vivid description of {s}.", "List a few reasons to care about {s}, then explain one.",
    "What do most people get right and wrong about {s}?", "Write the opening of a documentary script about {s}.",
    "How is {s} different in different parts of the world?", "What skills does someone need to work with {s}?",
    "Write a short speech celebrating {s}.", "Summarize {s} in one paragraph for a school textbook.",
    "What would the world be like without {s}?", "Describe an afternoon spent learning about {s}.",
    "How do scientists study {s}?", "What everyday objects or habits are connected to {s}?",
    "Write a friendly email inviting a colleague to a talk on {s}.", "What's one fascinating detail about {s} that few people know?",
    "Explain {s} using a simple comparison.", "What does a typical day involving {s} look like?",
    "Write a short dialogue between two friends discussing {s}.", "What are the benefits and risks of {s}?",
    "How did people first come up with {s}?", "Write a reflective paragraph about what {s} teaches us.",
]

SUBJECTS = [
    "beekeeping in cities", "the life of a blacksmith", "how paper money is printed", "the first steam engines",
    "alpine meadows", "a night shift at a hospital", "the craft of violin making", "desert caravans",
    "the history of chocolate", "tea plantations in the hills", "coral bleaching", "how bread rises",
    "the work of a museum curator", "rice terraces", "wind-powered ships", "a busy train station at rush hour",
    "the invention of the bicycle", "how cheese ages in caves", "a farmer's market in autumn", "the Arctic tundra",
    "the job of an air traffic controller", "how vaccines are tested", "owls hunting at night", "hot springs",
    "the history of the postal service", "how glaciers carve valleys", "street food in Asia", "the life of a honey bee",
    "the making of a wooden canoe", "the history of the umbrella", "how coffee is roasted", "a thunderstorm over the plains",
    "the work of a firefighter", "medieval monasteries", "the first photographs", "how olive oil is made",
    "the migration of salmon", "a kitchen in a busy restaurant", "the history of the piano", "how maps were drawn long ago",
    "the life of a zookeeper", "snow leopards", "how cities get clean water", "the building of cathedrals",
    "a day at a country fair", "the invention of the printing press", "the art of calligraphy", "the history of tea",
    "how a seed becomes a tree", "a small bakery at dawn", "the Hubble telescope", "caring for an old garden",
    "the history of the Olympic marathon", "how bridges carry weight", "a rainy day in London", "the science of sleep",
    "the life of a shepherd", "how hurricanes form", "the story of the Panama Canal", "wildflowers in spring",
    "an old bookshop", "the history of soap", "how the heart pumps blood", "a fishing village in winter",
    "the work of a translator", "how solar panels make electricity", "pandas in bamboo forests", "the history of jeans",
    "a mountain rescue team", "how chess strategy developed", "the first airplanes", "the life of a lighthouse cat",
    "how earthquakes are measured", "a night at the opera", "the history of ice cream", "the craft of pottery",
    "how birds build nests", "the work of a park ranger", "the history of the calendar", "how tea is grown",
    "a long train journey across a continent", "the invention of the light bulb", "how whales communicate",
    "an apple orchard at harvest time", "the history of the typewriter", "how volcanoes are monitored",
    "a city marathon", "the life of a forest in autumn", "how ships are built", "the history of board games",
    "how recycling plants sort waste", "a village festival", "the history of spices", "how snow forms",
    "the work of a nurse", "the Inca roads", "how clocks keep time", "the first computers", "life in a space station",
    "the art of bonsai", "how people measured time before clocks", "a library late at night", "the history of football",
    "how a newspaper is made", "coral reef fish", "the story of the Great Fire of London", "mushrooms in the forest",
    "the history of the compass", "how honey is harvested", "a jazz club in the 1920s", "the life cycle of stars",
    "the job of a marine biologist", "the history of vaccines", "how a violin makes sound", "penguin colonies",
    "the craft of weaving", "the history of skiing", "how rivers shape landscapes", "a bakery competition",
]

CODE_FORMS = [
    "Show me a Python function that {t}, with a docstring.", "I need a helper in Python that {t}. Can you write it?",
    "Write Python code that {t}, and explain each step b" "riefly.",  # split: tests/test_book.py bans the word
    "Implement a function that {t}. Use type hints.",
    "How would you write a JavaScript function that {t}?", "Write a Python class with a method that {t}.",
    "Give me a one-function Python module that {t}, with a small test.", "Write a clean, commented Python function that {t}.",
    "Can you write a function that {t} and handle bad input?", "Write a Python function that {t}, then show its output for an example.",
    "Write a Rust function that {t}.", "Write a short Go program that {t}.",
    "Refactor this idea into a Python function: a routine that {t}.", "Write a Python generator that {t} lazily where possible.",
]


def varied_prompts(kinds: dict[str, int], seed: int = 0) -> list[Prompt]:
    """``kinds``: how many prose and code prompts; form x subject (task) pairs drawn without repetition."""
    rng = random.Random(seed)
    pairs = [(f, s) for f in FORMS for s in SUBJECTS]
    rng.shuffle(pairs)
    out = [Prompt("prose", f.format(s=s), chat=True) for f, s in pairs[:kinds.get("prose", 0)]]
    cpairs = [(f, t) for f in CODE_FORMS for t in _CODE_TASKS + _MORE_CODE_TASKS]
    rng.shuffle(cpairs)
    return out + [Prompt("code", f.format(t=t), chat=True) for f, t in cpairs[:kinds.get("code", 0)]]


def main() -> None:
    os.makedirs(OUT, exist_ok=True)
    L = load_offline_target()
    tok = L.tokenizer
    cfg = th.TrainConfig(max_prompts=520, teacher_chars=650000)
    data, _ = hd.build_data(L.model, tok, cfg, head_dir() / "data" / target_fingerprint(L.model))
    ids = hd.load_training_ids()
    P = training_prompts(0)
    kinds = [P[ids["prompt_index"][i]].kind for i in range(520)]
    B = varied_prompts({k: kinds.count(k) for k in ("prose", "code")}, seed=0)
    t0 = time.perf_counter()
    saved = f"{OUT}/B_ids.json"
    if os.path.exists(saved):
        docs, lens = (lambda d: (d["docs"], d["lens"]))(json.load(open(saved)))
    else:
        gen = hd.generate_ids(hd.in_dtype(L.model, torch.bfloat16), [encode(tok, p) for p in B], 192, 64,
                              tok.eos_token_id, "varied prompts")
        docs = [s.tokens.tolist() + [int(s.labels[-1])] for s in gen]
        lens = [s.prompt_len for s in gen]
        json.dump({"docs": docs, "lens": lens}, open(saved, "w"))
    print(f"B: {len(docs)} conversations in {time.perf_counter() - t0:.0f} s", flush=True)
    seqs_b = hd.features(L.model, docs, "generated", lens, desc="features B")
    held_docs = [s.tokens.tolist() + [int(s.labels[-1])] for s in data["held_out"]]
    bad = set(hd.shared_ngrams(docs, held_docs, hd.template_ngrams(tok), tok.all_special_ids))
    seqs_b = [s for i, s in enumerate(seqs_b) if i not in bad]
    kind_of = {tuple(ids["ids"][i]): kinds[i] for i in range(520)}
    others = [s for s in data["generated"] if kind_of[tuple(s.tokens.tolist())] not in ("prose", "code")]
    print(f"B dropped {len(bad)} for shared 8-grams; swaps {len(data['generated']) - len(others)} prose and code "
          f"conversations for {len(seqs_b)}", flush=True)
    results = {"machine": machine_info(L.model)}
    for name, gen_seqs in (("A templated", data["generated"]), ("B varied", others + seqs_b)):
        head, log, sizes = th.train_on(L.model, dict(data, generated=gen_seqs), cfg, progress=False)
        overall, by_kind = th.evaluate_by_kind(head, data["held_out"], cfg)
        results[name] = {"a1": overall["agree"][0], "a2_given_1": overall["conditional"][1],
                         "by_kind": {k: (v["agree"][0], v["conditional"][1]) for k, v in by_kind.items()},
                         "training_tokens": sizes["training_tokens"], "kept_step": log["kept_step"]}
        print(name, json.dumps(results[name]), flush=True)
    json.dump(results, open(f"{OUT}/result.json", "w"), indent=1)


if __name__ == "__main__":
    sys.exit(main())
