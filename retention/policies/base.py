"""The eviction-policy interface shared by learned gates and training-free baselines.

A policy only *scores* cache entries; the cache owns selection (top-B per budget group), compaction
and page bookkeeping, so every policy competes on equal terms. A new baseline (SnapKV, H2O, ...) is one
file with a subclass of :class:`EvictionPolicy` that sets

* ``budget_scope``: ``"global"`` (one budget per sequence over all layers and heads), ``"layer"``
  (budget / L per layer) or ``"head"`` (budget / (L * H) per KV head, or ``head_budgets``);
* ``mode``: ``"streaming"`` (evict whenever the cache passes budget + slack) or ``"one_shot"``
  (compress once when a prefill ends, e.g. SnapKV; the cache then grows during decoding);
* ``needs_queries``: True to get :meth:`observe` calls with each layer's queries (observation-window
  attention for attention-based policies);

and implements :meth:`score`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..cache.paged import PaddedView

BUDGET_SCOPES = ("global", "layer", "head")
MODES = ("streaming", "one_shot")


@dataclass
class EntryView:
    """Cache entries of the streams being scored, padded per stream.

    ``log_beta`` ``(R, Lpad)`` float32, ``pos`` ``(R, Lpad)`` int64 (position in the batch's padded
    rows; -1 marks padding tokens of left-padded batches), ``valid`` ``(R, Lpad)`` bool, ``step``
    ``(R,)`` int64: position of the newest token of the stream's sequence; ``seq``, ``layer``, ``head``
    ``(R,)`` identify each stream; ``start`` ``(R,)`` int64: position of the sequence's first real
    token (its left padding; ``None``: no padding); ``keys``, ``values`` ``(R, Lpad, D)``: the entries'
    key (after RoPE) and value vectors, given only to policies with ``needs_kv`` (``None`` otherwise);
    ``is_image`` ``(R, Lpad)`` bool: the entries of image tokens (a vision-language model's image placeholders), set
    from what the cache was told (:meth:`RetentionCache.mark_image_tokens`, which :class:`RetentionChat` calls);
    ``None`` when it knows no modality (a text model, or ``generate`` called without marks). False at padding.
    """

    log_beta: torch.Tensor
    pos: torch.Tensor
    valid: torch.Tensor
    step: torch.Tensor
    seq: torch.Tensor
    layer: torch.Tensor
    head: torch.Tensor
    start: torch.Tensor | None = None
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    is_image: torch.Tensor | None = None

    def sinks(self, n: int) -> torch.Tensor:
        """``(R, Lpad)`` bool: the entries among each sequence's first ``n`` real tokens (attention sinks)."""
        rel = self.pos if self.start is None else self.pos - self.start[:, None]
        return (self.pos >= 0) & (rel < n)


def protect(score: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``score`` with the entries where ``keep`` (bool, broadcastable) is set raised to +inf, so the cache's
    top-B always keeps them (sinks, a recent window, forced picks) whatever else competes."""
    return torch.where(keep, torch.full_like(score, float("inf")), score)


class EvictionPolicy(ABC):
    """Base class: turn cache contents into retention scores (higher = keep)."""

    name: str = "base"
    budget_scope: str = "global"
    mode: str = "streaming"
    needs_queries: bool = False
    needs_kv: bool = False  # True: the cache gathers each entry's key and value into EntryView.keys / values
    evicts: bool = True  # False: the full cache (never evicts, whatever the budget)
    uses_gates: bool = False  # True: scores come from the attached retention gates (their beta)
    # True: the gates score every new token although this policy reads none of it (a cache whose entries another,
    # gated policy ranks later); False with uses_gates False: the gate MLP is skipped and log_beta stored as 0
    keeps_gate_scores: bool = False
    head_budgets: torch.Tensor | None = None  # (L, H) entries per head, only with budget_scope="head"

    def bind(self, model: PreTrainedModel) -> None:
        """Called once by the cache with the model (policies that need weights, e.g. ``W_O``, read them here)."""

    def set_budget(self, total: int, num_layers: int, num_heads: int) -> None:
        """Called before each :meth:`score` with the budget being enforced (once for each distinct budget of a batch
        with one budget per sequence; the rows of that budget take that call's scores)."""

    def layer_budget_table(self, total: int, num_layers: int, seq: int = 0) -> torch.Tensor | None:
        """Entries per layer ``(L,)`` of sequence ``seq`` (its row in the batch) for ``budget_scope="layer"``
        policies that allocate across layers from what they observed of it (LAVa); ``None`` keeps the even
        split."""
        return None

    def head_budget_table(self, total: int, num_layers: int, num_heads: int, seq: int = 0) -> torch.Tensor | None:
        """Entries per (layer, head) ``(L, H)`` of sequence ``seq`` (its row in the batch) for a total budget, for
        policies that allocate unevenly across layers (PyramidKV, CAKE); ``None`` keeps the cache's default split
        for ``budget_scope``."""
        return None

    def validate(self) -> None:
        import dataclasses
        import math
        import numbers

        for f in dataclasses.fields(self) if dataclasses.is_dataclass(self) else ():
            if not f.init:  # built from the others, after this check
                continue
            value = getattr(self, f.name)
            kind = {"int": numbers.Integral, "float": numbers.Real}.get(f.type if isinstance(f.type, str)
                                                                     else getattr(f.type, "__name__", ""))
            if kind is not None and (not isinstance(value, kind) or isinstance(value, bool)):  # window=2.5, "7"
                raise ValueError(f"{f.name} must be {'an integer' if kind is numbers.Integral else 'a number'}, "
                                 f"got {value!r}")
            if kind is numbers.Real and not math.isfinite(value):  # NaN passes every "< 0" check below
                raise ValueError(f"{f.name} must be a finite number, got {value!r}")
            # a switch from a hand-written config ("no", "false", 0) is truthy or falsy by accident: value_norm="no"
            # turned AdaKV into CriticalKV without a word
            if f.type in ("bool", bool) and not isinstance(value, bool):
                raise ValueError(f"{f.name} must be true or false, got {value!r}")
            # every policy that max-pools its scores over neighbours (SnapKV and its kin) names the width kernel
            if f.name == "kernel" and (value < 1 or value % 2 == 0):
                raise ValueError(f"kernel must be odd and >= 1 (1: no pooling), got {value}")
        if self.budget_scope not in BUDGET_SCOPES:
            raise ValueError(f"budget_scope must be one of {BUDGET_SCOPES}, got {self.budget_scope!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.head_budgets is not None and self.budget_scope != "head":
            raise ValueError("head_budgets needs budget_scope='head'")

    @abstractmethod
    def score(self, entries: EntryView) -> torch.Tensor:
        """Scores ``(R, Lpad)`` float32 for ``entries`` (values at invalid slots are ignored)."""

    def observe(self, layer: int, query: torch.Tensor, view: PaddedView, query_pos: torch.Tensor) -> None:
        """Called per layer and forward when ``needs_queries``, before attention: ``query`` ``(B, Hq, Q, D)``
        (after RoPE), ``view`` the layer's kept entries (:class:`retention.cache.paged.PaddedView`: keys,
        values ``(B, H, Lmax, D)``, pos, valid ``(B, H, Lmax)``) including this forward's new tokens, and
        ``query_pos`` ``(B, Q)`` true positions. Training-free policies keep statistics here."""

    def select_batch(self, indices: torch.Tensor) -> None:
        """Per-sequence state follows the cache's rows: row ``i`` becomes old row ``indices[i]`` ``(B',)``
        (beam search, repeated samples). Policies that keep statistics in ``stats`` reorder them."""
        stats = getattr(self, "stats", None)
        if stats is not None:
            stats.select_batch(indices)

    def reset(self) -> None:
        """Forget per-sequence state (a new conversation starts)."""
