"""Held-out family 3: a detail the user gives in the first turn (a locker number, a flight, a relative's name, a
parking bay), asked many turns later, after a long talk about news articles (a genre no training dialogue uses)."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from ..base import Item, item_id, rng_for
from ..dialogue import talk_about_passages
from .common import FIRST, TOWNS

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ASKS = ["Summarise this for me in one line.", "What is this one about?", "Next article. What is the gist?",
        "Could you boil this down?", "Anything surprising in this one?"]
REPLIES = ["In one line: {s}", "The gist is this. {s}", "Mainly that {s}", "It boils down to this: {s}"]


def _detail(rng: random.Random) -> tuple[str, str, str]:
    """(what the user says, the later question, the answer)."""
    kind = rng.randrange(4)
    if kind == 0:
        n = str(rng.randrange(100, 999))
        return (f"my gym locker is number {n}", "Which number did I say my gym locker is?", n)
    if kind == 1:
        flight = f"{rng.choice(['QF', 'LH', 'KL', 'AC', 'NZ'])}{rng.randrange(100, 999)}"
        return (f"I fly home on flight {flight} next week", "What was the flight number I mentioned at the start?",
                flight)
    if kind == 2:
        name = rng.choice(FIRST)
        return (f"my cousin {name} is coming to stay with me", "What is the name of the cousin who is coming to stay?",
                name)
    town = rng.choice(TOWNS)
    return (f"I grew up near {town}", "Near which town did I tell you I grew up?", town)


def late_recall(tokenizer: PreTrainedTokenizerBase, length: int, n: int, seed: int = 0, split: str = "eval",
                source: str = "auto") -> list[Item]:
    """One detail in the first user turn, news articles summarised turn after turn (``length`` tokens of rendered
    conversation), then the detail asked. ``split``/``source`` are ignored: the genre is held out."""
    items = []
    for i in range(n):
        rng = rng_for("late_recall", "eval", length, seed, i)
        said, question, answer = _detail(rng)
        opening = [{"role": "user", "content": f"Quick note before the articles: {said}. Now, I will paste some "
                    "news stories one by one; keep your summaries short."},
                   {"role": "assistant", "content": "Noted. Paste the first story whenever you are ready."}]
        turns = talk_about_passages(tokenizer, rng, opening, length, "eval", "news", asks=ASKS, replies=REPLIES)
        items.append(Item("late_recall", item_id("late_recall", "eval", length, seed, i), "", question,
                          [answer], messages=opening + turns, meta={"said": said}))
    return items
