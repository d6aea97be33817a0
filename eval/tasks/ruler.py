"""RULER-style synthetic tasks over real haystacks (Hsieh et al., 2024, "RULER: What's the Real
Context Size of Your Long-Context Language Models?")."""

from __future__ import annotations

from ..haystack import filler
from .base import WORDS, Item, number, place, rng_for


def _needles(task, tokenizer, length, n, seed, split, make):
    items = []
    for i in range(n):
        rng = rng_for(task, length, seed, i)
        inserts, question, answers = make(rng)
        overhead = len(tokenizer(" ".join(inserts) + " " + question, add_special_tokens=False)["input_ids"])
        hay = filler(tokenizer, max(16, length - overhead - 16), rng, split)
        items.append(Item(task, f"{task}-{length}-{seed}-{i}", place(hay, inserts, rng), question, answers))
    return items


def single_needle(tokenizer, length: int, n: int, seed: int = 0, split: str = "eval") -> list[Item]:
    """One ``key -> number`` fact; ask for the number."""
    def make(rng):
        key, val = rng.choice(WORDS), number(rng)
        return [f"The special magic number for {key} is {val}."], f"What is the special magic number for {key}?", [val]
    return _needles("niah_single", tokenizer, length, n, seed, split, make)


def multi_key_needle(tokenizer, length: int, n: int, seed: int = 0, split: str = "eval") -> list[Item]:
    """Four facts with different keys; ask for one (the others are distractors)."""
    def make(rng):
        keys = rng.sample(WORDS, 4)
        vals = [number(rng) for _ in keys]
        facts = [f"The special magic number for {k} is {v}." for k, v in zip(keys, vals)]
        return facts, f"What is the special magic number for {keys[0]}?", [vals[0]]
    return _needles("niah_multikey", tokenizer, length, n, seed, split, make)


def multi_value_needle(tokenizer, length: int, n: int, seed: int = 0, split: str = "eval") -> list[Item]:
    """Three numbers for one key; all must be recalled."""
    def make(rng):
        key = rng.choice(WORDS)
        vals = [number(rng) for _ in range(3)]
        return ([f"One of the special magic numbers for {key} is {v}." for v in vals],
                f"What are all the special magic numbers for {key}?", vals)
    return _needles("niah_multivalue", tokenizer, length, n, seed, split, make)


def multi_query_needle(tokenizer, length: int, n: int, seed: int = 0, split: str = "eval") -> list[Item]:
    """Two keys asked at once; both numbers must be recalled."""
    def make(rng):
        keys = rng.sample(WORDS, 2)
        vals = [number(rng) for _ in keys]
        return ([f"The special magic number for {k} is {v}." for k, v in zip(keys, vals)],
                f"What are the special magic numbers for {keys[0]} and {keys[1]}?", vals)
    return _needles("niah_multiquery", tokenizer, length, n, seed, split, make)


def variable_tracking(tokenizer, length: int, n: int, seed: int = 0, split: str = "eval") -> list[Item]:
    """A chain of assignments ``VAR A = 12345. VAR B = VAR A. ...``; find every name holding the value."""
    def make(rng):
        names = ["".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(5)) for _ in range(4)]
        val = str(rng.randrange(10_000, 99_999))
        chain = [f"VAR {names[0]} = {val}."] + [f"VAR {names[k]} = VAR {names[k - 1]}." for k in range(1, 4)]
        return chain, f"Which variables are assigned the value {val}? List their names.", names
    return _needles("variable_tracking", tokenizer, length, n, seed, split, make)


def common_words(tokenizer, length: int, n: int, seed: int = 0, split: str = "eval") -> list[Item]:
    """A numbered list of words where three appear far more often; name the three most common."""
    items = []
    for i in range(n):
        rng = rng_for("common_words", length, seed, i)
        common = rng.sample(WORDS, 3)
        rare = [w for w in WORDS if w not in common]
        def draw():
            if rng.random() < 0.3:
                return rng.choice(common)
            return rng.choice(rare) + rng.choice(["s", "ing", "ed", ""]) + str(rng.randrange(100))

        sample = [draw() for _ in range(64)]  # tokens per numbered word, measured on this tokenizer
        per_word = len(tokenizer(" ".join(f"{k + 1}. {w}" for k, w in enumerate(sample)), add_special_tokens=False)["input_ids"]) / 64
        words = sample[: max(8, int((length - 16) / per_word))]
        words += [draw() for _ in range(max(0, int((length - 16) / per_word) - len(words)))]
        context = "Below is a numbered list of words. " + " ".join(f"{k + 1}. {w}" for k, w in enumerate(words))
        items.append(Item("common_words", f"common_words-{length}-{seed}-{i}", context,
                          "What are the three most common words in the list above?", common))
    return items
