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

The class is the transformers ``Cache`` face; each of its other jobs is a module of its own, mixed in here:
:mod:`~retention.cache.cache_budget` (the budget and its checks), :mod:`~retention.cache.padding` (left padding),
:mod:`~retention.cache.eviction` (when to evict and what to keep), :mod:`~retention.cache.dispatch` (which attention
path a layer's queries take), :mod:`~retention.cache.planned` (the planned steps of
:class:`~retention.cache.graph_decode.GraphDecoder`), :mod:`~retention.cache.rows` (beams and row selection) and
:mod:`~retention.cache.report` (the memory report). They share the cache's state, which is why they are mixins: one
object, as transformers and the policies see it.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import torch
from transformers.cache_utils import Cache

from ..attach import text_config_of, unwrap
from ..budget import default_slack
from ..padding import new_token_valid
from ..policies.base import EvictionPolicy
from ..policies.global_gates import GlobalGatesPolicy
from .cache_budget import BudgetMixin, CacheBudgetError, is_count
from .dispatch import AttentionMixin
from .eviction import EvictionMixin
from .layer import RetentionLayer
from .paged import PagedKVStore
from .padding import PaddingMixin
from .planned import PlannedStepMixin
from .report import MemoryReport, ReportMixin, kept_where
from .rows import RowsMixin

# names other modules import from here
__all__ = ["CacheBudgetError", "MemoryReport", "RetentionCache", "is_count", "kept_where"]


class RetentionCache(BudgetMixin, PaddingMixin, EvictionMixin, AttentionMixin, PlannedStepMixin, RowsMixin,
                     ReportMixin, Cache):
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
        super().__init__(layers=[RetentionLayer(self, i) for i in range(self.num_layers)])
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
        # (B, T) bool over positions: image tokens (mark_image_tokens); None: no modality known
        self._image: torch.Tensor | None = None
        self.evictions = 0
        self.peak_entries = 0
        # set by GraphDecoder around one decode step: {"slots": (L, B*H), "pos": (B*H,)} device tensors; the step
        # then writes its entries there and attends without host work (see retention.cache.graph_decode)
        self._static: dict[str, torch.Tensor] | None = None

    # -- transformers Cache API --------------------------------------------------------------------
    def retention_pre_attention(self, layer: int, log_beta: torch.Tensor, attention_mask: Any) -> None:
        """Called by the attachment's pre-hook: gate scores ``(B, H, T)`` of the new tokens and the layer's mask."""
        B, _, T = log_beta.shape
        self._pending[layer] = (log_beta, new_token_valid(attention_mask, B, T))

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
            self._new_rows(B)
        elif self.store.batch != B and not any(self._seen):  # new or reset: take the batch as it comes
            self.store.select_batch(torch.zeros(B, dtype=torch.long))  # B empty sequences, on the same pool
            self._new_rows(B)
        elif self.store.batch != B:
            hint = (f"; to continue each held sequence {B // self.store.batch} times call "
                    f"cache.batch_repeat_interleave({B // self.store.batch}) first"
                    if B % self.store.batch == 0 else "")
            held = f"{self.store.batch} sequence{'s' if self.store.batch != 1 else ''}"
            raise RuntimeError(f"RetentionCache holds {held} but got a batch of {B}{hint}; "
                               "or call cache.reset() to start over with the new batch")
        if self.planning:  # a decode step GraphDecoder planned: no host work, so a graph can record it
            return self._write_planned(layer_idx, key_states, value_states, log_beta)
        t0 = self._seen[layer_idx]
        if layer_idx == 0:
            self._maybe_evict(T)
            self._last_query_len = T
            self._read_forward_padding(token_valid, t0, T)
        pos = self._positions(token_valid, t0, (B, H, T), key_states.device)
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

    def mark_image_tokens(self, marked: torch.Tensor | None) -> None:
        """Tell the cache which positions hold image tokens, for policies that read the modality
        (:attr:`EntryView.is_image <retention.policies.base.EntryView>`): ``marked`` ``(B, T)`` or ``(T,)`` (one
        sequence, or the same for every row) bool over positions 0..T-1 as the cache records them (a left-padded
        batch's padded positions), e.g. ``input_ids == config.image_token_id``; positions at or past ``T`` (replies
        still to come) are text. Replaces earlier marks; ``None`` forgets them (no modality known). Call it before
        the forward that feeds the marked tokens, e.g. with the whole conversation's ids before each turn."""
        if marked is None:
            self._image = None
            return
        if not torch.is_tensor(marked) or marked.dtype != torch.bool or marked.dim() not in (1, 2):
            raise TypeError("mark_image_tokens takes a (B, T) or (T,) bool tensor over positions, got "
                            + (f"{marked.dtype} of shape {tuple(marked.shape)}" if torch.is_tensor(marked)
                               else type(marked).__name__))
        self._image = marked[None] if marked.dim() == 1 else marked

    def _image_flags(self, seqs: torch.Tensor, pos: torch.Tensor) -> torch.Tensor | None:
        """``(R, Lpad)`` bool: whether each entry (rows of sequences ``seqs`` ``(R,)``, positions ``pos`` ``(R, Lpad)``,
        -1 for padding) is an image token by the marks; ``None`` without marks."""
        if self._image is None:
            return None
        marks = self._image.to(pos.device)
        rows = seqs.clamp_max(marks.shape[0] - 1) if marks.shape[0] > 1 else torch.zeros_like(seqs)
        inside = (pos >= 0) & (pos < marks.shape[1])
        return marks[rows[:, None], pos.clamp(0, marks.shape[1] - 1)] & inside

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
        self._image = None
        self.policy.reset()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        for layer in self.layers:  # a copy's or an unpickled cache's layers link to it, not to the original
            layer.relink(self)

    def copy_from(self, other: "RetentionCache") -> None:
        """Hold a deep copy of ``other``'s contents (same model), keeping this cache's policy and budget:
        one prefill scored by several policies (the eval harness's shared prefill).

        A policy that reads queries (``needs_queries``: SnapKV, H2O, TOVA, ...) must have observed the prefill's
        queries before it can score. So either ``other`` was prefilled with a
        :class:`~retention.policies.recorder.QueryRecorder` policy, whose queries are replayed into this cache's
        policy here as the forward would have shown them, or ``other``'s policy is the same policy with the same
        options, whose statistics are copied. Otherwise it is an error (the policy would score with no statistics and
        keep only the newest tokens)."""
        from ..policies.recorder import QueryRecorder

        if other.num_layers != self.num_layers or other.num_kv_heads != self.num_kv_heads:
            raise ValueError("copy_from needs a cache of the same model (layers and KV heads differ)")
        recorded = other.policy.queries if isinstance(other.policy, QueryRecorder) else None
        # the same policy with the same options (statistics are no part of a policy's repr) observed the same queries
        twin = (type(other.policy) is type(self.policy) and repr(other.policy) == repr(self.policy)
                and hasattr(other.policy, "stats"))
        if self.policy.needs_queries and other.store is not None and not recorded and not twin:
            raise ValueError(
                f"copy_from: this cache's policy {self.policy.name!r} reads the prefill's queries, and the cache "
                f"copied from (policy {other.policy.name!r}) recorded none, so the policy would score blind: prefill "
                "that cache with policy=QueryRecorder() (retention.policies.recorder), whose queries copy_from "
                "replays, or prefill this cache itself")
        self.store = copy.deepcopy(other.store)
        self._seen = list(other._seen)
        self._pad_entries = None if other._pad_entries is None else other._pad_entries.clone()
        self._start = None if other._start is None else other._start.clone()
        self._image = None if other._image is None else other._image.clone()
        self._last_query_len, self.peak_entries = other._last_query_len, other.peak_entries
        self._crop_floor = other._crop_floor
        for layer in self.layers:
            layer.is_initialized = other.store is not None
        if self.policy.needs_queries and recorded:
            for layer, (query, qpos) in sorted(recorded.items()):
                self.policy.observe(layer, query, self.store.gather_layer(layer), qpos)
        elif self.policy.needs_queries and twin:
            self.policy.stats = copy.deepcopy(other.policy.stats)

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
