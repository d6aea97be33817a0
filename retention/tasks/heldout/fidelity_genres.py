"""Fidelity on the held-out genres: :func:`retention.tasks.fidelity.fidelity` over news or Wikipedia prose, under a
task name of its own so its rows stand beside the in-distribution fidelity rows, never pooled with them."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from ..base import Item
from ..fidelity import fidelity

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def _genre(genre: str, tokenizer: PreTrainedTokenizerBase, length: int, n: int, seed: int,
           continuation: int) -> list[Item]:
    task = f"fidelity_{genre}"
    return [replace(it, task=task, id=it.id.replace("fidelity-", f"{task}-", 1))
            for it in fidelity(tokenizer, length, n, seed=seed, split="eval", source=genre, continuation=continuation)]


def fidelity_news(tokenizer: PreTrainedTokenizerBase, length: int, n: int, seed: int = 0, split: str = "eval",
                  source: str = "auto", continuation: int = 32) -> list[Item]:
    """Fidelity on news articles (the Lee corpus). ``split``/``source`` are ignored: the genre is held out."""
    return _genre("news", tokenizer, length, n, seed, continuation)


def fidelity_wiki(tokenizer: PreTrainedTokenizerBase, length: int, n: int, seed: int = 0, split: str = "eval",
                  source: str = "auto", continuation: int = 32) -> list[Item]:
    """Fidelity on Wikipedia articles. ``split``/``source`` are ignored: the genre is held out."""
    return _genre("wiki", tokenizer, length, n, seed, continuation)
