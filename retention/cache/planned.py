"""Planned decode steps: what :class:`~retention.cache.graph_decode.GraphDecoder` asks of the cache around one step.

A CUDA graph replays fixed kernels on fixed addresses, so a recorded step can do no host work: the decoder evicts and
plans each stream's next slot before the step (:meth:`PlannedStepMixin.begin_planned_step`,
:meth:`~retention.cache.paged.PagedKVStore.reserve_next`), hands the slots to the cache for the step
(:meth:`PlannedStepMixin.planned_slots`), and counts the token after it (:meth:`PlannedStepMixin.end_planned_step`).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


class PlannedStepMixin:
    """Planned steps of :class:`~retention.cache.hf.RetentionCache`: ``_static`` holds, during one step,
    ``{"slots": (L, B*H), "pos": (B*H,)}`` device tensors; each layer then writes its entries there and attends
    without host work."""

    @property
    def planning(self) -> bool:
        """Whether a planned step is running (between :meth:`planned_slots`' entry and exit)."""
        return self._static is not None

    def begin_planned_step(self) -> None:
        """Before a planned one-token step: what the cache's first layer does at the start of a forward (evict by the
        cache's rule, over budget + slack; note a query of one token, unpadded)."""
        self._maybe_evict(1)
        self._last_query_len, self._forward_pads = 1, None

    @contextmanager
    def planned_slots(self, slots: torch.Tensor, pos: torch.Tensor) -> Iterator[None]:
        """During the ``with`` block each layer writes its new entry to pool slots ``slots[layer]`` ``(B*H,)`` at
        position ``pos`` ``(B*H,)`` (device tensors a graph may record) instead of appending on the host."""
        self._static = {"slots": slots, "pos": pos}
        try:
            yield
        finally:
            self._static = None

    def end_planned_step(self) -> None:
        """After a planned step: every layer has seen one more token."""
        self._seen = [s + 1 for s in self._seen]
        self.peak_entries = max(self.peak_entries, int(self.store.host_lengths.sum()))

    def _write_planned(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor,
                       log_beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's part of a planned step: ``key/value_states`` ``(B, H, 1, D)`` and ``log_beta`` ``(B, H, 1)`` go
        to the planned slots; attention then reads the pages in place."""
        B, H, _, D = key_states.shape
        self.store.write(self._static["slots"][layer_idx], key_states.reshape(B * H, D),
                         value_states.reshape(B * H, D), log_beta.reshape(B * H), self._static["pos"])
        self._views[layer_idx] = (None, None, None)
        return key_states, value_states
