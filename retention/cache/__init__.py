"""Inference-time KV cache: paged storage, global eviction, transformers integration."""

from .attention import padded_attention, paged_decode_reference
from .graph_decode import GraphDecoder
from .hf import CacheBudgetError, RetentionCache
from .paged import PagedKVStore, PaddedView
from .pool import PagePool
from .select import rank_in_groups, select_keep

__all__ = [
    "CacheBudgetError",
    "GraphDecoder",
    "PagePool",
    "PagedKVStore",
    "PaddedView",
    "RetentionCache",
    "padded_attention",
    "paged_decode_reference",
    "rank_in_groups",
    "select_keep",
]
