"""Average gate checkpoints weight by weight (a "model soup": Wortsman et al., 2022, WiSE-FT / soups).

Two gate sets fine-tuned from one parent usually sit in one basin, so their weighted mean is a third set
between them: for example the shipped gates and a continuation that traded needles for fidelity. The
result is an ordinary checkpoint (safetensors, config, model card) that loads and ships like any other.

    retention average checkpoints/a runs/b/final --weights 0.5 0.5 --out runs/soup
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

import torch

from .gates import RetentionGates, check_gate_folder_target
from .hub import HubError, checkpoint_folder, export_gates, local_checkpoint


def normalised_weights(weights: Sequence[float] | None, n: int) -> list[float]:
    """``n`` averaging weights (default equal), checked (n >= 2; >= 0, positive sum) and scaled to sum 1."""
    if n < 2:
        raise ValueError(f"averaging needs at least two gate sets, got {n}")
    weights = [1.0] * n if weights is None else [float(w) for w in weights]
    if len(weights) != n:
        raise ValueError(f"{len(weights)} weights for {n} gate sets: give one weight per checkpoint")
    if any(not w >= 0 for w in weights) or sum(weights) <= 0:  # `not w >= 0` also catches NaN
        raise ValueError(f"weights must be >= 0 with a positive sum, got {weights}")
    return [w / sum(weights) for w in weights]


def average_gates(gate_sets: Sequence[RetentionGates], weights: Sequence[float] | None = None) -> RetentionGates:
    """Weighted mean of every parameter of ``gate_sets`` (same config; weights >= 0, normalised to sum 1).

    Returns new gates with the first set's config; the inputs are left untouched."""
    weights = normalised_weights(weights, len(gate_sets))
    first = gate_sets[0].config.to_dict()
    for i, g in enumerate(gate_sets[1:], 1):
        other = g.config.to_dict()
        differ = sorted(k for k in first if k not in ("base_model", "bias_init") and first[k] != other[k])
        if differ:  # bias_init only seeds training; a different base model is checked when loading against it
            raise ValueError(
                f"gate set {i} differs from gate set 0 in "
                f"{', '.join(f'{k} ({other[k]!r} vs {first[k]!r})' for k in differ)}: "
                "only gates of one layout (variant, width, model shape) can be averaged"
            )
    out = RetentionGates(gate_sets[0].config)
    states = [g.state_dict() for g in gate_sets]
    with torch.no_grad():
        for name, param in out.state_dict().items():
            mean = sum(w * s[name].to(torch.float64) for w, s in zip(weights, states))
            param.copy_(mean.to(param.dtype))
    return out


def average_checkpoints(
    paths: Sequence[str | Path], out: str | Path, weights: Sequence[float] | None = None
) -> Path:
    """Load checkpoints (folders or Hub repos), average them, and export the mean to ``out`` atomically.

    The card and ``config.json`` record the sources and weights; base model and budget are taken from the
    first checkpoint, and the sources must share the base model."""
    weights = normalised_weights(weights, len(paths))  # a lone checkpoint or bad weights fail before any download
    out = Path(out).expanduser()
    check_gate_folder_target(out)  # and an --out that holds other files (it is replaced whole)
    # a source named by its folder, by a file in it (gates.safetensors) or by "~/..."
    source = next((p for p in paths if (local := local_checkpoint(p)) is not None and local.resolve() == out.resolve()),
                  None)
    if source is not None:  # replaced whole: the source's own gates, card and plots would be gone
        raise FileExistsError(f"--out {out} is one of the checkpoints averaged ({source}): writing the mean there "
                              "replaces those gates; choose a new folder")
    folders = [checkpoint_folder(p) for p in paths]  # each Hub repo downloaded once
    gate_sets = [RetentionGates.from_pretrained(folder) for folder in folders]  # names a missing file
    configs = [json.loads((folder / "config.json").read_text()) for folder in folders]
    bases = {c.get("base_model") or c["gate_config"].get("base_model") for c in configs}
    if len(bases) > 1:
        raise ValueError(f"the checkpoints were trained for different base models {sorted(map(str, bases))}: "
                         "average only gates of one base model")
    gates = average_gates(gate_sets, weights)
    recipe = " + ".join(f"{w:.3g} x {p}" for w, p in zip(weights, paths))
    first = configs[0]
    return export_gates(
        gates, out, base_model=bases.pop(), base_revision=first.get("base_revision"), budget=first.get("budget"),
        training={"averaged_from": recipe, **{f"source {i}": c.get("training", {}).get("config", "n/a")
                                              for i, c in enumerate(configs)}},
    )


def _average_command(args: argparse.Namespace) -> int:
    try:
        print(average_checkpoints(args.checkpoints, args.out, args.weights))
    except (FileNotFoundError, FileExistsError, ValueError, HubError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("average", help="average gate checkpoints weight by weight into a new checkpoint")
    p.add_argument("checkpoints", nargs="+", help="two or more checkpoint folders or Hub repos of one layout")
    p.add_argument("--weights", type=float, nargs="+", default=None, help="one per checkpoint (default: equal)")
    p.add_argument("--out", required=True, help="folder to write the averaged checkpoint to")
    p.set_defaults(func=_average_command)
