"""Average gate checkpoints weight by weight (a "model soup": Wortsman et al., 2022, WiSE-FT / soups).

Two gate sets fine-tuned from one parent usually sit in one basin, so their weighted mean is a third set
between them: for example the shipped gates and a continuation that traded needles for fidelity. The
result is an ordinary checkpoint (safetensors, config, model card) that loads and ships like any other.

    retention average checkpoints/a runs/b/final --weights 0.5 0.5 --out runs/soup
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Sequence

import torch

from .gates import GateConfig, RetentionGates, check_gate_folder_target, nonfinite_tensors
from .hub import HubError, checkpoint_folder, export_gates, local_checkpoint
from .metadata import read_metadata


def normalised_weights(weights: Sequence[float] | None, n: int) -> list[float]:
    """``n`` averaging weights (default equal), checked (n >= 2; >= 0, positive sum) and scaled to sum 1."""
    if n < 2:
        raise ValueError(f"averaging needs at least two gate sets, got {n}")
    weights = [1.0] * n if weights is None else [float(w) for w in weights]
    if len(weights) != n:
        raise ValueError(f"{len(weights)} weights for {n} gate sets: give one weight per checkpoint")
    if any(not 0 <= w < math.inf for w in weights) or sum(weights) <= 0:  # `not` also catches NaN
        raise ValueError(f"weights must be finite and >= 0 with a positive sum, got {weights}")
    # scaled by the largest first: a sum that overflows (1e308 twice) would turn every weight into 0
    weights = [w / max(weights) for w in weights]
    return [w / sum(weights) for w in weights]


_ARCHITECTURE_KEYS = ("base_model_type", "base_architecture")  # GateConfig's record of the base's architecture


def average_gates(gate_sets: Sequence[RetentionGates], weights: Sequence[float] | None = None) -> RetentionGates:
    """Weighted mean of every parameter of ``gate_sets`` (same config; weights >= 0, normalised to sum 1).

    Returns new gates with the first set's config; the inputs are left untouched."""
    weights = normalised_weights(weights, len(gate_sets))
    first = gate_sets[0].config.to_dict()
    recorded = {k: first[k] for k in _ARCHITECTURE_KEYS}  # the base's architecture, as the sets that record it say
    for i, g in enumerate(gate_sets[1:], 1):
        other = g.config.to_dict()
        # bias_init only seeds training; a different base model is checked when loading against it; a set from before
        # the base's architecture was recorded has None there, which differs from nothing
        seen = {**first, **recorded}
        differ = sorted(k for k in seen if k not in ("base_model", "bias_init") and seen[k] != other[k]
                        and not (k in _ARCHITECTURE_KEYS and None in (seen[k], other[k])))
        if differ:
            raise ValueError(
                f"gate set {i} differs from gate set 0 in "
                f"{', '.join(f'{k} ({other[k]!r} vs {seen[k]!r})' for k in differ)}: "
                "only gates of one layout (variant, width, model shape and architecture) can be averaged"
            )
        recorded = {k: recorded[k] if recorded[k] is not None else other[k] for k in _ARCHITECTURE_KEYS}
    out = RetentionGates(GateConfig.from_dict({**first, **recorded}))
    states = [g.state_dict() for g in gate_sets]
    with torch.no_grad():
        for name, param in out.state_dict().items():
            mean = sum(w * s[name].to(torch.float64) for w, s in zip(weights, states))
            param.copy_(mean.to(param.dtype))
    return out


def _same_weights(a: RetentionGates, b: RetentionGates) -> bool:
    """Whether two gate sets hold equal tensors under the same names."""
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(sa[k].shape == sb[k].shape and torch.equal(sa[k], sb[k]) for k in sa)


def _per_source(values: Sequence[object]) -> str | None:
    """``None`` when every source has the same value, else a line listing each source's (``source i: value``)."""
    if len({json.dumps(v, sort_keys=True, default=str) for v in values}) == 1:
        return None
    return "differs by source: " + "; ".join(f"source {i}: {v or 'n/a'}" for i, v in enumerate(values))


def average_checkpoints(
    paths: Sequence[str | Path], out: str | Path, weights: Sequence[float] | None = None
) -> Path:
    """Load checkpoints (folders or Hub repos), average them, and export the mean to ``out`` atomically.

    The card and ``retention.json`` record the sources and weights; the sources must share the base model and be
    distinct checkpoints (one named twice is refused: weight it with ``weights``). A budget or base revision the
    sources do not share is written per source, never as the first one's. Sources with NaN or inf weights, or a
    non-finite mean, are refused before anything is written."""
    weights = normalised_weights(weights, len(paths))  # a lone checkpoint or bad weights fail before any download
    out = Path(out).expanduser()
    check_gate_folder_target(out)  # and an --out that holds other files (it is replaced whole)
    # a source named by its folder, by a file in it (gates.safetensors) or by "~/..."; a Hub repo id by itself
    local_folders = [local_checkpoint(p) for p in paths]
    keys = [str(p) if local is None else str(local.resolve()) for p, local in zip(paths, local_folders)]
    source = next((p for p, local in zip(paths, local_folders) if local and local.resolve() == out.resolve()), None)
    if source is not None:  # replaced whole: the source's own gates, card and plots would be gone
        raise FileExistsError(f"--out {out} is one of the checkpoints averaged ({source}): writing the mean there "
                              "replaces those gates; choose a new folder")
    twice = next(((i, j) for j in range(len(keys)) for i in range(j) if keys[i] == keys[j]), None)
    if twice is not None:  # the mean of a set with itself is that set again, recorded as a soup it is not
        i, j = twice
        raise ValueError(f"{paths[i]} and {paths[j]} are the same checkpoint ({keys[i]}): averaging gates with "
                         "themselves gives them back unchanged; name each checkpoint once (to count one more, "
                         "give it a larger --weights value)")
    folders = [checkpoint_folder(p) for p in paths]  # each Hub repo downloaded once
    gate_sets = [RetentionGates.from_pretrained(folder) for folder in folders]  # a missing file, NaN / inf weights
    same = next(((i, j) for j in range(len(gate_sets)) for i in range(j)
                 if _same_weights(gate_sets[i], gate_sets[j])), None)
    if same is not None:  # copies of one checkpoint in two folders (or a repo and its download): no soup either
        i, j = same
        raise ValueError(f"{paths[i]} and {paths[j]} hold the same gate weights: averaging gates with themselves "
                         "gives them back unchanged; name one of them (to count it more, give it a larger "
                         "--weights value)")
    configs = [read_metadata(folder) for folder in folders]
    bases = {c.get("base_model") or c["gate_config"].get("base_model") for c in configs}
    if len(bases) > 1:
        raise ValueError(f"the checkpoints were trained for different base models {sorted(map(str, bases))}: "
                         "average only gates of one base model")
    gates = average_gates(gate_sets, weights)
    bad = nonfinite_tensors(gates.state_dict())
    if bad:  # finite sources should not give this, but a NaN mean must never be written as a checkpoint
        raise ValueError(f"the weighted mean of {', '.join(map(str, paths))} holds NaN or inf in {', '.join(bad)}: "
                         f"nothing written to {out}")
    recipe = " + ".join(f"{w:.3g} x {p}" for w, p in zip(weights, paths))
    budgets = [c.get("budget") for c in configs]
    revisions = [c.get("base_revision") for c in configs]
    revisions_differ = _per_source(revisions)
    training = {"averaged_from": recipe, **{f"source {i}": c.get("training", {}).get("config", "n/a")
                                            for i, c in enumerate(configs)}}
    if revisions_differ:  # no one revision is the mean's: base_revision stays empty, the card says why
        training["base_revision"] = revisions_differ
    return export_gates(  # a budget the sources share is the mean's; else each source's, not the first one's
        gates, out, base_model=bases.pop(), base_revision=None if revisions_differ else revisions[0],
        budget=_per_source(budgets) or budgets[0], training=training,
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
