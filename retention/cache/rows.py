"""The batch rows of :class:`~retention.cache.hf.RetentionCache`: beams, several continuations, row selection."""

from __future__ import annotations

import torch

from .cache_budget import is_count


class RowsMixin:
    """Row selection of :class:`~retention.cache.hf.RetentionCache`: pages, padding, per-row budgets and the policy's
    per-sequence statistics follow the rows."""

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` continues from row ``beam_idx[i]`` (rows named twice are copied)."""
        self.batch_select_indices(beam_idx)

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
        if self._image is not None and self._image.shape[0] > 1:  # marks per row follow their rows
            self._image = self._image[indices.to(self._image.device)]
        if self.budget is not None and not isinstance(self.budget, int):
            self.budget = [self.budget[i] for i in indices.tolist()]
        self.policy.select_batch(indices)
