"""Eviction policies: each scores cache entries; :mod:`retention.cache` selects, compacts and frees.

One file per method; :func:`get_policy` builds any of them by name.
"""

from .base import BUDGET_SCOPES, EntryView, EvictionPolicy, protect
from .global_gates import GlobalGatesPolicy, lookahead_log_score
from .registry import POLICIES, get_policy, policy_params
from .trimkv import TrimKVPolicy

__all__ = [
    "BUDGET_SCOPES", "EntryView", "EvictionPolicy", "GlobalGatesPolicy", "POLICIES",
    "TrimKVPolicy", "get_policy", "lookahead_log_score", "policy_params", "protect",
]
