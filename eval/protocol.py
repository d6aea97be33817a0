"""The evaluation protocol for one item under one method and budget.

* ``query_agnostic`` (default): the context is prefilled and compressed before the question arrives,
  as in a chat where the next user turn is unknown; ``query_aware``: the question is prefilled too
  (everything but the prompt's last token), then the cache is compressed.
* ``one_shot`` prefill feeds the compressed part in one forward; ``streaming`` feeds it in chunks of
  ``chunk`` tokens with the method evicting between chunks under the same budget.

Then the rest of the prompt (question, generation prompt, answer prefix) is fed and the reply is
generated greedily; fidelity items score a teacher-forced continuation against the full cache.
"""

from __future__ import annotations

from typing import Any

import torch

from .budgets import Budget
from .methods import Method, kv_streams, prefill
from .metrics import kl_and_top1, score_reply
from .tasks.base import Item, render_chat

PROTOCOLS = ("query_agnostic", "query_aware")
PREFILLS = ("one_shot", "streaming")


def prompt_ids(tokenizer, item: Item) -> tuple[list[int], list[int]]:
    """``(context_ids, prompt_ids)``: the tokens before the question, and the whole prompt (chat
    template, generation prompt and answer prefix); the first is a prefix of the second."""
    if item.messages is not None:
        history = item.messages
        before = render_chat(tokenizer, history)
        full = render_chat(tokenizer, history + [{"role": "user", "content": item.question}], add_generation_prompt=True)
    else:
        full = render_chat(tokenizer, [{"role": "user", "content": item.context + "\n\n" + item.question}],
                           add_generation_prompt=True)
        before = full[: full.rindex(item.question)]
    if not full.startswith(before):
        raise ValueError(f"{item.id}: the chat template does not keep earlier turns as a prefix")
    full += item.answer_prefix
    ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    ctx = tokenizer(before, add_special_tokens=False)["input_ids"]
    n = 0  # longest shared prefix: tokenisation may merge across the seam
    while n < min(len(ids), len(ctx)) and ids[n] == ctx[n]:
        n += 1
    return ids[:n], ids


@torch.no_grad()
def reference_logits(model, item: Item) -> torch.Tensor:
    """Full-context logits at the continuation's positions ``(T_cont, V)`` (no cache, gates bypassed)."""
    ctx, cont = item.meta["context_ids"], item.meta["continuation_ids"]
    x = torch.tensor([ctx + cont], device=model.device)
    attachment = getattr(model, "retention", None)
    if attachment is None:
        return model(input_ids=x, use_cache=False, logits_to_keep=len(cont)).logits[0]
    with attachment.use_mode("teacher"):
        return model(input_ids=x, use_cache=False, logits_to_keep=len(cont)).logits[0]


@torch.no_grad()
def run_item(model, tokenizer, item: Item, method: Method, budget: Budget | None, *,
             protocol: str = "query_agnostic", prefill_mode: str = "one_shot", chunk: int = 512,
             max_new_tokens: int = 32, reference: torch.Tensor | None = None) -> dict[str, Any]:
    """Score one item; returns the score, the reply and the KV memory kept when the question arrives."""
    if protocol not in PROTOCOLS or prefill_mode not in PREFILLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS} and prefill one of {PREFILLS}")
    L, H, _ = kv_streams(model)
    chunk_size = chunk if prefill_mode == "streaming" else None
    with method.active(model):
        if item.metric == "fidelity":
            ctx, cont = item.meta["context_ids"], item.meta["continuation_ids"]
            head = ctx
        else:
            ctx, ids = prompt_ids(tokenizer, item)
            head = ids[:-1] if protocol == "query_aware" else ctx
        entries = budget.entries(len(head), L * H) if (budget is not None and method.uses_budget) else None
        cache = method.new_cache(model, entries, streaming=prefill_mode == "streaming")
        prefill(model, cache, head, chunk_size)
        method.compress(cache)
        mem = method.memory(cache, model)
        row: dict[str, Any] = {"context_tokens": len(head), "budget_entries": entries, **mem}
        if item.metric == "fidelity":
            x = torch.tensor([cont], device=model.device)
            logits = model(input_ids=x, past_key_values=cache, use_cache=True).logits[0]
            ref = reference if reference is not None else reference_logits(model, item)
            kl, top1 = kl_and_top1(ref, logits)
            return {**row, "score": top1, "kl": kl, "reply": ""}
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        out = model.generate(input_ids=torch.tensor([ids], device=model.device), past_key_values=cache,
                             max_new_tokens=item.max_new_tokens or max_new_tokens, do_sample=False,
                             pad_token_id=pad, temperature=None, top_p=None, top_k=None)
        reply = tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
        return {**row, "score": score_reply(item.metric, reply, item.answers), "reply": reply}
