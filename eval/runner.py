"""The sweep: tasks x lengths x items x methods x budgets, one JSONL row per scored item.

Rows are appended (and flushed) as they are produced, so an interrupted sweep resumes where it
stopped: items whose key is already in ``<output>/results.jsonl`` are skipped, and a line torn by the
interruption is dropped. Items are regenerated from their seeds, so a resumed sweep scores the same
items the first run did.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

from tqdm.auto import tqdm

from .config import EvalConfig
from .methods import PolicyCache
from .protocol import reference_logits, run_item
from .tasks import generate

KEY_FIELDS = ("task", "length", "item", "method", "budget", "protocol", "prefill")


def row_key(row: dict[str, Any]) -> tuple:
    return tuple(row.get(k) for k in KEY_FIELDS)


def read_results(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a results file; a torn line (an interrupted write) is skipped."""
    p = Path(path)
    if not p.is_file():
        return []
    rows = []
    for line in p.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def _drop_torn_tail(path: Path) -> None:
    """Cut a partial last line so the next append starts on a fresh line."""
    if not path.is_file():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(path, "r+b") as fh:
            fh.truncate(data.rfind(b"\n") + 1)


def _jobs(cfg: EvalConfig, tokenizer, done: set) -> Iterator[tuple]:
    methods, budgets = cfg.method_list(), cfg.budget_list()
    for spec in cfg.task_specs():
        for length in cfg.lengths:
            items = generate(spec.name, tokenizer, length, cfg.items, seed=cfg.seed, split=cfg.split,
                             source=cfg.source, **spec.params)
            for item in items:
                for m in methods:
                    for b in (budgets if m.uses_budget else [None]):
                        row = {"task": spec.name, "length": length, "item": item.id, "method": m.label,
                               "budget": "full" if b is None else b.key, "protocol": cfg.protocol, "prefill": cfg.prefill}
                        if row_key(row) not in done:
                            yield item, m, b, row


def prepare_model(cfg: EvalConfig, model, tokenizer):
    """Attach gates (score mode) when a policy method needs them; a model given already attached is kept."""
    if any(isinstance(m, PolicyCache) for m in cfg.method_list()) and getattr(model, "retention", None) is None:
        from retention import attach_gates

        gates = None
        if cfg.gates:
            from retention.hub import load_gates

            gates = load_gates(cfg.gates, model=model)
        attach_gates(model, gates, mode="score")
    return model, tokenizer


def run_sweep(cfg: EvalConfig, model_and_tokenizer: tuple | None = None, progress: bool = True) -> Path:
    """Run every job not yet in ``<output>/results.jsonl``; returns that path."""
    out_dir = Path(cfg.output)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = out_dir / "results.jsonl"
    _drop_torn_tail(results)
    done = {row_key(r) for r in read_results(results)}
    if model_and_tokenizer is None:
        from .models import load_eval_model

        model_and_tokenizer = load_eval_model(cfg.model, dtype=cfg.dtype, device=cfg.device, seed=cfg.seed)
    model, tok = prepare_model(cfg, *model_and_tokenizer)
    jobs = list(_jobs(cfg, tok, done))
    references: dict[str, Any] = {}  # fidelity: the full-context logits, once per item
    with open(results, "a") as fh:
        for item, method, budget, row in tqdm(jobs, desc=f"eval {out_dir.name}", unit="item", disable=not progress):
            ref = None
            if item.metric == "fidelity":
                if item.id not in references:
                    references.clear()  # jobs of one item are consecutive: keep one at a time
                    references[item.id] = reference_logits(model, item)
                ref = references[item.id]
            try:
                res = run_item(model, tok, item, method, budget, protocol=cfg.protocol, prefill_mode=cfg.prefill,
                               chunk=cfg.chunk, max_new_tokens=cfg.max_new_tokens, reference=ref)
            except ValueError as e:  # e.g. a budget below what the cache's options require
                if type(e).__name__ != "CacheBudgetError":
                    raise
                res = {"score": None, "error": str(e)}
            res = {**row, "policy": method.name, "metric": item.metric, "model": cfg.model, "seed": cfg.seed,
                   "split": cfg.split, **res}
            fh.write(json.dumps(res) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
    return results
