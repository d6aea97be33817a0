"""``RetentionCache``: a transformers ``Cache`` backed by the paged store, with learned global eviction.

Use with a model whose gates are attached in ``"score"`` mode::

    attachment = attach_gates(model, gates, mode="score")
    cache = RetentionCache(model, budget=RetentionCache.budget_for(model, tokens=512))
    out = model.generate(**inputs, cache=cache, prefill_chunk_size=256)  # past_key_values= before 5.24

Per forward and layer: the attachment's pre-hook computes ``log_beta`` for the new tokens (from the same
hidden state the keys come from) and hands it, with the padding mask, to the cache; ``update`` appends
key, value, log_beta and true position to the layer's paged streams; the attention function asks the
cache to attend over the kept entries. Eviction runs at the start of a forward (layer 0), before new
entries are appended, so a chunked prefill never holds more than ``budget + slack + one chunk``.

``get_seq_length`` and ``get_mask_sizes`` count every token seen, not the entries kept, so RoPE and
M-RoPE positions stay true positions after eviction.
"""

from __future__ import annotations

import copy
import numbers
import weakref
from typing import Any, Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..attach import text_config_of, unwrap
from ..budget import default_slack, entries_for_tokens, streams_of
from ..padding import new_token_valid as _new_token_valid
from ..policies.base import EntryView, EvictionPolicy
from ..policies.global_gates import GlobalGatesPolicy
from .attention import padded_attention, paged_decode_reference
from .paged import PagedKVStore
from .select import rank_in_groups, select_keep


class CacheBudgetError(ValueError):
    """The budget cannot hold what the options require (protected window, per-head minimum, a turn)."""


def is_count(value: Any) -> bool:
    """An integer (Python, NumPy or a one-element integer tensor), not a bool or a float."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and not value.is_floating_point() and value.dtype != torch.bool
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _no_cache() -> None:
    """The link of a layer copied without its cache (see ``_RetentionLayer.__getstate__``)."""
    return None


class _RetentionLayer(CacheLayerMixin):
    """Per-layer face of :class:`RetentionCache` for transformers; the data lives in the shared store."""

    is_sliding = False
    is_compileable = False

    @property
    def is_croppable(self) -> bool:
        return self.cache.is_croppable

    def __init__(self, cache: "RetentionCache", layer: int) -> None:
        super().__init__()
        # A weak link back: a strong one would make every cache a reference cycle, whose pages (hundreds of
        # MB at 4k tokens) wait for Python's cyclic GC; a sweep of many items then grew to 24 GB.
        self._cache, self.layer = weakref.ref(cache), layer

    @property
    def cache(self) -> "RetentionCache":
        cache = self._cache()
        if cache is None:
            raise RuntimeError("this cache layer outlived its RetentionCache: keep the cache, not only cache.layers")
        return cache

    # Copies and pickles carry no link (a weakref cannot be pickled); RetentionCache.__setstate__ relinks its
    # layers, so copy.deepcopy(cache) and pickle / torch.save of a cache give a cache whose layers are its own.
    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_cache"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._cache = _no_cache

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        return self.cache.update(key_states, value_states, self.layer)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache._seen[self.layer] + query_length, 0

    def get_seq_length(self) -> int:
        return self.cache._seen[self.layer]

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.is_initialized = False


def _triton_decodes(t: torch.Tensor) -> bool:
    """Whether paged decoding runs the Triton kernel for ``t``'s device: on CUDA, or forced for tests."""
    import os

    return t.is_cuda or os.environ.get("RETENTION_FORCE_TRITON") == "1"


class RetentionCache(Cache):
    """Paged KV cache with global top-B eviction scored by an :class:`EvictionPolicy`.

    ``budget``: entries kept per sequence (one entry = one token in one KV head of one layer), an int,
    a sequence of ints (one per batch row) or ``None`` (unlimited: never evicts; then generation is
    token-for-token the same as with ``DynamicCache``). :meth:`budget_for` converts a token count.
    ``slack``: eviction starts once a sequence holds more than ``budget + slack`` entries and cuts
    back to ``budget`` (default: one page per stream). ``protected_window``: the newest tokens are
    always kept in every head. ``min_per_head``: each (layer, KV head) keeps at least this many.
    ``policy``: an :class:`EvictionPolicy` or a name for :func:`retention.policies.get_policy` (``"snapkv"``);
    default :class:`GlobalGatesPolicy`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        budget: int | Sequence[int] | None = None,
        policy: EvictionPolicy | str | None = None,
        *,
        slack: int | None = None,
        page_size: int = 16,
        protected_window: int = 0,
        min_per_head: int = 0,
        initial_pages: int | None = None,
    ) -> None:
        cfg = text_config_of(model)
        self.num_layers = cfg.num_hidden_layers
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        super().__init__(layers=[_RetentionLayer(self, i) for i in range(self.num_layers)])
        attachment = getattr(unwrap(model), "retention", None)
        if attachment is None:
            raise RuntimeError(
                "RetentionCache needs retention gates attached to the model: "
                "attach_gates(model, gates, mode='score') (retention.attach) before generating"
            )
        self.attachment = attachment
        if isinstance(policy, str):  # a name, as the eval configs and the CLI take it
            from ..policies.registry import get_policy

            policy = get_policy(policy)
        if isinstance(policy, type) and issubclass(policy, EvictionPolicy):
            raise TypeError(f"policy must be an EvictionPolicy instance, got the class {policy.__name__}: pass "
                            f"{policy.__name__}() (with its options)")
        if policy is not None and not isinstance(policy, EvictionPolicy):
            raise TypeError(
                f"policy must be an EvictionPolicy (retention.policies) or a policy name, got {type(policy).__name__}"
            )
        self.policy = policy if policy is not None else GlobalGatesPolicy()
        self.policy.validate()
        self.policy.bind(unwrap(model))
        for name, value, least in (("page_size", page_size, 1), ("protected_window", protected_window, 0),
                                   ("min_per_head", min_per_head, 0), ("slack", slack, 0),
                                   ("initial_pages", initial_pages, 1)):
            if value is not None and (not is_count(value) or value < least):
                raise ValueError(f"RetentionCache {name} must be an integer >= {least}, got {value!r}")
        self.page_size, self.protected_window, self.min_per_head = page_size, protected_window, min_per_head
        self.streams_per_seq = self.num_layers * self.num_kv_heads
        self.slack = default_slack(self.streams_per_seq, page_size) if slack is None else slack
        self.initial_pages = initial_pages
        self.budget = self._check_budget(budget)
        self.store: PagedKVStore | None = None
        self._seen = [0] * self.num_layers
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        # per layer, from update to attend: (padded view or None, query positions, held: see padded_attention)
        self._views: dict[int, tuple[Any, torch.Tensor | None, int | None]] = {}
        self._last_query_len = 0
        self._pad_entries: torch.Tensor | None = None  # (B,) padding entries not yet dropped (host)
        self._forward_pads: torch.Tensor | None = None  # (B,) padding tokens of this forward (host), None: none
        self._start: torch.Tensor | None = None  # (B,) left-padding tokens: position of the first real one
        self._crop_floor = 0  # tokens seen at the last eviction or padded forward: crop cannot go below
        self.evictions = 0
        self.peak_entries = 0
        # set by GraphDecoder around one decode step: {"slots": (L, B*H), "pos": (B*H,)} device tensors; the step
        # then writes its entries there and attends without host work (see retention.cache.graph_decode)
        self._static: dict[str, torch.Tensor] | None = None

    # -- budget ------------------------------------------------------------------------------------
    @staticmethod
    def budget_for(model: torch.nn.Module, tokens: int) -> int:
        """Entries that hold ``tokens`` tokens in every layer and KV head (``tokens * L * H_kv``)."""
        if not is_count(tokens) or tokens < 1:
            raise CacheBudgetError(f"tokens must be a whole number of tokens >= 1 in every layer and KV head, got "
                                   f"{tokens!r}")
        cfg = text_config_of(model)
        return entries_for_tokens(tokens, streams_of(cfg.num_hidden_layers, cfg.num_key_value_heads))

    def set_budget(self, budget: int | Sequence[int] | None) -> None:
        """Change the budget (checked as in the constructor); the next eviction or :meth:`compress`
        enforces it. E.g. compress copies of one prefilled cache to several budgets."""
        self.budget = self._check_budget(budget)

    def _check_budget(self, budget: int | Sequence[int] | None) -> int | list[int] | None:
        """The budget as an int or a list of ints, once it is checked to fit the options."""
        if budget is None:
            return None
        listed = isinstance(budget, (Sequence, torch.Tensor)) and not isinstance(budget, str)
        values = [budget] if is_count(budget) else list(budget) if listed else None
        if values is None or not all(is_count(b) for b in values):
            raise CacheBudgetError(
                f"budget must be a number of entries (an int, or one int per sequence), got {budget!r}; "
                "for a number of tokens in every layer and KV head use RetentionCache.budget_for(model, tokens=N)"
            )
        if not values:  # [] passed every check below and failed at the first forward
            raise CacheBudgetError("budget is an empty list: give one int per sequence, an int for all, or None")
        values = [int(b) for b in values]
        budget = values[0] if is_count(budget) else values
        if min(values, default=1) < 1:
            raise CacheBudgetError(f"budget must be at least 1 entry, got {budget!r}")
        n = self.streams_per_seq
        need = (self.protected_window + self.min_per_head) * n
        # tokens the policy keeps in every stream whatever the scores (the gates' sinks and recent window): a
        # smaller budget silently dropped some sinks in every head (the +inf ties went to the newest)
        held = getattr(self.policy, "sink", 0) + getattr(self.policy, "recent", 0) if self.policy.uses_gates else 0
        if held * n > max(need, 1):
            for b in values:
                if b < held * n:
                    raise CacheBudgetError(
                        f"budget of {b} entries cannot hold the policy's always-kept tokens (sink={self.policy.sink}, "
                        f"recent={self.policy.recent}: {held} per stream) in all {n} (layer, KV head) streams: use "
                        f"a budget >= {held * n} entries or a smaller sink / recent")
        if self.policy.budget_scope == "head" and self.policy.head_budgets is None and min(values) < n:
            raise CacheBudgetError(f"budget of {min(values)} entries gives a per-head policy ({self.policy.name}) no "
                                   f"entry in some of the {n} (layer, KV head) streams: use a budget >= {n} entries")
        if self.policy.budget_scope == "head" and self.policy.head_budgets is not None:
            hb = self.policy.head_budgets
            if tuple(hb.shape) != (self.num_layers, self.num_kv_heads):
                raise CacheBudgetError(f"head_budgets must be (layers, kv_heads) = "
                                       f"{(self.num_layers, self.num_kv_heads)}, got {tuple(hb.shape)}")
            values = [int(hb.sum())]
        for b in values:
            if b < max(need, 1):
                raise CacheBudgetError(
                    f"budget of {b} entries cannot hold the protected window ({self.protected_window} tokens) and "
                    f"per-head minimum ({self.min_per_head}) in all {n} (layer, KV head) streams: "
                    f"use a budget >= {max(need, 1)} entries or smaller options"
                )
        return budget

    def _budgets(self, batch: int) -> torch.Tensor:
        if isinstance(self.budget, int):  # _check_budget stored an int or a list of ints
            return torch.full((batch,), self.budget, dtype=torch.long)
        if len(self.budget) != batch:
            raise CacheBudgetError(f"{len(self.budget)} budgets given for a batch of {batch} sequences")
        return torch.tensor(list(self.budget), dtype=torch.long)

    # -- transformers Cache API --------------------------------------------------------------------
    def retention_pre_attention(self, layer: int, log_beta: torch.Tensor, attention_mask: Any) -> None:
        """Called by the attachment's pre-hook: gate scores ``(B, H, T)`` of the new tokens and the layer's mask."""
        B, _, T = log_beta.shape
        self._pending[layer] = (log_beta, _new_token_valid(attention_mask, B, T))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key/value_states`` ``(B, H, T, D)``; return the layer's kept entries ``(B, H, Lmax, D)``."""
        B, H, T, D = key_states.shape
        pending = self._pending.pop(layer_idx, None)
        if pending is None:
            if self.attachment.detached:
                raise RuntimeError("RetentionCache got keys without gate scores: its model's gates were detached "
                                   "(detach()); attach gates again and build a new cache, or use a plain cache")
            raise RuntimeError(
                "RetentionCache got keys without gate scores: the retention attachment must be in 'score' "
                f"mode while generating (attachment mode is {self.attachment.mode!r}); "
                "call model.retention.set_mode('score') or use `with model.retention.use_mode('score'):`"
            )
        log_beta, token_valid = pending
        if self.store is None:
            self.store = PagedKVStore(
                B, self.num_layers, H, D, self.page_size, key_states.dtype, key_states.device, self.initial_pages
            )
            for layer in self.layers:
                layer.is_initialized = True
            # padding counts live on the host: the decode path reads them every layer
            self._pad_entries = torch.zeros(B, dtype=torch.long)
            self._start = torch.zeros(B, dtype=torch.long, device=self.store.lengths.device)
        elif self.store.batch != B and not any(self._seen):  # new or reset: take the batch as it comes
            self.store.select_batch(torch.zeros(B, dtype=torch.long))  # B empty sequences, on the same pool
            self._pad_entries = torch.zeros(B, dtype=torch.long)
            self._start = torch.zeros(B, dtype=torch.long, device=self.store.lengths.device)
        elif self.store.batch != B:
            hint = (f"; to continue each held sequence {B // self.store.batch} times call "
                    f"cache.batch_repeat_interleave({B // self.store.batch}) first"
                    if B % self.store.batch == 0 else "")
            held = f"{self.store.batch} sequence{'s' if self.store.batch != 1 else ''}"
            raise RuntimeError(f"RetentionCache holds {held} but got a batch of {B}{hint}; "
                               "or call cache.reset() to start over with the new batch")
        if self._static is not None:  # a decode step GraphDecoder planned: no host work, so a graph can record it
            self.store.write(self._static["slots"][layer_idx], key_states.reshape(B * H, D),
                             value_states.reshape(B * H, D), log_beta.reshape(B * H), self._static["pos"])
            self._views[layer_idx] = (None, None, None)
            return key_states, value_states
        t0 = self._seen[layer_idx]
        if layer_idx == 0:
            self._maybe_evict(T)
            self._last_query_len = T
            # every layer sees the same padding: read it once per forward (the only device sync here)
            pads = None if token_valid is None else (~token_valid).sum(1).cpu()
            self._forward_pads = pads if pads is not None and bool(pads.any()) else None
            if self._forward_pads is not None:
                self._start += self._forward_pads.to(self._start.device)
                self._crop_floor = t0 + T
        pos = (t0 + torch.arange(T)).expand(B, T)  # on the host: travels with the append's slots
        if self._forward_pads is not None:
            pos = torch.where(token_valid.to(key_states.device), pos.to(key_states.device, non_blocking=True), -1)
            self._pad_entries += self._forward_pads * H
        self.store.append_layer(
            layer_idx,
            key_states.reshape(B * H, T, D),
            value_states.reshape(B * H, T, D),
            log_beta.reshape(B * H, T),
            pos[:, None, :].expand(B, H, T).reshape(B * H, T),
        )
        self._seen[layer_idx] += T
        if layer_idx == self.num_layers - 1:
            self.peak_entries = max(self.peak_entries, int(self.store.host_lengths.sum()))
        if self._paged_decode(key_states, T):
            # the Triton kernel reads the pages in place: no padded copy; attention ignores these
            self._views[layer_idx] = (None, pos, None)
            return key_states, value_states
        view = self.store.gather_layer(layer_idx)
        # nothing evicted or padded yet (host counts, no sync): every stream holds positions 0..seen-1 in order
        seen = self._seen[layer_idx]
        held = seen if not bool(self._pad_entries.any()) and self.store.shortest(layer_idx) == seen else None
        self._views[layer_idx] = (view, pos.to(key_states.device, non_blocking=True), held)  # pageable: no wait
        return view.keys, view.values

    def _paged_decode(self, key_states: torch.Tensor, T: int) -> bool:
        """Single-token decoding on CUDA (or forced for tests) goes through the Triton paged kernel."""
        if T != 1 or self.policy.needs_queries or self.page_size & (self.page_size - 1):
            return False
        if not _triton_decodes(key_states):
            return False
        return not bool(self._pad_entries.any())  # (host) padding entries are masked by the padded path only

    def retention_attend(self, layer: int, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """Attention of ``query`` ``(B, Hq, Q, D)`` over the layer's kept entries -> ``(B, Q, Hq, D)``."""
        view, qpos, held = self._views.pop(layer)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        if view is None:  # paged decode: one query per stream, every kept entry is in its past
            from .flash import flash_paged_decode
            from .triton_decode import paged_decode_triton

            B, Hq, _, D = query.shape
            H = self.num_kv_heads
            rows = self.store.streams(layer)
            q = query.reshape(B, H, Hq // H, D).reshape(B * H, Hq // H, D)
            store, pool = self.store, self.store.pool
            out = flash_paged_decode(q, pool.keys, pool.values, store.block_table, store.lengths, scale, rows=rows)
            if out is None and self._static is not None and not _triton_decodes(q):  # GraphDecoder on the CPU
                out = paged_decode_reference(q, pool.keys, pool.values, store.block_table[rows], store.lengths[rows],
                                             scale)
            if out is None:  # the kernel reads the layer's rows of the block table in place
                # a graph replays the grid it recorded: the table's width then, not the host's longest stream now
                longest = None if self._static is not None else store.longest(layer)
                out = paged_decode_triton(q, pool.keys, pool.values, store.block_table, store.lengths, scale, rows=rows,
                                          longest=longest)
            return out.reshape(B, Hq, D)[:, None]
        if self.policy.needs_queries:
            self.policy.observe(layer, query, view, qpos)
        return padded_attention(query, view.keys, view.values, view.pos, view.valid, qpos, scale, held=held)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen (not entries kept): positions after eviction stay true positions. A layer the model does
        not have holds none (0, as transformers' caches answer)."""
        return self._seen[layer_idx] if 0 <= layer_idx < self.num_layers else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self._seen[layer_idx] + query_length, 0

    def reset(self) -> None:
        """Forget every sequence (the pages go back to the pool, which stays allocated) and the counters of
        :meth:`memory_report`; the budget and policy stay. The next forward may bring a batch of any size."""
        self.evictions, self.peak_entries = 0, 0
        if self.store is not None:
            self.store.clear()
        self._seen = [0] * self.num_layers
        self._pending.clear()
        self._views.clear()
        self._last_query_len = 0
        self._crop_floor = 0
        self._forward_pads = None
        if self._pad_entries is not None:
            self._pad_entries.zero_()
            self._start.zero_()
        self.policy.reset()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        for layer in self.layers:  # a copy's or an unpickled cache's layers link to it, not to the original
            layer._cache = weakref.ref(self)

    def copy_from(self, other: "RetentionCache") -> None:
        """Hold a deep copy of ``other``'s contents (same model), keeping this cache's policy and budget:
        one prefill scored by several policies (the eval harness's shared prefill)."""
        if other.num_layers != self.num_layers or other.num_kv_heads != self.num_kv_heads:
            raise ValueError("copy_from needs a cache of the same model (layers and KV heads differ)")
        self.store = copy.deepcopy(other.store)
        self._seen = list(other._seen)
        self._pad_entries = None if other._pad_entries is None else other._pad_entries.clone()
        self._start = None if other._start is None else other._start.clone()
        self._last_query_len, self.peak_entries = other._last_query_len, other.peak_entries
        self._crop_floor = other._crop_floor
        for layer in self.layers:
            layer.is_initialized = other.store is not None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` continues from row ``beam_idx[i]`` (rows named twice are copied)."""
        self.batch_select_indices(beam_idx)

    @property
    def is_croppable(self) -> bool:
        """Whether :meth:`crop` can roll back a forward (assisted decoding reads it before its first crop):
        the policy evicts as the cache fills and keeps no statistics of the queries it saw."""
        return self.policy.mode == "streaming" and not self.policy.needs_queries

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the newest ``-tokens_to_remove`` tokens, as assisted decoding does with rejected draft
        tokens (transformers >= 5.24 passes a count <= 0; a positive value is the older API's number of
        tokens to keep).

        Exact: eviction runs at the start of a forward, before that forward's tokens are appended, so
        the tokens removed never competed for the budget, and what is left is what the kept tokens hold
        when fed in the same chunks. Going back past an eviction (or a padded forward) would need
        entries that are gone: that raises ``ValueError``.
        """
        seen = self._seen[0]
        keep = seen + tokens_to_remove if tokens_to_remove <= 0 else tokens_to_remove
        if keep >= seen:
            return
        if not self.is_croppable:
            raise NotImplementedError(
                f"RetentionCache cannot crop under {type(self.policy).__name__}: it needs a streaming policy that "
                "reads no queries (e.g. global_gates, trimkv, streamingllm) for assisted / speculative decoding"
            )
        if keep < 0:
            raise ValueError(f"cannot remove {seen - keep} tokens: the cache has seen {seen}")
        if keep < self._crop_floor:
            raise ValueError(
                f"cannot crop {seen} tokens back to {keep}: entries of the first {self._crop_floor} tokens were "
                "evicted or padded after those tokens arrived and cannot be restored; crop only the tokens of "
                "forwards since the last eviction (what assisted decoding does), or prefill again"
            )
        if self.store is not None:
            rows = torch.arange(self.store.lengths.numel(), device=self.store.lengths.device)
            view = self.store.gather(rows, with_kv=False)
            self.store.compact(rows, view.pos < keep)  # left padding (pos -1) stays, as it came first
        self._seen = [keep] * self.num_layers

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Several continuations of each sequence (``num_return_sequences``, beams) from one prefill."""
        if not is_count(repeats) or repeats < 1:  # 0 emptied the batch without a word
            raise ValueError(f"batch_repeat_interleave takes a whole number of copies >= 1, got {repeats!r}")
        repeats = int(repeats)
        if repeats == 1:
            return
        if self.store is None:  # nothing cached yet: only per-row budgets follow the new batch
            if self.budget is not None and not isinstance(self.budget, int):
                self.budget = [b for b in self.budget for _ in range(repeats)]
            return
        self.batch_select_indices(torch.arange(self.store.batch).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows ``indices`` ``(B',)`` in that order (repeats allowed): pages, padding, per-row budgets
        and the policy's per-sequence statistics all follow."""
        if self.store is None:
            return
        indices = indices.to(self.store.lengths.device, torch.long)
        self.store.select_batch(indices)
        self._pad_entries = self._pad_entries[indices.cpu()]
        self._start = self._start[indices]
        if self.budget is not None and not isinstance(self.budget, int):
            self.budget = [self.budget[i] for i in indices.tolist()]
        self.policy.select_batch(indices)

    # -- eviction ----------------------------------------------------------------------------------
    def _maybe_evict(self, query_len: int) -> None:
        if self.budget is None or self.store is None or not self.policy.evicts:
            return
        if self.policy.mode == "one_shot" and not (self._last_query_len > 1 and query_len == 1):
            return  # one-shot policies compress once, when a prefill has ended
        budgets = self._budgets(self.store.batch)
        if self.policy.head_budgets is not None:
            budgets = budgets.clamp_max(int(self.policy.head_budgets.sum()))
        slack = 0 if self.policy.mode == "one_shot" else self.slack
        self._evict_over(budgets, slack)

    def _evict_over(self, budgets: torch.Tensor, slack: int) -> None:
        """Evict the sequences holding more than ``budgets + slack`` entries (``budgets`` ``(B,)`` on the
        host, as the totals are: no device sync unless something is evicted)."""
        # padding entries do not count: a padded row evicts exactly when it would alone
        totals = self.store.host_lengths.view(self.store.batch, -1).sum(1) - self._pad_entries
        over = (totals > budgets + slack).nonzero().flatten()
        if over.numel():
            dev = self.store.lengths.device
            self.evict(over.to(dev), budgets[over].to(dev))

    def compress(self) -> None:
        """Evict every sequence down to its budget now, whatever the policy's mode (e.g. when a context
        has been prefilled and the question has not arrived yet: the query-agnostic protocol)."""
        if self.budget is None or self.store is None or not self.policy.evicts:
            return
        self._evict_over(self._budgets(self.store.batch), 0)

    def evict(self, seqs: torch.Tensor, budgets: torch.Tensor) -> None:
        """Cut sequences ``seqs`` ``(n,)`` down to ``budgets`` ``(n,)`` entries by the policy's ranking."""
        store, n, L, H = self.store, self.streams_per_seq, self.num_layers, self.num_kv_heads
        dev = store.lengths.device
        rows = (seqs[:, None] * n + torch.arange(n, device=dev)[None]).flatten()
        view = store.gather(rows, with_kv=self.policy.needs_kv)
        local = torch.arange(len(seqs), device=dev).repeat_interleave(n)
        layer = torch.arange(L, device=dev).repeat_interleave(H).repeat(len(seqs))
        head = torch.arange(H, device=dev).repeat(L * len(seqs))
        step = torch.full((len(rows),), self._seen[0] - 1, dtype=torch.long, device=dev)
        entries = EntryView(view.log_beta, view.pos, view.valid, step, seqs[local], layer, head,
                            self._start[seqs][local], view.keys, view.values)
        # policies whose scores depend on the budget (AdaKV's safeguard, the SnapKV share) score each row at its own
        score = None
        for b in budgets.unique().tolist():
            self.policy.set_budget(int(b), L, H)
            s = self.policy.score(entries)
            score = s if score is None else torch.where((budgets.to(dev)[local] == b)[:, None], s, score)
        valid = view.valid & (view.pos >= 0)  # padding tokens are dropped at the first eviction
        forced = torch.zeros_like(valid)
        if self.protected_window:
            forced |= view.pos >= self._seen[0] - self.protected_window
        if self.min_per_head:
            forced |= rank_in_groups(score, view.pos, valid, torch.arange(len(rows), device=dev)) < self.min_per_head
        scope = self.policy.budget_scope
        if scope == "global":
            group, budget = local, budgets
        elif scope == "layer":
            # each sequence's own allocation across layers (LAVa), from what the policy observed of it and not of
            # its batchmates; the even split while it has observed nothing
            budget = torch.cat([_or_even(self.policy.layer_budget_table(b, L, seq=q), b, L, dev)
                                for q, b in zip(seqs.tolist(), budgets.tolist())])
            group = local * L + layer
        else:
            group = torch.arange(len(rows), device=dev)
            if self.policy.head_budgets is not None:  # a fixed (L, H) split
                budget = self.policy.head_budgets.to(dev, torch.long).flatten().repeat(len(seqs))
            else:  # each sequence's uneven split across layers (PyramidKV, CAKE), else the even one
                budget = torch.cat([_or_even(self.policy.head_budget_table(b, L, H, seq=q), b, n, dev)
                                    for q, b in zip(seqs.tolist(), budgets.tolist())])
        keep = select_keep(score, view.pos, valid, group, budget, forced)
        store.compact(rows, keep)
        self._pad_entries[seqs.cpu()] = 0
        self._crop_floor = self._seen[0]
        self.evictions += 1

    # -- reports -----------------------------------------------------------------------------------
    def memory_report(self) -> "MemoryReport":
        """Entries kept per (sequence, layer, head), KV bytes in use vs a full cache, page slack: a dict that
        prints as a short summary (``print(cache.memory_report())``)."""
        if self.store is None:  # the same keys as after use, so a caller's report["kv_fraction"] never fails
            return MemoryReport(
                tokens_seen=0, entries_per_head=torch.zeros(0, self.num_layers, self.num_kv_heads, dtype=torch.long),
                kept_entries=0, full_cache_entries=0, kv_bytes=0, full_cache_bytes=0, kv_fraction=1.0, pages_in_use=0,
                page_bytes_in_use=0, page_slack_entries=0, metadata_bytes=0, pool_capacity_bytes=0,
                peak_entries=self.peak_entries, evictions=self.evictions)
        s = self.store
        elem = s.pool.keys.element_size()
        entry_bytes = 2 * self.head_dim * elem
        kept = int(s.lengths.sum())
        pages = s.pool.num_used
        full_entries = self._seen[0] * self.streams_per_seq * s.batch
        return MemoryReport({
            "tokens_seen": self._seen[0],
            "entries_per_head": s.entries_per_head(),
            "kept_entries": kept,
            "full_cache_entries": full_entries,
            "kv_bytes": kept * entry_bytes,
            "full_cache_bytes": full_entries * entry_bytes,
            "kv_fraction": kept / full_entries if full_entries else 1.0,
            "pages_in_use": pages,
            "page_bytes_in_use": pages * s.pool.page_bytes(),
            "page_slack_entries": pages * s.page_size - kept,
            "metadata_bytes": pages * s.page_size * (4 + 8),  # log_beta float32 + position int64
            "pool_capacity_bytes": s.pool.capacity * s.pool.page_bytes(),
            "peak_entries": self.peak_entries,
            "evictions": self.evictions,
        })


def _or_even(table: torch.Tensor | None, total: int, parts: int, device: torch.device) -> torch.Tensor:
    """A policy's budget table flattened ``(parts,)`` int64, or ``total`` split evenly over ``parts`` without one."""
    if table is None:
        return torch.full((parts,), total // parts, dtype=torch.long, device=device)
    return table.to(device, torch.long).flatten()


def kept_where(cache: "RetentionCache", marked: torch.Tensor) -> int:
    """How many entries ``cache`` keeps of the tokens ``marked`` (``(T,)`` bool over the sequence's token indices,
    e.g. ``ids[0] == image_token_id``), over every layer and KV head of sequence 0."""
    if cache.store is None:
        return 0
    kept = 0
    for layer in range(cache.store.num_layers):
        view = cache.store.gather_layer(layer)
        pos = view.pos[:1][view.valid[:1]]
        # left padding (position -1) and tokens past ``marked`` are no marked token (-1 would index the last one)
        pos = pos[(pos >= 0) & (pos < len(marked))]
        kept += int(marked[pos].sum())
    return kept


class MemoryReport(dict):
    """:meth:`RetentionCache.memory_report`: a plain dict of its numbers (``entries_per_head``: ``(batch, layers,
    kv_heads)`` entries kept; bytes in bytes) whose ``str`` is a summary a person can read."""

    def __str__(self) -> str:
        if not self.get("tokens_seen"):
            return "KV cache: empty (nothing prefilled yet)"
        mib = lambda n: f"{n / 2**20:.2f} MiB"  # noqa: E731
        lines = [f"KV cache: {self['kept_entries']:,} of {self['full_cache_entries']:,} entries kept "
                 f"({self['kv_fraction']:.1%}), {mib(self['kv_bytes'])} against {mib(self['full_cache_bytes'])} for a "
                 f"full cache; {self['tokens_seen']:,} tokens seen, eviction rounds: {self['evictions']:,}, peak "
                 f"{self['peak_entries']:,} entries"]
        per_head = self["entries_per_head"]
        for b in range(per_head.shape[0]):
            seq = f" (sequence {b})" if per_head.shape[0] > 1 else ""
            layers = per_head[b].sum(dim=1).tolist()
            lines.append(f"  kept per layer{seq}, all KV heads: {' '.join(str(n) for n in layers)}")
            flat = per_head[b].flatten()
            lo, hi = int(flat.argmin()), int(flat.argmax())
            heads = per_head.shape[2]
            lines.append(f"  per KV head: {int(flat[lo])} (layer {lo // heads}, head {lo % heads}) to {int(flat[hi])} "
                         f"(layer {hi // heads}, head {hi % heads}), mean {flat.float().mean():.1f}")
        if "kept_image_entries" in self:  # a vision-language chat: how the budget splits between the modalities
            share = self["kept_image_entries"] / self["kept_entries"] if self["kept_entries"] else 0.0
            lines.append(f"  image entries: {self['kept_image_entries']:,} kept ({share:.1%} of the kept entries) of "
                         f"{self['image_tokens']:,} image tokens seen")
        lines.append(f"  pages: {self['pages_in_use']:,} in use ({mib(self['page_bytes_in_use'])}, "
                     f"{self['page_slack_entries']:,} entries of slack), positions and scores "
                     f"{mib(self['metadata_bytes'])}, pool {mib(self['pool_capacity_bytes'])}")
        return "\n".join(lines)
