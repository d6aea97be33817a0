"""Learned global eviction: rank every entry of a sequence by its gate's lookahead retention score."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .base import EntryView, EvictionPolicy, protect
from .scoring import max_pool, value_metrics
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

    ``pool``: odd width of a max-pool of the scores over neighbouring entries of each (layer, KV head)
    stream, as SnapKV pools attention, so a span the gates rank high keeps its neighbours (a number
    that the tokenizer writes one digit per token); 1 (default) ranks every entry on its own score. With
    SmolLM2's shipped gates, 7 lost 4.7 points at 10% on untouched items: the neighbours of many peaks
    crowd out lone entries that matter.

    ``value_weight`` and ``key_weight``: query-agnostic signals added to each entry's log score,
    ``value_weight * log ||v_i W_O|| - key_weight * log ||k_i||``. The value norm (VATP's weighting, on
    the gates' score instead of attention) is the root mean square over the KV head's query heads of
    ``||v_i W_O^h||`` (``||v_i||`` for a model without ``o_proj``): an entry whose value barely moves the
    output is worth less than its retention says. A key of small norm tends to draw attention (Devoto
    et al., 2024, keep the lowest-norm keys). 0 (default) leaves the gates' score as it is.
    ``norm_scope``: ``"head"`` (default) keeps the gates' split of the budget (how many entries each
    head keeps) and lets the weighted score pick which ones; ``"global"`` ranks the weighted score over
    the whole model, so the norms move the split too. On SmolLM2 with its shipped gates both hurt:
    top-1 agreement at 10% of a 4k context fell 8.6 points at ``value_weight=0.5`` (``head``), 28.4 at
    1.0 (``global``), and 1.2 / 3.8 at ``key_weight=1`` / ``2`` (``head``); within a head the entries
    the continuation attends to most tend to have small value norms
    (``experiments/norms/smollm2-value-norm-*``, ``smollm2-key-norm-*``). Scoring then gathers
    every entry's key and value at each eviction, which the gates alone do not.
    """

    horizon: int = 1
    sink: int = 4
    recent: int = 0
    pool: int = 1
    value_weight: float = 0.0
    key_weight: float = 0.0
    norm_scope: str = "head"
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
        if self.pool < 1 or self.pool % 2 == 0:
            raise ValueError(f"pool must be odd and >= 1 (1: no pooling), got {self.pool}")
        for name in ("value_weight", "key_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: the gates' score alone), got {getattr(self, name)}")
        if self.norm_scope not in ("head", "global"):
            raise ValueError(f"norm_scope must be 'head' (the gates' split, reordered within each head) or "
                             f"'global' (the norms move the split too), got {self.norm_scope!r}")
        self.needs_kv = self.value_weight > 0 or self.key_weight > 0
        self._value_metric = None

    def bind(self, model: PreTrainedModel) -> None:
        warn_if_trained_for_another_scope(model, self)
        if self.value_weight > 0:
            self._value_metric = value_metrics(model)

    def score(self, entries: EntryView) -> torch.Tensor:
        age = entries.step[:, None] - entries.pos + 1
        score = lookahead_log_score(entries.log_beta, age, self.horizon)
        if self.pool > 1:  # padding (unused slots, a left-padded row's pos -1 tokens) must not lend its score
            real = entries.valid & (entries.pos >= 0)
            pooled = max_pool(score.masked_fill(~real, -float("inf")), self.pool)
            score = torch.where(real, pooled, score)
        keep = entries.sinks(self.sink) | recent_mask(entries, self.recent)  # both all False at 0
        if not self.needs_kv:
            return protect(score, keep)
        if entries.keys is None or entries.values is None:
            raise ValueError("value_weight or key_weight > 0 needs the entries' keys and values: score through "
                             "RetentionCache, which gathers them for policies with needs_kv, or pass "
                             "EntryView(keys=..., values=...)")
        weighted = score
        if self.value_weight > 0:
            weighted = weighted + self.value_weight * self._log_value_norm(entries)
        if self.key_weight > 0:
            weighted = weighted - self.key_weight * torch.log(entries.keys.float().norm(dim=-1).clamp_min(1e-30))
        weighted = protect(weighted, keep)
        if self.norm_scope == "global":
            return weighted
        real = entries.valid & (entries.pos >= 0)  # left padding is dropped at eviction: it must not hold a score
        return reorder_within_rows(protect(score, keep), weighted, real)

    def _log_value_norm(self, entries: EntryView) -> torch.Tensor:
        """``(R, Lpad)`` float32: ``log`` of the RMS over each stream's query heads of ``||v_i W_O^h||``
        (``||v_i||`` until :meth:`bind` has read ``W_O``)."""
        v = entries.values.float()
        if self._value_metric is None:
            sq = v.square().sum(-1)
        else:  # ||v W||^2 = v^T (W W^T) v: a (D, D) metric per KV head instead of (Lpad, hidden) outputs
            m = self._value_metric.to(v.device)[entries.layer, entries.head]  # (R, D, D)
            sq = torch.einsum("rld,rde,rle->rl", v, m, v)
        return 0.5 * torch.log(sq.clamp_min(1e-30))


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


def reorder_within_rows(base: torch.Tensor, order: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``(R, Lpad)``: each row's multiset of ``base`` scores handed out in the order of ``order``
    (the entry ranked j-th by ``order`` gets the row's j-th largest ``base``). A global top-B then keeps
    exactly as many entries of each row as it would under ``base``, chosen by ``order``."""
    neg = -float("inf")
    ranked = base.masked_fill(~valid, neg).sort(dim=1, descending=True).values
    idx = order.masked_fill(~valid, neg).argsort(dim=1, descending=True, stable=True)
    return torch.empty_like(ranked).scatter_(1, idx, ranked)
