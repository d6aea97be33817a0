"""Score a sweep's stored replies again under the current metrics, without running the model.

A metric fix (say ``recall`` no longer finding a needle inside a longer number) changes the scores of rows already on
disk. ``python -m retention.eval rescore RESULTS --config CFG`` regenerates the items of the config's tasks (the
tokenizer only: seconds), for every seed and split the rows name, checks each row's item is the one it was scored on
(its recorded ``item_sha``), scores the stored reply again with the item's metric and its answers, and rewrites the
file atomically. Rows scored without a reply (fidelity: logits against the full cache) and failed rows stay as they
are. Pooled files (rows of several seeds) rescore in place, or rescore each set and pool again.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from statistics import fmean
from typing import Any

from .config import EvalConfig
from .metrics import score_reply
from .runner import item_sha, jsonl, load_result_file, task_items

ItemKey = tuple[str, int, str]  # task, length, item id


def _generated_index(item_id: str) -> tuple[int, int] | None:
    """``(seed, i)`` of a generated item's id (``task-split-length-seed-i``); None for other ids (a Hub set's)."""
    parts = item_id.rsplit("-", 2)
    if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
        return int(parts[1]), int(parts[2])
    return None


def regenerate_items(cfg: EvalConfig, rows: list[dict[str, Any]], tokenizer: Any) -> dict[ItemKey, Any]:
    """The items ``rows`` were scored on, by (task, length, id), generated from ``cfg``'s tasks under every seed and
    split the rows name (as many items as the highest index asks); a Hub task's items as the config loads them."""
    specs = {s.name: s for s in cfg.task_specs()}
    wanted: dict[tuple[str, int, int, str], int] = {}  # (task, length, seed, split) -> items to generate
    for r in rows:
        at = _generated_index(r["item"])
        if r["task"] in specs and at is not None:
            key = (r["task"], r["length"], at[0], r.get("split", cfg.split))
            wanted[key] = max(wanted.get(key, 0), at[1] + 1)
    items: dict[ItemKey, Any] = {}
    for (task, length, seed, split), n in sorted(wanted.items()):
        for item in task_items(replace(cfg, seed=seed, split=split, items=n), specs[task], tokenizer, length):
            items[(task, length, item.id)] = item
    from .loaders import HUB_TASKS

    for spec in specs.values():  # a Hub set names its subsets as the rows' tasks
        if spec.name in HUB_TASKS:
            for length in cfg.lengths:
                for item in task_items(cfg, spec, tokenizer, length):
                    items[(item.task, length, item.id)] = item
    return items


def _has_reply(row: dict[str, Any]) -> bool:
    """Whether a row's score was made from its stored reply (not from logits, as fidelity's; not a failed row)."""
    return row.get("score") is not None and row.get("metric") != "fidelity" and "reply" in row


def rescore_rows(rows: list[dict[str, Any]], items: dict[ItemKey, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """``rows`` with every stored reply scored again by its item's metric; and a line per changed row. ValueError
    naming the fix when a row's item is not among ``items`` or is another text than the row was scored on."""
    out, changed, missing, other = [], [], [], []
    for r in rows:
        if not _has_reply(r):
            out.append(r)  # logits, not a reply, made its score (or it failed): nothing to score again
            continue
        item = items.get((r["task"], r["length"], r["item"]))
        if item is None or r.get("item_sha", sha := item_sha(item)) != sha:  # rows without a sha pass
            (missing if item is None else other).append(r["item"])
            out.append(r)
            continue
        score = score_reply(item.metric, r["reply"], item.answers)
        if score != r["score"]:
            changed.append(f"{r['task']} {r['item']} {r['method']} {r['budget']}: {r['score']:.1f} -> {score:.1f} "
                           f"(reply {r['reply'][:48]!r}, answers {item.answers})")
        out.append({**r, "score": score})
    if missing or other:
        said = (f"{len(missing)} rows name items the config does not generate (e.g. {missing[0]!r})" if missing
                else f"{len(other)} rows were scored on other text under the same ids (e.g. {other[0]!r}: other task "
                     "params, haystack source or generator)")
        raise ValueError(f"{said}: give the eval config that produced these rows (--config)")
    return out, changed


def cell_means(rows: list[dict[str, Any]]) -> dict[tuple, float]:
    """Mean score per (task, length, method, budget) over the scored rows."""
    cells: dict[tuple, list[float]] = defaultdict(list)
    for r in rows:
        if r.get("score") is not None:
            cells[(r["task"], r["length"], r["method"], r["budget"])].append(r["score"])
    return {k: fmean(v) for k, v in cells.items()}


def rescore_results(path: str | Path, cfg: EvalConfig, tokenizer: Any,
                    write: bool = True) -> tuple[list[str], list[str]]:
    """Rescore the results file at ``path`` (see the module docstring); returns a line per changed row and a line per
    (task, length, method, budget) whose mean moved. With ``write`` the file is replaced atomically when a score
    changed."""
    from retention.io import atomic_write_bytes

    rows = load_result_file(path)
    replies = [r for r in rows if _has_reply(r)]  # only their items are generated: fidelity's take longest
    new, changed = rescore_rows(rows, regenerate_items(cfg, replies, tokenizer))
    before, after = cell_means(rows), cell_means(new)
    moved = [f"{' '.join(map(str, k))}: {before[k]:.2f} -> {after[k]:.2f}" for k in sorted(before, key=str)
             if abs(after[k] - before[k]) > 1e-9]
    if changed and write:
        atomic_write_bytes(path, jsonl(new).encode())
    return changed, moved
