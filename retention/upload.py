"""Upload a gate checkpoint folder to the Hugging Face Hub: the checks that need no network first (a repo id, a
token, a card that names its base model by Hub id, the images it shows), then one commit of the checkpoint's files.

Below the gates (``RetentionGates.push_to_hub``) and the hub module (``retention push``, which re-exports these).
"""

from __future__ import annotations

import glob
import importlib
import os
from pathlib import Path

from .card import card_figures, card_results, is_hub_model_id, model_card, recorded_base_model
from .io import atomic_write_bytes
from .locate import CHECKPOINT_FILES, HubError, local_checkpoint
from .metadata import META_FILE, metadata_file, read_metadata, write_metadata


def check_push_target(repo_id: str, token: str | None = None) -> None:
    """HubError naming the fix unless ``repo_id`` is a valid repo id and a Hub token is at hand (``token``,
    ``HF_TOKEN`` or a stored login). Offline: checks what a long run's final upload needs, before the run."""
    from huggingface_hub import get_token
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise HubError(f"cannot upload to {repo_id!r}: {e} Give it as owner/name") from None
    if not (token or os.environ.get("HF_TOKEN") or get_token()):
        raise HubError(f"uploading to {repo_id!r} needs a Hub token: set HF_TOKEN or run `hf auth login` "
                       "(or leave out the upload and run `retention push DIR REPO_ID` later)")


def push_to_hub(path: str | Path, repo_id: str, private: bool = False, token: str | None = None,
                base_model: str | None = None, commit_message: str = "Upload retention gates") -> str:
    """Create ``repo_id`` (if needed) and upload the checkpoint (:data:`CHECKPOINT_FILES` and the images its model
    card shows, :func:`card_figures`); returns the commit URL. ``base_model``: the base model's Hub id, written into
    the checkpoint's metadata and card first (:func:`set_base_model`), for gates whose metadata names a local
    folder; HubError when the checkpoint names none by Hub id (:func:`check_card_base_model`)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    local = local_checkpoint(path)  # "smollm2-135m-global": the package's copy, as load_gates finds it
    if local is None:
        path = Path(path).expanduser()
        raise HubError(f"{path}: there is no such folder (looked for {path.resolve()}); give the folder a training "
                       "run exported (train.py --export, or its export.dir)")
    path = local
    # an older checkpoint's config.json stands for its retention.json
    missing = [f for f in CHECKPOINT_FILES if not (path / f).is_file()
               and not (f == META_FILE and metadata_file(path).is_file())]
    if missing:
        how = (f"python train.py --config CONFIG --export {path} --to DIR, then push DIR"
               if (path / "state.json").is_file() else "export it first")  # a run's checkpoints/step-N
        raise HubError(f"{path} is not a gate checkpoint: missing {missing} ({how})")
    if base_model is not None:
        set_base_model(path, base_model)
    check_card_base_model(path)
    check_push_target(repo_id, token)
    figures = card_figures(path)
    absent = [f for f in figures if not (path / f).is_file()]
    if absent:
        raise HubError(f"the model card in {path} shows {absent}, which the folder lacks: publish the results again "
                       "(python -m retention.eval report RESULTS --card FOLDER) or remove the image links from "
                       "README.md")
    api = HfApi(token=token or os.environ.get("HF_TOKEN"))
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        info = api.upload_folder(  # the patterns are fnmatch's: a figure named "fig[1].png" must match itself only
            folder_path=str(path), repo_id=repo_id,
            allow_patterns=[*CHECKPOINT_FILES, metadata_file(path).name, *map(glob.escape, figures)],
            commit_message=commit_message,
        )
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        hint = ("the Hub failed: try again later" if status is not None and status >= 500 else
                f"set HF_TOKEN to a token with write access to {repo_id.split('/')[0]!r}" if status in (401, 403)
                else "check the repo id")
        said = getattr(e, "server_message", None) or str(e).splitlines()[0]  # the Hub's own reason
        raise HubError(f"uploading to {repo_id!r} failed (HTTP {status}: {said}): {hint}") from None
    except _network_errors() as e:  # no network, a timeout
        raise HubError(f"cannot reach the Hub to upload {repo_id!r}: {e}; check your network, then run "
                       f"retention push {path} {repo_id}") from None
    return str(getattr(info, "commit_url", info))


def _network_errors() -> tuple[type[BaseException], ...]:
    """What a Hub call raises when the network fails: OSError (requests, before huggingface_hub 1.0), and the
    transport errors of the httpx client newer versions use (a ConnectError or ReadTimeout is no OSError)."""
    errors: list[type[BaseException]] = [OSError]
    for name in ("httpx2", "httpx"):
        try:
            errors.append(importlib.import_module(name).TransportError)
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def check_card_base_model(path: str | Path) -> None:
    """HubError naming the key and the fix when the checkpoint in ``path`` names its base model by a local folder
    (or not at all): its card then has no ``base_model``, so the Hub could not link the gates to their model."""
    meta = read_metadata(path)
    base = recorded_base_model(meta)
    if is_hub_model_id(base):
        return
    said = f"is the local path {base!r}, not a Hub id" if base else "is missing"
    raise HubError(f"{metadata_file(path)}: base_model {said}, so the model card names no base model; pass "
                   f"base_model= the base model's Hub id (retention push {path} REPO_ID --base-model owner/name, "
                   "push_to_hub(DIR, REPO_ID, base_model='owner/name'), gates.push_to_hub(REPO_ID, "
                   "base_model='owner/name') or export_gates(gates, DIR, base_model='owner/name'))")


def set_base_model(path: str | Path, base_model: str) -> None:
    """Record ``base_model`` (a Hub id) as the base of the checkpoint in ``path``: its metadata (``base_model`` and
    the gate config's) and its model card, rebuilt with the results it shows. HubError when it is no Hub id."""
    if not is_hub_model_id(base_model):
        raise HubError(f"base_model {base_model!r} is not a Hub model id: give it as owner/name (the repo the base "
                       "model is on)")
    meta = read_metadata(path)
    if recorded_base_model(meta) == base_model and meta.get("gate_config", {}).get("base_model") == base_model:
        return  # as recorded: nothing rewritten
    main, sections = card_results(path)  # read before the metadata is rewritten (an older config.json holds them)
    meta["base_model"] = base_model
    meta["gate_config"] = {**meta["gate_config"], "base_model": base_model}
    write_metadata(path, meta)
    atomic_write_bytes(Path(path) / "README.md", model_card(meta, main, sections).encode())
