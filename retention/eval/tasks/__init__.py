"""The task generators' former home: they are :mod:`retention.tasks` now (shared by training and evaluation).

This package keeps old imports working: ``retention.eval.tasks`` and its submodules (``retention.eval.tasks.base``,
...) are the modules of :mod:`retention.tasks` under that name.
"""

import importlib
import sys

from retention.tasks import TASKS, Item, check_params, generate

_MOVED = ("base", "dialogue", "fidelity", "image_memory", "niah", "qa", "variable_tracking", "words")
for _name in _MOVED:  # one module object under both names: a patch through either reaches the other
    sys.modules[f"{__name__}.{_name}"] = importlib.import_module(f"retention.tasks.{_name}")

__all__ = ["Item", "TASKS", "check_params", "generate"]
