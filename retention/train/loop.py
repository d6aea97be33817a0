"""The training loop: distil a frozen model into its retention-gated self under a KV budget.

Read top to bottom (:func:`_train`): check what can fail before anything loads; set up accelerate, the model and
its gates, the objective (:mod:`retention.train.objectives`: distillation + capacity, or eviction-aware) with its
data, and the optimizer over the gates (and any LoRA weights); then for each step the objective's loss over
``train.grad_accum`` micro-batches, an optimizer step, a record, a held-out pass every ``train.eval_every`` steps
and an atomic, resumable checkpoint every ``train.save_every`` (checkpoint.py); the end exports the gates with a
card (export.py).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import os
import shutil
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from retention.attach import attach_gates, check_gates_match, unwrap
from retention.compat import enable_activation_checkpointing
from retention.gates import GateConfig, RetentionGates, base_architecture_of
from retention.hub import export_gates, push_to_hub
from retention.losses import beta_stats
from retention.models import hub_model_id, load_model
from retention.templates import with_template_variables

from .checkpoint import (DEEPSPEED_STATE, StopRequests, deepspeed_processes, hold_run_folders, load_deepspeed_state,
                         run_settings, save_checkpoint, save_deepspeed_state, set_aside_old_checkpoints, set_rng_state)
from .config import Config
from .export import check_finite_gates, export_checkpoint, init_from_note, run_facts
from .objective_choice import objective_class
from .objectives import Objective
from .precision import training_precision
from .preflight import check_budget, check_positions, checks_before_loading, make_tracker, tracker_hparams
from .sources import hub_dataset_ids

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from accelerate import Accelerator

__all__ = ["train", "export_checkpoint", "init_from_note", "run_facts", "check_finite_gates", "lr_lambda"]


def _zero3(accelerator) -> bool:
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return plugin is not None and plugin.zero_stage == 3


def gathered(accelerator: Accelerator, params: Iterable[nn.Parameter]) -> contextlib.AbstractContextManager[None]:
    """Full (unpartitioned) parameters inside the block under DeepSpeed ZeRO-3 (collective: every rank
    enters); a no-op otherwise."""
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
        summary = _train(cfg, resume, push_to_hub_repo, model_and_processor)
    _end_process_group()
    return summary


def _end_process_group() -> None:
    """Destroy the process group once the DDP wrapper of ``_train`` is gone.

    Its gradient reducer holds the gloo process group from C++ and is freed with the GIL held; freed after
    ``destroy_process_group`` it holds the last reference, and the group's destructor (which joins gloo's worker
    threads) then waits on a worker that waits for the GIL to free a finished all-reduce's tensors: a hang at the end
    of a multi-process CPU run, about one run in four on two busy cores (pytorch/pytorch#56297). Freed first (the
    frame of ``_train`` returned, its cycles collected here), the group's last reference is Python's, whose
    destructor releases the GIL.
    """
    from accelerate import PartialState

    gc.collect()
    PartialState().destroy_process_group()


def _accelerator(cfg: Config) -> tuple[Accelerator, str | None, str | None]:
    """The run's Accelerator (mixed precision, DDP over gloo without GPUs, DeepSpeed when launched with it), seeded;
    with the tracker it logs to and a note to print about it."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs, set_seed

    mp = training_precision(cfg, cuda=torch.cuda.is_available())  # says the device and precision used
    use_deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    deepspeed_cpu = use_deepspeed and os.environ.get("DS_ACCELERATOR") == "cpu"  # DeepSpeed's CPU accelerator (gloo)
    if use_deepspeed and not torch.cuda.is_available() and not deepspeed_cpu:
        raise SystemExit("DeepSpeed runs need GPUs; without them launch DDP over gloo instead: "
                         "accelerate launch --multi_gpu --num_processes N train.py ..., or set DS_ACCELERATOR=cpu "
                         "for DeepSpeed's CPU accelerator (gloo; slow, for checks)")
    tracker, tracker_note = make_tracker(cfg)
    accelerator = Accelerator(
        mixed_precision=mp,
        # without GPUs, multi-process runs use DDP over gloo (cpu=True would turn DeepSpeed off on its CPU accelerator)
        cpu=not torch.cuda.is_available() and not deepspeed_cpu,
        gradient_accumulation_steps=cfg.train.grad_accum,
        log_with=tracker,
        project_dir=str(Path(cfg.train.output_dir)),
        step_scheduler_with_optimizer=False,  # one schedule step per optimizer step, whatever the world size
        # accelerate finds no backend for DeepSpeed's CPU accelerator and would count one process per rank
        kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")] if deepspeed_cpu else None,
    )
    set_seed(cfg.train.seed)
    if accelerator.device.type == "cpu":
        # the softmax of a long row underflows to denormals, which x86 CPUs compute ~100x slower: flushed to 0 they
        # change nothing above 1e-38 and the gated attention's fused SDPA path runs ~3x faster (bench_kernels --cpu)
        torch.set_flush_denormal(True)
    return accelerator, tracker, tracker_note


def _model_with_gates(cfg: Config, model_and_processor: tuple | None,
                      start_gates: RetentionGates | None) -> tuple[nn.Module, Any, Any]:
    """The model (with LoRA adapters when co-training), its processor (rendering with the config's template
    variables) and the attachment of the gates to train (``start_gates``, else fresh ones)."""
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
        # trained on from here on this model: its architecture is theirs now (also for gates from before it was kept)
        start_gates.config = replace(start_gates.config, **base_architecture_of(model))
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
    return model, processor, attachment


def _load_checkpoint_weights(ckpt: Path, model: nn.Module, attachment: Any) -> None:
    """A resumed run's gates (and LoRA weights), before ``prepare``: DeepSpeed copies them into its own fp32 master
    weights there."""
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


def _resume_state(ckpt: Path, accelerator: Accelerator, distiller: nn.Module, optimizer: Any, scheduler: Any,
                  stream: Any) -> tuple[int, list[dict[str, Any]], dict[str, float] | None]:
    """Optimizer, schedule, data position and RNG of a resumed run; returns its step, history and the held-out
    numbers before training."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    shards = deepspeed_processes(ckpt)
    if plugin is None and state.get("optimizer") is not None:
        optimizer.load_state_dict(state["optimizer"])
    elif plugin is not None and shards == accelerator.num_processes:  # its sharded optimizer, one file per rank
        load_deepspeed_state(distiller, ckpt / DEEPSPEED_STATE)
    elif accelerator.is_main_process:  # the weights are loaded either way
        then = f"a DeepSpeed run of {shards} processes" if shards else "a run without DeepSpeed"
        now = f"DeepSpeed with {accelerator.num_processes}" if plugin is not None else "no DeepSpeed"
        log.warning(f"{ckpt.name}'s optimizer state was written by {then} and this run has {now}: "
              "the Adam moments restart (resume with the run's own launch settings to continue it exactly)")
    scheduler.load_state_dict(state["scheduler"])
    meta = json.loads((ckpt / "state.json").read_text())
    stream.load_state_dict(meta["data"])
    set_rng_state(state["rng"])
    if accelerator.is_main_process:
        log.info(f"resumed from {ckpt} at step {meta['step']}")
    return meta["step"], meta["history"], meta.get("before")


def evaluate(objective: Objective, eval_rows: list) -> dict[str, float]:
    """Held-out KL, capacity loss, soft cache size and mean beta over the first ``train.eval_batches`` batches (and
    the oracle top-B recall when the objective ranks)."""
    bs = objective.cfg.train.batch_size
    vals: dict[str, list[float]] = {"kl": [], "capacity": [], "soft_cache_entries": [], "beta_mean": []}
    with torch.no_grad():
        for i in range(0, min(len(eval_rows), objective.cfg.train.eval_batches * bs), bs):
            _, kl, cap, stats, log_betas = objective.losses(objective.held_out_batch(eval_rows, i), weighted=False)
            # every rank evaluates the same rows, so each rank's share of the "global" mean is that mean
            vals["kl"].append(float(kl))
            vals["capacity"].append(float(cap))
            vals["soft_cache_entries"].append(stats["soft_cache_entries"])
            vals["beta_mean"].append(float(np.mean(beta_stats(log_betas)["beta_mean"])))
    return {k: float(np.mean(v)) for k, v in vals.items()}


def _opening_lines(cfg: Config, accelerator: Accelerator, objective: Objective, params: list[nn.Parameter],
                   train_rows: list, eval_rows: list, tracker_note: str | None) -> None:
    """What the run trains, on what data, under which budget, over how many processes (main process only)."""
    n = sum(getattr(p, "ds_numel", p.numel()) for p in params)  # ZeRO-3 leaves each rank a shard (numel 0)
    kind = accelerator.distributed_type.value
    world = (f"{accelerator.num_processes} processes ({kind})" if accelerator.num_processes > 1
             else "1 process" + ("" if kind == "NO" else f" ({kind})"))  # one GPU under DeepSpeed says so
    log.info(f"{cfg.model.name}: {n:,} trainable parameters; {objective.data_text(train_rows, eval_rows)}; "
          f"{world}")
    if not eval_rows:  # reported as missing, not as NaN numbers
        log.info(f"no held-out {objective.rows_word}: "
              + ("data.eval_fraction is 0" if cfg.data.eval_fraction == 0 else
                 "the data fills too few to hold any out (more data, or a shorter data.seq_len)")
              + "; the run reports no held-out KL")
    if tracker_note:
        log.info(f"{tracker_note}")


def _log_step(cfg: Config, accelerator: Accelerator, record: dict[str, Any], bstats: dict[str, list[float]],
              bar: Any, tokens_per_s: float) -> None:
    """A step's record to the progress bar, the tracker and (every ``train.log_every`` steps) the log."""
    step = record["step"]
    bar.set_postfix(kl=f"{record['kl']:.4f}", cap=f"{record['capacity']:.3f}",
                    cache=f"{record['soft_cache_entries']:.0f}", tok_s=f"{tokens_per_s:.0f}")
    bar.update(1)
    if accelerator.trackers:
        per_layer = {f"beta_{stat.split('_')[1]}/layer_{i:02d}": v for stat in ("beta_mean", "beta_std")
                     for i, v in enumerate(bstats[stat])}
        accelerator.log({**{k: v for k, v in record.items() if k != "step"}, **per_layer}, step=step)
    if accelerator.is_main_process and step % cfg.train.log_every == 0:
        per_layer = " ".join(f"{m:.3f}±{s:.3f}" for m, s in zip(bstats["beta_mean"], bstats["beta_std"]))
        tqdm.write(f"step {step}: loss {record['loss']:.4f} kl {record['kl']:.4f} "
                   f"capacity {record['capacity']:.4f} "
                   f"soft cache {record['soft_cache_entries']:.0f} entries | beta per layer {per_layer}")


def _log_held_out(accelerator: Accelerator, record: dict[str, Any], held: dict[str, float]) -> None:
    """A held-out pass's numbers into the step's record, the tracker and the log."""
    record["eval_kl"] = held["kl"]
    if accelerator.trackers:
        accelerator.log({"eval_kl": record["eval_kl"]}, step=record["step"])
    if accelerator.is_main_process:
        tqdm.write(f"step {record['step']}: held-out KL {record['eval_kl']:.4f}")


def _summary(step: int, history: list[dict[str, Any]], tokens_per_step: int, before: dict[str, float] | None,
             after: dict[str, float]) -> dict[str, Any]:
    """The finished run's numbers, as its card's training record shows them."""
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
    return summary


def _train(cfg: Config, resume: str | None, push_to_hub_repo: str | None,
           model_and_processor: tuple | None) -> dict[str, Any]:
    out_dir = Path(cfg.train.output_dir)
    repo = push_to_hub_repo or cfg.export.push_to_hub
    ckpt, start_gates = checks_before_loading(cfg, resume, repo, model_and_processor)
    accelerator, tracker, tracker_note = _accelerator(cfg)
    main = accelerator.is_main_process

    # -- model, gates, objective and its data -------------------------------------------------------------------
    model, processor, attachment = _model_with_gates(cfg, model_and_processor, start_gates)
    objective = objective_class(cfg)(cfg, model, attachment, accelerator)
    train_rows, eval_rows, stream = objective.load_data(processor)

    # -- optimizer: only trainable (gate, optional LoRA) parameters ---------------------------------------------
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    distiller = objective.module()
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None:  # no DataLoader goes through prepare: give DeepSpeed the batch and clipping
        plugin.deepspeed_config.update(
            train_micro_batch_size_per_gpu=cfg.train.batch_size, gradient_accumulation_steps=cfg.train.grad_accum,
            train_batch_size=cfg.train.batch_size * cfg.train.grad_accum * accelerator.num_processes,
            gradient_clipping=cfg.train.clip,
        )
    if ckpt is not None:
        _load_checkpoint_weights(ckpt, model, attachment)
    distiller, optimizer = accelerator.prepare(distiller, optimizer)
    lm_head = objective.lm_head
    if _zero3(accelerator):  # ZeRO-3 partitions the LM head; the chunked KL needs it whole (frozen: one copy)
        with gathered(accelerator, lm_head.parameters()):
            lm_head = nn.Linear(lm_head.in_features, lm_head.out_features, bias=lm_head.bias is not None,
                                device=accelerator.device, dtype=lm_head.weight.dtype).requires_grad_(False)
            lm_head.load_state_dict(unwrap(model).get_output_embeddings().state_dict())
    objective.use(distiller, lm_head)

    step, history, before = 0, [], None
    if ckpt is not None:
        step, history, before = _resume_state(ckpt, accelerator, distiller, optimizer, scheduler, stream)
    if tracker:
        accelerator.init_trackers("retention", config=tracker_hparams(cfg.to_dict()))
    if main:
        _opening_lines(cfg, accelerator, objective, params, train_rows, eval_rows, tracker_note)
    if before is None and cfg.train.report_before and eval_rows:
        before = evaluate(objective, eval_rows)  # the untrained gates on the held-out rows, for the before/after report
        if main:
            log.info(f"before training, held-out: KL {before['kl']:.4f}, capacity {before['capacity']:.4f}, "
                  f"soft cache {before['soft_cache_entries']:.0f} entries, mean beta {before['beta_mean']:.4f}")

    tokens_per_step = round(cfg.train.batch_size * objective.row_tokens(train_rows) * cfg.train.grad_accum
                            * accelerator.num_processes)
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
            # -- one optimizer step over grad_accum micro-batches -------------------------------------------------
            lr = scheduler.get_last_lr()[0]  # the rate this step's update uses (the scheduler steps after it)
            batches = [stream.next_batch() for _ in range(cfg.train.grad_accum)]
            counts = objective.step_counts(batches)
            parts = []
            for batch in batches:
                with accelerator.accumulate(distiller):
                    loss, kl, cap, stats, log_betas = objective.losses(batch, counts=counts)
                    parts.append((loss.detach(), kl.detach(), cap.detach()))
                    accelerator.backward(loss)
                    if accelerator.sync_gradients and cfg.train.clip:
                        accelerator.clip_grad_norm_(params, cfg.train.clip)
                    optimizer.step()
                    if accelerator.sync_gradients:
                        scheduler.step()
                    optimizer.zero_grad()
            step += 1

            # -- its record --------------------------------------------------------------------------------------
            bstats = beta_stats(log_betas)
            # each micro-batch holds grad_accum times its share of the step's mean, each rank its share of the
            # global mean: the mean over micro-batches, then over ranks, is the step's pooled mean
            loss, kl, cap = (accelerator.reduce(torch.stack(x).mean(), "mean") for x in zip(*parts))
            record = {
                "step": step, "loss": float(loss), "kl": float(kl), "capacity": float(cap),
                "lr": lr, "tokens": tokens_per_step, **stats,
                "beta_mean": float(np.mean(bstats["beta_mean"])),
            }
            if not math.isfinite(record["loss"]):  # diverged: every later step and the export would be NaN too
                bar.close()
                raise SystemExit(f"step {step}: the loss is {record['loss']} (KL {record['kl']}, capacity "
                                 f"{record['capacity']}) at train.lr {lr:g}: the run diverged; lower train.lr (or "
                                 "set train.clip), then start again or --resume an earlier checkpoint; nothing of "
                                 "this step was saved")
            history.append(record)
            _log_step(cfg, accelerator, record, bstats, bar,
                      tokens_per_step * (step - start_step) / (time.perf_counter() - t_start))
            if cfg.train.eval_every and step % cfg.train.eval_every == 0 and eval_rows:
                held, held_step = evaluate(objective, eval_rows), step
                _log_held_out(accelerator, record, held)

            # -- checkpoint, and a stop when asked -----------------------------------------------------------------
            asked = stop_requests.asked
            if accelerator.num_processes > 1:  # every rank stops at the same step, or the next collective hangs
                asked = bool(accelerator.reduce(torch.tensor(float(asked), device=accelerator.device), "sum") > 0)
            stopping = asked or (cfg.train.stop_after is not None and step >= cfg.train.stop_after)
            if step % cfg.train.save_every == 0 or step == cfg.train.steps or stopping:
                _save(cfg, accelerator, distiller, params, model, attachment, optimizer, scheduler, stream, step,
                      history, before)
            if stopping and step < cfg.train.steps:
                bar.close()
                accelerator.wait_for_everyone()
                if main:
                    why = "when interrupted" if asked else "as asked"
                    log.info(f"stopped after step {step} {why}, "
                          f"checkpoint {out_dir / 'checkpoints' / f'step-{step}'} "
                          "written; continue with --resume")
                _finish_trackers(accelerator)
                return {"steps": step, "stopped_early": True, "history": history}
    bar.close()

    # -- the end: a last held-out pass, the summary and the exported gates ----------------------------------------
    # the last step's held-out pass already scored these gates: no second pass over the same items
    after = (held if held_step == step else evaluate(objective, eval_rows)) if eval_rows else {}
    summary = _summary(step, history, tokens_per_step, before, after)
    summary.update(run_facts(cfg))
    export_dir = cfg.export_dir()
    with gathered(accelerator, params):  # ZeRO-3: whole gates and LoRA weights to write
        check_finite_gates(params, "the trained gates")  # on every rank, as for checkpoints
        if main:
            _export(cfg, model, attachment, objective, summary, history, before, after, repo)
    _finish_trackers(accelerator)
    summary["export_dir"] = str(export_dir)
    summary["history"] = history
    return summary


def _finish_trackers(accelerator: Accelerator) -> None:
    """``accelerator.end_training()`` less its ``destroy_process_group``, which :func:`train` calls once the DDP
    wrapper is freed (see :func:`_end_process_group`)."""
    for tracker in accelerator.trackers:
        tracker.finish()


def _save(cfg: Config, accelerator: Accelerator, distiller: nn.Module, params: list[nn.Parameter], model: nn.Module,
          attachment: Any, optimizer: Any, scheduler: Any, stream: Any, step: int, history: list[dict[str, Any]],
          before: dict[str, float] | None) -> None:
    """Step ``step``'s checkpoint (collective: every rank enters); keeps the latest ``train.keep_checkpoints``."""
    out_dir = Path(cfg.train.output_dir)
    main = accelerator.is_main_process
    shards = None
    if getattr(accelerator.state, "deepspeed_plugin", None) is not None:
        # every rank writes its optimizer shard (collective), then main moves them in
        shards = out_dir / "checkpoints" / f".step-{step}.{DEEPSPEED_STATE}"
        save_deepspeed_state(distiller, shards)
        accelerator.wait_for_everyone()
    with gathered(accelerator, params):  # the gates and any LoRA
        check_finite_gates(params, f"step {step}'s gates")  # on every rank (the same whole weights): all stop together
        if main:
            save_checkpoint(out_dir / "checkpoints" / f"step-{step}", attachment.gates, optimizer, scheduler,
                            stream, step, history, extra_trainable(model), before=before,
                            deepspeed_state=shards, settings=run_settings(cfg))
            old = sorted((out_dir / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
            for p in old[: -cfg.train.keep_checkpoints]:
                shutil.rmtree(p, ignore_errors=True)


def _export(cfg: Config, model: nn.Module, attachment: Any, objective: Objective, summary: dict[str, Any],
            history: list[dict[str, Any]], before: dict[str, float] | None, after: dict[str, float],
            repo: str | None) -> None:
    """The trained gates (and a LoRA adapter) exported with their card, the history beside the checkpoints, the
    before -> after report, and the upload when asked (main process)."""
    out_dir, export_dir, budget_text = Path(cfg.train.output_dir), cfg.export_dir(), objective.budget_text
    name = getattr(unwrap(model).config, "_name_or_path", "") or cfg.model.name
    # the card names the base by its Hub id: a model loaded from a local copy says only its folder
    base = hub_model_id(name) or hub_model_id(cfg.model.name) or name
    export_gates(
        attachment.gates, export_dir, base_model=base, base_revision=cfg.model.revision, budget=budget_text,
        training={k: (round(v, 5) if isinstance(v, float) else v) for k, v in summary.items()},
        datasets=hub_dataset_ids(cfg.data.sources),
    )
    (out_dir / "history.json").write_text(json.dumps(history, indent=1))
    if cfg.lora.enabled:  # the co-trained adapter, loadable with peft
        model.save_pretrained(str(export_dir / "lora"))
    if before is not None and after:
        table = [f"held-out rows, before -> after training (budget {budget_text}):"]
        for k, name in (("kl", "KL(teacher || student)"), ("capacity", "capacity loss"),
                        ("soft_cache_entries", "peak soft cache (entries)"), ("beta_mean", "mean beta")):
            if k in before and k in after:
                table.append(f"    {name:<24} {before[k]:>10.4f} -> {after[k]:>10.4f}")
        log.info("\n".join(table))
    log.info((f"held-out KL {after['kl']:.4f}; " if after else "") + f"gates exported to {export_dir}")
    if repo:
        from retention.hub import HubError

        try:
            log.info(f"pushed: {push_to_hub(export_dir, repo)}")
        except HubError as e:  # the run itself is done: say where its gates are
            raise SystemExit(f"{e}; the trained gates are exported to {export_dir} (retention push "
                             f"{export_dir} {repo} uploads them later)") from None
