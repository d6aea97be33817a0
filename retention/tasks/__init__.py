"""Task generators: seeded, any target length in tokens, any tokenizer, real-text haystacks.

Shared by training (``data.sources`` of kind ``synthetic``) and evaluation, so both import them from here, below
either (``retention.eval.tasks`` is the same package under its former name).

Every generator has the signature ``gen(tokenizer, length, n, seed=0, split="eval", source="auto",
**params) -> list[Item]``; ``split`` picks the evaluation or training pool of documents and, with
``seed``, makes the items reproducible. ``length`` is the size of the part that gets compressed (the
context, or the conversation so far), in tokens of ``tokenizer``.
"""

from __future__ import annotations

import inspect
import numbers
from typing import TYPE_CHECKING, Any

from .base import KEYS, Item
from .dialogue import dialogue_memory
from .facts import varied_facts
from .fidelity import fidelity
from .heldout.fidelity_genres import fidelity_news, fidelity_wiki
from .heldout.late_recall import late_recall
from .heldout.prose_facts import prose_facts
from .heldout.records import records
from .heldout.ruler_niah import ruler_niah
from .heldout.span_cloze import span_cloze
from .image_memory import image_memory
from .niah import multi_key_needle, multi_query_needle, multi_value_needle, single_needle
from .package_records import package_records
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
    "varied_facts": varied_facts,  # training's fact source of many phrasings (issue 74)
    "package_records": package_records,  # training's records: Debian changelogs and copyright files (issue 74)
    # vision-language models: photos early in a dialogue (retention.eval.multimodal runs it)
    "image_memory": image_memory,
    # held-out families (retention.tasks.heldout): evaluation only, training refuses them
    "prose_facts": prose_facts,
    "records": records,
    "late_recall": late_recall,
    "ruler_niah": ruler_niah,
    "span_cloze": span_cloze,
    "fidelity_news": fidelity_news,
    "fidelity_wiki": fidelity_wiki,
}
HELD_OUT_TASKS = ("prose_facts", "records", "late_recall", "ruler_niah", "span_cloze", "fidelity_news",
                  "fidelity_wiki")
# the fidelity tasks: a continuation scored against the full cache, no question
FIDELITY_TASKS = ("fidelity", "fidelity_news", "fidelity_wiki")


# the counts a task's options may take, (least, most): outside them a generator failed deep inside (rng.sample's
# "Sample larger than population"), or drew items with no answer that failed only when scored, after the model ran;
# one query made "numbers for  and walnut"
_COUNTS: dict[str, dict[str, tuple[int, int | None]]] = {
    "niah_multikey": {"keys": (1, len(KEYS))},
    "niah_multivalue": {"values": (1, None)},
    "niah_multiquery": {"queries": (2, len(KEYS))},
    "variable_tracking": {"hops": (0, None)},
    "common_words": {"top": (1, None)},
    "frequent_words": {"top": (1, None), "vocab_size": (2, None)},
    "document_qa": {"sections": (1, None)},
    "dialogue_memory": {"facts": (1, 4)},
    "fidelity": {"continuation": (1, None)},
    "fidelity_news": {"continuation": (1, None)},
    "fidelity_wiki": {"continuation": (1, None)},
    "prose_facts": {"facts": (1, 5)},
    "varied_facts": {"facts": (0, 4)},
    "ruler_niah": {"keys": (1, 50)},
}
_COMMON = ("tokenizer", "length", "n", "seed", "split", "source")


def check_params(task: str, params: dict[str, Any]) -> None:
    """ValueError naming the problem and the task's options for an unknown task, an option it does not take, or a
    count out of its range; nothing to load, so a config can check its tasks before a model loads."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; available: {sorted(TASKS)}")
    signature = inspect.signature(TASKS[task]).parameters
    options = [p for p in signature if p not in _COMMON]
    unknown = sorted(set(params) - set(options))
    if unknown:
        raise ValueError(f"{task} takes no option {', '.join(map(repr, unknown))}; its options: "
                         f"{', '.join(options) or 'none'}")
    for name, (least, most) in _COUNTS.get(task, {}).items():
        value = params.get(name)
        if value is None:
            continue
        whole = isinstance(value, numbers.Integral) and not isinstance(value, bool)
        if not whole or value < least or (most and value > most):
            span = f"from {least} to {most}" if most else f"{least} or more"
            hint = " (one key: niah_single)" if (task, name) == ("niah_multiquery", "queries") else ""
            raise ValueError(f"{task}: {name} must be a whole number {span}{hint}, got {value!r}")
    if task == "frequent_words":  # the answer is the top words of vocab_size, and one more is read to rank them
        top, size = (params.get(k, signature[k].default) for k in ("top", "vocab_size"))
        if top >= size:
            raise ValueError(f"frequent_words: top ({top}) must be below vocab_size ({size})")


def generate(task: str, tokenizer: PreTrainedTokenizerBase, length: int, n: int, seed: int = 0, split: str = "eval",
             source: str = "auto", **params: Any) -> list[Item]:
    """Items of a task by name (``params``: the task's own options, e.g. ``keys=8`` for ``niah_multikey``)."""
    check_params(task, params)
    try:
        return TASKS[task](tokenizer, length, n, seed=seed, split=split, source=source, **params)
    except ValueError as e:  # shared helpers (fit_length, the dialogue turns) do not know which task of a sweep failed
        if str(e).startswith(f"{task}:"):
            raise
        raise ValueError(f"{task}: {e}") from None


__all__ = ["FIDELITY_TASKS", "HELD_OUT_TASKS", "Item", "TASKS", "check_params", "generate"]
