"""The token ids of an item's prompt: the chat template over its context (or conversation so far), the question
and the answer prefix. Evaluation prefills them; eviction-aware training builds its rows from them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import Item, render_chat

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def prompt_ids(tokenizer: PreTrainedTokenizerBase, item: Item) -> tuple[list[int], list[int]]:
    """``(context_ids, prompt_ids)``: the tokens before the question, and the whole prompt (chat
    template, generation prompt and answer prefix); the first is a prefix of the second."""
    if item.messages is not None:
        history, question = item.messages, {"role": "user", "content": item.question}
        before = render_chat(tokenizer, history)
        full = render_chat(tokenizer, history + [question], add_generation_prompt=True)
        if not full.startswith(before) and history and history[-1]["role"] == "assistant":
            # a template that renders an answered turn otherwise once a turn follows (Qwen3's think blocks): the
            # conversation as a chat feeds it, the history as rendered and then the new turn (RetentionChat's way)
            from retention.chat import shown_reply, text_after_reply

            after = text_after_reply(lambda m: render_chat(tokenizer, m, add_generation_prompt=True), history,
                                     question, item.question)
            shown = shown_reply(history[-1]["content"])
            if after is not None and shown in before:
                full = before[: before.rindex(shown) + len(shown)] + after
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
