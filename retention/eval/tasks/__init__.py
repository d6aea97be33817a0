"""Task generators: seeded, any target length in tokens, any tokenizer, real-text haystacks.

Every generator has the signature ``gen(tokenizer, length, n, seed=0, split="eval", source="auto",
**params) -> list[Item]``; ``split`` picks the evaluation or training pool of documents and, with
``seed``, makes the items reproducible. ``length`` is the size of the part that gets compressed (the
context, or the conversation so far), in tokens of ``tokenizer``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .base import Item
from .dialogue import dialogue_memory
from .fidelity import fidelity
from .image_memory import image_memory
from .niah import multi_key_needle, multi_query_needle, multi_value_needle, single_needle
from .qa import document_qa
from .variable_tracking import variable_tracking
from .words import common_words, frequent_words

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TASKS = {
    "niah_single": single_needle,
    "niah_multikey": multi_key_needle,
    "niah_multivalue": multi_value_needle,
    "niah_multiquery": multi_query_needle,
    "variable_tracking": variable_tracking,
    "common_words": common_words,
    "frequent_words": frequent_words,
    "document_qa": document_qa,
    "dialogue_memory": dialogue_memory,
    "fidelity": fidelity,
    # vision-language models: photos early in a dialogue (retention.eval.multimodal runs it)
    "image_memory": image_memory,
}


def generate(task: str, tokenizer: PreTrainedTokenizerBase, length: int, n: int, seed: int = 0, split: str = "eval",
             source: str = "auto", **params: Any) -> list[Item]:
    """Items of a task by name (``params``: the task's own options, e.g. ``keys=8`` for ``niah_multikey``)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; available: {sorted(TASKS)}")
    return TASKS[task](tokenizer, length, n, seed=seed, split=split, source=source, **params)


__all__ = ["Item", "TASKS", "generate"]
