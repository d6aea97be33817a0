"""A KV method from its config entry (``{name, params?, label?, gates?}``), and the names a config may use.

Kept apart from :mod:`retention.eval.methods` (the methods themselves): the oracle is a method too, built here
from its own module.
"""

from __future__ import annotations

from typing import Any

from .methods import FullCache, Method, PolicyCache


def available_methods() -> list[str]:
    """``full``, ``oracle`` (:mod:`retention.eval.oracle`, fidelity only) and every registered eviction policy."""
    try:
        from retention.policies import POLICIES
    except ImportError:
        return ["full"]
    return sorted({"full", "oracle", *POLICIES})


def make_method(spec: dict[str, Any]) -> Method:
    """A method from a config entry ``{name, params?, label?}``; parameters are checked now."""
    name = spec["name"]
    params = dict(spec.get("params") or {})
    label = spec.get("label") or ""
    gates = spec.get("gates")
    if name == "full":
        if params or gates:
            raise ValueError("method 'full' takes no params or gates")
        return FullCache(name, params, label)
    if name == "oracle":
        from .oracle import ContinuationOracle

        return ContinuationOracle(name, params, label, gates)
    from retention.policies import get_policy

    get_policy(name, **params)  # unknown names / parameters fail here, before any model loads
    if gates is not None and not isinstance(gates, str):
        raise ValueError(f"gates must be a checkpoint folder or Hub repo id, got {gates!r}")
    return PolicyCache(name, params, label, gates)
