"""What the held-out families share: their vocabulary (names, places, trades: none of it in a training generator)."""

from __future__ import annotations

import random

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
