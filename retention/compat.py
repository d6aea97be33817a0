"""Differences between the transformers versions we support (``transformers>=5.0,<6``)."""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

from packaging.version import Version

# 5.24 renamed the cache argument of forward / generate from `past_key_values` to `cache` (the old name
# still works, with a FutureWarning, until 5.40 for forward and 6.0 for generate). Read from the package
# metadata: no transformers import just to know its name.
CACHE_KWARG = "cache" if Version(version("transformers")).release >= (5, 24) else "past_key_values"


def cache_kwargs(cache: Any) -> dict[str, Any]:
    """``{name: cache}`` under the name this transformers' ``forward`` / ``generate`` take, e.g.
    ``model.generate(**inputs, **cache_kwargs(cache))``."""
    return {CACHE_KWARG: cache}


def enable_activation_checkpointing(model: Any) -> None:
    """Recompute each decoder layer's activations in the backward pass (``use_reentrant=False``, which
    works with frozen inputs). transformers 5.24 renamed ``gradient_checkpointing_enable`` to
    ``activation_checkpointing_enable`` (the old name warns until v6)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def output_cache(out: Any) -> Any:
    """The cache a ``forward(..., use_cache=True)`` returned: ``out.cache`` from transformers 5.24,
    ``out.past_key_values`` before (read by key, so it does not matter which release renamed the field)."""
    return out["cache"] if "cache" in out else out["past_key_values"]
