"""Held-out family 1: facts as natural sentences (a birthplace, a year, a code, an amount, a mooring) inside news
prose, with no warning line; the article is pasted in one turn and the question comes in a later one; the reply
starts by quoting the fact up to its answer."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from ..base import Item, fit_conversation, item_id, place, rng_for
from ..haystack import passage
from .common import MONTHS, ORGS, THINGS, TOWNS, code, person

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

OPENERS = ["Here is an article from this morning's paper.", "I copied this report from a news site.",
           "A friend sent me this piece from the local paper."]
ACKS = ["Thanks, I have read the article. What would you like to know?", "Got it. Ask me anything about it.",
        "I have gone through the report. What is your question?"]


def _fact(rng: random.Random) -> tuple[str, str, str]:
    """(sentence, question, answer), one of five kinds, each with its own wording."""
    who, org, thing = person(rng), rng.choice(ORGS), rng.choice(THINGS)
    kind = rng.randrange(5)
    if kind == 0:
        town = rng.choice(TOWNS)
        return (f"{who}, who now runs a small {thing} repair shop, was born in {town}.",
                f"In which town was {who} born?", town)
    if kind == 1:
        year = str(rng.randrange(1952, 2019))
        return (f"The {org} signed the lease on its first premises in {rng.choice(MONTHS)} {year}.",
                f"In what year did the {org} sign the lease on its first premises?", year)
    if kind == 2:
        c = code(rng)
        return (f"Volunteers at the {org} were reminded that the storeroom code is {c}.",
                f"What is the storeroom code at the {org}?", c)
    if kind == 3:
        amount = f"{rng.randrange(1, 99)},{rng.randrange(100, 999)}"
        return (f"Last spring {who} paid {amount} dollars for a second-hand {thing}.",
                f"How many dollars did {who} pay for the second-hand {thing}?", amount)
    town = rng.choice(TOWNS)
    return (f"{who} keeps an old fishing boat moored in the harbour at {town}.",
            f"In which town's harbour does {who} keep an old fishing boat?", town)


def prose_facts(tokenizer: PreTrainedTokenizerBase, length: int, n: int, seed: int = 0, split: str = "eval",
                source: str = "auto", facts: int = 1) -> list[Item]:
    """``facts`` fact sentences of different kinds in a news article (``length`` tokens of conversation); one is
    asked. ``split``/``source`` are ignored: the genre is held out (news, evaluation only)."""
    items = []
    for i in range(n):
        rng = rng_for("prose_facts", "eval", length, seed, i)
        drawn: dict[str, tuple[str, str, str]] = {}
        while len(drawn) < facts:  # distinct questions
            f = _fact(rng)
            drawn.setdefault(f[1], f)
        stated = list(drawn.values())
        depths = [rng.uniform(0.05, 0.95) for _ in stated]
        filler = passage(rng, length // 8 + 16, "eval", "news")
        messages = fit_conversation(tokenizer, length, rng.choice(OPENERS), rng.choice(ACKS),
                                    lambda k: place(filler[:k], [s for s, _, _ in stated], depths), len(filler))
        sentence, question, answer = stated[rng.randrange(facts)]
        # the reply quotes the fact's sentence up to the answer, as the other question families do: without it the
        # full cache of SmolLM2-135M answered 30% (item seed 100) and 10% (seed 101) at 4k
        lead = sentence[: sentence.index(answer)].rstrip()
        items.append(Item("prose_facts", item_id("prose_facts", "eval", length, seed, i), "", question, [answer],
                          messages=messages, answer_prefix=f'The article says: "{lead}',
                          meta={"facts": [s for s, _, _ in stated], "depths": depths}))
    return items
