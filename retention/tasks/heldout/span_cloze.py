"""Held-out family 5: span QA over real documents: a Wikipedia article is pasted, and a later turn asks to go on
with a quotation from it; the reply starts with the words that lead up to a name or number, and the answer is the
word that follows (a span of the text). A first version quoted the whole sentence with the span blanked: the full
cache of SmolLM2-135M answered 0 of 10 at 4k, explaining the blank instead of filling it."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from ..base import Item, fit_conversation, item_id, rng_for
from ..haystack import documents

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# a capitalised word that is not a sentence's first, or a number of 3+ digits: spans a reader could only copy
_SPAN = re.compile(r"(?<=\s)(?:[A-Z][a-z]{3,}|\d{3,})(?=[\s,.;:)])")


def _sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())) if 10 <= len(s.split()) <= 45]


def span_cloze(tokenizer: PreTrainedTokenizerBase, length: int, n: int, seed: int = 0, split: str = "eval",
               source: str = "auto") -> list[Item]:
    """Consecutive sentences of Wikipedia articles (``length`` tokens of conversation); one sentence at 5-80% depth
    with a span (a capitalised word or a 3+ digit number) that occurs once in the text, led up to by up to ten words
    that occur once too; the reply starts by quoting those words, and the span is the word that follows.
    ``split``/``source`` are ignored: the genre is held out."""
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
        for _ in range(200):  # a span whose lead-in (the words before it) occurs once, so the reply has one answer
            s = kept[rng.randrange(lo, hi)]
            spans = [(m, lead) for m in _SPAN.finditer(s)
                     if len(lead := " ".join(s[: m.start()].split()[-10:])) >= 20 and text.count(lead) == 1
                     and text.count(m.group()) == 1]
            if spans:
                break
        else:
            raise ValueError(f"span_cloze: no sentence with a unique span in item {i}; raise the length")
        m, lead = rng.choice(spans)
        # the lead-in only in the reply's prefix: quoted in the question too, the reply copied the question's
        # closing quote mark (2 of 3 probed items) instead of the article's next word
        question = "Please go on with the quotation from the article that I begin in your reply, word for word."
        items.append(Item("span_cloze", item_id("span_cloze", "eval", length, seed, i), "", question, [m.group()],
                          messages=messages, answer_prefix=f'The article says: "{lead}', meta={"sentence": s}))
    return items
