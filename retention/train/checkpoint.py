"""Training checkpoints: atomic, resumable, never the frozen base.

A checkpoint ``step-N/`` holds the gates (and LoRA weights) as safetensors, the optimizer, scheduler and RNG
states, the data position and the run's config; under DeepSpeed also DeepSpeed's own sharded optimizer state in
``deepspeed/``. ``--resume`` finds the latest intact one (:func:`intact_checkpoint`; a damaged one is skipped, saying
why) and refuses one whose config changed in a way that changes the loss curve. :class:`StopRequests` turns Ctrl-C /
SIGTERM into "stop after this step with a checkpoint".
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
import torch
from tqdm.auto import tqdm

from retention.gates import GATES_SHA256
from retention.io import atomic_directory, exclusive_use, save_state, tensors_sha256

from .config import Config
from .data import PackedStream

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from retention.gates import RetentionGates


def rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    # plain types and tensors only, so the state loads with torch.load(weights_only=True)
    state = {"python": random.getstate(),
             "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(tuple(x if not isinstance(x, list) else tuple(x) for x in state["python"]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


DEEPSPEED_STATE = "deepspeed"  # a checkpoint's folder of DeepSpeed's own state: optimizer shards, one file per rank


def save_deepspeed_state(engine: Any, folder: Path) -> None:
    """DeepSpeed's optimizer state (fp32 master weights and Adam moments, sharded over the ranks) and the trainable
    weights, written by every rank into ``folder`` (collective); never the frozen base."""
    engine.save_checkpoint(str(folder), tag="state", exclude_frozen_parameters=True, save_latest=False)


TRUST_DEEPSPEED_STATE = "RETENTION_TRUST_DEEPSPEED_STATE"  # "1": let DeepSpeed unpickle its state as it would


def deepspeed_safe_globals() -> list[type]:
    """The DeepSpeed classes its optimizer shards pickle beside plain tensors and numbers (the ZeRO stage, a
    parameter's slice of the flat buffer, the loss scaler): the only classes a resume may rebuild."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, fragment_address, LossScaler, DynamicLossScaler]


def load_without_pickled_code(path: str | Path, map_location: Any = None) -> Any:
    """``torch.load`` with ``weights_only=True``, allowing :func:`deepspeed_safe_globals`: DeepSpeed's own loader
    unpickles anything (``weights_only=False``), so a checkpoint from elsewhere could run code on resume."""
    import pickle

    allowed = deepspeed_safe_globals()
    with torch.serialization.safe_globals(allowed):
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as e:
            found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
            raise SystemExit(
                f"--resume: {path} holds pickled objects retention does not rebuild ({', '.join(found) or e}): "
                f"only tensors, numbers and {', '.join(c.__name__ for c in allowed)} load. If you trust this "
                f"checkpoint (your own run's, with a DeepSpeed setting that stores more), "
                f"set {TRUST_DEEPSPEED_STATE}=1 to let DeepSpeed unpickle it") from None


def load_deepspeed_state(engine: Any, folder: Path) -> None:
    """What :func:`save_deepspeed_state` wrote, into every rank's shard (collective; the same number of ranks).
    Read through :func:`load_without_pickled_code` unless ``RETENTION_TRUST_DEEPSPEED_STATE=1``."""
    loader = engine.checkpoint_engine
    trusted = os.environ.get(TRUST_DEEPSPEED_STATE) == "1"
    if not trusted:  # every file of DeepSpeed's load_checkpoint goes through its checkpoint engine's load
        loader.load = load_without_pickled_code
    try:
        path, _ = engine.load_checkpoint(str(folder), tag="state", load_module_strict=False,
                                         load_optimizer_states=True, load_lr_scheduler_states=False)
    finally:
        if not trusted:
            del loader.load  # the class's own again
    if path is None:
        raise SystemExit(f"--resume: DeepSpeed could not read its optimizer state in {folder}")


def deepspeed_processes(checkpoint: Path) -> int:
    """How many ranks wrote the DeepSpeed optimizer shards of ``checkpoint`` (0: none, a run without DeepSpeed)."""
    return len(list((checkpoint / DEEPSPEED_STATE).glob("state/*optim_states.pt")))


def save_checkpoint(path: Path, gates: RetentionGates, optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler, stream: PackedStream, step: int, history: list,
                    extra: dict[str, torch.Tensor] | None = None, before: dict[str, float] | None = None,
                    deepspeed_state: Path | None = None, settings: dict[str, Any] | None = None) -> None:
    """Gates (and LoRA weights) as safetensors, optimizer/scheduler/RNG/data position; never the frozen base.
    ``deepspeed_state``: a folder :func:`save_deepspeed_state` wrote (the optimizer, sharded): moved in."""
    with atomic_directory(path) as tmp:
        sha = save_state(gates.state_dict(), tmp / "gates.safetensors")
        if extra:
            save_state(extra, tmp / "trainable.safetensors")
        torch.save(
            {"optimizer": None if deepspeed_state else optimizer.state_dict(), "scheduler": scheduler.state_dict(),
             "rng": rng_state()},
            tmp / "trainer_state.pt",
        )
        if deepspeed_state is not None:
            os.rename(deepspeed_state, tmp / DEEPSPEED_STATE)
        meta = {"step": step, "data": stream.state_dict(), "history": history, "gate_config": gates.config.to_dict(),
                "before": before, **({"config": settings} if settings is not None else {}), GATES_SHA256: sha}
        (tmp / "state.json").write_text(json.dumps(meta, indent=1))


def set_aside_old_checkpoints(output_dir: Path) -> Path | None:
    """A fresh run into a folder holding another run's checkpoints moves them to ``checkpoints-before-<time>``:
    mixed in with the new run's, ``--resume latest`` could continue the other run's last step and the rotation
    could delete them. Nothing is lost; returns where they went (``None``: nothing to move)."""
    old = output_dir / "checkpoints"
    if not any(old.glob("step-*")):
        return None
    stamp, n = time.strftime("%Y%m%d-%H%M%S"), 0
    dest = output_dir / f"checkpoints-before-{stamp}"
    while dest.exists():  # two fresh runs within a second
        n += 1
        dest = output_dir / f"checkpoints-before-{stamp}-{n}"
    os.rename(old, dest)
    log.info(f"{output_dir} held checkpoints of an earlier run: moved to {dest} "
          "(use --resume to continue a run)")
    return dest


def remove_stale_temp(output_dir: Path, shards: bool = False) -> list[Path]:
    """Delete what a killed run left half-written in ``output_dir/checkpoints``: ``.tmp-step-*`` folders (a checkpoint
    being written; ~20 MB each) and ``.old-step-*`` (one being replaced); with ``shards`` also DeepSpeed's
    ``.step-N.deepspeed`` shard folders, which other ranks write only once the run is under way. Call it only while
    holding the folder (:func:`hold_run_folders`): then nothing else writes there. Returns what was removed."""
    folder = output_dir / "checkpoints"
    patterns = [".tmp-step-*", ".old-step-*", *([f".step-*.{DEEPSPEED_STATE}"] if shards else [])]
    stale = [p for pattern in patterns for p in folder.glob(pattern) if p.is_dir() and not p.is_symlink()]
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


@contextlib.contextmanager
def hold_run_folders(cfg: Config) -> Iterator[None]:
    """Hold a training run's folders: ``train.output_dir`` and the export folder (another run exporting there
    would replace its gates; :class:`~retention.io.FolderBusyError` before the model loads). Stale temporary
    checkpoint folders (:func:`remove_stale_temp`) are removed at the start and the end, under the lock."""
    out_dir, export = Path(cfg.train.output_dir), cfg.export_dir()
    with contextlib.ExitStack() as held:
        held.enter_context(exclusive_use(out_dir, "a training run"))
        if export.expanduser().resolve() != out_dir.expanduser().resolve():
            held.enter_context(exclusive_use(export, "the gates of a training run (its export.dir)",
                                             fix="export this one elsewhere (--set export.dir=DIR)"))
        stale = remove_stale_temp(out_dir, shards=True)
        if stale:
            log.info(f"removed {len(stale)} half-written checkpoint folder(s) an interrupted run left in "
                  f"{out_dir / 'checkpoints'}")
        try:
            yield
        finally:
            remove_stale_temp(out_dir)


class StopRequests:
    """Ctrl-C (SIGINT) or SIGTERM (a preempted machine, a scheduler's time limit) during training asks the run to
    stop after the step it is in, with a checkpoint, instead of losing every step since the last one; a second
    Ctrl-C quits at once. Handlers are only installed from the main thread, and restored on exit."""

    SIGNALS = ("SIGINT", "SIGTERM")

    REPEAT_S = 1.0  # launchers (torchrun) forward the terminal's Ctrl-C to workers that got it too: one request

    def __init__(self, announce: bool) -> None:
        self.asked, self.announce, self._old, self._first = False, announce, {}, 0.0

    def __enter__(self) -> "StopRequests":
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                sig = getattr(signal, name)
                if signal.getsignal(sig) is not signal.SIG_IGN:  # ignored (nohup, a background job): leave it so
                    self._old[sig] = signal.signal(sig, self._ask)
        return self

    def _ask(self, signum: int, frame: Any) -> None:
        import signal

        if self.asked:
            if signum == signal.SIGINT and time.monotonic() - self._first > self.REPEAT_S:
                raise KeyboardInterrupt  # asked twice: quit now (the last checkpoint stays)
            return
        self.asked, self._first = True, time.monotonic()
        if self.announce:
            tqdm.write(f"[retention] {signal.Signals(signum).name}: stopping after this step with a checkpoint "
                       "(Ctrl-C again to quit at once)")

    def __exit__(self, *exc: Any) -> None:
        import signal

        for sig, old in self._old.items():
            signal.signal(sig, old)


# what --resume may change: how long the run goes, how it logs, saves and exports; every other key shapes the loss curve
RESUME_MAY_CHANGE = frozenset({
    "train.steps", "train.stop_after", "train.save_every", "train.keep_checkpoints", "train.log_every",
    "train.eval_every", "train.tracker", "train.report_before", "train.output_dir", "export.dir", "export.push_to_hub",
    "model.gradient_checkpointing",
})


def run_settings(cfg: Config) -> dict[str, Any]:
    """The config as dotted keys (``data.seq_len``; lists such as ``data.sources`` whole), as JSON stores it."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}{k}.", v)
        else:
            flat[prefix[:-1]] = value

    walk("", cfg.to_dict())
    return json.loads(json.dumps(flat, default=str))


def check_resume_fits(cfg: Config, ckpt: Path, flag: str = "--resume") -> None:
    """SystemExit naming the difference when the config changed since the run started in a way that changes its loss
    curve (``data.seq_len``, ``train.lr``...; anything but :data:`RESUME_MAY_CHANGE`), or, for checkpoints from
    before the config was saved with them, when ``ckpt`` holds gates of another variant, width or activation.
    ``flag="--export"``: the same check before an export, whose model card states the run's settings."""
    redo = ("resume with the settings the run started with, or start a fresh run" if flag == "--resume" else
            "export with the config the run was trained with (the card states its settings)")
    try:
        state = json.loads((ckpt / "state.json").read_text())
    except (OSError, ValueError):
        return  # the load reports a damaged checkpoint
    if "config" in state:
        now = run_settings(cfg)
        changed = sorted(k for k in set(state["config"]) | set(now)
                         if k not in RESUME_MAY_CHANGE and state["config"].get(k) != now.get(k))
        if changed:
            diff = "; ".join(f"{k} {state['config'].get(k)!r} -> {now.get(k)!r}" for k in changed)
            raise SystemExit(f"{flag} {ckpt}: the config changed since the run started ({diff}); {redo} (only "
                             "train.steps, stop_after, save_every, logging, trackers and export settings may change "
                             f"on {flag})")
        return
    if cfg.gates.init_from:
        return
    saved = state.get("gate_config")
    if saved is None:
        return  # an older checkpoint without it: the state-dict load still checks the shapes
    wanted = {"variant": cfg.gates.variant, "gate_hidden": cfg.gates.gate_hidden, "activation": cfg.gates.activation}
    changed = {k: (saved.get(k), v) for k, v in wanted.items() if saved.get(k) != v}
    if changed:
        diff = ", ".join(f"gates.{k} {old!r} -> {new!r}" for k, (old, new) in changed.items())
        raise SystemExit(f"{flag} {ckpt}: the config changed since the run started ({diff}); {redo} "
                         "(--set gates.<key>=<its value>)")


def run_checkpoints(output_dir: Path) -> list[Path]:
    """The run's checkpoint folders ``checkpoints/step-N``, oldest first."""
    found = [p for p in (output_dir / "checkpoints").glob("step-*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def find_checkpoint(output_dir: Path, resume: str) -> Path:
    """The checkpoint ``resume`` names: ``latest`` (the newest of the run, whole or not) or a folder.
    FileNotFoundError when there is none."""
    if resume != "latest":
        p = Path(resume)
        if not (p / "state.json").is_file():
            raise FileNotFoundError(f"--resume {resume}: no checkpoint there (state.json missing)")
        return p
    ckpts = run_checkpoints(output_dir)
    if not ckpts:
        raise FileNotFoundError(f"--resume latest: no checkpoint under {output_dir / 'checkpoints'}")
    return ckpts[-1]


CHECKPOINT_FILES = ("state.json", "gates.safetensors", "trainer_state.pt")  # what every checkpoint holds


def checkpoint_damage(ckpt: Path) -> str | None:
    """What keeps ``ckpt`` from resuming, naming the file and the damage (a file missing, cut off, not JSON, tensors
    that do not match the SHA-256 ``state.json`` records, a trainer state that does not load); ``None`` when it is
    intact. Reads every file as the resume will (safetensors; ``torch.load`` with ``weights_only``), without the
    model: a disk that filled up or a copy cut short is found before the model and data load. DeepSpeed's optimizer
    shards are left to DeepSpeed's own load."""
    from safetensors import safe_open

    for name in CHECKPOINT_FILES:
        if not (ckpt / name).is_file():
            return f"{ckpt / name} is missing"
    state_file = ckpt / "state.json"
    try:
        meta = json.loads(state_file.read_text())
    except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        return f"{state_file} is damaged (not JSON: {e})"
    absent = [k for k in ("step", "data", "history") if not isinstance(meta, dict) or k not in meta]
    if absent:
        return f"{state_file} is damaged (it lacks {', '.join(absent)})"
    for name in ("gates.safetensors", "trainable.safetensors"):
        f = ckpt / name
        if not f.is_file():  # trainable.safetensors: only runs that train LoRA weights too
            continue
        try:
            with safe_open(str(f), framework="pt") as fh:
                tensors = {k: fh.get_tensor(k) for k in fh.keys()}
        except Exception as e:  # safetensors raises its own error types for each kind of damage
            return f"{f} is damaged (its tensors cannot be read: {e})"
        recorded = meta.get(GATES_SHA256) if name == "gates.safetensors" else None
        if recorded is not None and tensors_sha256(tensors) != recorded:
            return f"{f} is damaged (its tensors do not match the SHA-256 that state.json records)"
    f = ckpt / "trainer_state.pt"
    try:
        state = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # a cut-off zip, a garbled pickle: torch raises many kinds
        return f"{f} is damaged (it does not load: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    if not isinstance(state, dict) or not {"scheduler", "rng"} <= set(state):
        return f"{f} is damaged (it lacks the scheduler or RNG state)"
    return None


def intact_checkpoint(output_dir: Path, resume: str) -> Path:
    """The checkpoint to resume, checked by :func:`checkpoint_damage` before anything expensive loads. ``latest``:
    the newest intact one of the run, with a warning naming each newer one skipped and its damage; a folder: that
    one, or SystemExit naming the file and the damage. FileNotFoundError when there is no checkpoint at all."""
    ckpt = find_checkpoint(output_dir, resume)
    if resume != "latest":
        if damage := checkpoint_damage(ckpt):
            raise SystemExit(f"--resume {ckpt}: {damage}; give an earlier checkpoint of the run (step-N), --resume "
                             "latest (the newest intact one), or start a fresh run (drop --resume)")
        return ckpt
    skipped = []
    for ckpt in reversed(run_checkpoints(output_dir)):
        damage = checkpoint_damage(ckpt)
        if damage is None:
            if skipped and os.environ.get("RANK", "0") == "0":  # every rank checks; one says so
                for old, why in skipped:
                    log.warning(f"--resume latest skips {old.name}: {why}")
                log.warning(f"resuming from {ckpt}, the newest intact checkpoint (the steps after it "
                      "run again)")
            return ckpt
        skipped.append((ckpt, damage))
    raise SystemExit(f"--resume latest: no intact checkpoint under {output_dir / 'checkpoints'} ("
                     + "; ".join(f"{c.name}: {why}" for c, why in skipped)
                     + "): start a fresh run (drop --resume)")
