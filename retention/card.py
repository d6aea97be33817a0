"""A gate checkpoint's model card (``README.md``): Hub metadata in its YAML front matter, what the gates are, how to
use them, and the results tables :mod:`retention.eval.publish` puts in it; read back by :func:`card_results` and
:func:`card_figures`.

Below the gates (which write it with their checkpoint) and the hub module (which re-exports these names).
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

import yaml

from .architecture import VISION_LANGUAGE_MODEL_TYPES
from .locate import looks_like_a_path
from .metadata import RESULT_KEYS, read_metadata

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


CARD_TAGS = ("kv-cache", "kv-cache-eviction", "retention-gates")


def is_hub_model_id(name: str | None) -> bool:
    """Whether ``name`` is a Hub repo id (``owner/name``, or a bare legacy ``name``) rather than a path on this machine:
    never an absolute or relative path (``/x``, ``./x``, ``~/x``, ``a/b/c``) or a folder that exists here."""
    if not name or looks_like_a_path(name) or Path(name).expanduser().exists():
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def recorded_base_model(config: dict[str, Any]) -> str | None:
    """The base model the metadata names (the checkpoint's own key, else its gate config's), as recorded."""
    return config.get("base_model") or config.get("gate_config", {}).get("base_model") or None


def card_base_model(config: dict[str, Any]) -> str | None:
    """The Hub id of the checkpoint's base model for the card's ``base_model``; ``None`` when the metadata names a
    local folder (gates trained from a copy on disk: the Hub would link a repo that does not exist) or nothing."""
    base = recorded_base_model(config)
    return base if is_hub_model_id(base) else None


def card_pipeline_tag(config: dict[str, Any]) -> str:
    """``image-text-to-text`` when the base model reads images (its recorded ``base_model_type``; for a checkpoint
    from before that was recorded, a ``-VL`` in its name), else ``text-generation``."""
    model_type = config.get("gate_config", {}).get("base_model_type")
    if model_type is not None:
        vision = model_type in VISION_LANGUAGE_MODEL_TYPES
    else:
        vision = re.search(r"-vl\b", str(recorded_base_model(config) or ""), re.IGNORECASE) is not None
    return "image-text-to-text" if vision else "text-generation"


def card_datasets(config: dict[str, Any]) -> list[str]:
    """The Hub datasets the gates were trained on (the metadata's ``datasets``: the training sources that were Hub
    dataset ids), each once, in order; builtin corpora, local files and synthetic tasks are not on the Hub."""
    return list(dict.fromkeys(d for d in config.get("datasets") or [] if isinstance(d, str) and is_hub_model_id(d)))


def card_front_matter(config: dict[str, Any]) -> str:
    """The card's YAML front matter (without its ``---`` lines), the Hub's model metadata: ``library_name``,
    ``base_model`` with ``base_model_relation: adapter`` (the gates are an add-on to the frozen base, as a PEFT
    adapter is) when it is a Hub id, ``pipeline_tag``, ``datasets`` when any, ``tags`` and ``license``."""
    front: dict[str, Any] = {"library_name": "retention"}
    if base := card_base_model(config):
        front.update(base_model=base, base_model_relation="adapter")
    front["pipeline_tag"] = card_pipeline_tag(config)
    if datasets := card_datasets(config):
        front["datasets"] = datasets
    front.update(tags=list(CARD_TAGS), license="apache-2.0")
    return yaml.safe_dump(front, sort_keys=False, default_flow_style=False, allow_unicode=True)


def model_card(config: dict[str, Any], results_markdown: str | None = None,
               results_sections: list[dict[str, str]] | None = None) -> str:
    """The model card of a checkpoint with metadata ``config``: its layout and training record, how to use it,
    then the main results (``results_markdown``) and further result sets (``results_sections``: ``title`` and
    ``markdown`` each); an older checkpoint's ``config.json`` carries both as keys of ``config``."""
    gc = config["gate_config"]
    results_markdown = config.get("results_markdown") if results_markdown is None else results_markdown
    sections = config.get("results_sections", []) if results_sections is None else results_sections
    base = card_base_model(config)
    # the title and the snippet need a name; a local folder is named by its last part, never by its path
    shown = base or (recorded_base_model(config) or "").rstrip("/").rsplit("/", 1)[-1] or "an unknown base model"
    summary = config.get("training") or {}  # export_gates(..., training=None) records None
    lines = [
        "---",
        card_front_matter(config).rstrip("\n"),
        "---",
        "",
        f"# Retention gates for {shown}",
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
        f'model, tok = load_model("{base or "<the base model: its Hub id or folder>"}")',
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


def card_figures(path: str | Path) -> list[str]:
    """The images the checkpoint's model card shows from its own folder (markdown ``![..](name)`` links that
    are relative paths), in order: they go up with the checkpoint so the card on the Hub shows them."""
    card = Path(path) / "README.md"
    # a link may carry a title, ![x](a.png "title"); its target is kept as the upload's relative path, so
    # "./a.png" becomes "a.png" (the upload's patterns match "a.png" only)
    links = re.findall(r"!\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", card.read_text()) if card.is_file() else []
    links = [posixpath.normpath(x) for x in links if "://" not in x and not x.startswith(("/", "#"))]
    return list(dict.fromkeys(x for x in links if not x.startswith("..")))


