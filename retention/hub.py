"""Gate checkpoints: export (safetensors + metadata + model card), load (local or Hub), push to the Hub.

A checkpoint folder holds ``gates.safetensors``, ``retention.json`` (:mod:`retention.metadata`: gate config, base
model id and revision, budget, a short training record) and ``README.md`` (a model card with Hub metadata, and
the results tables :mod:`retention.eval.publish` puts in it). Checkpoints from before ``retention.json`` keep
their metadata in ``config.json``: they load, push and publish as they are.
"""

from __future__ import annotations

import argparse
import glob
import importlib
import os
import posixpath
import re
from pathlib import Path
from typing import Any

from torch import nn

from .gates import GATES_SHA256, RetentionGates, check_finite_before_writing, check_gate_folder_target
from .io import atomic_directory, save_state
from .locate import (CHECKPOINT_FILES, DOWNLOAD_FILES, HubError, checkpoint_folder,  # noqa: F401  (home: locate)
                     is_gate_folder, local_checkpoint)
from .metadata import LEGACY_META_FILE, META_FILE, RESULT_KEYS, metadata_file, metadata_text, read_metadata


_CARD_INTRO = {  # what the gates are, by GateConfig.variant
    "global": ["Learned retention gates for global KV-cache eviction (one budget for all layers, heads and",
               "modalities; the scoring projection is tied so scores share one scale), trained by teacher-student",
               "KL distillation with a global capacity loss using the `retention` toolkit."],
    "trimkv": ["TRIM-KV retention gates (a scoring projection per layer and KV head, nothing tied) for per-head",
               "KV-cache eviction (every KV head keeps its own budget), trained by teacher-student KL distillation",
               "with a per-head capacity loss using the `retention` toolkit."],
    "seed": ["Retention gates in the seed authors' layout (an MLP per layer shared by its heads), trained by",
             "teacher-student KL distillation with a capacity loss using the `retention` toolkit."],
}


# the cache each variant is meant for; both policies keep 4 attention-sink tokens per head by default
_CARD_CACHE = {
    "global": [
        "from retention.cache import RetentionCache  # global top-B over all layers and heads",
        "cache = RetentionCache(model, budget=RetentionCache.budget_for(model, tokens=64))",
    ],
    "trimkv": [
        "from retention.cache import RetentionCache  # every KV head keeps its own top-B / (L * H)",
        "from retention.policies import TrimKVPolicy",
        "cache = RetentionCache(model, budget=RetentionCache.budget_for(model, tokens=64), policy=TrimKVPolicy())",
    ],
}


def model_card(config: dict[str, Any], results_markdown: str | None = None,
               results_sections: list[dict[str, str]] | None = None) -> str:
    """The model card of a checkpoint with metadata ``config``: its layout and training record, how to use it,
    then the main results (``results_markdown``) and further result sets (``results_sections``: ``title`` and
    ``markdown`` each); an older checkpoint's ``config.json`` carries both as keys of ``config``."""
    gc = config["gate_config"]
    results_markdown = config.get("results_markdown") if results_markdown is None else results_markdown
    sections = config.get("results_sections", []) if results_sections is None else results_sections
    base = config.get("base_model") or gc.get("base_model") or "unknown"
    summary = config.get("training") or {}  # export_gates(..., training=None) records None
    lines = [
        "---",
        "library_name: retention",
        f"base_model: {base}",
        "tags:",
        "- kv-cache",
        "- kv-cache-eviction",
        "- retention-gates",
        "license: apache-2.0",
        "---",
        "",
        f"# Retention gates for {base}",
        "",
        *_CARD_INTRO.get(gc["variant"], _CARD_INTRO["global"]),
        "Only the gates are here; the base model is loaded separately.",
        "",
        "| | |",
        "|---|---|",
        f"| variant | {gc['variant']} |",
        f"| layers x KV heads | {gc['num_layers']} x {gc['num_kv_heads']} |",
        f"| gate MLP width | {gc['gate_hidden']} |",
        f"| training budget | {config.get('budget') or 'n/a'} |",
    ]
    for k, v in summary.items():
        lines.append(f"| {k} | {v} |")
    lines += [
        "",
        "## Use",
        "",
        "```python",
        "from retention import load_model, attach_gates, load_gates",
        f'model, tok = load_model("{base}")',
        'gates = load_gates("<this repo or folder>", model=model)',
        'attach_gates(model, gates, mode="score")',
        *_CARD_CACHE.get(gc["variant"], _CARD_CACHE["global"]),
        "# model.generate(**inputs, cache=cache)  # past_key_values=cache before transformers 5.24",
        "```",
        "",
    ]
    if results_markdown or sections:
        lines += ["## Results", "", *([results_markdown, ""] if results_markdown else [])]
    for section in sections:  # further result sets (e.g. a goal check), in the order they were published
        lines += [f"### {section['title']}", "", section["markdown"], ""]
    return "\n".join(lines)


_RESULTS_HEADING = "## Results\n\n"
_SECTION = re.compile(r"\n\n### (.+)\n\n")  # a further result set's heading, as model_card writes it


def card_results(folder: str | Path) -> tuple[str | None, list[dict[str, str]]]:
    """The results the card of the checkpoint in ``folder`` shows, as :func:`model_card` takes them: the main
    results' markdown (None when it has none) and the further sections (``title``, ``markdown`` and, when the
    section shows a plot of its own, ``figure``). An older checkpoint's ``config.json`` holds them as keys; else
    they are read from ``README.md``, the results part :func:`model_card` wrote."""
    legacy = read_metadata(folder, results=True)
    if any(k in legacy for k in RESULT_KEYS):
        return legacy.get("results_markdown"), list(legacy.get("results_sections", []))
    card = Path(folder) / "README.md"
    text = card.read_text() if card.is_file() else ""
    at = text.find("\n" + _RESULTS_HEADING)
    if at < 0:
        return None, []
    # model_card ends with an empty line: the last part carries one "\n" more than the markdown it was given
    rest = "\n\n" + text[at + 1 + len(_RESULTS_HEADING):].removesuffix("\n")
    parts = _SECTION.split(rest)  # [main, title, markdown, title, markdown, ...]
    main = parts[0].removeprefix("\n\n") or None
    sections = []
    for title, markdown in zip(parts[1::2], parts[2::2]):
        section = {"title": title, "markdown": markdown}
        figures = [x for x in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", markdown) if "://" not in x]
        if figures:  # the plot publish put beside it, removed with it when the section is replaced
            section["figure"] = figures[-1]
        sections.append(section)
    return main, sections


def export_gates(gates: RetentionGates, path: str | Path, **info: Any) -> Path:
    """Write a self-describing checkpoint atomically. ``info``: base_model, base_revision, budget, training..."""
    path = Path(path).expanduser()  # as loading reads "~/gates"
    gate_config = gates.config.to_dict()
    if info.get("base_model"):  # one name for the base: the gates' own may be a local folder they were trained from
        gate_config["base_model"] = info["base_model"]
    config = {"gate_config": gate_config, "format": "retention-gates/1", **info}
    check_finite_before_writing(gates, path)  # what loading refuses must not replace what is there
    check_gate_folder_target(path)  # the folder is replaced whole: never over someone's files
    with atomic_directory(path) as tmp:
        config[GATES_SHA256] = save_state(gates.state_dict(), tmp / "gates.safetensors", metadata={"format": "pt"})
        (tmp / META_FILE).write_text(metadata_text(config))
        (tmp / "README.md").write_text(model_card(config))
    return path


def load_gates(path_or_repo_id: str | Path, model: nn.Module | None = None,
               revision: str | None = None, verify: bool = True) -> RetentionGates:
    """Load gates from a folder or a Hub repo (safetensors only; NaN or inf weights refused); with ``model``, check
    they fit it. ``verify``: refuse tensors that do not match the SHA-256 the metadata records (``False``: gates
    whose weights were edited on purpose)."""
    gates = RetentionGates.from_pretrained(checkpoint_folder(path_or_repo_id, revision), verify=verify)
    if model is not None:
        from .attach import check_gates_match

        check_gates_match(model, gates.config)
    return gates


def card_figures(path: str | Path) -> list[str]:
    """The images the checkpoint's model card shows from its own folder (markdown ``![..](name)`` links that
    are relative paths), in order: they go up with the checkpoint so the card on the Hub shows them."""
    card = Path(path) / "README.md"
    # a link may carry a title, ![x](a.png "title"); its target is kept as the upload's relative path, so
    # "./a.png" becomes "a.png" (the upload's patterns match "a.png" only)
    links = re.findall(r"!\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", card.read_text()) if card.is_file() else []
    links = [posixpath.normpath(x) for x in links if "://" not in x and not x.startswith(("/", "#"))]
    return list(dict.fromkeys(x for x in links if not x.startswith("..")))


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


def push_to_hub(path: str | Path, repo_id: str, private: bool = False, token: str | None = None) -> str:
    """Create ``repo_id`` (if needed) and upload the checkpoint (:data:`CHECKPOINT_FILES` and the images its model
    card shows, :func:`card_figures`); returns the commit URL."""
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
            commit_message="Upload retention gates",
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


def _push_command(args: argparse.Namespace) -> int:
    print(push_to_hub(args.path, args.repo_id, private=args.private))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("push", help="upload a gate checkpoint folder to the Hugging Face Hub")
    p.add_argument("path", help=f"checkpoint folder (gates.safetensors, {META_FILE}, README.md)")
    p.add_argument("repo_id", help="e.g. your-name/smollm2-135m-retention-gates")
    p.add_argument("--private", action="store_true", help="create the repo private (when it does not exist yet)")
    p.set_defaults(func=_push_command)
