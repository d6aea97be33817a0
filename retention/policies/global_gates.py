"""Learned global eviction: rank every entry of a sequence by its gate's lookahead retention score."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .base import EntryView, EvictionPolicy


def lookahead_log_score(log_beta: torch.Tensor, age: torch.Tensor, horizon: int) -> torch.Tensor:
    """``log sum_{k=1..H} beta^(age + k - 1)`` computed in log space, stable for ``beta -> 1`` and ``beta -> 0``.

    ``age = t - i + 1`` (1 for the newest entry at step t). Equals
    ``age * log beta + log(1 - beta^H) - log(1 - beta)``; the last two terms tend to
    ``log H + (H - 1) / 2 * log beta`` as ``log beta -> 0``. ``H = 1`` is TRIM-KV's myopic score.
    Shapes broadcast; returns float32.
    """
    if horizon < 1:
        raise ValueError(f"horizon must be >= 1, got {horizon}")
    a = log_beta.to(torch.float32)
    base = age.to(torch.float32) * a
    if horizon == 1:
        return base
    # expm1 keeps both logs accurate for any a < 0; only a == 0 (beta == 1 to fp32) needs the limit
    near_one = a > -1e-30
    safe = torch.where(near_one, torch.full_like(a, -1.0), a)
    ratio = torch.log(-torch.expm1(horizon * safe)) - torch.log(-torch.expm1(safe))
    series = math.log(horizon) + 0.5 * (horizon - 1) * a
    return base + torch.where(near_one, series, ratio)


@dataclass
class GlobalGatesPolicy(EvictionPolicy):
    """Keep the global top-B over all layers, heads and modalities by ``sum_{k=1..H} beta_i^(t-i+k)``."""

    horizon: int = 1
    budget_scope: str = "global"
    mode: str = "streaming"
    name: str = "global_gates"

    def __post_init__(self) -> None:
        self.validate()
        if self.horizon < 1:
            raise ValueError(f"horizon must be >= 1, got {self.horizon}")

    def score(self, entries: EntryView) -> torch.Tensor:
        age = entries.step[:, None] - entries.pos + 1
        return lookahead_log_score(entries.log_beta, age, self.horizon)
