"""``get_policy(name, **params)``: every eviction policy by name, with clear errors."""

from __future__ import annotations

import dataclasses
from typing import Any

from .base import EvictionPolicy
from .full import FullCachePolicy
from .global_gates import GlobalGatesPolicy
from .h2o import H2OPolicy
from .pyramidkv import PyramidKVPolicy
from .random import RandomPolicy
from .snapkv import SnapKVPolicy
from .streaming_llm import StreamingLLMPolicy
from .tova import TOVAPolicy
from .trimkv import TrimKVPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {
    "full": FullCachePolicy,
    "random": RandomPolicy,
    "streamingllm": StreamingLLMPolicy,
    "h2o": H2OPolicy,
    "tova": TOVAPolicy,
    "snapkv": SnapKVPolicy,
    "pyramidkv": PyramidKVPolicy,
    "trimkv": TrimKVPolicy,
    "global_gates": GlobalGatesPolicy,
}
_INTERNAL = {"name", "stats", "needs_queries", "evicts", "head_budgets"}


def policy_params(name: str) -> list[str]:
    """The parameters a policy accepts."""
    return sorted(f.name for f in dataclasses.fields(POLICIES[name]) if f.name not in _INTERNAL)


def get_policy(name: str, **params: Any) -> EvictionPolicy:
    """Build a policy: ``get_policy("snapkv", window=32, mode="streaming")``."""
    key = name.lower().replace("-", "_")
    if key not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; available: {sorted(POLICIES)}")
    allowed = policy_params(key)
    bad = sorted(set(params) - set(allowed))
    if bad:
        raise ValueError(f"policy {key!r} has no parameter(s) {bad}; allowed: {allowed}")
    return POLICIES[key](**params)
