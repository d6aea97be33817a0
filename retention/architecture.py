"""What the base model is, read off its config: the architectures retention gates support, the text decoder's config
(layers, KV heads, hidden size) under wrappers and vision-language models, Qwen3-VL's text positions, and the
architecture fingerprint gate checkpoints record of their base model.

Every layer that needs a model's shapes reads them here (the gates, the attachment, the cache, the loaders).
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

# model_type of the top-level config -> model_type of its text decoder
SUPPORTED_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_vl": "qwen3_vl_text",
}


class UnsupportedModelError(ValueError):
    """The base model's architecture has no retention-gate support."""


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model under PEFT / DDP / DeepSpeed wrappers."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if hasattr(model, "module") and isinstance(model.module, nn.Module):  # DDP, DeepSpeed
            model = model.module
        elif hasattr(model, "get_base_model"):  # PEFT
            model = model.get_base_model()
    return model


def sliding_window_of(text_config: Any) -> int | None:
    """The attention window (tokens) of the decoder's sliding-window layers; ``None`` when every layer is full.

    Qwen2/Qwen3 mark such layers in ``layer_types``; Mistral slides every layer when ``sliding_window`` is set.
    """
    window = getattr(text_config, "sliding_window", None)
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is not None:
        return window if "sliding_attention" in layer_types else None
    return window


def text_config(config: Any) -> Any:
    """The text decoder's config within a model's top-level config (the config itself for text-only models)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def check_supported(config: Any, owner: str | None = None) -> None:
    """Raise :class:`UnsupportedModelError` unless retention gates can drive this model (its top-level config).

    Checked from the config alone, so loaders can refuse before the weights are read. ``owner`` names the model
    when its config has no ``_name_or_path`` (a model built from a config: its class name).
    """
    model_type = getattr(config, "model_type", None)
    name = getattr(config, "_name_or_path", "") or owner or "this model"
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"retention gates do not support model_type {model_type!r} ({name}); "
            f"supported: {sorted(SUPPORTED_MODEL_TYPES)}"
        )
    text = text_config(config)
    window = sliding_window_of(text)
    if window is not None:
        # the gated attention and the retention cache attend over every kept entry: a window would be ignored,
        # so the student and the cache would silently stop matching the model
        off = "sliding_window=None"
        if getattr(text, "layer_types", None) is not None:
            off += f', layer_types=["full_attention"] * {len(text.layer_types)}'
        raise UnsupportedModelError(
            f"{name} has sliding-window attention layers ({window} tokens); retention gates and the retention "
            "cache attend over every kept entry and do not support a window. If your contexts stay within "
            f"{window} tokens the window changes nothing: load the model with every layer full, "
            f"load_model(..., {off}) or the same keywords to from_pretrained (for train.py and the eval "
            "configs, save_pretrained the model so loaded and name that folder)"
        )


def text_config_of(model: nn.Module) -> PreTrainedConfig:
    """Config of the text decoder (the model's own config for text-only models)."""
    base = unwrap(model)
    config = getattr(base, "config", None)
    check_supported(config, owner=type(base).__name__)
    return text_config(config)


def is_multimodal(config: Any) -> bool:
    return getattr(config, "vision_config", None) is not None


def text_mrope_positions(text: torch.Tensor, delta: torch.Tensor | int) -> torch.Tensor:
    """Qwen3-VL ``position_ids`` ``(4, B, n)`` of text tokens at true indices ``text`` ``(B, n)``: the first row the
    index itself (the masks read it), then M-RoPE's three axes, each at the index plus ``delta`` (the model's
    ``rope_deltas``, ``(B, 1)`` or an int: how far the images so far moved the text positions)."""
    return torch.cat([text[None], (text + delta)[None].expand(3, *text.shape)], dim=0)


# the config fields that say which architecture a model is (the decoder's; model_type the top-level config's): models
# that share them have hidden states of one layout and size, so gates trained on one may score the other
ARCHITECTURE_FIELDS = ("model_type", "num_hidden_layers", "num_key_value_heads", "num_attention_heads", "hidden_size",
                       "head_dim", "vocab_size", "rope_theta", "intermediate_size")
VISION_LANGUAGE_MODEL_TYPES = ("qwen3_vl",)  # top-level model_type of the supported bases that read images


def architecture_fields(config: Any) -> dict[str, Any]:
    """The :data:`ARCHITECTURE_FIELDS` a model's top-level ``config`` has (``model_type`` its own, the rest its text
    decoder's), those it lacks or holds as None left out. ``rope_theta`` is read from ``rope_parameters`` too, where
    transformers 5 keeps it, so the fields read the same under either version."""
    text = text_config(config)
    found: dict[str, Any] = {"model_type": getattr(config, "model_type", None)}
    for name in ARCHITECTURE_FIELDS[1:]:
        found[name] = getattr(text, name, None)
    if found["rope_theta"] is None:
        rope = getattr(text, "rope_parameters", None)
        found["rope_theta"] = rope.get("rope_theta") if isinstance(rope, dict) else None
    if found["rope_theta"] is not None:  # 10000 and 10000.0 are one model
        found["rope_theta"] = float(found["rope_theta"])
    return {k: v for k, v in found.items() if v is not None}


def architecture_fingerprint(config: Any) -> str:
    """12 hex digits of a SHA-256 over the canonical JSON (sorted keys, no spaces) of :func:`architecture_fields`:
    the same for a model loaded from the Hub or from a local copy, and for a base model and its fine-tunes."""
    canonical = json.dumps(architecture_fields(config), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:12]
