"""StreamingLLM (Xiao et al., 2023, "Efficient Streaming Language Models with Attention Sinks").

Keep the first ``sink`` tokens (attention sinks, default 4) and the most recent tokens:
``score_i = +inf`` if ``i < sink`` else ``i`` (newer is better), per head with equal budgets.
Natively streaming; one-shot compresses once after the prefill with the same rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import EntryView, EvictionPolicy, protect


@dataclass
class StreamingLLMPolicy(EvictionPolicy):
    sink: int = 4
    name: str = "streamingllm"
    mode: str = "streaming"
    budget_scope: str = "head"

    def __post_init__(self) -> None:
        self.validate()
        if self.sink < 0:
            raise ValueError(f"sink must be >= 0, got {self.sink}")

    def score(self, entries: EntryView) -> torch.Tensor:
        recency = entries.pos.float()
        return protect(recency, entries.sinks(self.sink))
