"""A gate checkpoint's metadata file: ``retention.json``, small and machine-readable.

It holds what code reads back: ``gate_config`` (the gates' layout), ``base_model`` and ``base_revision``, the
training ``budget`` in words, a short ``training`` record (steps, KL, data, what the run started from; a soup's
``averaged_from``) and ``format``. Tables and prose live only in the model card (``README.md``).

Checkpoints written before it kept all of that, and the card's results, in ``config.json`` (a name transformers
reads as a model's config): they still load (:func:`read_metadata` falls back to it), and writing their metadata
again converts them (:func:`write_metadata` removes the old file). Plain ``json`` and ``pathlib`` only: every layer
may import this.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

META_FILE = "retention.json"
LEGACY_META_FILE = "config.json"  # checkpoints before retention.json: metadata and the card's results in one file
RESULT_KEYS = ("results_markdown", "results_sections")  # what a legacy config.json held of the card's results


def metadata_file(folder: str | Path) -> Path:
    """The metadata file of the checkpoint in ``folder``: ``retention.json``, else an older checkpoint's
    ``config.json`` when it holds a ``gate_config``; ``folder / retention.json`` (missing) when neither does."""
    folder = Path(folder)
    new, old = folder / META_FILE, folder / LEGACY_META_FILE
    if new.is_file() or not old.is_file():
        return new
    try:
        legacy = "gate_config" in json.loads(old.read_text())
    except (OSError, ValueError, TypeError):  # a model's config.json, or not JSON: no gate checkpoint's
        legacy = False
    return old if legacy else new


def read_metadata(folder: str | Path, results: bool = False) -> dict[str, Any]:
    """The metadata of the checkpoint in ``folder`` (``OSError`` when it has none, ``ValueError`` when it is not
    JSON). ``results``: keep an older ``config.json``'s card results too (:data:`RESULT_KEYS`)."""
    meta = json.loads(metadata_file(folder).read_text())
    return meta if results else {k: v for k, v in meta.items() if k not in RESULT_KEYS}


def metadata_text(meta: dict[str, Any]) -> str:
    """``meta`` as the file holds it: sorted keys, two-space indent (values JSON cannot hold as their text)."""
    return json.dumps(meta, indent=2, sort_keys=True, default=str)


def write_metadata(folder: str | Path, meta: dict[str, Any]) -> Path:
    """Write ``meta`` (without card results) as ``folder/retention.json`` atomically; an older checkpoint's
    ``config.json`` goes, as the new file replaces it. Returns the file written."""
    from .io import atomic_write_bytes

    folder = Path(folder)
    legacy = metadata_file(folder)
    target = folder / META_FILE
    atomic_write_bytes(target, metadata_text({k: v for k, v in meta.items() if k not in RESULT_KEYS}).encode())
    if legacy.name == LEGACY_META_FILE:
        legacy.unlink()
    return target
