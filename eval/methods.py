"""Run one item under one method (policy x budget) over the retention cache.

Query-agnostic protocol (default): the context is prefilled and compressed before the question
arrives, as in a chat; query-aware: the question is prefilled too before compressing. One-shot
prefill feeds the context in one forward; streaming feeds it in chunks, with the policy evicting
between chunks under the same budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from retention.cache import RetentionCache
from retention.policies import get_policy

from .metrics import answer_recall, kl_and_top1
from .tasks import Item


@dataclass
class Method:
    name: str  # a policy name (``full`` keeps everything)
    params: dict[str, Any]
    label: str

    def policy(self, prefill: str):
        params = dict(self.params)
        if prefill == "streaming" and "mode" not in params and self.name != "full":
            params["mode"] = "streaming"
        return get_policy(self.name, **params)


def _split_prompt(tokenizer, item: Item) -> tuple[list[int], list[int]]:
    """Token ids of everything before the question, and of the whole prompt."""
    if item.messages is not None:
        full = tokenizer.apply_chat_template(item.messages + [{"role": "user", "content": item.question}],
                                             tokenize=False, add_generation_prompt=True)
        before = tokenizer.apply_chat_template(item.messages, tokenize=False)
    else:
        full = tokenizer.apply_chat_template([{"role": "user", "content": item.context + "\n\n" + item.question}],
                                             tokenize=False, add_generation_prompt=True)
        before = full[: full.rindex(item.question)]
    ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    ctx = tokenizer(before, add_special_tokens=False)["input_ids"]
    n = 0  # the longest shared prefix (tokenisation may differ at the seam)
    while n < min(len(ids), len(ctx)) and ids[n] == ctx[n]:
        n += 1
    return ids[:n], ids


def _prefill(model, cache, ids: list[int], chunk: int | None) -> None:
    x = torch.tensor([ids], device=model.device)
    step = chunk or x.shape[1]
    for s in range(0, x.shape[1], step):
        model(input_ids=x[:, s : s + step], past_key_values=cache, use_cache=True)


def budget_entries(budget: float | None, context_tokens: int, streams: int) -> int | None:
    """``< 1``: a fraction of the context; ``>= 1``: tokens per (layer, KV head). Entries for the model."""
    if budget is None:
        return None
    tokens = budget * context_tokens if budget < 1 else budget
    return max(1, int(round(tokens))) * streams


@torch.no_grad()
def run_item(model, tokenizer, item: Item, method: Method, budget: float | None, *, protocol: str = "query_agnostic",
             prefill: str = "one_shot", chunk: int = 512, max_new_tokens: int = 32) -> dict[str, Any]:
    """Score one item; returns the score, the reply and the KV memory kept."""
    cfg = model.config.get_text_config()
    streams = cfg.num_hidden_layers * cfg.num_key_value_heads
    model.retention.reset()
    if item.task == "fidelity":
        return _fidelity(model, tokenizer, item, method, budget, streams, prefill, chunk)
    ctx, ids = _split_prompt(tokenizer, item)
    entries = None if method.name == "full" else budget_entries(budget, len(ctx), streams)
    cache = RetentionCache(model, budget=entries, policy=method.policy(prefill))
    head = ids[:-1] if protocol == "query_aware" else ctx
    _prefill(model, cache, head, chunk if prefill == "streaming" else None)
    cache.compress()
    report = cache.memory_report()  # what the question is answered from
    out = model.generate(input_ids=torch.tensor([ids], device=model.device), attention_mask=None,
                         past_key_values=cache, max_new_tokens=max_new_tokens, do_sample=False)
    reply = tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
    return {"score": answer_recall(reply, item.answers), "reply": reply, "context_tokens": len(ctx),
            "budget_entries": entries, "kept_entries": report["kept_entries"], "kv_bytes": report["kv_bytes"],
            "full_cache_bytes": report["full_cache_bytes"]}


def _fidelity(model, tokenizer, item, method, budget, streams, prefill, chunk):
    ctx = tokenizer(item.context, add_special_tokens=False)["input_ids"]
    cont = tokenizer(item.continuation, add_special_tokens=False)["input_ids"]
    x = torch.tensor([ctx + cont], device=model.device)
    reference = model(input_ids=x, use_cache=False).logits[0, len(ctx) : len(ctx) + len(cont)]
    entries = None if method.name == "full" else budget_entries(budget, len(ctx), streams)
    cache = RetentionCache(model, budget=entries, policy=method.policy(prefill))
    _prefill(model, cache, ctx, chunk if prefill == "streaming" else None)
    cache.compress()
    report = cache.memory_report()
    logits = model(input_ids=torch.tensor([cont], device=model.device), past_key_values=cache, use_cache=True).logits[0]
    kl, top1 = kl_and_top1(reference, logits)
    return {"score": top1, "kl": kl, "reply": "", "context_tokens": len(ctx), "budget_entries": entries,
            "kept_entries": report["kept_entries"], "kv_bytes": report["kv_bytes"], "full_cache_bytes": report["full_cache_bytes"]}
