"""The cache's budget: entries kept per sequence, checked against the options and the policy before any forward
(the arithmetic of tokens and entries is :mod:`retention.budget`'s)."""

from __future__ import annotations

import numbers
from typing import Any, Sequence

import torch

from ..attach import text_config_of
from ..budget import entries_for_tokens, streams_of


class CacheBudgetError(ValueError):
    """The budget cannot hold what the options require (protected window, per-head minimum, a turn)."""


def is_count(value: Any) -> bool:
    """An integer (Python, NumPy or a one-element integer tensor), not a bool or a float."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and not value.is_floating_point() and value.dtype != torch.bool
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


class BudgetMixin:
    """:class:`~retention.cache.hf.RetentionCache`'s budget: ``budget`` (an int, a list of ints, one per batch row,
    or ``None``), checked against ``policy``, ``protected_window`` and ``min_per_head`` of the cache."""

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
