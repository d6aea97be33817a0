"""Task generators: seeded, any target length in tokens, any tokenizer. ``TASKS[name](tokenizer, length, n, seed, split)``."""

from .base import Item
from .dialogue import dialogue_memory
from .fidelity import fidelity
from .qa import document_qa
from .ruler import common_words, multi_key_needle, multi_query_needle, multi_value_needle, single_needle, variable_tracking

TASKS = {
    "niah_single": single_needle,
    "niah_multikey": multi_key_needle,
    "niah_multivalue": multi_value_needle,
    "niah_multiquery": multi_query_needle,
    "variable_tracking": variable_tracking,
    "common_words": common_words,
    "document_qa": document_qa,
    "dialogue_memory": dialogue_memory,
    "fidelity": fidelity,
}

__all__ = ["Item", "TASKS"]
