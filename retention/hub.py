"""Gate checkpoints: export (safetensors + metadata + model card), load (local or Hub), push to the Hub.

A checkpoint folder holds ``gates.safetensors``, ``retention.json`` (:mod:`retention.metadata`: gate config, base
model id and revision, budget, a short training record) and ``README.md`` (a model card with Hub metadata, and
the results tables :mod:`retention.eval.publish` puts in it). Checkpoints from before ``retention.json`` keep
their metadata in ``config.json``: they load, push and publish as they are.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from torch import nn

# the card and the upload sit below the gates, which write and push checkpoints too; their names stay importable here
from .card import card_figures, card_results, model_card  # noqa: F401
from .gates import RetentionGates
from .locate import (CHECKPOINT_FILES, DOWNLOAD_FILES, HubError, checkpoint_folder,  # noqa: F401  (home: locate)
                     is_gate_folder, local_checkpoint)
from .metadata import LEGACY_META_FILE, META_FILE, RESULT_KEYS, metadata_file, read_metadata  # noqa: F401
from .upload import _network_errors, check_card_base_model, check_push_target, push_to_hub, set_base_model  # noqa: F401


def export_gates(gates: RetentionGates, path: str | Path, **info: Any) -> Path:
    """Write a self-describing checkpoint atomically: :meth:`RetentionGates.save_pretrained`, the one writer.
    ``info``: base_model (a Hub id), base_revision, budget, training, datasets..."""
    return gates.save_pretrained(path, **info)


def load_gates(path_or_repo_id: str | Path, model: nn.Module | None = None,
               revision: str | None = None, verify: bool = True, token: str | None = None) -> RetentionGates:
    """Load gates from a folder or a Hub repo (safetensors only; NaN or inf weights refused); with ``model``, check
    they fit it. ``verify``: refuse tensors that do not match the SHA-256 the metadata records (``False``: gates
    whose weights were edited on purpose). ``token``: for a private Hub repo (else ``HF_TOKEN`` or a stored login)."""
    gates = RetentionGates.from_pretrained(path_or_repo_id, revision=revision, verify=verify, token=token)
    if model is not None:
        from .attach import check_gates_match

        check_gates_match(model, gates.config)
    return gates


def _push_command(args: argparse.Namespace) -> int:
    print(push_to_hub(args.path, args.repo_id, private=args.private, base_model=args.base_model))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("push", help="upload a gate checkpoint folder to the Hugging Face Hub")
    p.add_argument("path", help=f"checkpoint folder (gates.safetensors, {META_FILE}, README.md)")
    p.add_argument("repo_id", help="e.g. your-name/smollm2-135m-retention-gates")
    p.add_argument("--private", action="store_true", help="create the repo private (when it does not exist yet)")
    p.add_argument("--base-model", dest="base_model", default=None, metavar="HUB_ID",
                   help="the base model's Hub id, recorded in the checkpoint first (for gates trained from a local "
                        "copy, whose metadata names its folder)")
    p.set_defaults(func=_push_command)
