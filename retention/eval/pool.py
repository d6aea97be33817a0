"""Several sweeps of the same question on different items (e.g. seeds 0, 1, 2) as one results file.

With a handful of items per task one item moves a score by many points; pooling sets that were run
separately (each one resumable and published on its own) gives the summary, and its paired-bootstrap
intervals, all the items at once. Only methods scored in every set are kept, so each method's mean is
over the same items.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .runner import jsonl, load_result_file, row_key


def pool_rows(sets: dict[str, list[dict[str, Any]]],
              methods: list[str] | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """``(rows, dropped)``: the rows of every set (name -> rows) of the methods scored in all of them
    (or of ``methods``), each marked with its set (``pooled_from``), and the methods left out. Raises
    ``ValueError`` naming the set and the fix when a set is empty, lacks a requested method, or holds a
    row (same task, item, method, budget) that another set holds too: pooled items must be distinct
    (different seeds)."""
    if len(sets) < 2:
        raise ValueError("pooling needs two or more results files")
    for name, rows in sets.items():
        if not rows:
            raise ValueError(f"{name} holds no results")
    present = {name: {r["method"] for r in rows} for name, rows in sets.items()}
    common = set.intersection(*present.values())
    if methods is not None:
        for name, have in present.items():
            if missing := [m for m in methods if m not in have]:
                raise ValueError(f"{name} has no rows of {missing}: run those methods there, or leave them out of "
                                 "--methods")
        keep = set(methods)
    else:
        keep = common
    if not keep:
        raise ValueError("no method is scored in every results file: nothing to pool")
    rows, seen = [], {}
    for name, set_rows in sets.items():
        for r in set_rows:
            if r["method"] not in keep:
                continue
            k = row_key(r)
            if k in seen and seen[k] != name:
                raise ValueError(f"{name} and {seen[k]} both hold {r['task']} item {r['item']!r} ({r['method']}, "
                                 f"{r['budget']}): pool sweeps of different items (another `seed:`)")
            seen[k] = name
            rows.append({**r, "pooled_from": name})
    dropped = sorted(set.union(*present.values()) - keep)
    return rows, dropped


def pool_results(paths: list[str | Path], out: str | Path, methods: list[str] | None = None) -> tuple[Path, list[str]]:
    """Write the pooled rows of ``paths`` (results.jsonl files) to ``out``; returns ``(out, dropped methods)``."""
    from retention.io import atomic_write_bytes

    if len({Path(p).resolve() for p in paths}) < len(paths):
        raise ValueError("a results file is given twice: pool sweeps of different items (another `seed:`)")
    if Path(out).resolve() in {Path(p).resolve() for p in paths}:
        raise ValueError(f"--out {out} is one of the files to pool: it would be replaced by the pool; give a new file")
    rows, dropped = pool_rows({str(p): load_result_file(p) for p in paths}, methods)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out, jsonl(rows).encode())
    return out, dropped
