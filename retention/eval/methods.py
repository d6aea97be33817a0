"""KV methods a sweep compares, behind one small interface.

A :class:`Method` makes a fresh cache for one item, says whether it needs a budget, compresses after
the prefill and reports the KV memory kept. :mod:`retention.eval.protocol` drives prefill / generate / scoring
through that interface only, so every method runs the same protocol.

* :class:`FullCache`: plain transformers ``DynamicCache`` (the reference: nothing evicted, retention
  gates bypassed even when attached).
* :class:`PolicyCache`: the adapter to :class:`retention.cache.RetentionCache` with any eviction policy
  from :func:`retention.policies.get_policy` (learned global gates, TRIM-KV, SnapKV, H2O, ...), under
  one global budget in KV entries.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

import torch

from retention.compat import cache_kwargs

if TYPE_CHECKING:
    from transformers import Cache, DynamicCache, PreTrainedModel

    from retention.cache import RetentionCache
    from retention.gates import RetentionGates
    from retention.policies import EvictionPolicy

    from retention.tasks.base import Item


def kv_streams(model: PreTrainedModel) -> tuple[int, int, int]:
    """``(layers, kv_heads, head_dim)`` of the text decoder."""
    cfg = model.config.get_text_config()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim


@dataclass
class Method(ABC):
    """One KV method: ``name`` (``full`` or a policy name), its ``params`` and the ``label`` reported."""

    name: str
    params: dict[str, Any] = field(default_factory=dict)
    label: str = ""
    gates: str | None = None  # a gate checkpoint of its own (folder or Hub repo), e.g. TRIM-KV per-head gates

    uses_budget = True

    def __post_init__(self) -> None:
        if not self.label:
            self.label = self.name + "".join(f"_{k}{v}" for k, v in sorted(self.params.items()))

    @abstractmethod
    def new_cache(self, model: PreTrainedModel, budget_entries: int | None, streaming: bool) -> Cache:
        """A fresh cache for one item; ``streaming``: evict during a chunked prefill, not only after it."""

    def prepare(self, model: PreTrainedModel, item: Item) -> None:
        """Called with each item before its context is prefilled (the oracle reads its continuation here)."""

    def compress(self, cache: Cache) -> None:
        """Evict down to the budget now (the context is prefilled, the question has not arrived)."""

    def freeze(self, cache: Cache) -> None:
        """Evict nothing more from ``cache`` (the ``compress_once`` protocol: the compressed context stays as it is
        while the question and the reply are fed). A cache with a budget drops it; others never evict."""
        if hasattr(cache, "set_budget"):
            cache.set_budget(None)

    @abstractmethod
    def memory(self, cache: Cache, model: PreTrainedModel) -> dict[str, int]:
        """``kept_entries``, ``kv_bytes`` and ``full_cache_bytes`` of what the cache holds now."""

    @contextlib.contextmanager
    def active(self, model: PreTrainedModel) -> Iterator[None]:
        """Context in which this method's forwards run (e.g. the attachment's mode)."""
        yield

    def gates_id(self, model: PreTrainedModel) -> str | None:
        """Fingerprint of the gates that score this method's evictions; ``None`` when no gates do."""
        return None


class FullCache(Method):
    """Everything kept, in a plain ``DynamicCache``."""

    uses_budget = False

    def new_cache(self, model: PreTrainedModel, budget_entries: int | None, streaming: bool) -> DynamicCache:
        from transformers import DynamicCache

        return DynamicCache(config=model.config)

    def memory(self, cache: Cache, model: PreTrainedModel) -> dict[str, int]:
        L, H, D = kv_streams(model)
        entries = cache.get_seq_length() * L * H
        elem = next(model.parameters()).element_size()
        nbytes = entries * 2 * D * elem
        return {"kept_entries": entries, "kv_bytes": nbytes, "full_cache_bytes": nbytes}

    @contextlib.contextmanager
    def active(self, model: PreTrainedModel) -> Iterator[None]:
        attachment = getattr(model, "retention", None)
        if attachment is None:
            yield
        else:  # gates bypassed: output identical to the unpatched model
            with attachment.use_mode("teacher"):
                yield


class PolicyCache(Method):
    """Adapter: a :class:`retention.cache.RetentionCache` scored by ``get_policy(name, **params)``.

    Streaming prefill sets the policy's ``mode`` to ``"streaming"`` (evict whenever the cache passes
    budget + slack) unless the config sets ``mode`` itself.
    """

    def policy(self, streaming: bool) -> EvictionPolicy:
        from retention.policies import get_policy

        params = dict(self.params)
        if streaming and "mode" not in params and self.name != "full":
            params["mode"] = "streaming"
        return get_policy(self.name, **params)

    def new_cache(self, model: PreTrainedModel, budget_entries: int | None, streaming: bool) -> RetentionCache:
        from retention.cache import RetentionCache

        attachment = getattr(model, "retention", None)
        if attachment is None:
            raise RuntimeError("policy methods need retention gates attached: attach_gates(model, gates, mode='score')")
        attachment.reset()
        return RetentionCache(model, budget=budget_entries, policy=self.policy(streaming))

    def compress(self, cache: RetentionCache) -> None:
        cache.compress()

    def memory(self, cache: RetentionCache, model: PreTrainedModel) -> dict[str, int]:
        r = cache.memory_report()
        return {"kept_entries": int(r["kept_entries"]), "kv_bytes": int(r["kv_bytes"]),
                "full_cache_bytes": int(r["full_cache_bytes"])}

    @contextlib.contextmanager
    def active(self, model: PreTrainedModel) -> Iterator[None]:
        with model.retention.use_mode("score"), self._own_gates(model):
            yield

    def gates_id(self, model: PreTrainedModel) -> str | None:
        if not self.policy(streaming=False).uses_gates:
            return None  # training-free: the sweep's gates do not touch its scores
        return (self.own_gates(model) if self.gates else model.retention.gates).fingerprint()

    def _own_gates(self, model):
        """Swap in this method's own gates (loaded once) for its forwards; the sweep's gates otherwise."""
        if self.gates is None:
            return contextlib.nullcontext()
        return model.retention.use_gates(self.own_gates(model))

    def own_gates(self, model: PreTrainedModel) -> RetentionGates:
        """This method's own gates (``gates:`` in its config), loaded on first use and kept."""
        if getattr(self, "_loaded", None) is None:
            from retention.hub import load_gates

            self._loaded = load_gates(self.gates, model=model).eval()
        return self._loaded


@torch.no_grad()
def prefill(model: PreTrainedModel, cache: Cache, ids: list[int], chunk: int | None) -> torch.Tensor:
    """Feed ``ids`` into ``cache`` (in chunks of ``chunk`` tokens when given); last position's logits."""
    x = torch.tensor([ids], device=model.device)
    step = chunk or x.shape[1]
    logits = None
    for s in range(0, x.shape[1], step):
        logits = model(input_ids=x[:, s : s + step], **cache_kwargs(cache), use_cache=True, logits_to_keep=1).logits
    return logits[0, -1]


def snapshot_cache(cache: Any, model: torch.nn.Module) -> Any:
    """A deep copy of a prefilled cache (any HF ``Cache``) that shares the model, its weights and the gate
    attachment, so each method or probe can compress its own copy of one prefill."""
    import copy

    memo = {id(p): p for p in model.parameters()}
    memo[id(model)] = model
    attachment = getattr(model, "retention", None)
    if attachment is not None:
        memo[id(attachment)] = attachment
    return copy.deepcopy(cache, memo)
