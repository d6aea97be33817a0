"""Aggregation tasks (RULER): common-word extraction (a numbered list of real English words where a
few appear many times) and frequent-word extraction (coded words drawn from a Zipf distribution)."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from .haystack import vocabulary
from .base import Item, count_tokens, item_id, rng_for

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def _fit_list(tokenizer, length: int, draw, header: str, numbered: bool) -> list[str]:
    """Draw words until the rendered list reaches ``length`` tokens (counted on a sample, then exact)."""
    render = (lambda ws: header + " ".join(f"{k + 1}. {w}" for k, w in enumerate(ws))) if numbered else \
        (lambda ws: header + " ".join(ws))
    sample = [draw() for _ in range(64)]
    per_word = (count_tokens(tokenizer, render(sample)) - count_tokens(tokenizer, header)) / 64
    words = sample + [draw() for _ in range(max(0, int(length / per_word) + 8 - 64))]
    while len(words) > 1 and count_tokens(tokenizer, render(words)) > length:
        words = words[: max(1, int(len(words) * 0.98))]
    return words


def common_words(tokenizer: PreTrainedTokenizerBase, length: int, n: int, seed: int = 0, split: str = "eval",
                 source: str = "auto", top: int = 3, common_share: float = 0.3) -> list[Item]:
    """Name the ``top`` most common words of a numbered list of real words."""
    vocab = vocabulary(split, source)
    header = "Below is a numbered list of words. In these words, some appear more often than others. "
    items = []
    for i in range(n):
        rng = rng_for("common_words", split, length, seed, i)
        common = rng.sample(vocab, top)
        def draw() -> str:
            return rng.choice(common) if rng.random() < common_share else rng.choice(vocab)
        words = _fit_list(tokenizer, length, draw, header, numbered=True)
        counts = {w: words.count(w) for w in common}
        context = header + " ".join(f"{k + 1}. {w}" for k, w in enumerate(words))
        answers = sorted(common, key=lambda w: -counts[w])
        items.append(Item("common_words", item_id("common_words", split, length, seed, i), context,
                          f"What are the {top} most common words in the list above?", answers,
                          answer_prefix=f"Answer: The top {top} words that appear most often in the list are:",
                          meta={"counts": counts}))
    return items


def _coded_word(rng: random.Random) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(5))


def frequent_words(tokenizer: PreTrainedTokenizerBase, length: int, n: int, seed: int = 0, split: str = "eval",
                   source: str = "auto", top: int = 3, vocab_size: int = 60, alpha: float = 2.0) -> list[Item]:
    """Coded words with Zipf frequencies (rank r has weight r^-alpha); name the ``top`` most frequent.

    The text is synthetic by design (RULER's FWE); ``split``/``seed`` still separate training items.
    """
    header = "Read the following coded text and track the frequency of each coded word. "
    items = []
    for i in range(n):
        rng = rng_for("frequent_words", split, length, seed, i)
        vocab: list[str] = []
        while len(vocab) < vocab_size:
            w = _coded_word(rng)
            if w not in vocab:
                vocab.append(w)
        weights = [(r + 1) ** -alpha for r in range(vocab_size)]
        def draw() -> str:
            return rng.choices(vocab, weights)[0]
        words = _fit_list(tokenizer, length, draw, header, numbered=False)
        while True:
            counts = {w: words.count(w) for w in vocab}
            ranked = sorted(vocab, key=lambda w: -counts[w])
            if counts[ranked[top - 1]] != counts[ranked[top]]:
                break
            # a tie at the cut makes the answer ambiguous: more of the top words break it, within the length
            # (appended to a list already fitted to it, they made contexts of 1043 tokens for 1024); else a word fewer
            extra = [ranked[k] for k in range(top) for _ in range(top - k)]
            if count_tokens(tokenizer, header + " ".join(words + extra)) <= length:
                words += extra
                rng.shuffle(words)
            else:
                words = words[:-1]
        context = header + " ".join(words)
        items.append(Item("frequent_words", item_id("frequent_words", split, length, seed, i), context,
                          f"What are the {top} most frequently appeared coded words in the above coded text?",
                          ranked[:top], answer_prefix=f"Answer: According to the coded text above, the {top} most "
                          "frequently appeared words are:", meta={"counts": {w: counts[w] for w in ranked[:top + 2]}}))
    return items
