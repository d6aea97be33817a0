"""Several sweeps of the same question on different items (e.g. seeds 0, 1, 2) as one results file.

With a handful of items per task one item moves a score by many points; pooling sets that were run
separately (each one resumable and published on its own) gives the summary, and its paired-bootstrap
intervals, all the items at once. Only the cells (method, budget, task, length) scored in every set are
kept, so each method's mean at a budget, and its paired gap to another, is over the same items.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

from .budgets import parse_budget
from .runner import jsonl, load_result_file, row_key

Cell = tuple[str, str, str, int]  # method, budget key, task, length: what the summary averages over items
# what a method's score depends on beyond its items (the row key's protocol and prefill, runner.sweep_settings, the
# gates): sets that recorded other values are other setups, whose items one mean must not mix
SETUP_FIELDS = ("model", "protocol", "prefill", "split", "dtype", "max_new_tokens", "chunk", "chat_template_kwargs",
                "policy", "params", "gates_id")


def _cell(r: dict[str, Any]) -> Cell:
    return r["method"], r["budget"], r["task"], r["length"]


def _left_out(missing: dict[Cell, tuple[str, ...]], held: set[Cell]) -> list[str]:
    """One line per method and the sets it is missing from, for the cells not pooled (cell -> the sets without
    it; ``held``: every cell of any set): the whole method, some budgets, or a budget on some tasks only."""
    from .report import budget_label

    groups: dict[tuple[str, tuple[str, ...]], set[Cell]] = defaultdict(set)
    for c, sets in missing.items():
        groups[(c[0], sets)].add(c)
    lines = []
    for (method, sets), cells in sorted(groups.items()):
        why = f"missing from {', '.join(sets)}"
        mine = {c for c in held if c[0] == method}
        if cells == mine:
            lines.append(f"{method}: {why}")
            continue
        parts = []
        for b in sorted({c[1] for c in cells}, key=lambda b: -1.0 if b == "full" else parse_budget(b).value):
            at = {(c[2], c[3]) for c in cells if c[1] == b}
            parts.append(budget_label(b) if at == {(c[2], c[3]) for c in mine if c[1] == b}
                         else f"{budget_label(b)} on " + ", ".join(f"{t} ({n})" for t, n in sorted(at)))
        lines.append(f"{method} at {('; ' if any(' on ' in p for p in parts) else ', ').join(parts)}: {why}")
    return lines


def pool_rows(sets: dict[str, list[dict[str, Any]]],
              methods: list[str] | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """``(rows, left_out)``: the rows of every set (name -> rows) in the cells (method, budget, task, length)
    that all of them scored (of ``methods`` only, if given), each marked with its set (``pooled_from``), and
    one line per method saying what was left out and why. Raises ``ValueError`` naming the set and the fix when
    a set is empty, lacks a requested method, holds a row (same task, item, method, budget) that another set
    holds too (pooled items must be distinct: different seeds), scored a method with another setup than another set
    (:data:`SETUP_FIELDS`: model, protocol, gates...), or no cell is in every set."""
    if len(sets) < 2:
        raise ValueError("pooling needs two or more results files")
    if methods is not None and not methods:
        raise ValueError("--methods names no method: give comma-separated labels, or leave it out to keep every "
                         "method scored in all the files")
    for name, rows in sets.items():
        if not rows:
            raise ValueError(f"{name} holds no results")
    if methods is not None:
        for name, rows in sets.items():
            have = {r["method"] for r in rows}
            if missing := [m for m in methods if m not in have]:
                raise ValueError(f"{name} has no rows of {missing}: run those methods there, or leave them out of "
                                 "--methods")
    cells = {name: {_cell(r) for r in rows} for name, rows in sets.items()}
    held = set.union(*cells.values())
    wanted = {c for c in held if methods is None or c[0] in methods}
    # a cell one set lacks would average other items than the cells beside it (a 20% mean over one seed's items
    # against a full cache over all of them): only cells in every set are pooled
    keep = wanted.intersection(*cells.values())
    if not keep:
        raise ValueError("no (method, budget, task, length) is scored in every results file: nothing to pool")
    rows, seen = [], {}
    setup: dict[tuple[str, str], tuple[Any, str]] = {}  # (method, field) -> (value, the set that recorded it)
    for name, set_rows in sets.items():
        for r in set_rows:
            if _cell(r) not in keep:
                continue
            k = row_key(r)
            if k in seen and seen[k] != name:
                raise ValueError(f"{name} and {seen[k]} both hold {r['task']} item {r['item']!r} ({r['method']}, "
                                 f"{r['budget']}): pool sweeps of different items (another `seed:`)")
            seen[k] = name
            # a value a row does not record (rows from before it was) counts as the same, as a resumed sweep reads it
            for f in (f for f in SETUP_FIELDS if f in r):
                value, other = setup.setdefault((r["method"], f), (r[f], name))
                if r[f] != value:
                    raise ValueError(f"{name} scored {r['method']} with {f} {r[f]!r}, {other} with {value!r}: pool "
                                     "sweeps of the same setup on different items (another `seed:`), or leave the "
                                     "method out (--methods)")
            rows.append({**r, "pooled_from": name})
    left_out = [f"{m}: not in --methods" for m in sorted({c[0] for c in held - wanted})]
    left_out += _left_out({c: tuple(n for n, have in cells.items() if c not in have) for c in wanted - keep}, held)
    return rows, sorted(left_out)


def pooled_path(out: str | Path) -> Path:
    """The file ``--out`` names: ``out``, or the ``results.jsonl`` in it when it is a folder (an existing one, or
    a path ending in a slash), as ``report`` reads a sweep's folder."""
    text = str(out)
    return Path(out) / "results.jsonl" if text.endswith(("/", "\\")) or Path(out).is_dir() else Path(out)


def pool_results(paths: list[str | Path], out: str | Path, methods: list[str] | None = None,
                 check: Callable[[list[dict[str, Any]]], None] | None = None) -> tuple[Path, list[str]]:
    """Write the pooled rows of ``paths`` (results.jsonl files) to ``out`` (a folder: its results.jsonl);
    returns ``(the file written, what was left out)``, as :func:`pool_rows`. ``check`` sees the pooled rows
    before anything is written (its ValueError leaves ``out`` as it was)."""
    from retention.io import atomic_write_bytes

    out = pooled_path(out)
    if len({Path(p).resolve() for p in paths}) < len(paths):
        raise ValueError("a results file is given twice: pool sweeps of different items (another `seed:`)")
    if out.resolve() in {Path(p).resolve() for p in paths}:
        raise ValueError(f"--out {out} is one of the files to pool: it would be replaced by the pool; give a new file")
    rows, left_out = pool_rows({str(p): load_result_file(p) for p in paths}, methods)
    if check is not None:
        check(rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out, jsonl(rows).encode())
    return out, left_out
