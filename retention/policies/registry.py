"""``get_policy(name, **params)``: every eviction policy by name, with clear errors."""

from __future__ import annotations

import dataclasses
from typing import Any

from .adakv import AdaKVPolicy
from .base import EvictionPolicy
from .cake import CAKEPolicy
from .defensivekv import DefensiveKVPolicy, LayerDefensiveKVPolicy
from .full import FullCachePolicy
from .global_gates import GlobalGatesPolicy
from .h2o import H2OPolicy
from .lava import LAVaPolicy
from .pyramidkv import PyramidKVPolicy
from .random import RandomPolicy
from .restkv import ReSTKVPolicy
from .snapkv import SnapKVPolicy
from .streaming_llm import StreamingLLMPolicy
from .tova import TOVAPolicy
from .trimkv import TrimKVPolicy

POLICIES: dict[str, Any] = {
    "full": FullCachePolicy,
    "random": RandomPolicy,
    "streamingllm": StreamingLLMPolicy,
    "h2o": H2OPolicy,
    "tova": TOVAPolicy,
    "snapkv": SnapKVPolicy,
    "pyramidkv": PyramidKVPolicy,
    "adakv": AdaKVPolicy,
    "criticalkv": lambda **p: AdaKVPolicy(**{"value_norm": True, "name": "criticalkv", **p}),
    "cake": CAKEPolicy,
    "lava": LAVaPolicy,
    "restkv": ReSTKVPolicy,
    "defensivekv": DefensiveKVPolicy,
    "layer_defensivekv": LayerDefensiveKVPolicy,
    "trimkv": TrimKVPolicy,
    "global_gates": GlobalGatesPolicy,
}
_INTERNAL = {"name", "stats", "needs_queries", "evicts", "head_budgets"}  # not user parameters


def policy_params(name: str) -> list[str]:
    """The parameters a policy accepts."""
    cls = POLICIES[name] if isinstance(POLICIES[name], type) else AdaKVPolicy
    hidden = _INTERNAL | ({"value_norm"} if name == "criticalkv" else set())
    return sorted(f.name for f in dataclasses.fields(cls) if f.init and f.name not in hidden)


def get_policy(name: str, /, **params: Any) -> EvictionPolicy:
    """Build a policy: ``get_policy("snapkv", window=32, mode="streaming")``."""
    # ``name`` is positional-only, so ``params`` naming ``name`` gets the error below, not a TypeError
    key = name.lower().replace("-", "_") if isinstance(name, str) else None
    if key not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; available: {sorted(POLICIES)}")
    allowed = policy_params(key)
    bad = sorted(set(params) - set(allowed))
    if bad:
        raise ValueError(f"policy {key!r} has no parameter(s) {bad}; allowed: {allowed}")
    return POLICIES[key](**params)
