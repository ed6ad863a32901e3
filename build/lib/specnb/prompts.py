"""Prompts of several kinds for checks and benchmarks: code, prose, dialogue, lists, and
prompt-grounded tasks (editing or summarizing a given passage, where the output copies
from the prompt).

Each prompt is either raw text to continue, or a user message wrapped in the
tokenizer's chat template (the offline model is an instruct model).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    kind: str  # "code", "prose", "dialogue", "list" or "grounded"
    text: str
    chat: bool = False  # wrap in the chat template as a user message


_PASSAGE = ("The city council met on Tuesday to discuss the new bicycle lanes on Main Street. "
            "Supporters said the lanes would make cycling safer and reduce traffic. Shop owners "
            "worried that removing parking spaces would hurt their business. The council voted "
            "five to two to build the lanes next spring, and promised to review parking in a year.")

_FUNCTION = ("def moving_average(values, window):\n"
             "    result = []\n"
             "    for i in range(len(values) - window + 1):\n"
             "        chunk = values[i:i + window]\n"
             "        result.append(sum(chunk) / window)\n"
             "    return result\n")

PROMPTS: list[Prompt] = [
    Prompt("code", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"),
    Prompt("code", "import json\n\n\ndef load_config(path):\n"),
    Prompt("code", "Write a Python function that checks whether a string is a palindrome.", chat=True),
    Prompt("code", "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"),
    Prompt("code", "Write a SQL query that returns the ten customers with the highest total order value.",
           chat=True),
    Prompt("prose", "Once upon a time, in a small village by the sea, there lived"),
    Prompt("prose", "The history of the printing press begins"),
    Prompt("prose", "Write a short paragraph about why the sky is blue.", chat=True),
    Prompt("prose", "Describe a walk through a forest in autumn.", chat=True),
    Prompt("dialogue", "Hi! Can you recommend a good book for a long train journey?", chat=True),
    Prompt("dialogue", "I feel nervous about my job interview tomorrow. Any advice?", chat=True),
    Prompt("dialogue", "Alice: Did you finish the report?\nBob: Almost, I just need the figures.\nAlice:"),
    Prompt("list", "List five fruits that are high in vitamin C.", chat=True),
    Prompt("list", "Give me a packing list for a weekend camping trip.", chat=True),
    Prompt("list", "Steps to make a cup of tea:\n1."),
    Prompt("grounded", f"Summarize this passage in two sentences:\n\n{_PASSAGE}", chat=True),
    Prompt("grounded", f"Rewrite this passage in the past perfect tense, keeping everything else:\n\n{_PASSAGE}",
           chat=True),
    Prompt("grounded", f"Add type hints to this function and return the full function:\n\n{_FUNCTION}",
           chat=True),
    Prompt("grounded", f"Rename the variable `chunk` to `window_values` in this code and return it:\n\n{_FUNCTION}",
           chat=True),
    Prompt("grounded", f"Copy this passage, fixing any spelling mistakes:\n\nThe qick brown fox jumpd over the "
           "lazy dog. It was a sunny day and the fox was hapy.", chat=True),
    Prompt("list", "What are the planets of the solar system, in order from the Sun?", chat=True),
    Prompt("dialogue", "User: What's the capital of Australia?\nAssistant:"),
]


def chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of chat ``messages`` through the tokenizer's chat template (transformers returns a list
    or, in some versions, a mapping with ``input_ids``: either way, a list of ints here)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def encode(tokenizer, prompt: Prompt) -> list[int]:
    """Token ids of ``prompt`` (through the chat template when ``prompt.chat`` and the tokenizer has one;
    a base model's tokenizer without a template, such as GPT-2's, gets the message as plain text)."""
    if prompt.chat and getattr(tokenizer, "chat_template", None):
        return chat_ids(tokenizer, [{"role": "user", "content": prompt.text}])
    return [int(t) for t in tokenizer(prompt.text)["input_ids"]]


def by_kind(kind: str) -> list[Prompt]:
    return [p for p in PROMPTS if p.kind == kind]
