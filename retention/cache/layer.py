"""The per-layer face of :class:`~retention.cache.hf.RetentionCache` that transformers' ``Cache`` API asks for."""

from __future__ import annotations

import weakref
from typing import Any

import torch
# typed as transformers' Cache: naming RetentionCache here would import hf, which imports this module
from transformers.cache_utils import Cache, CacheLayerMixin


def _no_cache() -> None:
    """The link of a layer copied without its cache (see ``RetentionLayer.__getstate__``)."""
    return None


class RetentionLayer(CacheLayerMixin):
    """Per-layer face of :class:`RetentionCache` for transformers; the data lives in the shared store."""

    is_sliding = False
    is_compileable = False

    @property
    def is_croppable(self) -> bool:
        return self.cache.is_croppable

    def __init__(self, cache: Cache, layer: int) -> None:
        super().__init__()
        # A weak link back: a strong one would make every cache a reference cycle, whose pages (hundreds of
        # MB at 4k tokens) wait for Python's cyclic GC; a sweep of many items then grew to 24 GB.
        self._cache, self.layer = weakref.ref(cache), layer

    @property
    def cache(self) -> Cache:
        cache = self._cache()
        if cache is None:
            raise RuntimeError("this cache layer outlived its RetentionCache: keep the cache, not only cache.layers")
        return cache

    def relink(self, cache: Cache) -> None:
        """Link this layer to ``cache`` (a copied or unpickled cache's layers link to it, not to the original)."""
        self._cache = weakref.ref(cache)

    # Copies and pickles carry no link (a weakref cannot be pickled); RetentionCache.__setstate__ relinks its
    # layers, so copy.deepcopy(cache) and pickle / torch.save of a cache give a cache whose layers are its own.
    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_cache"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._cache = _no_cache

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.update(key_states, value_states, self.layer)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache._seen[self.layer] + query_length, 0

    def get_seq_length(self) -> int:
        return self.cache._seen[self.layer]

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.is_initialized = False
