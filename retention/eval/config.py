"""Sweep configs (YAML), validated before any model loads: errors name the key and what is allowed."""

from __future__ import annotations

import string
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from retention.templates import template_variables_problem
from retention.models import MODEL_DTYPES, device_problem
from retention.tasks.haystack import SOURCES, SPLITS
from retention.tasks import TASKS, check_params

from .budgets import Budget, parse_budget
from .method_specs import available_methods, make_method
from .methods import Method
from .multimodal import IMAGE_TASKS
from .protocol import PREFILLS, PROTOCOLS
from .loaders import HUB_TASKS, check_hub_task

CONFIG_DIR = Path(__file__).resolve().parents[2] / "eval" / "configs"  # the checkout's eval/configs


class EvalConfigError(ValueError):
    """A bad eval config: the message names the key and the allowed values."""


@dataclass
class TaskSpec:
    name: str
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class EvalConfig:
    """One sweep: ``methods x budgets x lengths x tasks``, ``items`` per (task, length).

    ``budgets`` apply to every method but ``full`` (see :mod:`retention.eval.budgets`); ``lengths`` are context
    sizes in tokens; ``split``/``seed``/``source`` pick the haystack pool and make items reproducible.
    """

    model: str = "smollm2-135m"
    dtype: str | None = None
    device: str | None = None
    # gate checkpoint (folder or Hub repo) for global_gates / trimkv: null = the gates shipped for an
    # embedded model (checkpoints/), untrained otherwise; "untrained" forces untrained gates
    gates: str | None = None
    # the results folder; "{seed}" in it is filled with the item seed (one folder per item set: --seed N)
    output: str = "runs/eval/sweep"
    tasks: list[Any] = field(default_factory=lambda: ["niah_single"])
    lengths: list[int] = field(default_factory=lambda: [1024])
    budgets: list[Any] = field(default_factory=lambda: [0.1, 0.25])
    methods: list[Any] = field(default_factory=lambda: [{"name": "full"}])
    items: int = 5
    seed: int = 0
    split: str = "eval"
    source: str = "auto"
    protocol: str = "query_agnostic"
    prefill: str = "one_shot"
    chunk: int = 512
    max_new_tokens: int = 32
    # variables for the model's chat template in every prompt, e.g. {enable_thinking: false} for Qwen3
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    def task_specs(self) -> list[TaskSpec]:
        return [TaskSpec(t) if isinstance(t, str) else TaskSpec(t["name"], dict(t.get("params") or {}))
                for t in self.tasks]

    def method_list(self) -> list[Method]:
        """The methods, built once per config: a method's own gates, loaded when the sweep is prepared,
        stay with it for the sweep (not loaded a second time)."""
        built = self.__dict__.get("_methods")
        if built is None or built[0] != repr(self.methods):
            built = (repr(self.methods), [make_method(m if isinstance(m, dict) else {"name": m}) for m in self.methods])
            self.__dict__["_methods"] = built
        return built[1]

    def budget_list(self) -> list[Budget]:
        return [parse_budget(b) for b in self.budgets]


def _fail(key: str, msg: str) -> None:
    raise EvalConfigError(f"{key}: {msg}")


def _gates_problem(gates: Any) -> str | None:
    """What is wrong with a ``gates:`` value (top level or a method's), or ``None``: YAML reads ``gates: 3`` as a
    number, which would reach the checkpoint lookup as a path and fail there with a TypeError."""
    if gates is None or (isinstance(gates, str) and gates):
        return None
    number = isinstance(gates, (int, float)) and not isinstance(gates, bool)
    return (f"must be a gate checkpoint folder, a Hub repo id or 'untrained', got {gates!r}"
            + (f" (quote a folder named by a number: gates: \"{gates}\")" if number else ""))


def fill_seed(output: str, seed: int) -> str:
    """``output`` with its ``{seed}`` placeholder filled (``runs/eval/goal-set{seed}`` -> ``runs/eval/goal-set4``), so
    one config serves every item set, each in a folder of its own; a path without it is returned as it is."""
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(output) if name is not None}
    except ValueError as e:  # a lone "{" or "}"
        raise EvalConfigError(f"output: {output!r}: {e}; the one placeholder is {{seed}} (write {{{{ and }}}} for a "
                              "literal brace)") from None
    if names - {"seed"}:
        _fail("output", f"{output!r} names {sorted(names - {'seed'})}; the one placeholder is {{seed}} (the item seed)")
    try:
        return output.format(seed=seed)
    except (ValueError, TypeError) as e:  # a bad format spec: {seed:x.y}
        raise EvalConfigError(f"output: {output!r}: {e}; write {{seed}}") from None


def validate(cfg: EvalConfig) -> EvalConfig:
    """Check every key; raise :class:`EvalConfigError` naming the first bad one."""
    for key, allowed in (("protocol", PROTOCOLS), ("prefill", PREFILLS), ("split", SPLITS), ("source", SOURCES)):
        if getattr(cfg, key) not in allowed:
            _fail(key, f"{getattr(cfg, key)!r} is not allowed; choose one of {list(allowed)}")
    if not isinstance(cfg.seed, int) or isinstance(cfg.seed, bool) or cfg.seed < 0:  # YAML's `seed: true` is no set
        _fail("seed", f"must be an integer >= 0 (the item set), got {cfg.seed!r}")
    if not isinstance(cfg.output, str) or not cfg.output:
        _fail("output", f"must be a folder path (the sweep writes results.jsonl there), got {cfg.output!r}")
    # "~/sweeps/a" is the user's home, not a folder named "~"
    cfg.output = str(Path(fill_seed(cfg.output, cfg.seed)).expanduser())
    if Path(cfg.output).exists() and not Path(cfg.output).is_dir():
        _fail("output", f"{cfg.output} is a file; the sweep writes results.jsonl and its report into a folder: give a "
                        "folder path (an existing sweep's folder resumes it)")
    if not isinstance(cfg.model, str) or not cfg.model:
        _fail("model", "give an embedded name (smollm2-135m), tiny-llama-random, a Hub id or a local folder")
    if problem := _gates_problem(cfg.gates):
        _fail("gates", f"{problem}; or leave it out (the gates shipped for the model, untrained otherwise)")
    if cfg.dtype is not None and cfg.dtype not in MODEL_DTYPES:
        _fail("dtype", f"{cfg.dtype!r} is not allowed; choose one of {list(MODEL_DTYPES)} (or leave it out: float32)")
    problem = device_problem(cfg.device) if cfg.device is not None else None
    if problem:
        _fail("device", f"{problem}; or leave device out (cuda when there is one, else cpu)")
    for key in ("items", "chunk", "max_new_tokens"):
        v = getattr(cfg, key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            _fail(key, f"must be an integer >= 1, got {v!r}")
    if problem := template_variables_problem(cfg.chat_template_kwargs):
        _fail("chat_template_kwargs", problem)
    if not isinstance(cfg.lengths, list) or not cfg.lengths or any(
            not isinstance(n, int) or isinstance(n, bool) or n < 64 for n in cfg.lengths):
        _fail("lengths", f"must be a non-empty list of integers >= 64 (context tokens), got {cfg.lengths!r}")
    available = f"generated: {sorted(TASKS)}; from the Hub: {sorted(HUB_TASKS)}"
    if not isinstance(cfg.tasks, list) or not cfg.tasks:
        _fail("tasks", f"must be a non-empty list of task names or {{name, params}}; {available}")
    seen_tasks: dict[str, Any] = {}
    for t in cfg.tasks:
        name = t if isinstance(t, str) else (t.get("name") if isinstance(t, dict) else None)
        if name in TASKS and name in seen_tasks:  # rows are keyed by the task's name: two variants would mix
            _fail("tasks", f"lists {name} twice ({seen_tasks[name]!r} and {t!r}); a sweep's rows name a generated "
                           "task by its name alone, so one output holds one variant of it: sweep the other "
                           "into a second output")
        seen_tasks[name] = t
        if name not in TASKS and name not in HUB_TASKS:
            _fail("tasks", f"unknown task {name!r}; {available}")
        if isinstance(t, dict) and set(t) - {"name", "params"}:
            _fail("tasks", f"a task entry takes 'name' and 'params', got {sorted(t)}")
        params = (t.get("params") or {}) if isinstance(t, dict) else {}
        if not isinstance(params, dict):
            _fail("tasks", f"{name}: params must be a mapping of the task's options, got {params!r}")
        try:  # a generated task's options too, before any model loads (a typo failed after the load)
            (check_hub_task if name in HUB_TASKS else check_params)(name, dict(params))
        except ValueError as e:
            _fail("tasks", str(e))
    if not isinstance(cfg.methods, list) or not cfg.methods:
        _fail("methods", f"must be a non-empty list of {{name, params?, label?}}; available: {available_methods()}")
    labels = []
    for m in cfg.methods:
        spec = m if isinstance(m, dict) else {"name": m}
        if not isinstance(spec.get("name"), str):
            _fail("methods", f"each method needs a name, got {m!r}")
        if set(spec) - {"name", "params", "label", "gates"}:
            _fail("methods", f"a method entry takes 'name', 'params', 'label' and 'gates', got {sorted(spec)}")
        if spec["name"] not in available_methods():
            _fail("methods", f"unknown method {spec['name']!r}; available: {available_methods()}")
        if problem := _gates_problem(spec.get("gates")):
            _fail("methods", f"{spec['name']}: gates {problem}")
        try:
            labels.append(make_method(spec).label)
        except (ValueError, TypeError) as e:
            _fail("methods", f"{spec['name']}: {e}")
    if any(m.name == "oracle" for m in cfg.method_list()):
        others = sorted({s.name for s in cfg.task_specs()} - {"fidelity"})
        if others or cfg.prefill != "one_shot":
            _fail("methods", f"the oracle reads a fidelity item's continuation and compresses once: it needs "
                             f"tasks: [fidelity] and prefill: one_shot (got tasks {others or ['fidelity']}, prefill "
                             f"{cfg.prefill!r}); run the other tasks in a config of their own")
    if len(set(labels)) != len(labels):
        _fail("methods", f"labels must be distinct (set 'label' on repeated methods), got {labels}")
    if not isinstance(cfg.budgets, list):  # as lengths and tasks: a list, even of one
        fix = "[]" if cfg.budgets is None else f"[{cfg.budgets}]"
        _fail("budgets", f"must be a list of budgets (fractions 0.1 or \"10%\", {{tokens: N}}, {{entries: N}}; [] for "
                         f"the full cache alone), got {cfg.budgets!r}: write budgets: {fix}")
    if any(m.uses_budget for m in cfg.method_list()) and not cfg.budgets:
        _fail("budgets", "policy methods need at least one budget")
    for b in cfg.budgets or []:
        try:
            parse_budget(b)
        except ValueError as e:
            _fail("budgets", str(e))
    shown = sorted({s.name for s in cfg.task_specs() if s.name in IMAGE_TASKS})
    if shown:  # dialogues with images run through retention.eval.multimodal
        if cfg.protocol != "query_agnostic":
            _fail("protocol", f"{shown}: dialogues with images run query-agnostic only (the history is compressed "
                              "before the question arrives); set protocol: query_agnostic or leave them out")
        fractions = [b for b in cfg.budgets or [] if parse_budget(b).kind == "fraction"]
        if cfg.prefill == "streaming" and fractions:
            _fail("budgets", f"{fractions}: {shown} under a streaming prefill evict before a dialogue's length "
                             "(with its images) is known, so their budgets must be {tokens: N} or {entries: N}; or "
                             "use prefill: one_shot")
    return cfg


def load_eval_config(path: str | Path, **overrides: Any) -> EvalConfig:
    """Read and validate a YAML config (a bare file name is also looked up in ``eval/configs``)."""
    p = Path(path)
    if not p.is_file():
        if not CONFIG_DIR.is_dir():  # an installed wheel: the configs stay in the repository
            raise EvalConfigError(f"config: {str(path)!r} not found; a bare name is looked up in a checkout's "
                                  "eval/configs, and this installed copy has none: pass the YAML file's path")
        alt = CONFIG_DIR / p.name
        if not alt.is_file():
            raise EvalConfigError(f"config: {str(path)!r} not found (also looked in {CONFIG_DIR})")
        p = alt
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise EvalConfigError(f"config: {p} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise EvalConfigError(f"config: {p} must hold a mapping of keys, got {type(data).__name__}")
    data.update(overrides)
    known = [f.name for f in fields(EvalConfig)]
    unknown = sorted(set(data) - set(known))
    if unknown:
        hint = ("; this is a training config: python train.py --config " + str(p)
                if {"train", "data", "loss"} & set(unknown) else "")
        raise EvalConfigError(f"unknown key(s) {unknown} in {p}; allowed: {known}{hint}")
    return validate(EvalConfig(**data))


def restrict(cfg: EvalConfig, tasks: list[str] | None = None, budgets: list[str] | None = None,
             methods: list[str] | None = None) -> EvalConfig:
    """``cfg`` cut to a part of its sweep (``run --tasks/--budgets/--methods``): a staged run into the same output,
    whose rows the whole config's run keeps and fills in around (rows are keyed by task, item, method and budget).
    ``tasks``: task names, or ``held_out`` / ``in_distribution`` for those families
    (:data:`retention.tasks.HELD_OUT_TASKS`); ``budgets``: as a config writes them (``0.1``, ``10%``); ``methods``:
    labels. A name the config does not hold is an :class:`EvalConfigError` naming what it holds."""
    from dataclasses import replace

    from retention.tasks import HELD_OUT_TASKS

    changes: dict[str, Any] = {}
    if tasks is not None:
        names = [s.name for s in cfg.task_specs()]
        groups = {"held_out": [n for n in names if n in HELD_OUT_TASKS],
                  "in_distribution": [n for n in names if n not in HELD_OUT_TASKS]}
        wanted = {w for t in tasks for w in groups.get(t, [t])}
        unknown = sorted(wanted - set(names))
        if unknown or not wanted:
            _fail("--tasks", f"{unknown or tasks} not in this config's tasks {names} (or held_out, in_distribution)")
        changes["tasks"] = [t for t, n in zip(cfg.tasks, names) if n in wanted]
    if budgets is not None:
        keys = [b.key for b in cfg.budget_list()]
        wanted_keys = set()
        for text in budgets:
            try:
                wanted_keys.add(parse_budget(yaml.safe_load(text)).key)
            except (ValueError, yaml.YAMLError) as e:
                _fail("--budgets", str(e))
        if wanted_keys - set(keys) or not wanted_keys:
            shown = [parse_budget(b).label for b in cfg.budgets]
            _fail("--budgets", f"{budgets} not all in this config's budgets {shown}")
        changes["budgets"] = [b for b, k in zip(cfg.budgets, keys) if k in wanted_keys]
    if methods is not None:
        labels = [m.label for m in cfg.method_list()]
        if set(methods) - set(labels) or not methods:
            _fail("--methods", f"{sorted(set(methods) - set(labels))} not in this config's methods {labels}")
        changes["methods"] = [spec for spec, label in zip(cfg.methods, labels) if label in methods]
    return replace(cfg, **changes) if changes else cfg
