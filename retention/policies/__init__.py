"""Eviction policies: each scores cache entries; :mod:`retention.cache` selects, compacts and frees."""

from .base import BUDGET_SCOPES, EntryView, EvictionPolicy
from .global_gates import GlobalGatesPolicy, lookahead_log_score
from .trimkv import TrimKVPolicy

__all__ = ["BUDGET_SCOPES", "EntryView", "EvictionPolicy", "GlobalGatesPolicy", "TrimKVPolicy", "lookahead_log_score"]
