"""The evaluation protocol for one item under one method and budget.

* ``query_agnostic`` (default): the context is prefilled and compressed before the question arrives,
  as in a chat where the next user turn is unknown; the budget stays live, so the question's and the reply's
  tokens compete for it too (they evict context entries, and a one-shot policy such as SnapKV scores again with
  the question's queries when the cache outgrows its slack).
* ``compress_once``: the same compression of the context, then nothing more is evicted while the question and the
  reply are fed (the cache grows by their tokens), as kvpress measures; the question cannot touch the choice.
* ``query_aware``: the question is prefilled too (everything but the prompt's last token), then the cache is
  compressed.
* ``one_shot`` prefill feeds the compressed part in one forward; ``streaming`` feeds it in chunks of
  ``chunk`` tokens with the method evicting between chunks under the same budget.

Then the rest of the prompt (question, generation prompt, answer prefix) is fed and the reply is
generated greedily; fidelity items score a teacher-forced continuation against the full cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from retention.compat import cache_kwargs
from retention.policies.recorder import QueryRecorder
from retention.tasks.base import Item
from retention.tasks.prompt import prompt_ids

from .budgets import Budget
from .methods import Method, kv_streams, prefill, snapshot_cache
from .metrics import kl_and_top1, score_reply

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from retention.cache import RetentionCache

PROTOCOLS = ("query_agnostic", "compress_once", "query_aware")
# what each protocol means, in the words a published table names it with
PROTOCOL_SUMMARY = {
    "query_agnostic": "the context compressed before the question arrives; the budget stays live while the question "
                      "and reply are fed",
    "compress_once": "the context compressed once before the question arrives; nothing evicted while the question "
                     "and reply are fed",
    "query_aware": "the question prefilled with the context, then the cache compressed",
}
PREFILLS = ("one_shot", "streaming")


@torch.no_grad()
def reference_logits(model: PreTrainedModel, item: Item) -> torch.Tensor:
    """Full-context logits at the continuation's positions ``(T_cont, V)`` (no cache, gates bypassed)."""
    ctx, cont = item.meta["context_ids"], item.meta["continuation_ids"]
    x = torch.tensor([ctx + cont], device=model.device)
    attachment = getattr(model, "retention", None)
    if attachment is None:
        return model(input_ids=x, use_cache=False, logits_to_keep=len(cont)).logits[0]
    with attachment.use_mode("teacher"):
        return model(input_ids=x, use_cache=False, logits_to_keep=len(cont)).logits[0]


def context_and_prompt(tokenizer: PreTrainedTokenizerBase, item: Item,
                       protocol: str = "query_agnostic") -> tuple[list[int], list[int]]:
    """``(head, rest)``: the tokens prefilled and compressed, and what is fed after the compression
    (fidelity: the continuation to teacher-force; otherwise the whole prompt, which ``generate``
    continues from the cache)."""
    if item.metric == "fidelity":
        return item.meta["context_ids"], item.meta["continuation_ids"]
    ctx, ids = prompt_ids(tokenizer, item)
    return (ids[:-1] if protocol == "query_aware" else ctx), ids


class SharedPrefill:
    """One one-shot prefill of an item's context, replayed into any :class:`PolicyCache` method.

    In score mode the forward does not depend on the policy: every method's cache receives the same
    keys, values and gate scores, and an attention-based policy sees the same queries. So the context
    is prefilled once into a recording cache (K/V, gate scores and each layer's queries), and
    :meth:`cache_for` builds a method's cache from copies of it (``copy_from`` calls the policy's ``observe`` with
    the recorded queries exactly as the forward would have). Methods with their own gates (other gate
    scores) and streaming prefills cannot share and prefill on their own.
    """

    def __init__(self, model: PreTrainedModel, head: list[int]) -> None:
        from retention.cache import RetentionCache

        self.model, self.recorder = model, QueryRecorder()
        attachment = model.retention
        attachment.reset()
        with attachment.use_mode("score"):
            self.cache = RetentionCache(model, budget=None, policy=self.recorder)
            prefill(model, self.cache, head, None)

    def cache_for(self, method: Method) -> RetentionCache:
        """A fresh cache of ``method`` holding the shared prefill (budget unset: see ``set_budget``)."""
        cache = method.new_cache(self.model, None, streaming=False)
        cache.copy_from(self.cache)
        return cache


def shareable(method: Method, prefill_mode: str) -> bool:
    """Whether ``method`` can start from a :class:`SharedPrefill` (one-shot, the sweep's gates)."""
    from .methods import PolicyCache

    return prefill_mode == "one_shot" and isinstance(method, PolicyCache) and method.gates is None


@torch.no_grad()
def run_item(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, item: Item, method: Method,
             budget: Budget | None, *, protocol: str = "query_agnostic", prefill_mode: str = "one_shot",
             chunk: int = 512, max_new_tokens: int = 32, reference: torch.Tensor | None = None) -> dict[str, Any]:
    """Score one item; returns the score, the reply and the KV memory kept when the question arrives."""
    return run_item_budgets(model, tokenizer, item, method, [budget], protocol=protocol, prefill_mode=prefill_mode,
                            chunk=chunk, max_new_tokens=max_new_tokens, reference=reference)[0]


@torch.no_grad()
def run_item_budgets(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, item: Item, method: Method,
                     budgets: list[Budget | None], *, protocol: str = "query_agnostic",
                     prefill_mode: str = "one_shot", chunk: int = 512, max_new_tokens: int = 32,
                     reference: torch.Tensor | None = None,
                     shared: SharedPrefill | None = None) -> list[dict[str, Any]]:
    """:func:`run_item` for several budgets. With a one-shot prefill nothing is evicted before the
    compression, so the context is prefilled once and each budget compresses its own copy of that
    cache (the same result as separate runs, one prefill instead of one per budget); a streaming
    prefill evicts as it goes, so each budget prefills on its own. ``shared``: the item's context
    prefilled once for all methods (see :class:`SharedPrefill`; only where :func:`shareable`)."""
    if protocol not in PROTOCOLS or prefill_mode not in PREFILLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS} and prefill one of {PREFILLS}")
    L, H, _ = kv_streams(model)
    streaming = prefill_mode == "streaming"
    with method.active(model):
        method.prepare(model, item)
        head, rest = context_and_prompt(tokenizer, item, protocol)

        def entries_for(budget: Budget | None) -> int | None:
            return budget.entries(len(head), L * H) if (budget is not None and method.uses_budget) else None

        def prefilled(entries: int | None):
            cache = method.new_cache(model, entries, streaming=streaming)
            prefill(model, cache, head, chunk if streaming else None)
            return cache

        base = None  # a prefilled cache, budget unset, that each budget compresses a copy of
        if shared is not None:
            if not shareable(method, prefill_mode):
                raise ValueError(f"method {method.label} cannot use a shared prefill "
                                 "(see retention.eval.protocol.shareable)")
            base = shared.cache_for(method)
        elif not streaming and len(budgets) > 1:
            base = prefilled(None)
        rows = []
        for budget in budgets:
            entries = entries_for(budget)
            row: dict[str, Any] = {"context_tokens": len(head), "budget_entries": entries}
            try:
                if base is None:
                    cache = prefilled(entries)
                else:
                    cache = snapshot_cache(base, model)
                    cache.set_budget(entries)
                method.compress(cache)
                if protocol == "compress_once":
                    method.freeze(cache)
            except ValueError as e:  # a budget below what the cache's options require: recorded, not fatal
                if type(e).__name__ != "CacheBudgetError":
                    raise
                rows.append({**row, "score": None, "error": str(e)})
                continue
            rows.append(_answer(model, tokenizer, item, method, cache, row, rest, max_new_tokens, reference))
        return rows


def _answer(model, tokenizer, item: Item, method: Method, cache, row: dict[str, Any], ids: list[int],
            max_new_tokens: int, reference: torch.Tensor | None) -> dict[str, Any]:
    """The KV memory kept, then the reply (or the fidelity continuation) scored."""
    row = {**row, **method.memory(cache, model)}
    if item.metric == "fidelity":
        x = torch.tensor([ids], device=model.device)
        logits = model(input_ids=x, **cache_kwargs(cache), use_cache=True).logits[0]
        ref = reference if reference is not None else reference_logits(model, item)
        kl, top1 = kl_and_top1(ref, logits)
        return {**row, "score": top1, "kl": kl, "reply": ""}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = model.generate(input_ids=torch.tensor([ids], device=model.device), **cache_kwargs(cache),
                         max_new_tokens=item.max_new_tokens or max_new_tokens, do_sample=False,
                         pad_token_id=pad, temperature=None, top_p=None, top_k=None)
    reply = tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
    return {**row, "score": score_reply(item.metric, reply, item.answers), "reply": reply}
