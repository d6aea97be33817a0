"""What the held-out families share: their vocabulary (names, places, trades: none of it in a training generator)
and fitting a pasted document into a conversation of a given length, the question asked in a later turn."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Callable

from ..base import count_tokens, render_chat

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

FIRST = ["Marta", "Tobias", "Ngozi", "Anselm", "Priya", "Caspar", "Yusra", "Leopold", "Ingrid", "Matteo", "Soraya",
         "Emeric", "Wanjiru", "Lucien", "Halvard", "Beatriz", "Oskar", "Mireille", "Teodor", "Aiyana"]
LAST = ["Kovacs", "Lindqvist", "Okafor", "Brandt", "Ramaswamy", "Delacroix", "Haddad", "Novak", "Castellano",
        "Achterberg", "Moreau", "Szabo", "Kariuki", "Fontaine", "Bergstrom", "Quintero", "Vasquez", "Eriksen"]
TOWNS = ["Valparaiso", "Tromsdal", "Ballarat", "Zadar", "Ouarzazate", "Bendigo", "Lillehammer", "Arequipa", "Kilkenny",
         "Trieste", "Mombasa", "Whanganui", "Esbjerg", "Salta", "Matera", "Kananaskis", "Gdynia", "Tulear"]
ORGS = ["Harrow Street Cooperative", "Minden Valley Rowing Club", "Eastgate Seed Library", "Corran Ferry Trust",
        "Pellham Choral Society", "Northmoor Tool Exchange", "Ridley Observatory Guild", "Saltmarsh Beekeepers"]
THINGS = ["tractor", "piano", "sailboat", "kiln", "telescope", "printing press", "loom", "caravan"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]


def person(rng: random.Random) -> str:
    return f"{rng.choice(FIRST)} {rng.choice(LAST)}"


def code(rng: random.Random) -> str:
    """A code as staff write them: two capitals, a dash, four digits (``KT-4471``)."""
    return f"{rng.choice('BCDFGHJKLMNPRSTVWXZ')}{rng.choice('ABDEHKMNRTWY')}-{rng.randrange(1000, 9999)}"


def fit_conversation(tokenizer: PreTrainedTokenizerBase, length: int, opener: str, ack: str,
                     build: Callable[[int], str], max_units: int) -> list[dict[str, str]]:
    """``[user: opener + document, assistant: ack]`` with the longest ``build(k)`` whose rendered conversation has
    at most ``length`` tokens: the question then comes in a turn of its own, after the assistant's reply."""
    def msgs(k: int) -> list[dict[str, str]]:
        return [{"role": "user", "content": opener + "\n\n" + build(k)}, {"role": "assistant", "content": ack}]

    def size(k: int) -> int:
        return count_tokens(tokenizer, render_chat(tokenizer, msgs(k)))

    if size(0) > length:
        raise ValueError(f"length {length} is too short: the conversation without its document is {size(0)} tokens")
    if size(max_units) <= length:
        raise ValueError(f"not enough text ({max_units} units) for {length} tokens")
    lo, hi = 0, max_units
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if size(mid) <= length else (lo, mid)
    return msgs(lo)
