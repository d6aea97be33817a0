"""Rename the labels of a sweep's rows in place, once, when a candidate ships (python relabel.py OUTPUT...).

When candidate 1 shipped as checkpoints/smollm2-135m-global, its rows (label ``mixture1_sink4``) became what
``smollm2-general.yaml``'s ``global_gates_sink4`` scores: the same policy, parameters, gates, items and settings. The
rows of the gates it replaced (``global_gates_sink4`` until then) become ``previous_gates_sink4``
(``candidates.yaml``). Each row's ``gates_id`` names the gates that scored it, so a resumed sweep checks the relabelled
rows against the config's gates and scores again any that do not match. A folder whose rows were relabelled already is
left as it is.
"""

from __future__ import annotations

import sys
from pathlib import Path

from retention.eval.runner import jsonl, read_results
from retention.io import atomic_write_bytes, exclusive_use

SHIPPED, PREVIOUS = "b9f2ddc9e7b3", "b49312ce5b7a"  # gates_id of candidate 1 and of the gates it replaced
RENAME = {("mixture1_sink4", SHIPPED): "global_gates_sink4", ("global_gates_sink4", PREVIOUS): "previous_gates_sink4"}


def relabel(folder: Path) -> int:
    with exclusive_use(folder, "a relabel"):  # not under a running sweep
        rows = read_results(folder / "results.jsonl")
        moved = 0
        for r in rows:
            new = RENAME.get((r.get("method"), r.get("gates_id")))
            if new:
                r["method"], moved = new, moved + 1
        atomic_write_bytes(folder / "results.jsonl", jsonl(rows).encode())
    return moved


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(f"{arg}: {relabel(Path(arg))} rows relabelled")
