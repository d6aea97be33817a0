"""Where a gate checkpoint is: a folder on this machine, a shipped checkpoint's name (``smollm2-135m-global``) or a
Hub repo id, downloaded once into the local Hub cache.

Found here, below the gates that load from it and the hub module that exports and pushes checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

from .metadata import LEGACY_META_FILE, META_FILE, metadata_file

CHECKPOINT_FILES = ("gates.safetensors", META_FILE, "README.md")
# what a checkpoint download fetches: an older checkpoint's metadata too
DOWNLOAD_FILES = (*CHECKPOINT_FILES, LEGACY_META_FILE)
# Trained gates shipped with the toolkit (a few MB each): `checkpoints/` of a checkout, which a wheel installs as
# the data package `retention/checkpoints/` (pyproject.toml's package-dir); the first that exists wins.
CHECKPOINT_DIRS = (Path(__file__).resolve().parent / "checkpoints", Path(__file__).resolve().parents[1] / "checkpoints")


class HubError(RuntimeError):
    """A Hub operation failed; the message says why and what to do."""


def is_gate_folder(path: str | Path) -> bool:
    """Whether ``path`` holds gates written by this toolkit (a ``retention.json``, or an older checkpoint's
    ``config.json``, with a ``gate_config``)."""
    try:
        return "gate_config" in json.loads(metadata_file(path).read_text())
    except (OSError, ValueError, TypeError):
        return False


def shipped_checkpoint(name_or_path: str | Path) -> Path | None:
    """A shipped gate checkpoint named by its folder (``smollm2-135m-global``, or the checkout's
    ``checkpoints/smollm2-135m-global`` from any working directory); ``None`` when it names none."""
    parts = Path(name_or_path).parts
    if not parts or len(parts) > 2 or (len(parts) == 2 and parts[0] != "checkpoints"):
        return None
    found = (d / parts[-1] for d in CHECKPOINT_DIRS if (d / parts[-1] / "gates.safetensors").is_file())
    return next(found, None)


def looks_like_a_path(name: str) -> bool:
    """A name that can only be a local path: a Hub id is ``name`` or ``owner/name``, never ``/x``, ``./x``,
    ``a/b/c``."""
    return name.startswith(("/", ".", "~", "\\")) or name.count("/") > 1 or "\\" in name


def local_checkpoint(path_or_repo_id: str | Path) -> Path | None:
    """The folder ``path_or_repo_id`` names on this machine: itself when it exists (``~`` expanded; the folder of a
    checkpoint file such as its ``gates.safetensors``), else a shipped checkpoint of that name
    (:func:`shipped_checkpoint`: the installed package's copy, from any folder); ``None`` when
    neither exists."""
    p = Path(path_or_repo_id).expanduser()
    if p.is_file() and p.name in DOWNLOAD_FILES and is_gate_folder(p.parent):
        return p.parent  # a file of a checkpoint (its gates.safetensors, say) names the checkpoint
    if p.exists():
        return p
    return shipped_checkpoint(p)


def checkpoint_folder(path_or_repo_id: str | Path, revision: str | None = None, token: str | None = None) -> Path:
    """A gate checkpoint's folder: ``path_or_repo_id`` itself when it exists here, else a shipped checkpoint of that
    name (:func:`shipped_checkpoint`), else the Hub snapshot of its checkpoint files at ``revision`` (downloaded
    once, then read from the local Hub cache; ``token`` for a private repo, else ``HF_TOKEN`` or a stored login).
    HubError naming the fix otherwise."""
    local = local_checkpoint(path_or_repo_id)
    if local is not None:
        return local
    if looks_like_a_path(str(path_or_repo_id)):  # no Hub id has this form: say what is missing
        raise HubError(
            f"gate checkpoint {str(path_or_repo_id)!r}: there is no such folder (looked for "
            f"{Path(path_or_repo_id).expanduser().resolve()}); give "
            f"the folder a training run exported (gates.safetensors, {META_FILE}), a shipped checkpoint's name "
            "(smollm2-135m-global) or a Hub repo id (owner/name)"
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(str(path_or_repo_id), revision=revision, token=token,
                                      allow_patterns=list(DOWNLOAD_FILES)))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as e:
        raise HubError(
            f"gate checkpoint {str(path_or_repo_id)!r} is neither a local folder nor reachable on the Hub ({e}); "
            "check the path or repo id, your network, and HF_TOKEN for private repos"
        ) from None
