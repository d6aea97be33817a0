"""The machine-readable results of the GPU benchmarks: one JSON file that several benchmarks fill, each its own key.

``benchmarks/results/gpu.json`` holds ``{"device": ..., "attention": [...], "step": [...]}``: ``kernels.py --json``
writes ``attention``, ``train_step.py --json`` writes ``step``; a run replaces its own key and keeps the others.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def update(path: str | Path, key: str, rows: list[dict[str, Any]], device: str) -> None:
    """Set ``key`` to ``rows`` (and ``device``) in the JSON file at ``path``, written atomically."""
    path = Path(path)
    data: dict[str, Any] = {}
    if path.exists():
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not JSON ({e}); move it aside or name another --json file") from None
    data["device"] = device
    data[key] = rows
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
