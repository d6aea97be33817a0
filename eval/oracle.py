"""An attention oracle for the fidelity task: what eviction could keep if it saw the continuation.

Query-agnostic methods rank the context's entries before the next tokens arrive. The oracle ranks them
by the attention the continuation itself pays them: the context and its continuation are prefilled once
with nothing evicted, and an entry's score is the attention of the continuation's queries (all of
them, in every layer) summed over the continuation and averaged over the KV head's query heads:
SnapKV's score with the true future as its observation window, no pooling, nothing protected. Then the
context alone is prefilled and compressed to the budget by those scores, per KV head (``scope: head``,
``B / (L * H)`` entries each) or over one global top-B (``scope: global``), and the continuation is
scored as for every other method (:mod:`eval.protocol`).

It reads the future, so it is no method to serve; it shows what ranking single entries by the attention
they will receive keeps at a budget, a reference to read a fidelity gap against. In an eval config:
``{name: oracle, params: {scope: head}}``, with ``tasks: [fidelity]`` and a one-shot prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from retention.policies.base import EntryView
from retention.policies.window import WindowPolicy, window_attention

from .methods import PolicyCache, prefill

SCOPES = ("head", "global")


@dataclass
class FutureAttention(WindowPolicy):
    """Scores recorded from one prefill of context + continuation (``window`` = the continuation's
    length), then frozen: later prefills and decoding steps leave them as they are."""

    name: str = "oracle"
    frozen: bool = False

    def layer_scores(self, layer, query, view, query_pos) -> torch.Tensor:
        """``(B, H, L)``: attention of the last ``window`` queries, summed over them, mean over the group."""
        return window_attention(query, view, query_pos, self.window).sum(3).mean(2)

    def observe(self, layer, query, view, query_pos) -> None:
        if not self.frozen:
            super().observe(layer, query, view, query_pos)

    def score(self, entries: EntryView) -> torch.Tensor:
        """``(R, Lpad)``: the recorded attention; no recent window is protected (the future decides)."""
        return self.stats.lookup(entries)


class ContinuationOracle(PolicyCache):
    """The oracle as an eval method: :meth:`prepare` records each fidelity item's future attention."""

    def __post_init__(self) -> None:
        unknown = set(self.params) - {"scope"}
        if unknown:
            raise ValueError(f"oracle takes only 'scope' ({list(SCOPES)}), got {sorted(unknown)}")
        if self.params.get("scope", "head") not in SCOPES:
            raise ValueError(f"oracle scope must be one of {list(SCOPES)}, got {self.params['scope']!r}")
        if self.gates is not None:
            raise ValueError("oracle takes no gates: it ranks by attention alone")
        super().__post_init__()
        self._scores: FutureAttention | None = None

    @torch.no_grad()
    def prepare(self, model, item) -> None:
        if item.metric != "fidelity":
            raise ValueError(f"the oracle needs a continuation to look at: fidelity items only, got {item.task} "
                             "(set tasks: [fidelity] in the config)")
        from retention.cache import RetentionCache

        ctx, cont = item.meta["context_ids"], item.meta["continuation_ids"]
        scores = FutureAttention(window=len(cont), budget_scope=self.params.get("scope", "head"))
        model.retention.reset()
        prefill(model, RetentionCache(model, budget=None, policy=scores), ctx + cont, None)
        scores.frozen = True
        self._scores = scores

    def policy(self, streaming: bool):
        if streaming:
            raise ValueError("the oracle compresses once after a one-shot prefill (prefill: one_shot)")
        if self._scores is None:
            raise RuntimeError("oracle: prepare(model, item) records the continuation's attention first")
        return self._scores

    def gates_id(self, model) -> str | None:
        return None  # attention only: the sweep's gates never touch its scores
