"""Learned global eviction: rank every entry of a sequence by its gate's lookahead retention score."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .base import EntryView, EvictionPolicy, protect
from .window import recent_mask

if TYPE_CHECKING:
    from transformers import PreTrainedModel


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
    """Keep the global top-B over all layers, heads and modalities by ``sum_{k=1..H} beta_i^(t-i+k)``.

    ``sink``: each sequence's first ``sink`` tokens are always kept in every head (attention sinks, as
    in StreamingLLM; 4 * L * H_kv entries of the budget). Gates trained on short rows give the sink a
    beta that is high but not high enough for contexts several times longer, and a head that loses its
    sink loses its attention pattern: SmolLM2's gates trained on 1k-token rows keep position 0 in only
    19 of 90 heads at 10% of a 4k context, and next-token top-1 agreement falls to 55% (95% with the
    sinks). ``sink=0`` leaves every decision to the gates (the paper's method as written).

    ``recent``: the newest ``recent`` tokens are also kept in every head (a local window, as SnapKV and
    StreamingLLM keep; ``recent * L * H_kv`` entries of the budget). The gates may give a fresh token a
    low beta and the global top-B then drops it at once, although the next few queries attend to it
    most; 0 (default) leaves those decisions to the gates.
    """

    horizon: int = 1
    sink: int = 4
    recent: int = 0
    budget_scope: str = "global"
    mode: str = "streaming"
    name: str = "global_gates"
    uses_gates = True  # class attribute, not a parameter

    def __post_init__(self) -> None:
        self.validate()
        if self.horizon < 1:
            raise ValueError(f"horizon must be >= 1, got {self.horizon}")
        if self.sink < 0:
            raise ValueError(f"sink must be >= 0 (tokens always kept at the start), got {self.sink}")
        if self.recent < 0:
            raise ValueError(f"recent must be >= 0 (newest tokens always kept), got {self.recent}")

    def bind(self, model: PreTrainedModel) -> None:
        warn_if_trained_for_another_scope(model, self)

    def score(self, entries: EntryView) -> torch.Tensor:
        age = entries.step[:, None] - entries.pos + 1
        score = lookahead_log_score(entries.log_beta, age, self.horizon)
        keep = entries.sinks(self.sink) | recent_mask(entries, self.recent)  # both all False at 0
        return protect(score, keep)


class GateScopeWarning(UserWarning):
    """Gates ranked under a budget scope other than the one they were trained for (TRIM-KV's per-head gates under
    one global budget)."""


def warn_if_trained_for_another_scope(model: PreTrainedModel, policy: EvictionPolicy) -> None:
    """:class:`GateScopeWarning` when the gates attached to ``model`` are TRIM-KV's (``variant="trimkv"``: nothing
    tied, trained for a budget per KV head) and ``policy`` ranks them under one global budget: their scores were
    never put on one scale across heads, so the global top-B splits the budget among heads by accident."""
    gates = getattr(model, "retention_gates", None)
    if getattr(getattr(gates, "config", None), "variant", None) != "trimkv" or policy.budget_scope != "global":
        return
    warnings.warn(
        f"the attached gates are TRIM-KV gates (variant 'trimkv': a scoring projection per layer and KV head, trained "
        f"for a budget per KV head), but {type(policy).__name__} ranks them under one global budget, which they were "
        "not trained for (their scores are not on one scale across heads): use TrimKVPolicy() (--policy trimkv; "
        "name: trimkv in an eval config), or gates of variant 'global'. To rank them globally on purpose, filter "
        "retention.policies.global_gates.GateScopeWarning", GateScopeWarning, stacklevel=3)
