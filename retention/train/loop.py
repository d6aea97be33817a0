"""The training loop: distil a frozen model into its retention-gated self under a KV budget.

Read top to bottom: set up (accelerate, model, gates, data, optimizer), then for each step a teacher
pass (gates bypassed, no grad) and a student pass (retention-gated attention), loss = KL + capacity,
an optimizer step on the gates only; checkpoints are atomic and resumable (checkpoint.py); the end exports
the gates.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from retention.attach import RetentionAttachment, attach_gates, check_gates_match, text_config_of, unwrap
from retention.compat import enable_activation_checkpointing
from retention.gates import GateConfig, check_gate_folder_target
from retention.hub import export_gates, load_gates, local_checkpoint, push_to_hub
from retention.losses import beta_stats, capacity_loss, capacity_terms, distillation_kl
from retention.models import cache_dir, load_model, looks_like_a_path
from retention.templates import with_template_variables

from .checkpoint import (DEEPSPEED_STATE, StopRequests, check_resume_fits, deepspeed_processes, find_checkpoint,
                         hold_run_folders,
                         load_deepspeed_state, run_settings, save_checkpoint, save_deepspeed_state,
                         set_aside_old_checkpoints, set_rng_state)
from .config import Config
from .data import PackedStream, build_data, collate_any
from .multimodal_data import build_multimodal, shows_images
from .precision import training_precision
from .sources import check_hub_source, check_local_source
from .evict import HARD_TAU, EvictionDistiller, ExampleStream, future_rank_loss, load_examples

if TYPE_CHECKING:
    from accelerate import Accelerator


class Distiller(nn.Module):
    """One forward = teacher pass + student pass, so DDP / DeepSpeed see a single module call.

    Returns final hidden states ``(B, T, D)`` of both passes and the student's ``log_beta`` per layer.
    """

    def __init__(self, model: nn.Module, attachment: RetentionAttachment) -> None:
        super().__init__()
        self.model = model
        self.attachment = attachment

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                **extra: Any) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        import contextlib

        decoder = unwrap(self.model).model  # the transformer without the LM head
        kw = dict(input_ids=input_ids, position_ids=position_ids, use_cache=False, **extra)
        # with LoRA co-training the teacher is the original model: adapters off as well as gates
        no_adapter = getattr(self.model, "disable_adapter", None)
        with torch.no_grad(), self.attachment.teacher(), (no_adapter() if no_adapter else contextlib.nullcontext()):
            h_teacher = decoder(**kw).last_hidden_state
        with self.attachment.student():
            h_student = decoder(**kw).last_hidden_state
        return h_student, h_teacher, self.attachment.log_betas()


def budget_total(cfg: Config, streams: int) -> int:
    """The configured budget in KV entries for a model with ``streams`` = layers x KV heads."""
    b = cfg.budget
    return b.global_entries if b.global_entries is not None else b.tokens_per_head * streams


def evict_budget_text(cfg: Config) -> str:
    """Objective ``evict``: its budgets are shares of each item's context (``loss.evict_fractions``).

    The list is a draw (a share listed twice is drawn twice as often) whose first entry is the held-out budget,
    so the text names the distinct shares and the held-out one rather than echoing the list.
    """
    fr = cfg.loss.evict_fractions
    shares = sorted(set(fr))
    if len(shares) == 1:
        return f"global top-B of {fr[0]:.0%} of each context"
    listed = ", ".join(f"{f:.0%}" for f in shares)
    return f"global top-B of {listed} of each context (drawn per item; held out at {fr[0]:.0%})"


def budget_entries(cfg: Config, model: nn.Module) -> tuple[float, str]:
    """The capacity target M for the configured form and a readable description of it."""
    tc = text_config_of(model)
    streams = tc.num_hidden_layers * tc.num_key_value_heads
    total = budget_total(cfg, streams)
    return ((total / streams if cfg.loss.capacity_form == "per_head" else float(total)),
            capacity_budget_text(cfg, streams))


def capacity_budget_text(cfg: Config, streams: int) -> str:
    """The capacity budget in words: per KV head for TRIM-KV's per-head form, else one total for the model."""
    total = budget_total(cfg, streams)
    if cfg.loss.capacity_form == "per_head":
        return f"{total / streams:g} entries per KV head ({total} in all)"
    return f"{total} entries in all ({total / streams:g} per KV head on average)"


def mrope_positions(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """M-RoPE positions ``(3, B, T)`` of a packed multimodal row, from the model's own rule.

    Computed over the whole row: a later conversation's positions are shifted by a constant in all
    three axes, which leaves its attention unchanged (RoPE sees only differences, and the packing
    keeps conversations from attending to each other)."""
    inner = unwrap(model).model
    pos, _ = inner.get_rope_index(batch["input_ids"], mm_token_type_ids=batch["mm_token_type_ids"],
                                  image_grid_thw=batch.get("image_grid_thw"))
    return pos


def _zero3(accelerator) -> bool:
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return plugin is not None and plugin.zero_stage == 3


def gathered(accelerator: Accelerator, params: Iterable[nn.Parameter]) -> contextlib.AbstractContextManager[None]:
    """Full (unpartitioned) parameters inside the block under DeepSpeed ZeRO-3 (collective: every rank
    enters); a no-op otherwise."""
    import contextlib

    if not _zero3(accelerator):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(params), modifier_rank=None)


def lr_lambda(cfg: Config) -> Callable[[int], float]:
    warm, total = cfg.train.warmup_steps, cfg.train.steps

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        if cfg.train.schedule == "constant":
            return 1.0
        progress = (step - warm) / max(1, total - warm)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return f


def extra_trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    """Trainable weights other than the gates (LoRA adapters when co-training), by name."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad and "retention_gates." not in n}


def init_from_note(cfg: Config) -> str | None:
    """What a run continued from, for its card: ``init_from`` and, for a local checkpoint, its steps,
    config and row length (read at export time, before anything may overwrite the folder)."""
    src = cfg.gates.init_from
    if not src:
        return None
    folder = local_checkpoint(src)  # a folder here or a shipped checkpoint's name
    meta = None if folder is None else folder / "config.json"
    if meta is None or not meta.is_file():
        return str(src)  # a Hub repo id: its own card says how it was trained
    parent = json.loads(meta.read_text()).get("training", {})
    if "averaged_from" in parent:  # a soup (`retention average`) trained no steps itself: its recipe says what it is
        return f"{src} (a weight-space average: {parent['averaged_from']})"
    said = [f"{parent['steps']} steps" if "steps" in parent else None,
            f"{parent['tokens_per_step']}-token rows" if "tokens_per_step" in parent else None,
            parent.get("config")]
    if "held_out_kl" in parent:  # a float (finished run) or "0.0125 (step 50)" (an exported unfinished one)
        kl = parent["held_out_kl"]
        kl = f"{kl:.4g}" if isinstance(kl, float) else str(kl)
        before = parent.get("held_out_kl_before")
        said.append(f"held-out KL {before:.4g} -> {kl}" if isinstance(before, float) else f"held-out KL {kl}")
    said = [x for x in said if x]
    return f"{src} ({', '.join(said)})" if said else str(src)


def run_facts(cfg: Config) -> dict[str, str]:
    """The config file, data mix and starting gates a run used, for its checkpoint card."""
    facts = {"data": cfg.describe_data()}
    if src := cfg.describe_source():
        facts["config"] = src
    if note := init_from_note(cfg):
        facts["init_from"] = note
        if cfg.gates.widen_to is not None:
            facts["init_from"] += (f"; each gate MLP widened to {cfg.gates.widen_to} hidden units "
                                   "(new units' readout from 0)")
    if any(src.weight != 1 for src in cfg.data.sources):
        # the card's training-KL rows are then the source-weighted mean; held-out rows are always the plain mean
        facts["kl_weighting"] = ("the training-KL rows (first_kl, final_kl, kl_last_10_steps) weight each "
                                 "source's positions by its data weight; held_out_kl is the plain mean over the "
                                 "held-out rows")
    if cfg.loss.objective == "evict":
        facts["objective"] = (f"eviction-aware distillation (retention/train/evict.py): each item's continuation "
                              f"read over a relaxed global top-B of its prefilled context, tau {cfg.loss.evict_tau:g}, "
                              f"budgets {', '.join(f'{f:g}' for f in cfg.loss.evict_fractions)} of the context; "
                              f"held-out KL over the hard top-B at {cfg.loss.evict_fractions[0]:g} (not comparable "
                              "with a distill stage's soft-decay KL)")
        if cfg.loss.rank_weight:
            # layer / head: the gates' split, described below
            scope = "global " if cfg.loss.rank_scope == "global" else ""
            facts["objective"] += (f"; plus {cfg.loss.rank_weight:g} x a ranking loss against the future-attention "
                                   f"oracle's {scope}top-B (retention.train.evict.future_rank_loss, "
                                   f"tau {cfg.loss.rank_tau:g}"
                                   + (", ranked by the attention of the distilled positions only"
                                      if cfg.loss.rank_queries == "targets" else "")
                                   + (f", within each {cfg.loss.rank_scope} at the gates' own split of the budget"
                                      if cfg.loss.rank_scope != "global" else "")
                                   + ")")
    if cfg.gates.sink:
        facts["sink"] = (f"the first {cfg.gates.sink} tokens of each sequence never decayed "
                         "(the inference policy keeps them)")
    return facts


def export_checkpoint(cfg: Config, checkpoint: str = "latest", dest: str | Path | None = None) -> Path:
    """Export the gates of a training checkpoint (an unfinished run, e.g. one spread over sessions) as
    a self-describing gate checkpoint, without loading the base model; the card says how far it got."""
    from safetensors.torch import load_file

    from retention.gates import GateConfig, RetentionGates
    from retention.models import EMBEDDED_MODELS

    ckpt = find_checkpoint(Path(cfg.train.output_dir), checkpoint)
    check_resume_fits(cfg, ckpt, flag="--export")  # the card's facts (tokens seen, data, budget) come from cfg
    meta = json.loads((ckpt / "state.json").read_text())
    gates = RetentionGates(GateConfig(**meta["gate_config"]))
    gates.load_state_dict(load_file(str(ckpt / "gates.safetensors")))
    check_finite_gates(gates.parameters(), f"{ckpt}'s gates")
    gc, history, step = gates.config, meta["history"], meta["step"]
    streams = gc.num_layers * gc.num_kv_heads
    if cfg.loss.objective == "evict":
        budget_text = evict_budget_text(cfg)
    else:
        budget_text = f"{capacity_budget_text(cfg, streams)}, capacity {cfg.loss.capacity_form}"
    tail = history[-10:]
    training: dict[str, Any] = {
        "steps": f"{step} of {cfg.train.steps}" + ("" if step >= cfg.train.steps else " (unfinished run)"),
        # each step's record holds its tokens (processes and evict items' own lengths counted); older records lack it
        "tokens_seen": round(sum(r.get("tokens", cfg.train.batch_size * cfg.train.grad_accum * cfg.data.seq_len)
                                 for r in history)),
        "first_kl": round(history[0]["kl"], 5) if history else None,
        "kl_last_10_steps": round(float(np.mean([r["kl"] for r in tail])), 5) if tail else None,
        "capacity_last_10_steps": round(float(np.mean([r["capacity"] for r in tail])), 5) if tail else None,
        "soft_cache_entries_last_10_steps": (round(float(np.mean([r["soft_cache_entries"] for r in tail])))
                                             if tail else None),
    }
    if meta.get("before"):
        training["held_out_kl_before"] = round(meta["before"]["kl"], 5)
    evals = [r for r in history if "eval_kl" in r]
    if evals:  # the latest held-out evaluation (every train.eval_every steps)
        training["held_out_kl"] = f"{evals[-1]['eval_kl']:.5f} (step {evals[-1]['step']})"
    training.update(run_facts(cfg))
    spec = EMBEDDED_MODELS.get(cfg.model.name)
    dest = Path(dest or cfg.export_dir())
    export_gates(gates, dest, base_model=spec.hub_id if spec else cfg.model.name, base_revision=cfg.model.revision,
                 budget=budget_text, training=training, checkpoint=f"{ckpt.name} of {cfg.train.output_dir}")
    return dest


def check_finite_gates(params: Iterable[torch.Tensor], what: str) -> None:
    """SystemExit before gates holding NaN or inf are written (a checkpoint, an export): the run diverged, and such
    gates would evict at random (every comparison with NaN is false)."""
    bad = sum(int((~torch.isfinite(p.detach())).sum()) for p in params)
    if bad:
        raise SystemExit(f"{what} hold {bad:,} NaN or infinite weights: the run diverged; lower train.lr (or set "
                         "train.clip), then start again or --resume an earlier checkpoint; nothing was written")


def _make_tracker(cfg: Config) -> tuple[str | None, str | None]:
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


def train(
    cfg: Config, resume: str | None = None, push_to_hub_repo: str | None = None,
    model_and_processor: tuple | None = None,
) -> dict[str, Any]:
    """Run the configured training; returns a summary (losses, export path).

    ``model_and_processor``: an already loaded ``(model, tokenizer or processor)`` to train instead of
    loading ``cfg.model.name`` (which then only names the run). A second run into the same ``train.output_dir``
    while this one runs gets :class:`~retention.io.FolderBusyError` (rank 0 holds the folder).
    """
    rank0 = os.environ.get("RANK", "0") == "0"  # before the Accelerator exists: torchrun / accelerate set RANK
    with hold_run_folders(cfg) if rank0 else contextlib.nullcontext():  # output and export folders, stale temp
        return _train(cfg, resume, push_to_hub_repo, model_and_processor)


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
    full = tc.num_hidden_layers * tc.num_key_value_heads * cfg.data.seq_len
    if b.global_entries >= full:
        raise SystemExit(f"budget.global_entries = {b.global_entries} holds every entry of a full row of "
                         f"{cfg.model.name} ({full}: layers x KV heads x data.seq_len {cfg.data.seq_len}), so the "
                         "capacity loss never acts; give a smaller budget (or longer rows)")


def _train(cfg: Config, resume: str | None, push_to_hub_repo: str | None,
           model_and_processor: tuple | None) -> dict[str, Any]:
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs, set_seed

    out_dir = Path(cfg.train.output_dir)
    repo = push_to_hub_repo or cfg.export.push_to_hub
    if repo:  # the upload comes last: a missing token fails now, not hours on
        from retention.hub import HubError, check_push_target

        try:
            check_push_target(repo)
        except HubError as e:
            raise SystemExit(str(e)) from None
    try:  # a missing checkpoint fails now, not after the model and data load
        ckpt = find_checkpoint(out_dir, resume) if resume else None
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
    mp = training_precision(cfg, cuda=torch.cuda.is_available())  # says the device and precision used
    use_deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    deepspeed_cpu = use_deepspeed and os.environ.get("DS_ACCELERATOR") == "cpu"  # DeepSpeed's CPU accelerator (gloo)
    if use_deepspeed and not torch.cuda.is_available() and not deepspeed_cpu:
        raise SystemExit("DeepSpeed runs need GPUs; without them launch DDP over gloo instead: "
                         "accelerate launch --multi_gpu --num_processes N train.py ..., or set DS_ACCELERATOR=cpu "
                         "for DeepSpeed's CPU accelerator (gloo; slow, for checks)")
    tracker, tracker_note = _make_tracker(cfg)
    accelerator = Accelerator(
        mixed_precision=mp,
        # without GPUs, multi-process runs use DDP over gloo (cpu=True would turn DeepSpeed off on its CPU accelerator)
        cpu=not torch.cuda.is_available() and not deepspeed_cpu,
        gradient_accumulation_steps=cfg.train.grad_accum,
        log_with=tracker,
        project_dir=str(out_dir),
        step_scheduler_with_optimizer=False,  # one schedule step per optimizer step, whatever the world size
        # accelerate finds no backend for DeepSpeed's CPU accelerator and would count one process per rank
        kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")] if deepspeed_cpu else None,
    )
    set_seed(cfg.train.seed)
    if accelerator.device.type == "cpu":
        # the softmax of a long row underflows to denormals, which x86 CPUs compute ~100x slower: flushed to 0 they
        # change nothing above 1e-38 and the gated attention's fused SDPA path runs ~3x faster (bench_kernels --cpu)
        torch.set_flush_denormal(True)
    main = accelerator.is_main_process

    # -- model and gates --------------------------------------------------------------------------
    if model_and_processor is not None:
        model, processor = model_and_processor
        check_positions(cfg, unwrap(model).config)
        check_budget(cfg, unwrap(model).config)
    else:
        model, processor = load_model(
            cfg.model.name, dtype=cfg.model.dtype, revision=cfg.model.revision,
            attn_implementation=cfg.model.attn_implementation,
        )
    # the data renders with the config's template variables (a copy: the model's own tokenizer stays as it was)
    processor = with_template_variables(processor, cfg.data.chat_template_kwargs)
    tokenizer = getattr(processor, "tokenizer", processor)
    if cfg.lora.enabled:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model

        # peft reads transformers' deprecated `is_gradient_checkpointing`: not ours to fix
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            model = get_peft_model(
                model,
                PeftLoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                               target_modules=cfg.lora.target_modules),
            )
    if start_gates is not None:
        check_gates_match(model, start_gates.config)
        gates = start_gates
    else:
        g = cfg.gates
        gates = GateConfig.for_model(model, variant=g.variant, gate_hidden=g.gate_hidden, bias_init=g.bias_init,
                                     activation=g.activation)
    attachment = attach_gates(model, gates)
    attachment.sink = cfg.gates.sink
    if cfg.lora.enabled:  # attach_gates froze the base; LoRA weights co-train with the gates
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.requires_grad_(True)
    if cfg.model.gradient_checkpointing:
        enable_activation_checkpointing(unwrap(model))
    evicting = cfg.loss.objective == "evict"
    if evicting:  # the budget is a share of each item's context, not budget.*
        budget, budget_text = None, evict_budget_text(cfg)
    else:
        budget, budget_text = budget_entries(cfg, model)
    lm_head = unwrap(model).get_output_embeddings()

    # -- data ---------------------------------------------------------------------------------------
    # objective "evict": one item (context + continuation) a micro-step; otherwise packed rows
    if evicting:
        train_rows, eval_rows = load_examples(cfg.data, tokenizer, cache=cache_dir() / "data")
        stream = ExampleStream(train_rows, cfg.loss.evict_fractions, cfg.data.seed, accelerator.process_index,
                               accelerator.num_processes)
    else:
        if any(shows_images(s) for s in cfg.data.sources):
            train_rows, eval_rows = build_multimodal(cfg.data, processor, cache=cache_dir() / "data")
        else:
            train_rows, eval_rows = build_data(cfg.data, tokenizer, cache=cache_dir() / "data")
        stream = PackedStream(train_rows, cfg.train.batch_size, cfg.data.seed, accelerator.process_index,
                              accelerator.num_processes)

    # -- optimizer: only trainable (gate, optional LoRA) parameters ----------------------------------
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    distiller = EvictionDistiller(model, attachment) if evicting else Distiller(model, attachment)
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None:  # no DataLoader goes through prepare: give DeepSpeed the batch and clipping
        plugin.deepspeed_config.update(
            train_micro_batch_size_per_gpu=cfg.train.batch_size, gradient_accumulation_steps=cfg.train.grad_accum,
            train_batch_size=cfg.train.batch_size * cfg.train.grad_accum * accelerator.num_processes,
            gradient_clipping=cfg.train.clip,
        )
    if ckpt is not None:  # the weights before prepare: DeepSpeed copies them into its own fp32 master weights there
        from safetensors.torch import load_file

        try:
            attachment.gates.load_state_dict(load_file(str(ckpt / "gates.safetensors")))
        except RuntimeError as e:  # gates of another shape (a changed init_from or widen_to)
            raise SystemExit(f"--resume {ckpt}: its gates do not fit the ones this config builds ({e}); resume "
                             "with the settings the run started with, or start a fresh run") from None
        if (ckpt / "trainable.safetensors").is_file():
            named = dict(model.named_parameters())
            with torch.no_grad():
                for n, t in load_file(str(ckpt / "trainable.safetensors")).items():
                    named[n].copy_(t)
    distiller, optimizer = accelerator.prepare(distiller, optimizer)
    if _zero3(accelerator):  # ZeRO-3 partitions the LM head; the chunked KL needs it whole (frozen: one copy)
        with gathered(accelerator, lm_head.parameters()):
            lm_head = nn.Linear(lm_head.in_features, lm_head.out_features, bias=lm_head.bias is not None,
                                device=accelerator.device, dtype=lm_head.weight.dtype).requires_grad_(False)
            lm_head.load_state_dict(unwrap(model).get_output_embeddings().state_dict())

    step, history, before = 0, [], None
    if ckpt is not None:
        state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
        shards = deepspeed_processes(ckpt)
        if plugin is None and state.get("optimizer") is not None:
            optimizer.load_state_dict(state["optimizer"])
        elif plugin is not None and shards == accelerator.num_processes:  # its sharded optimizer, one file per rank
            load_deepspeed_state(distiller, ckpt / DEEPSPEED_STATE)
        elif main:  # the weights are loaded either way
            then = f"a DeepSpeed run of {shards} processes" if shards else "a run without DeepSpeed"
            now = f"DeepSpeed with {accelerator.num_processes}" if plugin is not None else "no DeepSpeed"
            print(f"[retention] warning: {ckpt.name}'s optimizer state was written by {then} and this run has {now}: "
                  "the Adam moments restart (resume with the run's own launch settings to continue it exactly)")
        scheduler.load_state_dict(state["scheduler"])
        meta = json.loads((ckpt / "state.json").read_text())
        step, history, before = meta["step"], meta["history"], meta.get("before")
        stream.load_state_dict(meta["data"])
        set_rng_state(state["rng"])
        if main:
            print(f"[retention] resumed from {ckpt} at step {step}")
    if tracker:
        accelerator.init_trackers("retention", config={k: str(v) for k, v in cfg.to_dict().items()})
    if main:
        n = sum(getattr(p, "ds_numel", p.numel()) for p in params)  # ZeRO-3 leaves each rank a shard (numel 0)
        kind = accelerator.distributed_type.value
        world = (f"{accelerator.num_processes} processes ({kind})" if accelerator.num_processes > 1
                 else "1 process" + ("" if kind == "NO" else f" ({kind})"))  # one GPU under DeepSpeed says so
        data_text = (f"objective evict: {len(train_rows)} train / {len(eval_rows)} held-out items, "
                     f"budget {budget_text}" if evicting else
                     f"budget {budget_text}; {len(train_rows)} train / {len(eval_rows)} held-out rows of "
                     f"{cfg.data.seq_len} tokens")
        print(f"[retention] {cfg.model.name}: {n:,} trainable parameters; {data_text}; {world}")
        if not eval_rows:  # reported as missing, not as NaN numbers
            print("[retention] no held-out " + ("items" if evicting else "rows") + ": "
                  + ("data.eval_fraction is 0" if cfg.data.eval_fraction == 0 else
                     "the data fills too few to hold any out (more data, or a shorter data.seq_len)")
                  + "; the run reports no held-out KL")
        if tracker_note:
            print(f"[retention] {tracker_note}")

    def global_mean(total: torch.Tensor, count: float, accumulated: int = 1) -> torch.Tensor:
        """Sum over this rank / count over all ranks, times the world size (DDP averages gradients):
        the gradient equals one process's pooled mean over the same global batch. ``count``: the whole step's
        (all ``accumulated`` micro-batches'), whose losses accelerate divides by ``accumulated``."""
        n = accelerator.reduce(torch.tensor(float(count), device=accelerator.device), "sum")
        # counts may be weights < 1
        return total * (accelerator.num_processes * accumulated) / torch.where(n > 0, n, torch.ones_like(n))

    gate_streams = attachment.gates.config.num_layers * attachment.gates.config.num_kv_heads

    def step_counts(batches: list) -> dict[str, float]:
        """This rank's count for each mean over a step's micro-batches: distilled positions (or their weights),
        capacity terms and cross-entropy targets. Each micro-batch's sum is divided by the step's count, not its
        own, so batch_size 1 x grad_accum 2 trains as batch_size 2 on the same rows (a micro-batch's own mean
        gave a row of few distilled positions, or of a lightly weighted source, as much say as a full one)."""
        kl = cap = ce = 0.0
        for batch in batches:
            if evicting:
                example, _ = batch
                kl += sum(example.targets) * example.weight
                continue
            mask, weight = batch["loss_mask"], batch.get("loss_weight")
            kl += float(mask.sum()) if weight is None else float(weight[mask].sum())
            B, T = mask.shape
            cap += int(capacity_terms(batch["cu_seqlens"], B, gate_streams, T, budget, cfg.loss.capacity_form,
                                      batch.get("capacity_mask"))[1].sum())
            ce += float(mask[:, :-1].sum())
        return {"kl": kl, "capacity": cap, "ce": ce}

    def evict_losses(example, fraction: float, weighted: bool = True, counts: dict[str, float] | None = None):
        """Objective ``evict``: KL over an item's continuation read over a relaxed global top-B of its context;
        held-out (``weighted=False``) over the hard top-B itself, what inference keeps, whatever ``evict_tau``."""
        dev = accelerator.device
        head, tail = torch.tensor([example.head], device=dev), torch.tensor([example.tail], device=dev)
        tau = cfg.loss.evict_tau if weighted else HARD_TAU
        ranking = bool(cfg.loss.rank_weight)
        mask = torch.tensor([example.targets], device=dev)
        # rank_queries targets: the oracle ranks the context by the attention of the distilled positions only
        queries = mask[0].float() if ranking and cfg.loss.rank_queries == "targets" else None
        h_s, h_t, log_betas, stats = distiller(head, tail, fraction, tau, future_mass=ranking, mass_queries=queries)
        weights = mask.float() * (example.weight if weighted else 1.0)
        kl_sum, kl_n = distillation_kl(h_s, h_t, lm_head, mask, cfg.loss.kl_temperature, cfg.loss.kl_chunk,
                                       reduction="sum", weights=weights)
        kl = global_mean(kl_sum, counts["kl"], cfg.train.grad_accum) if counts else global_mean(kl_sum, kl_n)
        # no capacity term: the top-B itself holds the budget; the record keeps the soft kept size
        cap_stats = {"soft_cache_entries": stats["soft_entries"], "budget_entries": stats["budget"],
                     "capacity_terms": 1}
        loss = kl
        if ranking:  # the gates' keep decisions against the future-attention oracle's top-B (global or per layer)
            rank, rank_stats = future_rank_loss(log_betas, stats["future_mass"], int(stats["budget"]), attachment.sink,
                                                cfg.loss.rank_tau, scope=cfg.loss.rank_scope)
            rank = global_mean(rank, 1)  # a collective: every item computes it, so ranks stay in step
            # a source's rank_weight scales its items' share (0: the KL alone); held-out loss is the plain sum
            loss = kl + cfg.loss.rank_weight * (example.rank_weight if weighted else 1.0) * rank
            cap_stats.update(rank_loss=float(rank.detach()), **rank_stats)
        return loss, kl, torch.zeros((), device=dev), cap_stats, log_betas

    def losses(batch, weighted: bool = True, counts: dict[str, float] | None = None):
        """``weighted=False``: the plain mean KL (held-out KL stays comparable whatever the sources' weights).
        ``counts``: the step's :func:`step_counts`, for a training micro-batch (else the batch's own means)."""
        if evicting:
            return evict_losses(*batch, weighted=weighted, counts=counts)
        accumulated = cfg.train.grad_accum if counts else 1
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        vision = {k: batch[k] for k in ("pixel_values", "image_grid_thw", "mm_token_type_ids") if k in batch}
        # packed rows carry positions restarting in each document (the teacher's block-diagonal mask and
        # the student's document boundaries come from them)
        position_ids = batch["position_ids"]
        if "mm_token_type_ids" in batch:  # Qwen3-VL: text positions on top of the M-RoPE (t, h, w) rows
            position_ids = torch.cat([position_ids[None], mrope_positions(model, batch)])
        h_s, h_t, log_betas = distiller(batch["input_ids"], position_ids, **vision)
        kl_sum, kl_n = distillation_kl(
            h_s, h_t, lm_head, batch["loss_mask"], cfg.loss.kl_temperature, cfg.loss.kl_chunk, reduction="sum",
            weights=batch.get("loss_weight") if weighted else None,
        )
        cap_sum, cap_stats = capacity_loss(log_betas, budget, cfg.loss.capacity_form, batch["cu_seqlens"],
                                           reduction="sum", mask=batch.get("capacity_mask"))
        kl = global_mean(kl_sum, counts["kl"] if counts else kl_n, accumulated)
        cap = global_mean(cap_sum, counts["capacity"] if counts else cap_stats["capacity_terms"], accumulated)
        loss = kl + cfg.loss.capacity_weight * cap
        if cfg.loss.ce_weight:
            ce = nn.functional.cross_entropy(
                lm_head(h_s[:, :-1]).flatten(0, 1).float(), batch["input_ids"][:, 1:].flatten(), reduction="none"
            )
            m = batch["loss_mask"][:, :-1].flatten().float()
            loss = loss + cfg.loss.ce_weight * global_mean((ce * m).sum(), counts["ce"] if counts else int(m.sum()),
                                                           accumulated)
        return loss, kl, cap, cap_stats, log_betas

    def evaluate() -> dict[str, float]:
        """Held-out KL, capacity loss, soft cache size and mean beta over the first ``eval_batches`` batches."""
        vals: dict[str, list[float]] = {"kl": [], "capacity": [], "soft_cache_entries": [], "beta_mean": []}
        with torch.no_grad():
            for i in range(0, min(len(eval_rows), cfg.train.eval_batches * cfg.train.batch_size), cfg.train.batch_size):
                # objective evict: each held-out item at the first listed budget fraction
                batch = ((eval_rows[i], cfg.loss.evict_fractions[0]) if evicting
                         else collate_any(eval_rows[i : i + cfg.train.batch_size]))
                _, kl, cap, cap_stats, log_betas = losses(batch, weighted=False)
                # every rank evaluates the same rows, so each rank's share of the "global" mean is that mean
                vals["kl"].append(float(kl))
                vals["capacity"].append(float(cap))
                vals["soft_cache_entries"].append(cap_stats["soft_cache_entries"])
                vals["beta_mean"].append(float(np.mean(beta_stats(log_betas)["beta_mean"])))
                if "rank_recall" in cap_stats:  # objective evict with the ranking loss: the oracle's top-B kept
                    vals.setdefault("rank_recall", []).append(cap_stats["rank_recall"])
        return {k: float(np.mean(v)) for k, v in vals.items()}

    if before is None and cfg.train.report_before and eval_rows:
        before = evaluate()  # the untrained gates on the held-out rows, for the before/after report
        if main:
            print(f"[retention] before training, held-out: KL {before['kl']:.4f}, capacity {before['capacity']:.4f}, "
                  f"soft cache {before['soft_cache_entries']:.0f} entries, mean beta {before['beta_mean']:.4f}"
                  + (f", oracle top-B recall {before['rank_recall']:.3f}" if "rank_recall" in before else ""))

    row_tokens = ((sum(len(e.head) + len(e.tail) for e in train_rows) / len(train_rows)) if evicting
                  else cfg.data.seq_len)
    tokens_per_step = round(cfg.train.batch_size * row_tokens * cfg.train.grad_accum * accelerator.num_processes)
    # a fresh run (or one continued from another folder's checkpoint) moves this folder's earlier checkpoints aside
    # only now, once the model and data have loaded: a run that fails or is stopped before this leaves them in place
    if main and (ckpt is None or ckpt.parent.resolve() != (out_dir / "checkpoints").resolve()):
        set_aside_old_checkpoints(out_dir)
    bar = tqdm(total=cfg.train.steps, initial=step, disable=not main, desc="train", unit="step")
    t_start = time.perf_counter()
    start_step = step
    held, held_step = None, None  # the latest held-out pass and its step
    # Ctrl-C / SIGTERM in the loop: stop after the step with a checkpoint; after it (held-out pass, export) as usual
    with StopRequests(announce=main) as stop_requests:
        while step < cfg.train.steps:
            lr = scheduler.get_last_lr()[0]  # the rate this step's update uses (the scheduler steps after it)
            batches = [stream.next_batch() for _ in range(cfg.train.grad_accum)]
            counts = step_counts(batches)
            parts = []
            for batch in batches:
                with accelerator.accumulate(distiller):
                    loss, kl, cap, cap_stats, log_betas = losses(batch, counts=counts)
                    parts.append((loss.detach(), kl.detach(), cap.detach()))
                    accelerator.backward(loss)
                    if accelerator.sync_gradients and cfg.train.clip:
                        accelerator.clip_grad_norm_(params, cfg.train.clip)
                    optimizer.step()
                    if accelerator.sync_gradients:
                        scheduler.step()
                    optimizer.zero_grad()
            step += 1
            bstats = beta_stats(log_betas)
            # each micro-batch holds grad_accum times its share of the step's mean, each rank its share of the
            # global mean: the mean over micro-batches, then over ranks, is the step's pooled mean
            loss, kl, cap = (accelerator.reduce(torch.stack(x).mean(), "mean") for x in zip(*parts))
            record = {
                "step": step, "loss": float(loss), "kl": float(kl), "capacity": float(cap),
                "lr": lr, "tokens": tokens_per_step, **cap_stats,
                "beta_mean": float(np.mean(bstats["beta_mean"])),
            }
            if not math.isfinite(record["loss"]):  # diverged: every later step and the export would be NaN too
                bar.close()
                raise SystemExit(f"step {step}: the loss is {record['loss']} (KL {record['kl']}, capacity "
                                 f"{record['capacity']}) at train.lr {lr:g}: the run diverged; lower train.lr (or "
                                 "set train.clip), then start again or --resume an earlier checkpoint; nothing of "
                                 "this step was saved")
            history.append(record)
            elapsed = time.perf_counter() - t_start
            bar.set_postfix(kl=f"{record['kl']:.4f}", cap=f"{record['capacity']:.3f}",
                            cache=f"{record['soft_cache_entries']:.0f}",
                            tok_s=f"{tokens_per_step * (step - start_step) / elapsed:.0f}")
            bar.update(1)
            if accelerator.trackers:
                per_layer = {f"beta_{stat.split('_')[1]}/layer_{i:02d}": v for stat in ("beta_mean", "beta_std")
                             for i, v in enumerate(bstats[stat])}
                accelerator.log({**{k: v for k, v in record.items() if k != "step"}, **per_layer}, step=step)
            if main and step % cfg.train.log_every == 0:
                per_layer = " ".join(f"{m:.3f}±{s:.3f}" for m, s in zip(bstats["beta_mean"], bstats["beta_std"]))
                ranked = (f"rank {record['rank_loss']:.4f} recall {record['rank_recall']:.3f} "
                          if "rank_recall" in record else "")
                tqdm.write(f"step {step}: loss {record['loss']:.4f} kl {record['kl']:.4f} "
                           f"capacity {record['capacity']:.4f} {ranked}"
                           f"soft cache {record['soft_cache_entries']:.0f} entries | beta per layer {per_layer}")
            if cfg.train.eval_every and step % cfg.train.eval_every == 0 and eval_rows:
                held, held_step = evaluate(), step
                record["eval_kl"] = held["kl"]
                if "rank_recall" in held:
                    record["eval_rank_recall"] = held["rank_recall"]
                if accelerator.trackers:
                    accelerator.log({k: record[k] for k in ("eval_kl", "eval_rank_recall") if k in record}, step=step)
                if main:
                    recall = f", oracle top-B recall {held['rank_recall']:.3f}" if "rank_recall" in held else ""
                    tqdm.write(f"step {step}: held-out KL {record['eval_kl']:.4f}{recall}")
            asked = stop_requests.asked
            if accelerator.num_processes > 1:  # every rank stops at the same step, or the next collective hangs
                asked = bool(accelerator.reduce(torch.tensor(float(asked), device=accelerator.device), "sum") > 0)
            stopping = asked or (cfg.train.stop_after is not None and step >= cfg.train.stop_after)
            saving = step % cfg.train.save_every == 0 or step == cfg.train.steps or stopping
            shards = None
            # every rank writes its optimizer shard (collective), then main moves them in
            if saving and plugin is not None:
                shards = out_dir / "checkpoints" / f".step-{step}.{DEEPSPEED_STATE}"
                save_deepspeed_state(distiller, shards)
                accelerator.wait_for_everyone()
            with gathered(accelerator, params) if saving else contextlib.nullcontext():  # the gates and any LoRA
                if saving:  # on every rank (the same whole weights), so all stop together
                    check_finite_gates(params, f"step {step}'s gates")
                if main and saving:
                    save_checkpoint(out_dir / "checkpoints" / f"step-{step}", attachment.gates, optimizer, scheduler,
                                    stream, step, history, extra_trainable(model), before=before,
                                    deepspeed_state=shards, settings=run_settings(cfg))
                if main and saving:
                    old = sorted((out_dir / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
                    for p in old[: -cfg.train.keep_checkpoints]:
                        shutil.rmtree(p, ignore_errors=True)
            if stopping and step < cfg.train.steps:
                bar.close()
                accelerator.wait_for_everyone()
                if main:
                    why = "when interrupted" if asked else "as asked"
                    print(f"[retention] stopped after step {step} {why}, "
                          f"checkpoint {out_dir / 'checkpoints' / f'step-{step}'} "
                          "written; continue with --resume")
                accelerator.end_training()
                return {"steps": step, "stopped_early": True, "history": history}
    bar.close()

    # the last step's held-out pass already scored these gates: no second pass over the same items
    after = (held if held_step == step else evaluate()) if eval_rows else {}
    summary: dict[str, Any] = {
        "steps": step, "first_kl": history[0]["kl"] if history else None,
        "final_kl": history[-1]["kl"] if history else None,
        "final_capacity": history[-1]["capacity"] if history else None, "tokens_per_step": tokens_per_step,
    }
    if after:
        summary.update(held_out_kl=after["kl"], held_out_capacity=after["capacity"],
                       held_out_soft_cache_entries=after["soft_cache_entries"])
    if before is not None:
        summary["held_out_kl_before"] = before["kl"]
        summary["held_out_capacity_before"] = before["capacity"]
    if "rank_recall" in after:  # the share of the oracle's top-B that the gates' hard top-B keeps
        summary["held_out_oracle_recall"] = after["rank_recall"]
        if before is not None and "rank_recall" in before:
            summary["held_out_oracle_recall_before"] = before["rank_recall"]
    summary.update(run_facts(cfg))
    export_dir = cfg.export_dir()
    with gathered(accelerator, params):  # ZeRO-3: whole gates and LoRA weights to write
        check_finite_gates(params, "the trained gates")  # on every rank, as for checkpoints
        if main:
            base = getattr(unwrap(model).config, "_name_or_path", cfg.model.name)
            export_gates(
                attachment.gates, export_dir, base_model=base, base_revision=cfg.model.revision, budget=budget_text,
                training={k: (round(v, 5) if isinstance(v, float) else v) for k, v in summary.items()},
            )
            (out_dir / "history.json").write_text(json.dumps(history, indent=1))
            if cfg.lora.enabled:  # the co-trained adapter, loadable with peft
                model.save_pretrained(str(export_dir / "lora"))
            if before is not None and after:
                print(f"[retention] held-out rows, before -> after training (budget {budget_text}):")
                for k, name in (("kl", "KL(teacher || student)"), ("capacity", "capacity loss"),
                                ("soft_cache_entries", "peak soft cache (entries)"), ("beta_mean", "mean beta"),
                                ("rank_recall", "oracle top-B recall")):
                    if k in before and k in after:
                        print(f"    {name:<24} {before[k]:>10.4f} -> {after[k]:>10.4f}")
            print((f"[retention] held-out KL {after['kl']:.4f}; " if after else "[retention] ")
                  + f"gates exported to {export_dir}")
            if repo:
                from retention.hub import HubError

                try:
                    print(f"[retention] pushed: {push_to_hub(export_dir, repo)}")
                except HubError as e:  # the run itself is done: say where its gates are
                    raise SystemExit(f"{e}; the trained gates are exported to {export_dir} (retention push "
                                     f"{export_dir} {repo} uploads them later)") from None
    accelerator.end_training()
    summary["export_dir"] = str(export_dir)
    summary["history"] = history
    return summary
