"""Variable tracking (RULER): a chain of assignments ``VAR A = 12345 ... VAR B = VAR A ...`` spread
through real text; name every variable that holds the value (multi-hop tracing)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .haystack import passage
from .base import Item, fit_length, item_id, place, rng_for

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

LETTERS = "ABCDEFGHJKLMNPQRSTUVWXYZ"


def variable_tracking(tokenizer: PreTrainedTokenizerBase, length: int, n: int, seed: int = 0, split: str = "eval",
                      source: str = "auto", hops: int = 4) -> list[Item]:
    """A chain of ``hops`` assignments (VAR X = 12345. VAR Y = VAR X. ...) hidden in real text; name every variable
    that holds the value."""
    items = []
    for i in range(n):
        rng = rng_for("variable_tracking", split, length, seed, i)
        names: list[str] = []
        while len(names) < hops + 1:
            name = "".join(rng.choice(LETTERS) for _ in range(5))
            if name not in names:
                names.append(name)
        value = str(rng.randrange(10_000, 99_999))
        chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[k]} = VAR {names[k - 1]}." for k in range(1, hops + 1)]
        depths = sorted(rng.random() for _ in chain)  # in order: each assignment after the one it reads
        filler = passage(rng, length // 6 + 16, split, source)
        intro = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n"
        context, _ = fit_length(tokenizer, length, lambda k: intro + place(filler[:k], chain, depths), len(filler))
        question = f"Find all variables that are assigned the value {value} in the text above."
        items.append(Item("variable_tracking", item_id("variable_tracking", split, length, seed, i), context, question,
                          names, answer_prefix=f"Answer: According to the chain(s) of variable assignment in the text "
                          f"above, {hops + 1} variables are assigned the value {value}, they are:"))
    return items
