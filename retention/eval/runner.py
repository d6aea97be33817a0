"""The sweep: tasks x lengths x items x methods x budgets, one JSONL row per scored item.

Rows are appended (and flushed) as they are produced, so an interrupted sweep resumes where it
stopped: items whose key is already in ``<output>/results.jsonl`` are skipped, and a line torn by the
interruption is dropped. Items are regenerated from their seeds, so a resumed sweep scores the same
items the first run did.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from tqdm.auto import tqdm

from retention.attach import unwrap
from retention.models import is_multimodal
from retention.tasks import FIDELITY_TASKS, TASKS, Item, generate
from retention.tasks.base import count_tokens, render_chat

from .config import EvalConfig, EvalConfigError, TaskSpec
from .loaders import HUB_TASKS, hub_task_items
from .methods import Method, PolicyCache
from .models import max_positions
from .multimodal import (IMAGE_TASKS, check_images, is_multimodal_item, run_chat_item_budgets, shared_history,
                         shares_history)
from .protocol import SharedPrefill, context_and_prompt, reference_logits, run_item_budgets, shareable

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, ProcessorMixin

KEY_FIELDS = ("task", "length", "item", "method", "budget", "protocol", "prefill")


def row_key(row: dict[str, Any]) -> tuple:
    return tuple(row.get(k) for k in KEY_FIELDS)


def read_results(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a results file; a torn line (an interrupted write) is skipped."""
    p = Path(path)
    if not p.is_file():
        return []
    rows = []
    for line in p.read_text(errors="replace").splitlines():  # a line damaged on disk is no row either
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


ROW_FIELDS = ("task", "length", "item", "method", "budget", "score")  # what every report and pool reads


def results_file(path: str | Path) -> Path:
    """The results file a user names: ``path`` itself, or the ``results.jsonl`` of a sweep's output folder."""
    p = Path(path)
    return p / "results.jsonl" if p.is_dir() and (p / "results.jsonl").is_file() else p


def load_result_file(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a results file a user names (``report``, ``pool``): FileNotFoundError or ValueError naming the file,
    the line and the fix when it is missing or is not a sweep's rows. A torn last line (a sweep still writing, or
    interrupted) is left out, as :func:`read_results` does."""
    p = Path(path)
    if p.is_dir():
        raise FileNotFoundError(f"{p} is a folder without a results.jsonl: give a sweep's output folder or its "
                                "results.jsonl (or a published copy of one)")
    if not p.is_file():
        raise FileNotFoundError(f"{p} not found: give the results.jsonl of a sweep (or its published copy)")
    data = p.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ValueError(f"{p}, line {line}: not UTF-8 text; a results file holds one "
                         f"JSON row per line (resuming its sweep moves such lines to {p.name}.bad)") from None
    lines = text.splitlines()
    rows = []
    for i, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            # rows are written whole with their newline, so only an unterminated last line that starts as a row can
            # be torn; any other line that is not JSON means the file is something else
            if i == len(lines) and not text.endswith("\n") and line.lstrip().startswith("{"):
                continue  # torn by an interrupted write
            raise ValueError(f"{p}, line {i}: not JSON; a results file holds one JSON row per line (resuming its "
                             f"sweep moves such lines to {p.name}.bad)") from None
        missing = [k for k in ROW_FIELDS if not isinstance(row, dict) or k not in row]
        if missing:
            raise ValueError(f"{p}, line {i}: a row without {', '.join(missing)}; is this the results.jsonl of an "
                             "eval sweep (python -m retention.eval run)?")
        rows.append(row)
    return rows


def jsonl(rows: list[dict[str, Any]]) -> str:
    """Rows as results-file text: one JSON object per line, the inverse of :func:`read_results`."""
    return "".join(json.dumps(r) + "\n" for r in rows)


def _drop_torn_tail(path: Path) -> None:
    """Cut a partial last line so the next append starts on a fresh line."""
    if not path.is_file():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(path, "r+b") as fh:
            fh.truncate(data.rfind(b"\n") + 1)


def _is_row(line: bytes) -> bool:
    """Whether a line of a results file is a row that ``report`` and ``pool`` read (:func:`load_result_file`)."""
    try:
        row = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(row, dict) and all(k in row for k in ROW_FIELDS)


def _set_aside_bad_lines(path: Path) -> list[int]:
    """Move the lines of ``path`` that are no row (damaged on disk, or edited by hand) to ``<name>.bad`` beside it
    (appended, so nothing is lost) and rewrite ``path`` without them, atomically, with a warning naming the lines: a
    resumed sweep scores their items again, and ``report`` and ``pool``, which refuse such a file, read it again.
    Call it while holding the output folder. Returns the line numbers moved."""
    if not path.is_file():
        return []
    lines = path.read_bytes().splitlines(keepends=True)
    bad = [n for n, line in enumerate(lines, 1) if not _is_row(line)]
    if not bad:
        return []
    from retention.io import atomic_write_bytes

    aside = path.with_name(path.name + ".bad")
    with open(aside, "ab") as fh:  # first, so a crash before the rewrite loses nothing
        fh.write(b"".join(lines[n - 1].rstrip(b"\r\n") + b"\n" for n in bad))
        fh.flush()
        os.fsync(fh.fileno())
    drop = set(bad)
    atomic_write_bytes(path, b"".join(line for n, line in enumerate(lines, 1) if n not in drop))
    shown = ", ".join(map(str, bad[:10])) + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
    log.warning(f"{path}, line{'s' if len(bad) > 1 else ''} {shown}: not a row (damaged or edited); moved "
          f"to {aside}, and their items are scored again")
    return bad


def sweep_settings(cfg: EvalConfig) -> dict[str, Any]:
    """What a row's score depends on beyond its key (task, length, item, method, budget, protocol, prefill)
    and its gates: each row records these, and a resumed sweep rescores rows that recorded other values."""
    return {"model": cfg.model, "dtype": cfg.dtype or "float32", "max_new_tokens": cfg.max_new_tokens,
            "chunk": cfg.chunk, "chat_template_kwargs": cfg.chat_template_kwargs}


def item_sha(item: Item) -> str:
    """A short hash of what an item shows the model and scores against: task params, haystack source or a
    changed generator make other items under the same id."""
    shown = [item.meta["images"]] if item.meta.get("images") else []  # a dialogue's image files
    text = json.dumps([item.context, item.question, item.answers, item.messages, item.continuation,
                       item.answer_prefix, item.metric, item.max_new_tokens, *shown], sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def method_spec(method: Method) -> dict[str, Any]:
    """What a method's label stands for: its policy and parameters, recorded in each row (a label is the user's
    name for a method, so an edited config can give it another policy or other parameters)."""
    return {"policy": method.name, "params": json.loads(json.dumps(method.params, sort_keys=True, default=str))}


def _set_aside_stale(results: Path, gate_ids: dict[str, str | None], settings: dict[str, Any],
                     item_shas: dict[tuple, str],
                     specs: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The rows of ``results`` a resumed sweep may keep. A row scored with other gates than its method has now
    (say the shipped checkpoint changed), by another policy or parameters under the same label (``specs``:
    :func:`method_spec` of each label), with other settings (:func:`sweep_settings`: another model,
    ``max_new_tokens``...) or on another item under the same id (:func:`item_sha`) moves to
    ``results.replaced.jsonl`` and is scored again, so one table never mixes two setups. A value a row does not
    record (rows from before it was recorded) counts as the same."""
    def changes(r: dict[str, Any]) -> list[str]:
        found = []
        now = gate_ids.get(r.get("method"))
        if now and r.get("gates_id", now) != now:
            found.append(f"{r['method']} gates ({r['gates_id']} -> {now})")
        spec = (specs or {}).get(r.get("method"), {})
        found += [f"{r['method']} {k} ({r[k]!r} -> {v!r})" for k, v in spec.items() if k in r and r[k] != v]
        found += [f"{k} ({r[k]!r} -> {v!r})" for k, v in settings.items() if k in r and r[k] != v]
        sha = item_shas.get((r.get("task"), r.get("length"), r.get("item")))
        if sha and r.get("item_sha", sha) != sha:
            found.append(f"{r['task']} items (other text under the same ids: task params, source or generator)")
        return found

    rows = read_results(results)
    stale = {i: c for i, r in enumerate(rows) if (c := changes(r))}
    if stale:
        from retention.io import atomic_write_bytes

        aside = results.with_name("results.replaced.jsonl")
        with open(aside, "a") as fh:
            fh.write(jsonl([rows[i] for i in stale]))
        rows = [r for i, r in enumerate(rows) if i not in stale]
        atomic_write_bytes(results, jsonl(rows).encode())
        named = sorted({c for cs in stale.values() for c in cs})
        log.info(f"{len(stale)} rows were scored with another setup than this config's: {'; '.join(named)}; "
              f"moved to {aside} and scored again")
    return rows


def task_items(cfg: EvalConfig, spec: TaskSpec, tokenizer: Any, length: int) -> list[Item]:
    """A task's items at one length: generated from the config's seed, or ``items`` records of a Hub set."""
    if spec.name in HUB_TASKS:
        return hub_task_items(spec.name, tokenizer, length, cfg.items, **spec.params)
    return generate(spec.name, tokenizer, length, cfg.items, seed=cfg.seed, split=cfg.split, source=cfg.source,
                    **spec.params)


def _sweep_items(cfg: EvalConfig, tokenizer) -> list[tuple[str, int, Any]]:
    """``(task, length, item)`` of the whole sweep, in order; a Hub set's rows name its subset as their task. MMDU's
    dialogues run whole, once, under the first length."""
    return [(item.task if spec.name in HUB_TASKS else spec.name, length, item)
            for spec in cfg.task_specs() for length in (cfg.lengths[:1] if spec.name == "mmdu" else cfg.lengths)
            for item in task_items(cfg, spec, tokenizer, length)]


def _jobs(cfg: EvalConfig, items: list[tuple[str, int, Any]], done: set) -> Iterator[tuple]:
    """``(item, method, budgets, rows)`` still to run: the budgets of one (item, method) go together,
    so a one-shot prefill is shared by all of them (see :func:`retention.eval.protocol.run_item_budgets`)."""
    methods, budgets = cfg.method_list(), cfg.budget_list()
    for task, length, item in items:
        for m in methods:
            todo = []
            for b in (budgets if m.uses_budget else [None]):
                row = {"task": task, "length": length, "item": item.id, "method": m.label,
                       "budget": "full" if b is None else b.key, "protocol": cfg.protocol, "prefill": cfg.prefill}
                if row_key(row) not in done:
                    todo.append((b, row))
            if todo:
                yield item, m, [b for b, _ in todo], [r for _, r in todo]


def prepare_model(
    cfg: EvalConfig, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | ProcessorMixin
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | ProcessorMixin]:
    """Attach gates (score mode) when a policy method needs them; a model given already attached is kept."""
    if any(isinstance(m, PolicyCache) for m in cfg.method_list()) and getattr(model, "retention", None) is None:
        from retention import attach_gates
        from retention.gates import UNTRAINED_SEED
        from retention.hub import load_gates
        from retention.models import shipped_gates

        source = shipped_gates(model) if cfg.gates is None else None if cfg.gates == "untrained" else cfg.gates
        gates = None if source is None else load_gates(source, model=model)
        attach_gates(model, gates, mode="score", seed=None if gates is not None else UNTRAINED_SEED)
        log.info(f"gates: {source or 'untrained (beta ~ 1 with a little seeded noise: nearly recency only)'}")
    for m in cfg.method_list():  # a method's own gates: fail now, not hours into the sweep
        if getattr(m, "gates", None):
            try:
                m.own_gates(model)  # loaded now and kept by the method for the sweep
            except Exception as e:
                raise RuntimeError(f"method {m.label}: cannot load its gates {m.gates!r}: {e}") from None
    if cfg.chat_template_kwargs:  # every prompt of the sweep renders with them (a copy: the caller's stays as it was)
        from retention.templates import with_template_variables

        tokenizer = with_template_variables(tokenizer, cfg.chat_template_kwargs)
    return model, tokenizer


def _check_one_protocol(cfg: EvalConfig, results: Path) -> None:
    """An output holds rows of one protocol: its report's tables would average a live budget with a frozen one."""
    if not results.is_file():
        return
    found = set()
    for line in results.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            found.add(json.loads(line).get("protocol"))
        except (ValueError, AttributeError):  # a damaged line: set aside later, with a warning
            continue
    other = sorted(str(p) for p in found - {cfg.protocol, None})
    if other:
        raise EvalConfigError(f"{results} holds rows of protocol {', '.join(other)} and this sweep is {cfg.protocol}: "
                              "one output holds one protocol (its tables would mix them); give this sweep another "
                              "output (--output DIR)")


def run_sweep(cfg: EvalConfig, model_and_tokenizer: tuple | None = None, progress: bool = True) -> Path:
    """Run every job not yet in ``<output>/results.jsonl``; returns that path. A second sweep into the same output
    while this one runs gets :class:`~retention.io.FolderBusyError` (its rows would interleave with these)."""
    from retention.io import exclusive_use

    with exclusive_use(cfg.output, "a sweep"):
        return _run_sweep(cfg, model_and_tokenizer, progress)


def _run_sweep(cfg: EvalConfig, model_and_tokenizer: tuple | None, progress: bool) -> Path:
    out_dir = Path(cfg.output)
    results = out_dir / "results.jsonl"
    from retention.commands import check_gates_source

    # a typo or a damaged checkpoint fails before the model loads
    found = [g for source in [cfg.gates, *(getattr(m, "gates", None) for m in cfg.method_list())]
             if (g := check_gates_source(source)) is not None]
    for spec in cfg.task_specs():  # a Hub set downloads (or fails offline) before the model loads
        if spec.name in HUB_TASKS:
            for length in cfg.lengths if spec.name == "ruler" else cfg.lengths[:1]:
                check_images(hub_task_items(spec.name, None, length, cfg.items, **spec.params))
    from .models import eval_model_config, load_eval_model

    # the model's config, not its weights: a model that cannot load, or cannot run the config, fails first
    config = eval_model_config(cfg.model) if model_and_tokenizer is None else unwrap(model_and_tokenizer[0]).config
    from retention.attach import check_gates_shape, text_config

    for gates in found:  # gates of another model's shapes: from the config, before the weights load
        check_gates_shape(text_config(config), gates.config)
    _check_shows_images(cfg, config)
    _check_lengths_fit(cfg, config)
    _check_one_protocol(cfg, results)
    if model_and_tokenizer is None:
        model_and_tokenizer = load_eval_model(cfg.model, dtype=cfg.dtype, device=cfg.device, seed=cfg.seed)
    model, processor = prepare_model(cfg, *model_and_tokenizer)
    tok = getattr(processor, "tokenizer", processor)  # a vision-language model's processor holds its tokenizer
    gate_ids = {m.label: m.gates_id(model) for m in cfg.method_list()}
    settings = sweep_settings(cfg)
    items = _sweep_items(cfg, tok)
    _check_items_fit(cfg, items, tok, config)
    # the folder only now: a sweep refused above leaves no empty output folder behind
    out_dir.mkdir(parents=True, exist_ok=True)
    _drop_torn_tail(results)
    _set_aside_bad_lines(results)
    shas = {(task, length, item.id): item_sha(item) for task, length, item in items}
    specs = {m.label: method_spec(m) for m in cfg.method_list()}
    done = {row_key(r) for r in _set_aside_stale(results, gate_ids, settings, shas, specs)}
    jobs = list(_jobs(cfg, items, done))
    # what is computed once per item is kept for the item itself, not its id: two Hub sets of one sweep (ruler listed
    # twice) hold items of one id, and the second item was scored from the first one's prefill
    reference: tuple[Item, Any] | None = None  # fidelity: the full-context logits, once per item
    with open(results, "a") as fh, tqdm(total=sum(len(j[2]) for j in jobs), desc=f"eval {out_dir.name}", unit="run",
                                        disable=not progress) as bar:
        shared: tuple[Item, SharedPrefill] | None = None  # the current item's context, prefilled once
        shared_chat: tuple[Item, Any] | None = None  # the current dialogue-with-images' history, fed once
        for item, method, budgets, rows in jobs:
            bar.set_postfix(task=item.task, method=method.label, refresh=False)
            if is_multimodal_item(item):
                history = None
                if shares_history(method, cfg.prefill):
                    if shared_chat is None or shared_chat[0] is not item:
                        shared_chat = None  # free the previous item's first
                        shared_chat = (item, shared_history(model, processor, item, cfg.chunk))
                    history = shared_chat[1]
                results_ = run_chat_item_budgets(model, processor, item, method, budgets, prefill_mode=cfg.prefill,
                                                 chunk=cfg.chunk, max_new_tokens=cfg.max_new_tokens, history=history)
                _write_rows(fh, bar, rows, results_, method, item, settings, cfg, shas, gate_ids)
                continue
            share = None
            if shareable(method, cfg.prefill):
                if shared is None or shared[0] is not item:
                    shared = None  # free the previous item's first
                    head, _ = context_and_prompt(tok, item, cfg.protocol)
                    shared = (item, SharedPrefill(model, head))
                share = shared[1]
            ref = None
            if item.metric == "fidelity":
                if reference is None or reference[0] is not item:  # jobs of one item are consecutive: one at a time
                    reference = None
                    reference = (item, reference_logits(model, item))
                ref = reference[1]
            results_ = run_item_budgets(model, tok, item, method, budgets, protocol=cfg.protocol,
                                        prefill_mode=cfg.prefill, chunk=cfg.chunk, max_new_tokens=cfg.max_new_tokens,
                                        reference=ref, shared=share)
            _write_rows(fh, bar, rows, results_, method, item, settings, cfg, shas, gate_ids)
    return results


def _check_shows_images(cfg: EvalConfig, config: Any) -> None:
    """EvalConfigError when the config's image tasks (:data:`retention.eval.multimodal.IMAGE_TASKS`) meet a text-only
    model: read from the model's config (:func:`retention.eval.models.eval_model_config`), before the model loads."""
    shown = sorted({s.name for s in cfg.task_specs() if s.name in IMAGE_TASKS})
    if shown and not is_multimodal(config):
        from .config import EvalConfigError

        raise EvalConfigError(f"{cfg.model} is a text-only model, but {shown} show images: give a vision-language "
                              "model (model: Qwen/Qwen3-VL-4B-Instruct) or leave those tasks out")


def _tokens_after_context(cfg: EvalConfig, spec: Any) -> tuple[int, str]:
    """The fewest tokens a text task's item adds to its ``length`` context, and what they are: a fidelity item's
    continuation, a generated task's reply (``max_new_tokens``); a Hub set's reply length comes with its records."""
    if spec.name in FIDELITY_TASKS:
        import inspect

        n = spec.params.get("continuation", inspect.signature(TASKS[spec.name]).parameters["continuation"].default)
        return n, f"its continuation of {n} tokens"
    if spec.name in HUB_TASKS:
        return 1, "the question and the reply"
    return cfg.max_new_tokens, f"the question and a reply of up to {cfg.max_new_tokens} tokens (max_new_tokens)"


def _check_lengths_fit(cfg: EvalConfig, config: Any) -> None:
    """EvalConfigError, before the weights load, for a text task's length that with the tokens fed after the context
    (:func:`_tokens_after_context`) passes the model's positions: its rows would score positions the model never
    trained on (RoPE past its range; transformers only warns), and a length far past them may never finish. Dialogues
    with images are run and their rows marked ``past_positions`` (:mod:`retention.eval.multimodal`)."""
    limit = max_positions(config)
    if limit is None:
        return
    for spec in cfg.task_specs():
        if spec.name in IMAGE_TASKS:
            continue
        after, what = _tokens_after_context(cfg, spec)
        for length in cfg.lengths:
            if length + after > limit:
                from .config import EvalConfigError

                fix = (f"at most {limit - after}" if spec.name in FIDELITY_TASKS
                       else f"under {limit - after}, leaving room for the question")
                raise EvalConfigError(
                    f"lengths: {length} context tokens of {spec.name}, with {what} after them, pass {cfg.model}'s "
                    f"{limit} positions (max_position_embeddings): lower lengths to {fix}")


def _check_items_fit(cfg: EvalConfig, items: list[tuple[str, int, Any]], tokenizer: Any, config: Any) -> None:
    """:func:`_check_lengths_fit` on the items themselves, before any is scored: the whole prompt (chat template,
    question, answer prefix) plus the reply's tokens, or a fidelity item's context and continuation."""
    limit = max_positions(config)
    if limit is None:
        return
    worst, after = None, 0  # the item furthest past the limit; the most tokens any item adds after its context
    for task, length, item in items:
        if is_multimodal_item(item):
            continue
        if item.metric == "fidelity":
            shown, n = len(item.meta["context_ids"]), len(item.meta["context_ids"]) + len(item.meta["continuation_ids"])
        else:  # shown: what `length` counts (the context, or the conversation so far), at most `length` tokens
            text = item.context if item.messages is None else render_chat(tokenizer, item.messages)
            shown = count_tokens(tokenizer, text)
            n = len(context_and_prompt(tokenizer, item, cfg.protocol)[1]) + (item.max_new_tokens or cfg.max_new_tokens)
        after = max(after, n - shown)
        if n > limit and (worst is None or n > worst[0]):
            worst = (n, task, length, item)
    if worst is not None:
        from .config import EvalConfigError

        n, task, length, item = worst
        raise EvalConfigError(
            f"lengths: {length}: item {item.id} of {task} runs to {n} tokens, past {cfg.model}'s {limit} positions "
            f"(max_position_embeddings); the chat template, question and reply (max_new_tokens), or a fidelity "
            f"continuation, add up to {after} tokens to an item's context: lower lengths to {limit - after} or less")


def _write_rows(fh, bar, rows, results_, method, item, settings, cfg, shas, gate_ids) -> None:
    """Append one (item, method)'s rows, each flushed to disk as it is written (a resumed sweep keeps them)."""
    for row, res in zip(rows, results_):
        res = {**row, **method_spec(method), "metric": item.metric, **settings, "seed": cfg.seed,
               "split": cfg.split, "item_sha": shas[(row["task"], row["length"], row["item"])],
               **({"gates_id": gate_ids[method.label]} if gate_ids[method.label] else {}), **res}
        fh.write(json.dumps(res) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
        bar.update(1)
