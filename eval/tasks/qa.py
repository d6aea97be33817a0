"""Question answering over a long real document: several State of the Union addresses, each under a
heading with its year and president; the question quotes a sentence and asks who delivered it."""

from __future__ import annotations

import re

from ..haystack import addresses
from .base import Item, rng_for


def _split_title(title: str) -> tuple[str, str]:
    year, name = title.split("-")[:2]
    return year, name


def document_qa(tokenizer, length: int, n: int, seed: int = 0, split: str = "eval") -> list[Item]:
    docs = addresses(split)
    items = []
    for i in range(n):
        rng = rng_for("document_qa", length, seed, i)
        parts, count, used = [], 0, set()
        while count < length - 40:
            title, text = docs[rng.randrange(len(docs))]
            year, name = _split_title(title)
            if name in used:
                continue
            used.add(name)
            words = text.split()
            room = max(30, length - 40 - count)
            start = rng.randrange(max(1, len(words) - room))
            body = " ".join(words[start : start + int(room * 0.7)])  # ~0.7 words per token budgeted
            section = f"Address of {year} by President {name}:\n{body}"
            parts.append((name, section))
            count += len(tokenizer(section, add_special_tokens=False)["input_ids"])
        target_name, target = parts[rng.randrange(len(parts))]
        candidates = [s for s in re.split(r"(?<=[.!?])\s+", target.split(":\n", 1)[1]) if 10 <= len(s.split()) <= 40]
        quote = rng.choice(candidates) if candidates else " ".join(target.split()[5:20])
        context = "\n\n".join(p for _, p in parts)
        question = f'Which president delivered the address containing this sentence: "{quote}"? Answer with the name.'
        items.append(Item("document_qa", f"document_qa-{length}-{seed}-{i}", context, question, [target_name]))
    return items
