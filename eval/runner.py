"""The sweep: model, gates, methods x budgets x lengths x tasks; results appended per item to JSONL so an
interrupted sweep resumes where it stopped. Configs are validated before any model loads."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from tqdm.auto import tqdm

from .methods import Method, run_item
from .tasks import TASKS


class EvalConfigError(ValueError):
    """A bad eval config: the message names the key and what is allowed."""


@dataclass
class EvalConfig:
    model: str = "smollm2-135m"
    gates: str | None = None
    output: str = "runs/eval/sweep"
    tasks: list[str] = field(default_factory=lambda: ["niah_single"])
    lengths: list[int] = field(default_factory=lambda: [1024])
    budgets: list[float] = field(default_factory=lambda: [0.1, 0.2])
    methods: list[dict[str, Any]] = field(default_factory=lambda: [{"name": "full"}, {"name": "snapkv"}])
    items: int = 5
    seed: int = 0
    split: str = "eval"
    protocol: str = "query_agnostic"
    prefill: str = "one_shot"
    chunk: int = 512
    max_new_tokens: int = 32

    def method_list(self) -> list[Method]:
        out = []
        for m in self.methods:
            params = dict(m.get("params") or {})
            label = m.get("label") or m["name"] + "".join(f"_{k}{v}" for k, v in sorted(params.items()))
            out.append(Method(m["name"], params, label))
        return out


def load_eval_config(path: str | Path) -> EvalConfig:
    from retention.policies import POLICIES, get_policy

    p = Path(path)
    if not p.is_file():
        alt = Path(__file__).parent / "configs" / p.name
        if not alt.is_file():
            raise EvalConfigError(f"eval config {str(path)!r} not found (also looked in {alt.parent})")
        p = alt
    data = yaml.safe_load(p.read_text()) or {}
    known = set(EvalConfig.__dataclass_fields__)
    unknown = sorted(set(data) - known)
    if unknown:
        raise EvalConfigError(f"unknown key(s) {unknown} in {p}; allowed: {sorted(known)}")
    cfg = EvalConfig(**data)
    bad = [t for t in cfg.tasks if t not in TASKS]
    if bad:
        raise EvalConfigError(f"tasks: unknown {bad}; available: {sorted(TASKS)}")
    for key, allowed in (("protocol", ("query_agnostic", "query_aware")), ("prefill", ("one_shot", "streaming")),
                         ("split", ("eval", "train"))):
        if getattr(cfg, key) not in allowed:
            raise EvalConfigError(f"{key} = {getattr(cfg, key)!r} is not allowed; choose one of {list(allowed)}")
    if any(not isinstance(b, (int, float)) or b <= 0 for b in cfg.budgets):
        raise EvalConfigError(f"budgets must be > 0 (< 1: fraction of the context, >= 1: tokens per KV head), got {cfg.budgets}")
    if any(not isinstance(n, int) or n < 16 for n in cfg.lengths) or cfg.items < 1:
        raise EvalConfigError("lengths must be integers >= 16 and items >= 1")
    for m in cfg.methods:
        if not isinstance(m, dict) or "name" not in m:
            raise EvalConfigError(f"each method needs a name, got {m!r}")
        if m["name"] not in POLICIES:
            raise EvalConfigError(f"methods: unknown policy {m['name']!r}; available: {sorted(POLICIES)}")
        get_policy(m["name"], **(m.get("params") or {}))  # parameter errors now, not mid-sweep
    return cfg


def _key(r: dict[str, Any]) -> tuple:
    return (r["task"], r["item"], r["length"], r["method"], r["budget"])


def read_results(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a results file; a torn last line (interrupted write) is skipped."""
    rows = []
    p = Path(path)
    if not p.is_file():
        return rows
    for line in p.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def run_sweep(cfg: EvalConfig, model_and_tokenizer: tuple | None = None) -> Path:
    """Run every (task, length, item, method, budget) not yet in ``<output>/results.jsonl``."""
    from retention import attach_gates, load_model
    from retention.hub import load_gates

    out_dir = Path(cfg.output)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = out_dir / "results.jsonl"
    if results.is_file():  # drop a line torn by an interruption, so appends start on a fresh line
        text = results.read_text()
        if text and not text.endswith("\n"):
            from retention.io import atomic_write_bytes

            atomic_write_bytes(results, text[: text.rfind("\n") + 1].encode())
    done = {_key(r) for r in read_results(results)}
    model, tok = model_and_tokenizer or load_model(cfg.model)
    tok = getattr(tok, "tokenizer", tok)
    if getattr(model, "retention", None) is None:
        gates = load_gates(cfg.gates, model=model) if cfg.gates else None
        attach_gates(model, gates, mode="score")
    model.retention.set_mode("score")
    methods = cfg.method_list()
    jobs = []
    for task in cfg.tasks:
        for length in cfg.lengths:
            for item in TASKS[task](tok, length, cfg.items, cfg.seed, cfg.split):
                for m in methods:
                    for b in ([None] if m.name == "full" else cfg.budgets):
                        row = {"task": task, "item": item.id, "length": length, "method": m.label, "budget": b}
                        if _key(row) not in done:
                            jobs.append((item, m, b, row))
    with open(results, "a") as fh:
        for item, m, b, row in tqdm(jobs, desc="eval", unit="item"):
            res = run_item(model, tok, item, m, b, protocol=cfg.protocol, prefill=cfg.prefill, chunk=cfg.chunk,
                           max_new_tokens=cfg.max_new_tokens)
            fh.write(json.dumps({**row, "policy": m.name, **res}) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
    return results
