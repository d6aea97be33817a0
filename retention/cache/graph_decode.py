"""Decode steps over a :class:`~retention.cache.hf.RetentionCache` recorded once as a CUDA graph and replayed.

A small model's decode step on a GPU is bound by host work, not arithmetic: on an H100, SmolLM2-135M in bf16 takes
about 25 ms a token eagerly and 5 ms replayed as one graph (``benchmarks/graph_ceiling.py``). A graph
replays fixed kernels on fixed addresses, so everything a step decides on the host is done before the replay,
eagerly:

1. eviction (the cache's own rule: over budget + slack, cut back to the budget);
2. page planning: :meth:`PagedKVStore.reserve_next` gives every stream the pool slot of its next entry (a new page
   where the last one is full) and grows the lengths on the host and the device;
3. the token, its position and the slots are copied into the graph's input tensors.

Inside the graph each layer's gates score the token, its key, value, score and position go to the planned slots
(:meth:`PagedKVStore.write`) and the paged kernel attends over the stream's pages up to its (device) length, with
the grid of the block table's width. The graph is recorded again when an address or that width changes (the pool
or the block table grew), which doubling makes rare.

On the CPU the same planned step runs eagerly (``graph=False``; the reference paged attention), which is how the
tests check it against the cache's ordinary decode path. A vision-language model (Qwen3-VL) decodes its text with
M-RoPE positions shifted by the model's ``rope_deltas``, read before each step.
"""

from __future__ import annotations

import torch

from ..attach import unwrap
from ..compat import cache_kwargs
from ..architecture import is_multimodal, text_mrope_positions
from .hf import RetentionCache


class GraphDecoder:
    """Decode steps of ``model`` (retention gates attached in score mode) over ``cache``, a prefilled
    :class:`RetentionCache` of an unpadded batch.

    ``step(ids)``: feed ``ids`` ``(B, 1)`` (the batch's next tokens) and return the next-token logits ``(B, V)``,
    as ``model(input_ids=ids, past_key_values=cache).logits[:, -1]`` would, evicting by the same rule. ``graph``:
    record and replay CUDA graphs (default: on a CUDA model); ``False`` runs the same planned step eagerly.
    ``captures`` counts the recordings (one, plus one per growth of the pool or the block table).
    """

    def __init__(self, model: torch.nn.Module, cache: RetentionCache, graph: bool | None = None) -> None:
        base = unwrap(model)
        if not isinstance(cache, RetentionCache):
            raise TypeError(f"GraphDecoder decodes over a RetentionCache, got {type(cache).__name__}")
        if getattr(base, "retention", None) is None or base.retention.mode != "score":
            raise ValueError("GraphDecoder needs the retention gates attached in score mode "
                             "(attach_gates(model, gates, mode='score'), as RetentionChat and generate use)")
        if cache.store is None:
            raise ValueError("the cache is empty: prefill the prompt first "
                             "(model(input_ids=..., past_key_values=cache))")
        if cache.policy.needs_queries:
            raise ValueError(f"{type(cache.policy).__name__} reads the queries as they come, which a recorded step "
                             "cannot hand it: decode with model.generate, or use a policy that reads none "
                             "(global_gates)")
        if cache.page_size & (cache.page_size - 1):
            raise ValueError(f"the paged kernel needs a power-of-two page size, got {cache.page_size}")
        if cache.holds_padding:
            raise ValueError("the cache holds left padding, which the recorded step does not mask: decode a padded "
                             "batch with model.generate")
        device = cache.store.lengths.device
        self.graph = device.type == "cuda" if graph is None else graph
        if self.graph and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA model; this cache is on {device}: pass graph=False")
        self.model, self.cache = model, cache
        self.batch, self.layers, self.heads = cache.store.batch, cache.num_layers, cache.num_kv_heads
        B, L, H = self.batch, self.layers, self.heads
        self._ids = torch.zeros(B, 1, dtype=torch.long, device=device)
        self._t = torch.zeros(1, dtype=torch.long, device=device)  # the fed token's position
        self._slots = torch.zeros(L, B * H, dtype=torch.long, device=device)
        # a vision-language model (Qwen3-VL) places text after images at its index plus rope_deltas (M-RoPE)
        self._mrope = is_multimodal(base.config)
        self._delta = torch.zeros(B, 1, dtype=torch.long, device=device)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._recorded_on: tuple | None = None
        self._logits: torch.Tensor | None = None
        self.captures = 0

    @torch.no_grad()
    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """Feed ``ids`` ``(B, 1)``; the next-token logits ``(B, V)`` (a new tensor, not the graph's buffer)."""
        c, store = self.cache, self.cache.store
        if tuple(ids.shape) != (self.batch, 1):
            raise ValueError(f"step takes one token per sequence, ids of shape ({self.batch}, 1); "
                             f"got {tuple(ids.shape)}")
        if store is None or store.batch != self.batch:
            raise RuntimeError("the cache was reordered since this decoder was built: build a new one")
        # reset since: a step would decode the lone token at position 0 as if it began a text
        if not c.get_seq_length():
            raise RuntimeError("the cache holds no tokens (it was reset): prefill it again before stepping")
        if ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"step takes token ids (an integer tensor), got {ids.dtype}")
        if c.holds_padding:  # refilled since (reset) with a padded batch
            raise ValueError("the cache holds left padding, which the recorded step does not mask: decode a padded "
                             "batch with model.generate")
        c.begin_planned_step()  # what the cache's first layer does at the start of a forward: evict
        B, L, H = self.batch, self.layers, self.heads
        slots = store.reserve_next()  # streams ordered (b, l, h); each layer reads its (b, h) rows
        self._slots.copy_(slots.view(B, L, H).transpose(0, 1).reshape(L, B * H))
        self._t.fill_(c.get_seq_length())
        self._ids.copy_(ids)
        if self._mrope:
            delta = unwrap(self.model).model.rope_deltas
            self._delta.copy_(delta.expand(B, 1) if delta is not None else torch.zeros_like(self._delta))
        try:
            with c.planned_slots(self._slots, self._t.expand(B * H)):
                if self.graph:
                    self._replay()
                else:
                    self._logits = self._forward()
        except BaseException:  # the step did not happen: give its slots back, so the cache is as before it
            store.release_next()
            raise
        c.end_planned_step()
        return self._logits.clone()

    def _forward(self) -> torch.Tensor:
        position = self._t.expand(self.batch, 1)
        if self._mrope:  # (4, B, 1): the text position (masks), then M-RoPE's three, each shifted by rope_deltas
            position = text_mrope_positions(position, self._delta)
        out = self.model(input_ids=self._ids, **cache_kwargs(self.cache), cache_position=self._t,
                         position_ids=position, use_cache=True)
        return out.logits[:, -1]

    def _addresses(self) -> tuple:
        """What a recording depends on: the store's tensors (they move when they grow) and the table's width."""
        s, p = self.cache.store, self.cache.store.pool
        return (p.keys.data_ptr(), p.values.data_ptr(), p.log_beta.data_ptr(), p.pos.data_ptr(),
                s.block_table.data_ptr(), tuple(s.block_table.shape), s.lengths.data_ptr())

    def _replay(self) -> None:
        if self._graph is None or self._recorded_on != self._addresses():
            self._record()
        self._graph.replay()

    def _record(self) -> None:
        # warm up on a side stream, as torch.cuda.graphs asks (the steps write this token's entries, which the replay
        # writes again with the same values), then record one step
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward()
        torch.cuda.current_stream().wait_stream(side)
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph):
            self._logits = self._forward()
        self._recorded_on = self._addresses()
        self.captures += 1
