"""Training configuration: YAML -> validated dataclasses (:mod:`retention.train.schema`), with ``--set key=value``
overrides.

Every key is checked before any model loads; an error names the key, the allowed values and the line
of the YAML file it came from.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from retention.models import MODEL_DTYPES
from retention.templates import template_variables_problem

# the keys' dataclasses live in schema; every name stays importable from here
from .schema import (  # noqa: F401
    BudgetConfig, Config, ConfigError, DataConfig, DataError, ExportConfig, GatesConfig, LoraConfig, LossConfig,
    ModelConfig, SourceConfig, TrainConfig,
)

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"  # the checkout's configs/
# the recipes inside an installed wheel (pyproject.toml's package-dir: configs/ -> retention/configs/)
PACKAGED_CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
# where a bare config name is looked up, in this order: a checkout's own (edited) recipes first
CONFIG_DIRS = (CONFIG_DIR, PACKAGED_CONFIG_DIR)


CHOICES = {
    "gates.variant": ("global", "seed", "trimkv"),
    "gates.activation": ("silu", "gelu", "relu", "tanh"),
    "loss.capacity_form": ("global", "per_head"),
    "loss.objective": ("distill", "evict"),
    "data.sources.kind": ("text", "chat", "multimodal", "synthetic"),
    "train.schedule": ("cosine", "constant"),
    "train.mixed_precision": ("auto", "no", "bf16", "fp16"),
    "train.tracker": ("auto", "tensorboard", "wandb", "none", None),
    "model.dtype": MODEL_DTYPES,
    "model.attn_implementation": ("sdpa", "eager"),
}
# string keys whose value `no` YAML reads as false (`mixed_precision: no`, accelerate's spelling): false means this
FALSE_MEANS = {"train.mixed_precision": "no"}
POSITIVE = {
    "gates.gate_hidden", "gates.widen_to", "loss.kl_chunk", "loss.kl_temperature", "loss.evict_tau",
    "data.seq_len", "train.steps",
    "train.batch_size", "train.grad_accum", "train.lr", "train.log_every", "train.save_every",
    "train.eval_batches", "train.stop_after", "lora.r",
    # the run prunes to the newest keep_checkpoints: -1 deleted each checkpoint it wrote (old[:1]), 0 kept them all
    "train.keep_checkpoints", "budget.tokens_per_head", "budget.global_entries",
    "data.sources.length", "data.sources.max_docs", "data.sources.weight",
}
NON_NEGATIVE = {
    "gates.sink", "loss.capacity_weight", "loss.ce_weight",
    "train.warmup_steps", "train.clip", "train.eval_every", "train.weight_decay", "data.eval_fraction",
}


def _lines(text: str, source: str) -> dict[str, int]:
    """Dotted key -> 1-based line in the YAML text (list items as ``key.0.sub``); ConfigError for a key set twice."""
    out: dict[str, int] = {}

    def walk(node, prefix):
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = f"{prefix}{k.value}"
                if key in out:  # YAML keeps the last silently: a setting written twice is a mistake either way
                    raise ConfigError(f"{key} is set twice in {source} (lines {out[key]} and {k.start_mark.line + 1}): "
                                      "keep one")
                out[key] = k.start_mark.line + 1
                walk(v, key + ".")
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                out[f"{prefix}{i}"] = v.start_mark.line + 1
                walk(v, f"{prefix}{i}.")

    root = yaml.compose(text)
    if root is not None:
        walk(root, "")
    return out


def _where(key: str, lines: dict[str, Any], source: str) -> str:
    if key not in lines:
        return f" ({source})"
    where = lines[key]
    return f" ({where})" if isinstance(where, str) else f" ({source}, line {where})"


def _convert(value: Any, tp: Any, key: str, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _convert(value, args[0], key, where)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list{where}, got {value!r}")
        (inner,) = typing.get_args(tp)
        return [_convert(v, inner, f"{key}.{i}", where) for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping{where}, got {value!r}")
        return value  # built by _build
    if tp is bool:
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false{where}, got {value!r}")
        return value
    if tp in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"{key} must be a number{where}, got {value!r}")
        try:
            num = tp(value) if not isinstance(value, str) else tp(float(value)) if tp is float else int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key} must be {'an integer' if tp is int else 'a number'}{where}, "
                              f"got {value!r}") from None
        if tp is int and isinstance(value, float) and not value.is_integer():
            raise ConfigError(f"{key} must be an integer{where}, got {value!r}")
        if not math.isfinite(num):  # inf passed every "> 0" check (train.lr=inf trained NaN gates)
            raise ConfigError(f"{key} must be a finite number{where}, got {value!r}")
        return num
    if tp is str:
        if value is False and key in FALSE_MEANS:  # YAML reads a bare `no` as false
            return FALSE_MEANS[key]
        if not isinstance(value, (str, int, float)):
            raise ConfigError(f"{key} must be a string{where}, got {value!r}")
        return str(value)
    return value


def _build(cls, data: Any, prefix: str, lines: dict[str, int], source: str):
    where = _where(prefix.rstrip("."), lines, source)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'the config'} must be a mapping{where}, got {data!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in known:
            full = f"{prefix}{key}"
            raise ConfigError(f"unknown key {full!r}{_where(full, lines, source)}; allowed here: {sorted(known)}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        key = f"{prefix}{f.name}"
        tp = hints[f.name]
        value = _convert(data[f.name], tp, key, _where(key, lines, source))
        if dataclasses.is_dataclass(tp):
            value = _build(tp, value, key + ".", lines, source)
        elif typing.get_origin(tp) is list and dataclasses.is_dataclass(typing.get_args(tp)[0]):
            value = [_build(typing.get_args(tp)[0], v, f"{key}.{i}.", lines, source) for i, v in enumerate(value)]
        kwargs[f.name] = value
    return cls(**kwargs)


def _validate(cfg: Config, lines: dict[str, int], source: str) -> None:
    def check(key: str, value: Any) -> None:
        generic = ".".join(p for p in key.split(".") if not p.isdigit())
        where = _where(key, lines, source)
        if generic in CHOICES and value not in CHOICES[generic]:
            allowed = [c for c in CHOICES[generic] if c is not None]
            raise ConfigError(f"{key} = {value!r}{where} is not allowed; choose one of {allowed}")
        if generic in POSITIVE and value is not None and not value > 0:
            raise ConfigError(f"{key} must be > 0{where}, got {value!r}")
        if generic in NON_NEGATIVE and value is not None and value < 0:
            raise ConfigError(f"{key} must be >= 0{where}, got {value!r}")

    def walk(obj: Any, prefix: str) -> None:
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            key = f"{prefix}{f.name}"
            if dataclasses.is_dataclass(value):
                walk(value, key + ".")
            elif isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
                for i, v in enumerate(value):
                    walk(v, f"{key}.{i}.")
            else:
                check(key, value)

    walk(cfg, "")
    if cfg.data.seq_len < 2:  # a row distils each token's next: one token has none (every row would be dropped)
        raise ConfigError(f"data.seq_len must be >= 2{_where('data.seq_len', lines, source)}, got {cfg.data.seq_len}")
    b = cfg.budget
    unset = b.tokens_per_head is None and b.global_entries is None
    if cfg.loss.objective == "evict" and unset:
        pass  # its budgets are loss.evict_fractions of each item's context
    elif (b.tokens_per_head is None) == (b.global_entries is None):
        raise ConfigError(
            "budget: set exactly one of budget.tokens_per_head or budget.global_entries"
            f"{_where('budget', lines, source)}"
        )
    if cfg.loss.objective == "distill" and b.tokens_per_head is not None and b.tokens_per_head >= cfg.data.seq_len:
        # a cache of a row's every token is within the budget: the capacity loss has no term, and the gates learn
        # only to keep everything (the KL's pull)
        where = _where("budget.tokens_per_head", lines, source)
        raise ConfigError(f"budget.tokens_per_head = {b.tokens_per_head}{where} holds every entry of a data.seq_len = "
                          f"{cfg.data.seq_len} row, so the capacity loss never acts; give a budget below data.seq_len "
                          "(or longer rows)")
    if not cfg.data.sources:
        raise ConfigError(f"data.sources must list at least one source{_where('data.sources', lines, source)}")
    for i, src in enumerate(cfg.data.sources):
        if src.kind == "synthetic":
            _check_synthetic(src, cfg.data.seq_len, f"data.sources.{i}", lines, source, cfg.loss.objective == "evict")
        elif src.length is not None or src.params is not None or src.haystack != "auto":
            raise ConfigError(f"data.sources.{i}: length, params and haystack apply to kind: synthetic only"
                              f"{_where(f'data.sources.{i}', lines, source)}")
        if src.kind == "multimodal" and src.weight != 1:
            raise ConfigError(f"data.sources.{i}.weight{_where(f'data.sources.{i}', lines, source)}: weights apply to "
                              "text, chat and synthetic sources (packed rows); multimodal conversations all weigh 1, "
                              "so remove it")
    from retention.tasks.image_items import IMAGE_TASKS

    imaged = [i for i, s in enumerate(cfg.data.sources) if s.kind == "synthetic" and s.path in IMAGE_TASKS]
    if imaged:  # image tasks train as multimodal conversations: beside multimodal sources only, distilled
        i = imaged[0]
        others = [s.kind for s in cfg.data.sources if s.kind not in ("multimodal", "synthetic")
                  or (s.kind == "synthetic" and s.path not in IMAGE_TASKS)]
        if cfg.data.sources[i].weight != 1:
            raise ConfigError(f"data.sources.{i}.weight{_where(f'data.sources.{i}', lines, source)}: "
                              f"{cfg.data.sources[i].path} trains as multimodal conversations, which all weigh 1; "
                              "remove it")
        if others or cfg.loss.objective == "evict":
            raise ConfigError(f"data.sources.{i}.path = {cfg.data.sources[i].path!r}"
                              f"{_where(f'data.sources.{i}', lines, source)}: "
                              "its photos make it a multimodal conversation, which trains with loss.objective: distill "
                              f"beside kind: multimodal sources only (this config has {others or 'objective evict'}); "
                              "train it in a vision-language run of its own")
    # refused by the multimodal data only after the (vision-language) model had loaded
    shown = [i for i, s in enumerate(cfg.data.sources) if s.kind == "multimodal" or i in imaged]
    if shown and cfg.loss.objective != "evict":
        mixed = sorted({s.kind for i, s in enumerate(cfg.data.sources) if i not in shown})
        if mixed:
            raise ConfigError(f"data.sources.{shown[0]}{_where(f'data.sources.{shown[0]}', lines, source)}: "
                              f"multimodal conversations train in a vision-language run of their own, beside other "
                              f"multimodal sources only (this config also has {mixed}); use one kind per run")
        if cfg.train.batch_size != 1:
            raise ConfigError(f"train.batch_size = {cfg.train.batch_size}{_where('train.batch_size', lines, source)}: "
                              "multimodal conversations are not packed into a batch; set train.batch_size: 1 and "
                              "raise train.grad_accum (or use more GPUs) instead")
    if cfg.loss.objective == "evict":
        fr = cfg.loss.evict_fractions
        if not fr or not all(isinstance(f, (int, float)) and not isinstance(f, bool) and 0 < f <= 1 for f in fr):
            raise ConfigError(f"loss.evict_fractions = {fr!r}{_where('loss.evict_fractions', lines, source)}: list "
                              "budgets as fractions of the context in (0, 1], e.g. [0.05, 0.1, 0.2]")
        for i, src in enumerate(cfg.data.sources):
            if src.kind != "synthetic":
                raise ConfigError(f"data.sources.{i}.kind = {src.kind!r}{_where(f'data.sources.{i}', lines, source)}: "
                                  "objective 'evict' reads items with a context and a continuation, so every source "
                                  "must be kind: synthetic (fidelity gives plain text; niah_*, document_qa, "
                                  "dialogue_memory give questions)")
        if cfg.train.batch_size != 1:
            raise ConfigError(f"train.batch_size = {cfg.train.batch_size}{_where('train.batch_size', lines, source)}: "
                              "objective 'evict' reads one item a micro-step; set train.batch_size: 1 and raise "
                              "train.grad_accum instead")
        if cfg.lora.enabled:
            raise ConfigError("lora.enabled: objective 'evict' trains the gates only; set lora.enabled: false or "
                              "loss.objective: distill")
        if not unset:  # it was read by nothing: the run kept evict_fractions of each context instead
            key = "budget.tokens_per_head" if b.tokens_per_head is not None else "budget.global_entries"
            raise ConfigError(f"{key}{_where(key, lines, source)}: objective 'evict' keeps loss.evict_fractions of "
                              "each item's context and reads no budget; remove the budget section and list the shares "
                              "in loss.evict_fractions (e.g. [0.05, 0.1, 0.2])")
    if cfg.gates.widen_to is not None and not cfg.gates.init_from:
        raise ConfigError(f"gates.widen_to = {cfg.gates.widen_to}{_where('gates.widen_to', lines, source)}: it widens "
                          "the gates of gates.init_from; set init_from, or set gates.gate_hidden to train new gates of "
                          "that width")
    if not 0 <= cfg.data.eval_fraction < 1:
        raise ConfigError(f"data.eval_fraction must be in [0, 1){_where('data.eval_fraction', lines, source)}")
    if not 0 <= cfg.lora.dropout < 1:  # peft refuses it only once the model has loaded
        raise ConfigError(f"lora.dropout must be in [0, 1){_where('lora.dropout', lines, source)}, got "
                          f"{cfg.lora.dropout:g}: it is the probability of dropping a LoRA input")
    if problem := template_variables_problem(cfg.data.chat_template_kwargs):
        raise ConfigError(f"data.chat_template_kwargs{_where('data.chat_template_kwargs', lines, source)} {problem}")


def _check_synthetic(src: SourceConfig, seq_len: int, key: str, lines: dict[str, Any], source: str,
                     evicting: bool = False) -> None:
    """A synthetic source names an eval task, draws from the training haystacks and fits in a row."""
    from retention.tasks import HELD_OUT_TASKS, TASKS, check_params  # light: generators only, no model

    if src.path in HELD_OUT_TASKS:  # training on them would turn the held-out score into an in-distribution one
        raise ConfigError(f"{key}.path = {src.path!r}{_where(key + '.path', lines, source)}: a held-out task family "
                          "(retention.tasks.heldout), for evaluation only: its templates and genres must stay unseen "
                          "by training; train on the other tasks and text or chat sources")
    # fidelity is plain text (use a text source) except for objective evict, which needs its context/continuation split
    usable = sorted(t for t in TASKS if (t != "fidelity" or evicting) and t not in HELD_OUT_TASKS)
    if src.path not in usable:
        raise ConfigError(f"{key}.path = {src.path!r}{_where(key + '.path', lines, source)}: a synthetic source "
                          f"names an eval task, one of {usable}")
    from retention.tasks.haystack import HELD_OUT_SOURCES, SOURCES

    trainable = [h for h in SOURCES if h not in HELD_OUT_SOURCES]
    if src.haystack not in trainable:
        why = ("a held-out genre, for evaluation only" if src.haystack in HELD_OUT_SOURCES
               else "not a haystack")
        raise ConfigError(f"{key}.haystack = {src.haystack!r}{_where(key + '.haystack', lines, source)}: {why}; "
                          f"synthetic training items are built in one of {trainable}")
    if src.split != "train":
        raise ConfigError(f"{key}.split = {src.split!r}{_where(key + '.split', lines, source)}: synthetic training "
                          "data must use the training haystacks (split: train); the eval pool stays unseen")
    if src.max_docs is None:
        raise ConfigError(f"{key}: set max_docs, the number of synthetic items to generate{_where(key, lines, source)}")
    length = src.length if src.length is not None else seq_len - 128
    if not 64 <= length <= seq_len - 32:
        raise ConfigError(f"{key}.length = {length}{_where(key + '.length', lines, source)}: must be in [64, "
                          f"data.seq_len - 32 = {seq_len - 32}] so an item (context, question, answer) fits one row")
    if src.params is not None and not isinstance(src.params, dict):
        raise ConfigError(f"{key}.params must be a mapping of the task's options"
                          f"{_where(key + '.params', lines, source)}")
    try:  # the generator's options, before the model loads (a typo failed when the items were drawn)
        check_params(src.path, dict(src.params or {}))
    except ValueError as e:
        raise ConfigError(f"{key}.params{_where(key + '.params', lines, source)}: {e}") from None


def resolve_config_path(path: str | Path) -> Path:
    """A path as given, else a bare name (``qwen3vl.yaml`` or ``qwen3vl``, ``accelerate/zero2.yaml``) resolved
    against a checkout's ``configs/``, then the recipes inside the installed package."""
    p = Path(path)
    if p.is_file():
        return p
    dirs = [d for d in CONFIG_DIRS if d.is_dir()]
    for folder in dirs:
        for candidate in (folder / p, folder / f"{p}.yaml"):
            if candidate.is_file():
                return candidate
    if not dirs:
        raise ConfigError(f"config {str(path)!r} not found, and this copy of retention has no recipes (neither a "
                          "checkout's configs/ nor the packaged ones): pass the YAML file's path")
    available = sorted({x.name for d in dirs for x in d.glob("*.yaml")})
    raise ConfigError(f"config {str(path)!r} not found (a bare name is looked up among the recipes); available: "
                      f"{available}")


def _apply_override(data: dict, assignment: str) -> str:
    """Set ``key=value`` (dotted; list entries by index, ``data.sources.0.path``) in the YAML ``data``; returns the
    key. ConfigError naming the ``--set`` when the path runs through a value or past a list's end."""
    if "=" not in assignment:
        raise ConfigError(f"--set needs key=value, got {assignment!r}")
    key, raw = assignment.split("=", 1)
    key = key.strip()
    value = yaml.safe_load(raw) if raw else None
    parts = key.split(".")
    if not all(parts):
        raise ConfigError(f"--set {assignment}: {key!r} is not a dotted key such as train.steps")
    node: Any = data
    for depth, p in enumerate(parts):
        here = ".".join(parts[:depth]) or "the config"
        if isinstance(node, list):
            if not p.isdigit() or int(p) >= len(node):
                raise ConfigError(f"--set {assignment}: {here} is a list of {len(node)}: give an index from 0 to "
                                  f"{len(node) - 1} in place of {p!r}")
            p = int(p)  # type: ignore[assignment]
        elif not isinstance(node, dict):
            raise ConfigError(f"--set {assignment}: {here} is {node!r}, not a section with keys")
        if depth == len(parts) - 1:
            node[p] = value
        else:
            node = node.setdefault(p, {}) if isinstance(node, dict) else node[p]
    return key


def _read(path: Path) -> tuple[dict, dict[str, int]]:
    """One YAML file: its mapping and the line of each dotted key."""
    source = str(path)
    try:
        text = path.read_text()
        data = yaml.safe_load(text) or {}
        lines = _lines(text, source) if text else {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{source} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source} must be a mapping of sections (model:, data:, train:, ...), got a "
                          f"{type(data).__name__}: see configs/smollm2.yaml")
    return data, lines


def _merge(base: dict, child: dict) -> dict:
    """``child`` over ``base``: mappings merge key by key; lists and scalars replace."""
    out = dict(base)
    for key, value in child.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _resolve_bases(path: Path, chain: tuple[Path, ...] = ()) -> tuple[dict, dict[str, Any]]:
    """The config at ``path`` merged over the chain of ``base:`` files it names (each relative to the folder of
    the file naming it). Lines: an int for a key of ``path`` itself, ``"FILE, line N"`` for a base file's key."""
    data, lines = _read(path)
    base = data.pop("base", None)
    lines.pop("base", None)
    if base is None:
        return data, lines
    if not isinstance(base, str) or not base:
        raise ConfigError(f"base in {path} must be the path of another config file (relative to {path.parent}), "
                          f"got {base!r}")
    base_path = path.parent / base
    if not base_path.is_file():
        raise ConfigError(f"base {base!r} named in {path} not found: no file {base_path}; base paths are relative to "
                          "the folder of the config that names them")
    here = (*chain, path.resolve())
    if base_path.resolve() in here:
        cycle = " -> ".join(str(p) for p in (*here, base_path.resolve()))
        raise ConfigError(f"base {base!r} named in {path} makes a cycle of bases ({cycle}): remove one base: key")
    base_data, base_lines = _resolve_bases(base_path, here)
    # a key the child sets to a list or a value replaces the base's, so the base's lines under it go too
    replaced = [k for k in lines if not isinstance(_at(data, k), dict)]
    merged_lines: dict[str, Any] = {
        k: v if isinstance(v, str) else f"{base_path}, line {v}" for k, v in base_lines.items()
        if not any(k.startswith(r + ".") for r in replaced)}
    merged_lines.update(lines)
    return _merge(base_data, data), merged_lines


def _at(data: Any, dotted: str) -> Any:
    """The value at a dotted key of nested mappings and lists (``data.sources.0.path``)."""
    for part in dotted.split("."):
        data = data[int(part)] if isinstance(data, list) else data[part]
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read, override and validate a config; nothing heavy is imported or loaded here. A config may name a
    ``base:`` file (relative to its own folder) that it is merged over: mappings merge key by key, lists and
    values replace, and bases chain."""
    data, lines, source = {}, {}, "defaults"
    if path is not None:
        p = resolve_config_path(path)
        source = str(p)
        data, lines = _resolve_bases(p)
    for assignment in overrides:
        key = _apply_override(data, assignment)
        lines[key] = f"--set {assignment}"  # type: ignore[assignment]
    if isinstance(data, dict) and {"tasks", "methods", "budgets"} & set(data) and not {"train", "data"} & set(data):
        raise ConfigError(f"{source} is an evaluation sweep config (tasks, methods, budgets): "
                          f"run it with python -m retention.eval run --config {source}")
    cfg = _build(Config, data, "", lines, source)
    # "~/runs/x" is the user's home, not a folder named "~" beside the working directory
    cfg.train.output_dir = str(Path(cfg.train.output_dir).expanduser())
    if cfg.export.dir:
        cfg.export.dir = str(Path(cfg.export.dir).expanduser())
    _validate(cfg, lines, source)
    if path is not None:
        cfg.source, cfg.overrides = source, tuple(overrides)
    return cfg
