"""An attention oracle for the fidelity task: what eviction could keep if it saw the continuation.

Query-agnostic methods rank the context's entries before the next tokens arrive. The oracle ranks them
by the attention the continuation itself pays them: the context and its continuation are prefilled once
with nothing evicted, and an entry's score is the attention of the continuation's queries (all of
them, in every layer) summed over the continuation and averaged over the KV head's query heads:
SnapKV's score with the true future as its observation window, no pooling, nothing protected. Then the
context alone is prefilled and compressed to the budget by those scores, per KV head (``scope: head``,
``B / (L * H)`` entries each) or over one global top-B (``scope: global``), and the continuation is
scored as for every other method (:mod:`retention.eval.protocol`).

It reads the future, so it is no method to serve; it shows what ranking single entries by the attention
they will receive keeps at a budget, a reference to read a fidelity gap against. In an eval config:
``{name: oracle, params: {scope: head}}``, with ``tasks: [fidelity]`` and a one-shot prefill.

Where a global ranking loses to the oracle, it either splits the budget between KV heads differently or
orders the entries within a head differently. Two crossings tell the two apart: ``scope: gates`` ranks
by the oracle within each KV head, each head keeping as many entries as the gates' global top-B keeps
there (``GlobalGatesPolicy(sink=4)``, the shipped policy); ``rank: gates, scope: oracle`` ranks by the
gates within each head, each keeping what the oracle's global top-B keeps there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from retention.policies.base import EntryView
from retention.policies.global_gates import GlobalGatesPolicy
from retention.policies.window import WindowPolicy, window_attention

from .methods import PolicyCache, prefill, snapshot_cache

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from retention.cache import PaddedView, RetentionCache
    from retention.policies.base import EvictionPolicy

    from retention.tasks.base import Item

RANKS = ("oracle", "gates")
# per KV head (even), one global top-B, or each head keeping what the other ranking's global top-B keeps there
SCOPES = {"oracle": ("head", "global", "gates"), "gates": ("head", "global", "oracle")}


@dataclass
class FutureAttention(WindowPolicy):
    """Scores recorded from one prefill of context + continuation (``window`` = the continuation's
    length), then frozen: later prefills and decoding steps leave them as they are."""

    name: str = "oracle"
    frozen: bool = False
    keeps_gate_scores = True  # class attribute: the gates' global top-B may set the split of its cache (head_split)

    def layer_scores(self, layer: int, query: torch.Tensor, view: PaddedView, query_pos: torch.Tensor) -> torch.Tensor:
        """``(B, H, L)``: attention of the last ``window`` queries, summed over them, mean over the group."""
        return window_attention(query, view, query_pos, self.window).sum(3).mean(2)

    def observe(self, layer: int, query: torch.Tensor, view: PaddedView, query_pos: torch.Tensor) -> None:
        if not self.frozen:
            super().observe(layer, query, view, query_pos)

    def score(self, entries: EntryView) -> torch.Tensor:
        """``(R, Lpad)``: the recorded attention; no recent window is protected (the future decides)."""
        return self.stats.lookup(entries)


class ContinuationOracle(PolicyCache):
    """The oracle as an eval method: :meth:`prepare` records each fidelity item's future attention.

    ``params``: ``rank`` (``oracle`` | ``gates``: whose scores order the entries) and ``scope`` (see
    :data:`SCOPES`; a ranking's own global top-B is ``global``, the other ranking's split names it)."""

    def __post_init__(self) -> None:
        unknown = set(self.params) - {"scope", "rank"}
        if unknown:
            raise ValueError(f"oracle takes only 'scope' and 'rank', got {sorted(unknown)}")
        rank = self.params.get("rank", "oracle")
        if rank not in RANKS:
            raise ValueError(f"oracle rank must be one of {list(RANKS)}, got {rank!r}")
        if self.params.get("scope", "head") not in SCOPES[rank]:
            raise ValueError(f"oracle scope must be one of {list(SCOPES[rank])} with rank {rank!r}, "
                             f"got {self.params['scope']!r}")
        if self.gates is not None:
            raise ValueError("oracle takes no gates of its own: rank: gates uses the sweep's gates")
        super().__post_init__()
        self._scores: FutureAttention | None = None
        self._model = None

    @property
    def _rank(self) -> str:
        return self.params.get("rank", "oracle")

    @property
    def _scope(self) -> str:
        return self.params.get("scope", "head")

    @property
    def _split_from_other(self) -> bool:
        return self._scope not in ("head", "global")

    @torch.no_grad()
    def prepare(self, model: PreTrainedModel, item: Item) -> None:
        if item.metric != "fidelity":
            raise ValueError(f"the oracle needs a continuation to look at: fidelity items only, got {item.task} "
                             "(set tasks: [fidelity] in the config)")
        from retention.cache import RetentionCache

        ctx, cont = item.meta["context_ids"], item.meta["continuation_ids"]
        # the scope the oracle's scores rank in: the global top-B whose split they hand to the gates, per head
        # at a split handed to them (filled in by compress), or their own scope
        if self._rank == "gates":
            scope = "global"
        else:
            scope = "head" if self._split_from_other else self._scope
        scores = FutureAttention(window=len(cont), budget_scope=scope)
        model.retention.reset()
        prefill(model, RetentionCache(model, budget=None, policy=scores), ctx + cont, None)
        scores.frozen = True
        self._scores, self._model = scores, model

    def policy(self, streaming: bool) -> EvictionPolicy:
        if streaming:
            raise ValueError("the oracle compresses once after a one-shot prefill (prefill: one_shot)")
        if self._scores is None:
            raise RuntimeError("oracle: prepare(model, item) records the continuation's attention first")
        if self._rank == "oracle":
            return self._scores
        return GlobalGatesPolicy(sink=4, budget_scope="head" if self._split_from_other else self._scope)

    def _split_policy(self):
        """The policy whose global top-B sets each head's share under ``scope: gates | oracle``."""
        return self._scores if self._rank == "gates" else GlobalGatesPolicy(sink=4)

    def compress(self, cache: RetentionCache) -> None:
        if self._split_from_other and cache.budget is not None:
            cache.policy.head_budgets = self.head_split(cache)
        cache.compress()

    @torch.no_grad()
    def head_split(self, cache: RetentionCache) -> torch.Tensor:
        """``(L, H)`` entries each KV head keeps when a copy of ``cache`` is cut to its budget by the
        other ranking's global top-B (the split this method's own ranking is held to)."""
        probe = snapshot_cache(cache, self._model)
        probe.policy = self._split_policy()
        probe.policy.bind(self._model)
        probe.compress()
        return probe.store.entries_per_head()[0]

    def gates_id(self, model: PreTrainedModel) -> str | None:
        if self._rank == "oracle" and self._scope != "gates":
            return None  # attention only: the sweep's gates never touch its scores
        return model.retention.gates.fingerprint()
