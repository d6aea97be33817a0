"""Held-out family 5: span QA over real documents, as a cloze: a Wikipedia article is pasted, and a later turn
quotes one of its sentences with a name or number left out and asks for it (the answer is a span of the text)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from ..base import Item, item_id, rng_for
from ..haystack import documents
from .common import fit_conversation

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# a capitalised word that is not a sentence's first, or a number of 3+ digits: spans a reader could only copy
_SPAN = re.compile(r"(?<=\s)(?:[A-Z][a-z]{3,}|\d{3,})(?=[\s,.;:)])")


def _sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())) if 10 <= len(s.split()) <= 45]


def span_cloze(tokenizer: PreTrainedTokenizerBase, length: int, n: int, seed: int = 0, split: str = "eval",
               source: str = "auto") -> list[Item]:
    """Consecutive sentences of Wikipedia articles (``length`` tokens of conversation); one sentence at 5-80% depth
    with a span (a capitalised word or a 3+ digit number) that occurs once in the text is quoted with the span
    blanked. ``split``/``source`` are ignored: the genre is held out."""
    docs = documents("eval", "wiki")
    items = []
    for i in range(n):
        rng = rng_for("span_cloze", "eval", length, seed, i)
        sents: list[str] = []
        while len(sents) < length // 12:  # articles in a random order until there is more than enough
            sents += _sentences(docs[rng.randrange(len(docs))].text)
        messages = fit_conversation(tokenizer, length, "Please read this encyclopedia article carefully.",
                                    "I have read it. What would you like to ask?",
                                    lambda k: " ".join(sents[:k]), len(sents))
        text = messages[0]["content"]
        kept = [s for s in sents if s in text]
        lo, hi = int(0.05 * len(kept)), max(int(0.8 * len(kept)), int(0.05 * len(kept)) + 1)
        for _ in range(200):  # a sentence whose span is unique in the text, so the blank has one answer
            s = kept[rng.randrange(lo, hi)]
            spans = [m for m in _SPAN.finditer(s) if text.count(m.group()) == 1]
            if spans:
                break
        else:
            raise ValueError(f"span_cloze: no sentence with a unique span in item {i}; raise the length")
        m = rng.choice(spans)
        blanked = s[: m.start()] + "____" + s[m.end():]
        question = (f'The article has this sentence with one word replaced by ____: "{blanked}" '
                    "Which word was replaced?")
        items.append(Item("span_cloze", item_id("span_cloze", "eval", length, seed, i), "", question, [m.group()],
                          messages=messages, meta={"sentence": s}))
    return items
