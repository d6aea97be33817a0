"""Held-out family 3: a detail the user gives in the first turn (a locker number, a flight, a cousin's name, a home
town), asked many turns later, after a long talk about news articles (a genre no training dialogue uses). The
reply starts by quoting the user up to the detail (``You said: "my gym locker is number``), as RULER's answer prefixes
do: a first version without it had the full cache of SmolLM2-135M answer 0 of 10 at 4k, and 1 of 6 with a bare
prefix."""

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


def _detail(rng: random.Random) -> tuple[str, str, str, str]:
    """(the words before the detail, the detail, the words after it, the later question)."""
    kind = rng.randrange(4)
    if kind == 0:
        return "my gym locker is number", str(rng.randrange(100, 999)), "", "Which number did I say my gym locker is?"
    if kind == 1:
        flight = f"{rng.choice(['QF', 'LH', 'KL', 'AC', 'NZ'])}{rng.randrange(100, 999)}"
        return "I fly home next week on flight", flight, "", "What was the flight number I mentioned at the start?"
    if kind == 2:
        return ("my cousin", rng.choice(FIRST), " is coming to stay with me",
                "What is the name of the cousin who is coming to stay?")
    return "I grew up near the town of", rng.choice(TOWNS), "", "Near which town did I tell you I grew up?"


def late_recall(tokenizer: PreTrainedTokenizerBase, length: int, n: int, seed: int = 0, split: str = "eval",
                source: str = "auto") -> list[Item]:
    """One detail in the first user turn, news articles summarised turn after turn (``length`` tokens of rendered
    conversation), then the detail asked. ``split``/``source`` are ignored: the genre is held out."""
    items = []
    for i in range(n):
        rng = rng_for("late_recall", "eval", length, seed, i)
        lead, answer, tail, question = _detail(rng)
        said = f"{lead} {answer}{tail}"
        opening = [{"role": "user", "content": f"Quick note before the articles: {said}. Now, I will paste some "
                    "news stories one by one; keep your summaries short."},
                   {"role": "assistant", "content": "Noted. Paste the first story whenever you are ready."}]
        turns = talk_about_passages(tokenizer, rng, opening, length, "eval", "news", asks=ASKS, replies=REPLIES)
        items.append(Item("late_recall", item_id("late_recall", "eval", length, seed, i), "", question,
                          [answer], messages=opening + turns, answer_prefix=f'You said: "{lead}',
                          meta={"said": said}))
    return items
