"""What a training run checks before anything expensive loads: the upload's token, the checkpoint to resume, the
export folder, the data sources, the starting gates and the model's shapes (its config only), and the tracker."""

from __future__ import annotations

import json

from pathlib import Path
from typing import Any

import torch

from retention.budget import entries_for_tokens, streams_of
from retention.gates import RetentionGates, check_gate_folder_target
from retention.hub import load_gates, local_checkpoint
from retention.models import hub_model_id, looks_like_a_path

from .checkpoint import check_resume_fits, intact_checkpoint
from .config import Config
from .sources import check_hub_source, check_local_source


def make_tracker(cfg: Config) -> tuple[str | None, str | None]:
    """The accelerate tracker to log to, and a note to print when ``auto`` found none."""
    choice = cfg.train.tracker
    if choice in (None, "none"):
        return None, None
    if choice == "auto":
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            return None, ("no tracker: tensorboard is not installed "
                          "(pip install tensorboard, or set train.tracker: wandb)")
        return "tensorboard", None
    import importlib.util

    if importlib.util.find_spec(choice) is None:  # accelerate would skip it with a warning and log nothing
        raise SystemExit(f"train.tracker: {choice} is not installed: pip install {choice}, or set train.tracker: auto "
                         "(tensorboard when installed) or none")
    return choice, None


def tracker_hparams(tree: dict[str, Any], prefix: str = "") -> dict[str, int | float | str | bool]:
    """A config as trackers take hyperparameters: one flat key per setting (``train.lr``,
    ``budget.tokens_per_head``, ``data.sources.0.path``), so runs can be filtered and compared in TensorBoard or W&B
    (eight stringified sections could not be); numbers and booleans stay numbers, ``None`` reads ``"none"``."""
    out: dict[str, int | float | str | bool] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(tracker_hparams(value, f"{name}."))
        elif isinstance(value, (list, tuple)):
            if value and all(isinstance(v, dict) for v in value):  # data.sources: one group of keys per source
                for i, v in enumerate(value):
                    out.update(tracker_hparams(v, f"{name}.{i}."))
            else:
                out[name] = json.dumps(value, default=str)
        elif value is None:
            out[name] = "none"
        elif isinstance(value, (bool, int, float, str)):
            out[name] = value
        else:
            out[name] = str(value)
    return out


def check_positions(cfg: Config, model_config: Any) -> None:
    """Refuse rows longer than the positions the base model was built for: the gates would learn to keep entries
    for attention that the model itself never computes in use (RoPE past its trained range)."""
    from retention.attach import text_config

    limit = getattr(text_config(model_config), "max_position_embeddings", None)
    if limit is not None and cfg.data.seq_len > limit:
        raise SystemExit(f"data.seq_len = {cfg.data.seq_len} is longer than {cfg.model.name}'s {limit} positions "
                         f"(max_position_embeddings): use --set data.seq_len={limit} or less")


def check_budget(cfg: Config, model_config: Any) -> None:
    """Refuse a global budget that holds every entry of a full row (layers x KV heads x ``seq_len``): the capacity
    loss would have no term and the gates would learn only to keep everything (``budget.tokens_per_head`` is
    checked with the config, before the model's shapes are known)."""
    from retention.attach import text_config

    b, tc = cfg.budget, text_config(model_config)
    if cfg.loss.objective != "distill" or b.global_entries is None:
        return
    full = entries_for_tokens(cfg.data.seq_len, streams_of(tc.num_hidden_layers, tc.num_key_value_heads))
    if b.global_entries >= full:
        raise SystemExit(f"budget.global_entries = {b.global_entries} holds every entry of a full row of "
                         f"{cfg.model.name} ({full}: layers x KV heads x data.seq_len {cfg.data.seq_len}), so the "
                         "capacity loss never acts; give a smaller budget (or longer rows)")


def checks_before_loading(cfg: Config, resume: str | None, repo: str | None,
                           model_and_processor: tuple | None) -> tuple[Path | None, RetentionGates | None]:
    """Everything that can fail before the model loads, checked now rather than hours on: the upload's token, the
    checkpoint to resume and its fit, the export folder, the data sources, the starting gates and the model's
    shapes. Returns the checkpoint to resume (or None) and the starting gates (``gates.init_from``, widened)."""
    out_dir = Path(cfg.train.output_dir)
    if repo:  # the upload comes last: a missing token fails now, not hours on
        from retention.hub import HubError, check_push_target

        try:
            check_push_target(repo)
        except HubError as e:
            raise SystemExit(str(e)) from None
        given = model_and_processor[0] if model_and_processor else None  # a model handed to train(): its own name
        given = getattr(getattr(given, "config", None), "_name_or_path", "")
        if hub_model_id(given) is None and hub_model_id(cfg.model.name) is None:  # the push would refuse, at the end
            raise SystemExit(f"--push_to_hub {repo}: model.name {cfg.model.name!r} is a local folder that records no "
                             "Hub id, and the checkpoint's card must name its base model by Hub id; train without the "
                             "upload, then push with `retention push DIR REPO_ID --base-model owner/name`")
    try:  # a missing or damaged checkpoint fails now (or an earlier intact one is taken), not after the model loads
        ckpt = intact_checkpoint(out_dir, resume) if resume else None
    except FileNotFoundError as e:
        raise SystemExit(f"{e}: drop --resume to start a fresh run, or give a checkpoint folder (step-N)") from None
    if ckpt is not None:  # the checkpoint's gates must be the ones this config builds (say so before the model loads)
        check_resume_fits(cfg, ckpt)
    try:  # the export replaces its folder whole: a folder of someone's files fails now, not after the run
        check_gate_folder_target(cfg.export_dir())
    except FileExistsError as e:
        raise SystemExit(f"export.dir: {e} (--set export.dir=DIR)") from None
    # an unreadable local file or a missing Hub dataset fails now, not after the model loads
    for source in cfg.data.sources:
        check_local_source(source)
        check_hub_source(source)
    src = cfg.gates.init_from
    # a folder here, a shipped checkpoint's name, or a Hub id ("owner/name", never path-like); anything else is a
    # stage not yet run (say so before loading)
    if src and local_checkpoint(src) is None and (looks_like_a_path(src) or src.count("/") != 1):
        raise SystemExit(f"gates.init_from = {src!r} is not a folder here: train the run that writes it first "
                         f"(a stage-1 config's export.dir), or point init_from at a gate checkpoint folder or Hub repo")
    if model_and_processor is None:  # the model's config, not its weights: what cannot work fails before the load
        from retention.models import load_config

        model_config = load_config(cfg.model.name, revision=cfg.model.revision)[0]
        check_positions(cfg, model_config)
        check_budget(cfg, model_config)
    start_gates = None
    if src:  # loaded (and widened) before the model, so a bad checkpoint or width fails before the expensive load
        start_gates = load_gates(src)
        r = start_gates.config.gate_hidden
        if cfg.gates.widen_to is not None and cfg.gates.widen_to < r:
            raise SystemExit(f"gates.widen_to = {cfg.gates.widen_to} is narrower than the {r} hidden units of {src}: "
                             f"widening keeps every unit; give a width >= {r} or remove widen_to")
        if cfg.gates.widen_to is not None and cfg.gates.widen_to > r:
            start_gates = start_gates.widened(cfg.gates.widen_to,
                                              generator=torch.Generator().manual_seed(cfg.train.seed))
    return ckpt, start_gates
