"""Held-out family 4: RULER's needle task in RULER's own wording (Hsieh et al., 2024; its public generator's
templates): word-pair keys (``adjective-noun``), UUID or number values, distractor keys, over Wikipedia prose.

RULER's templates, as its generator writes them: the intro "A special magic {type} is hidden within the following
text. Make sure to memorize it. I will quiz you about the {type} afterwards.", the needle "One of the special magic
{type} for {key} is: {value}.", the question "What is the special magic {type} for {query} mentioned in the provided
text?" and the answer prefix "The special magic {type} for {query} mentioned in the provided text is"."""

from __future__ import annotations

import random
import uuid
from typing import TYPE_CHECKING

from ..base import Item, fit_length, item_id, place, rng_for
from ..haystack import passage

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# word-pair keys as RULER draws them (its generator uses wonderwords' adjectives and nouns; these lists are ours)
_ADJ = ["abrupt", "brittle", "careful", "damp", "eager", "faint", "gentle", "hollow", "icy", "jagged", "keen",
        "loud", "mellow", "narrow", "odd", "plain", "quiet", "rapid", "shiny", "tense", "upbeat", "vivid", "weary"]
_NOUN = ["anchor", "basket", "candle", "dolphin", "engine", "feather", "guitar", "helmet", "igloo", "jacket",
         "kettle", "ladder", "magnet", "notebook", "oyster", "pencil", "rocket", "saddle", "trumpet", "umbrella"]
VALUE_TYPES = ("uuids", "numbers")


def _value(rng: random.Random, kind: str) -> str:
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    return str(rng.randrange(1_000_000, 9_999_999))


def ruler_niah(tokenizer: PreTrainedTokenizerBase, length: int, n: int, seed: int = 0, split: str = "eval",
               source: str = "auto", keys: int = 4, value_type: str = "numbers") -> list[Item]:
    """``keys`` RULER needles with distinct word-pair keys in Wikipedia prose; one key is asked. ``value_type``:
    ``numbers`` (7 digits) or ``uuids``. ``split``/``source`` are ignored: the genre is held out."""
    if value_type not in VALUE_TYPES:
        raise ValueError(f"ruler_niah: value_type must be one of {list(VALUE_TYPES)}, got {value_type!r}")
    kind = "number" if value_type == "numbers" else "uuid"
    items = []
    for i in range(n):
        rng = rng_for("ruler_niah", "eval", length, seed, i)
        ks = rng.sample([f"{a}-{b}" for a in _ADJ for b in _NOUN], keys)
        vals = [_value(rng, value_type) for _ in ks]
        t = rng.randrange(keys)
        needles = [f"One of the special magic {value_type} for {k} is: {v}." for k, v in zip(ks, vals)]
        depths = [rng.random() for _ in needles]
        filler = passage(rng, length // 6 + 16, "eval", "wiki")
        intro = (f"A special magic {kind} is hidden within the following text. Make sure to memorize it. I will quiz "
                 f"you about the {kind} afterwards.\n")
        context, _ = fit_length(tokenizer, length, lambda k: intro + place(filler[:k], needles, depths), len(filler))
        items.append(Item("ruler_niah", item_id("ruler_niah", "eval", length, seed, i), context,
                          f"What is the special magic {kind} for {ks[t]} mentioned in the provided text?", [vals[t]],
                          answer_prefix=f"The special magic {kind} for {ks[t]} mentioned in the provided text is",
                          meta={"depths": depths, "value_type": value_type}))
    return items
