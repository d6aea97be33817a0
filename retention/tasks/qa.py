"""Question answering over a long real document: sections of several State of the Union addresses
(or, with the ``pydoc`` source, several modules' documentation), each under a heading; the question
quotes a sentence and asks which section (president / module) it comes from."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from .haystack import Document, documents
from .base import Item, count_tokens, fit_length, item_id, rng_for

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def _label(doc: Document) -> tuple[str, str]:
    """``(heading, answer)`` of a document."""
    if doc.source == "sotu":
        year, name = doc.title.split("-")[:2]
        return f"State of the Union address of {year} by President {name}", name
    module = doc.title.split(":", 1)[1]
    return f"Documentation of the Python module {module}", module


def _sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())) if 6 <= len(s.split()) <= 60]


def document_qa(tokenizer: PreTrainedTokenizerBase, length: int, n: int, seed: int = 0, split: str = "eval",
                source: str = "auto", sections: int | None = None) -> list[Item]:
    """``sections`` (default: one per ~400 tokens, 2 to 6) excerpts of distinct documents."""
    docs = [d for d in documents(split, source) if len(_sentences(d.text)) >= 40]
    m = sections or max(2, min(6, length // 400))
    items = []
    for i in range(n):
        rng = rng_for("document_qa", split, length, seed, i)
        chosen: list[tuple[str, str, list[str]]] = []
        for doc in rng.sample(docs, len(docs)):
            heading, answer = _label(doc)
            if any(a == answer for _, a, _ in chosen):  # one section per president / module
                continue
            sents = _sentences(doc.text)
            start = rng.randrange(max(1, len(sents) - length // 10))
            chosen.append((heading, answer, sents[start:]))
            if len(chosen) == m:
                break
        def build(k: int) -> str:
            return "\n\n".join(f"{h}:\n" + " ".join(s[:k]) for h, _, s in chosen)
        most = min(len(s) for _, _, s in chosen)
        try:
            context, k = fit_length(tokenizer, length, build, most)
        except ValueError:  # fit_length's "not enough filler (43 units)" named neither the task nor a fix
            have = count_tokens(tokenizer, build(most))
            fix = ("give more sections (params: {sections: N})" if len(chosen) == m else
                   f"use another source (only {len(docs)} {split!r} documents of {source!r} have 40 sentences)")
            raise ValueError(
                f"document_qa: item {i} has {len(chosen)} sections of {split!r} {source!r} documents, cut at the "
                f"shortest one's {most} sentences: {have} tokens, short of length {length}; lower the length, or "
                f"{fix}") from None
        if k == 0:  # headings alone: the quoted sentence (sents[0]) would not be in the context
            raise ValueError(f"document_qa: length {length} holds the {len(chosen)} section headings but not one "
                             "sentence under each; raise the length or give fewer sections (params: {sections: N})")
        target = rng.randrange(len(chosen))
        heading, answer, sents = chosen[target]
        quote = sents[rng.randrange(max(1, k))]
        what = "president delivered" if "President" in heading else "module's documentation contains"
        question = f'Which {what} the passage containing this sentence: "{quote}"? Answer with the name only.'
        items.append(Item("document_qa", item_id("document_qa", split, length, seed, i), context, question, [answer],
                          answer_prefix="Answer:", meta={"sections": [h for h, _, _ in chosen], "quote": quote}))
    return items
