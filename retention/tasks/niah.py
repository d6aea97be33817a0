"""Needle-in-a-haystack tasks in the style of RULER (Hsieh et al., 2024): ``key -> number`` facts
hidden at random depths of real text; single, multi-key (distractor needles), multi-value (several
numbers for one key) and multi-query (several keys asked at once)."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from .haystack import passage
from .base import KEYS, Item, fit_length, item_id, magic_number, place, rng_for

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def _fact(key: str, value: str) -> str:
    return f"The special magic number for {key} is: {value}."


def _needles(task: str, tokenizer, length: int, n: int, seed: int, split: str, source: str, make) -> list[Item]:
    items = []
    for i in range(n):
        rng = rng_for(task, split, length, seed, i)
        inserts, question, answers, prefix = make(rng)
        depths = [rng.random() for _ in inserts]
        filler = passage(rng, length // 6 + 16, split, source)  # sentences have >= 8 words, ~10+ tokens
        intro = "Some special magic numbers are hidden within the following text. Make sure to memorize them.\n"
        context, _ = fit_length(tokenizer, length, lambda k: intro + place(filler[:k], inserts, depths), len(filler))
        items.append(Item(task, item_id(task, split, length, seed, i), context, question, answers,
                          answer_prefix=prefix, meta={"depths": depths}))
    return items


def single_needle(tokenizer: PreTrainedTokenizerBase, length: int, n: int, seed: int = 0, split: str = "eval",
                  source: str = "auto") -> list[Item]:
    """One fact; ask for its number."""
    def make(rng: random.Random):
        key, val = rng.choice(KEYS), magic_number(rng)
        return ([_fact(key, val)], f"What is the special magic number for {key} mentioned in the text above?",
                [val], f"The special magic number for {key} mentioned in the text is")
    return _needles("niah_single", tokenizer, length, n, seed, split, source, make)


def multi_key_needle(tokenizer: PreTrainedTokenizerBase, length: int, n: int, seed: int = 0, split: str = "eval",
                     source: str = "auto", keys: int = 4) -> list[Item]:
    """``keys`` facts with different keys; one is asked, the others are distractors."""
    def make(rng: random.Random):
        ks = rng.sample(KEYS, keys)
        vals = [magic_number(rng) for _ in ks]
        target = rng.randrange(keys)
        return ([_fact(k, v) for k, v in zip(ks, vals)],
                f"What is the special magic number for {ks[target]} mentioned in the text above?",
                [vals[target]], f"The special magic number for {ks[target]} mentioned in the text is")
    return _needles("niah_multikey", tokenizer, length, n, seed, split, source, make)


def multi_value_needle(tokenizer: PreTrainedTokenizerBase, length: int, n: int, seed: int = 0, split: str = "eval",
                       source: str = "auto", values: int = 3) -> list[Item]:
    """``values`` numbers for one key; all must be recalled."""
    def make(rng: random.Random):
        key = rng.choice(KEYS)
        vals = [magic_number(rng) for _ in range(values)]
        return ([_fact(key, v) for v in vals],
                f"What are all the special magic numbers for {key} mentioned in the text above?",
                vals, f"The special magic numbers for {key} mentioned in the text are")
    return _needles("niah_multivalue", tokenizer, length, n, seed, split, source, make)


def multi_query_needle(tokenizer: PreTrainedTokenizerBase, length: int, n: int, seed: int = 0, split: str = "eval",
                       source: str = "auto", queries: int = 2) -> list[Item]:
    """``queries`` keys asked at once; every number must be recalled."""
    def make(rng: random.Random):
        ks = rng.sample(KEYS, queries)
        vals = [magic_number(rng) for _ in ks]
        names = ", ".join(ks[:-1]) + f" and {ks[-1]}"
        return ([_fact(k, v) for k, v in zip(ks, vals)],
                f"What are the special magic numbers for {names} mentioned in the text above?",
                vals, f"The special magic numbers for {names} mentioned in the text are")
    return _needles("niah_multiquery", tokenizer, length, n, seed, split, source, make)
