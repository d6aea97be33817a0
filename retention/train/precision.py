"""Which mixed precision a training run uses, and the line that says so before the model loads.

``train.mixed_precision: auto`` follows ``accelerate launch --mixed_precision`` (which passes it on as the
``ACCELERATE_MIXED_PRECISION`` environment variable; a launch without the flag passes its default, ``no``), else
bf16 on a GPU and none on the CPU. A precision the config names wins over accelerate's, and the run says so: the
config is the run's record (its card, ``--resume``'s check), so it must hold what ran.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)

ACCELERATE_ENV = "ACCELERATE_MIXED_PRECISION"


def resolve_mixed_precision(configured: str, cuda: bool, env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """``(precision, why)``: the precision to give ``Accelerator`` (``no``, ``bf16`` or ``fp16``) and a phrase saying
    where it came from. ``configured`` is ``train.mixed_precision``; ``cuda`` whether a CUDA GPU trains."""
    env = os.environ if env is None else env
    launched = (env.get(ACCELERATE_ENV) or "").strip().lower() or None
    if configured == "auto":
        if launched is not None:
            return launched, f"train.mixed_precision auto follows accelerate launch's --mixed_precision {launched}"
        return ("bf16" if cuda else "no"), f"train.mixed_precision auto: {'bf16 on a GPU' if cuda else 'none on CPU'}"
    if launched is not None and launched != configured:
        return configured, (f"train.mixed_precision {configured} from the config wins over accelerate launch's "
                            f"--mixed_precision {launched} (set train.mixed_precision: auto to follow accelerate)")
    return configured, f"train.mixed_precision {configured}"


def training_precision(cfg: Any, cuda: bool, env: Mapping[str, str] | None = None) -> str:
    """The run's mixed precision (:func:`resolve_mixed_precision`), after printing, on the main process, the device
    and precision the run will actually use (the run's first line, before the model loads)."""
    env = os.environ if env is None else env
    mp, why = resolve_mixed_precision(cfg.train.mixed_precision, cuda, env)
    if env.get("RANK", "0") == "0":
        log.info(describe_run_device(cfg, mp, cuda, why))
    return mp


def describe_run_device(cfg: Any, mp: str, cuda: bool, why: str) -> str:
    """One line: device, precision and where it came from, gradient checkpointing, and a hint when a CPU run
    asks for half precision (slower than float32 on most CPUs)."""
    device = "CUDA GPU" if cuda else "CPU (no CUDA GPU found)"
    autocast = "no autocast" if mp == "no" else f"{mp} autocast"
    line = f"training on {device}, weights {cfg.model.dtype}, {autocast} ({why})"
    if cfg.model.gradient_checkpointing:
        line += ", gradient checkpointing on"
    if not cuda and mp != "no":
        line += (f"; {mp} autocast on a CPU is emulated and usually slower than float32: set "
                 "train.mixed_precision: no")
    return line
