"""What a task produces: items with a context, a question and the answers that count."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Item:
    """One evaluation item.

    ``context`` is compressed before ``question`` arrives (query-agnostic protocol); ``answers`` are the
    strings a correct reply contains (all of them for multi-answer tasks). ``messages`` (dialogue tasks)
    replaces ``context`` as earlier chat turns. Fidelity items have a ``continuation`` instead.
    """

    task: str
    id: str
    context: str
    question: str
    answers: list[str]
    messages: list[dict[str, str]] | None = None
    continuation: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


def rng_for(task: str, length: int, seed: int, i: int) -> random.Random:
    return random.Random(f"{task}/{length}/{seed}/{i}")


def place(sentences: list[str], inserts: list[str], rng: random.Random) -> str:
    """Insert sentences at random depths of a haystack."""
    out = list(sentences)
    for s in inserts:
        out.insert(rng.randrange(len(out) + 1), s)
    return " ".join(out)


def number(rng: random.Random) -> str:
    return str(rng.randrange(1_000_000, 9_999_999))


WORDS = ["amber", "falcon", "harbor", "meadow", "lantern", "quartz", "willow", "canyon", "ember", "glacier",
         "orchid", "pepper", "raven", "saffron", "thistle", "velvet", "walnut", "zephyr", "cobalt", "juniper"]
