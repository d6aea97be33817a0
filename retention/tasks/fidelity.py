"""Fidelity: next-token distributions on held-out real text, compared with the full cache.

The context (``length`` tokens) is compressed, then the ``continuation`` is scored teacher-forced;
the metric is KL(full || compressed) and top-1 agreement over the continuation's positions."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .haystack import documents
from .base import Item, item_id, rng_for

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def fidelity(tokenizer: PreTrainedTokenizerBase, length: int, n: int, seed: int = 0, split: str = "eval",
             source: str = "auto", continuation: int = 32) -> list[Item]:
    """A real text's next ``continuation`` tokens, scored by KL and top-1 agreement with the full cache."""
    docs = documents(split, source)
    items = []
    for i in range(n):
        rng = rng_for("fidelity", split, length, seed, i)
        ids: list[int] = []
        while len(ids) < length + continuation:  # consecutive documents until long enough
            doc = docs[rng.randrange(len(docs))]
            ids += tokenizer(" ".join(doc.text.split()) + "\n\n", add_special_tokens=False)["input_ids"]
        start = rng.randrange(len(ids) - length - continuation + 1)
        ctx, cont = ids[start : start + length], ids[start + length : start + length + continuation]
        items.append(Item("fidelity", item_id("fidelity", split, length, seed, i), tokenizer.decode(ctx), "", [],
                          continuation=tokenizer.decode(cont), metric="fidelity",
                          meta={"context_ids": ctx, "continuation_ids": cont}))
    return items
