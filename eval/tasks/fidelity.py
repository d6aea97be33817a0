"""Fidelity: next-token distributions on held-out text continuations, compared with the full cache
(KL divergence and top-1 agreement); the answer is the continuation itself."""

from __future__ import annotations

from ..haystack import addresses
from .base import Item, rng_for


def fidelity(tokenizer, length: int, n: int, seed: int = 0, split: str = "eval", continuation: int = 32) -> list[Item]:
    docs = addresses(split)
    items = []
    for i in range(n):
        rng = rng_for("fidelity", length, seed, i)
        ids: list[int] = []
        while len(ids) < length + continuation:
            ids += tokenizer(" " + docs[rng.randrange(len(docs))][1], add_special_tokens=False)["input_ids"]
        start = rng.randrange(max(1, len(ids) - length - continuation))
        ctx = tokenizer.decode(ids[start : start + length])
        cont = tokenizer.decode(ids[start + length : start + length + continuation])
        items.append(Item("fidelity", f"fidelity-{length}-{seed}-{i}", ctx, "", [], continuation=cont))
    return items
