"""What a run's exported gates say about it: the card's training record (:func:`run_facts`, :func:`init_from_note`),
the export of a training checkpoint without the base model (:func:`export_checkpoint`) and the finite-weights
check before anything is written (:func:`check_finite_gates`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch

from retention.budget import streams_of
from retention.gates import GateConfig, RetentionGates
from retention.hub import export_gates, local_checkpoint
from retention.metadata import metadata_file, read_metadata

from .checkpoint import check_resume_fits, find_checkpoint
from .config import Config
from .objective_choice import objective_class
from .sources import hub_dataset_ids


def init_from_note(cfg: Config) -> str | None:
    """What a run continued from, for its card: ``init_from`` and, for a local checkpoint, its steps,
    config and row length (read at export time, before anything may overwrite the folder)."""
    src = cfg.gates.init_from
    if not src:
        return None
    folder = local_checkpoint(src)  # a folder here or a shipped checkpoint's name
    if folder is None or not metadata_file(folder).is_file():
        return str(src)  # a Hub repo id: its own card says how it was trained
    parent = read_metadata(folder).get("training", {})
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
    facts.update(objective_class(cfg).card_facts(cfg))
    if cfg.gates.sink:
        facts["sink"] = (f"the first {cfg.gates.sink} tokens of each sequence never decayed "
                         "(the inference policy keeps them)")
    return facts


def export_checkpoint(cfg: Config, checkpoint: str = "latest", dest: str | Path | None = None) -> Path:
    """Export the gates of a training checkpoint (an unfinished run, e.g. one spread over sessions) as
    a self-describing gate checkpoint, without loading the base model; the card says how far it got."""
    from safetensors.torch import load_file

    from retention.models import hub_model_id

    ckpt = find_checkpoint(Path(cfg.train.output_dir), checkpoint)
    check_resume_fits(cfg, ckpt, flag="--export")  # the card's facts (tokens seen, data, budget) come from cfg
    meta = json.loads((ckpt / "state.json").read_text())
    gates = RetentionGates(GateConfig(**meta["gate_config"]))
    gates.load_state_dict(load_file(str(ckpt / "gates.safetensors")))
    check_finite_gates(gates.parameters(), f"{ckpt}'s gates")
    gc, history, step = gates.config, meta["history"], meta["step"]
    budget_text = objective_class(cfg).card_budget(cfg, streams_of(gc.num_layers, gc.num_kv_heads))
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
    dest = Path(dest or cfg.export_dir())
    # the base by its Hub id (an embedded model's, or the one a local copy records); a local path is kept as it is,
    # and the card then names no base model (pushing asks for the id)
    export_gates(gates, dest, base_model=hub_model_id(cfg.model.name) or cfg.model.name,
                 base_revision=cfg.model.revision, budget=budget_text, training=training,
                 datasets=hub_dataset_ids(cfg.data.sources), checkpoint=f"{ckpt.name} of {cfg.train.output_dir}")
    return dest


def check_finite_gates(params: Iterable[torch.Tensor], what: str) -> None:
    """SystemExit before gates holding NaN or inf are written (a checkpoint, an export): the run diverged, and such
    gates would evict at random (every comparison with NaN is false)."""
    bad = sum(int((~torch.isfinite(p.detach())).sum()) for p in params)
    if bad:
        raise SystemExit(f"{what} hold {bad:,} NaN or infinite weights: the run diverged; lower train.lr (or set "
                         "train.clip), then start again or --resume an earlier checkpoint; nothing was written")
