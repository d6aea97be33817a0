"""A turn rendered by the chat template and tokenized: only the part the cache does not hold yet (the closer of the
last reply, the new turn and the generation prompt), found by rendering markers in place of texts."""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..attach import unwrap
from .errors import ChatInputError, ChatSetupError

def shown_reply(reply: str) -> str:
    """A reply's text as chat templates show it in later turns: without a reasoning part (``...</think>``)."""
    return reply.split("</think>")[-1].strip()


def text_after_reply(render: Callable[[list[dict[str, Any]]], str], messages: list[dict[str, Any]],
                     message: dict[str, Any], text: str | None = None) -> str | None:
    """What a chat template renders after the last reply of ``messages`` once ``message`` follows, generation prompt
    included: the reply's closer, the new turn and the prompt. ``render(messages)`` renders with the generation
    prompt. ``None`` when the template does not show the reply before the new turn. ``text``: the text of a
    ``message`` whose content is a string (default: that string); a content list's text parts are its own.

    Markers stand in for the new turn's texts and for the reply (whose shown text may differ from the generated one: a
    reasoning part left out; or be empty), so the closer is found wherever the template puts them."""
    content = message["content"]
    if isinstance(content, str):
        texts, marked = [content if text is None else text], _marker(0)
    else:
        texts, marked = [], []
        for c in content:
            if c.get("type") == "text":
                marked.append({**c, "text": _marker(len(texts))})
                texts.append(c.get("text", ""))
            else:
                marked.append(c)
        if not texts:  # images only: an empty text part first, which templates render as nothing, marks the turn
            marked, texts = [{"type": "text", "text": _marker(0)}, *marked], [""]
    rendered = render(_reply_as_marker(messages) + [{**message, "content": marked}])
    found = [at for at in (rendered.find(_marker(k)) for k in range(len(texts))) if at >= 0]
    at = min(found) if found else -1
    start = rendered.rfind(_REPLY, 0, at) if at >= 0 else -1
    if start < 0:
        return None
    after = rendered[start + len(_REPLY) :]
    for k, t in enumerate(texts):
        after = after.replace(_marker(k), t)
    return after


def _marker(k: int) -> str:
    """Stands in for a new turn's ``k``-th text, to find where the turn begins."""
    return f"\x1eretention-turn-{k}\x1e"


_REPLY = "\x1eretention-reply\x1e"  # stands in for the last reply, to find where the template ends it


def _ids(value: Any) -> list[int]:
    """Token ids given as transformers takes them (``eos_token_id``): one id, a list or a tensor of them, or None."""
    if value is None:
        return []
    if torch.is_tensor(value):
        return [int(v) for v in value.flatten().tolist()]
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _reply_as_marker(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with the last one's text content replaced by :data:`_REPLY`."""
    last = messages[-1]
    return [*messages[:-1], {**last, "content": _REPLY}] if isinstance(last["content"], str) else messages


class TemplateMixin:
    """Turn encoding of :class:`~retention.chat.RetentionChat` (its ``processor``, ``messages`` and ``ids``)."""

    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        return self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                  **self.chat_template_kwargs)

    def _encode_turn(self, parts: list[dict[str, Any]], images: list[Any]) -> dict[str, Any]:
        """A user turn tokenized as the cache needs it: ``parts`` the message content in order (``{"type": "text"}``
        and ``{"type": "image"}`` parts, :func:`~retention.chat.multimodal._turn_parts`), ``images`` the images of
        its image parts in their order. Returns the processor's outputs (``input_ids`` ``(1, T)``, with images
        ``pixel_values`` and ``image_grid_thw`` ``(n_images, 3)``), the ``message`` and the ``images``."""
        if images and not self.multimodal:
            raise ChatInputError(
                f"{len(images)} image(s) given but {type(unwrap(self.model)).__name__} is a text-only model: "
                "send text only, or load a vision-language model (e.g. Qwen3-VL)"
            )
        texts = [p["text"] for p in parts if p["type"] == "text"]
        # a text-only model's template takes a string: its parts' texts, as read_history joins a log's
        content: Any = parts if self.multimodal else " ".join(texts)
        message = {"role": "user", "content": content}
        new_full = self._render(self.messages + [message], generation_prompt=True)
        if len(self.ids[0]) == 0:
            delta = new_full
        else:
            history = self._render(self.messages, generation_prompt=False)
            if new_full.startswith(history):  # ChatML, Llama, Qwen3-VL: each turn renders after the last
                delta = self._closer() + new_full[len(history) :]
            else:  # the template renders the last reply otherwise once a turn follows (Qwen3's think blocks)
                delta = self._after_reply(message)
        if self.multimodal:  # the processor fills the template's image placeholders with the images in order
            enc = self.processor(text=[delta], images=images or None, return_tensors="pt")
        else:
            enc = self.tokenizer(delta, add_special_tokens=False, return_tensors="pt")
        # a turn longer than the budget is fine: it is prefilled in chunks and competes for the budget like every
        # earlier entry (a pasted document, then questions about it, is what the cache is for)
        return {**{k: v.to(self.device) if torch.is_tensor(v) else v for k, v in enc.items()}, "message": message,
                "images": images}

    def _after_reply(self, message: dict[str, Any]) -> str:
        """What follows the last reply when ``message`` is added, for templates that render a reply differently once
        a turn follows it (Qwen3 drops the empty ``<think>`` block of an answered turn). The cache keeps the reply as
        it was generated; only the turn's own text (the reply's closer, the message, the generation prompt) is fed."""
        after = text_after_reply(lambda m: self._render(m, generation_prompt=True), self.messages, message)
        if after is None:
            raise ChatSetupError("the chat template renders earlier turns without the reply generated, so turns "
                                 "cannot be fed incrementally; give RetentionChat a processor whose chat template "
                                 "appends turns")
        if self._last_reply_ended:  # the stop token was generated; generate feeds it with this turn
            stop = self.tokenizer.decode(self.ids[0, -1:], skip_special_tokens=False)
            after = after[len(stop) :] if after.startswith(stop) else after
        return after

    def _after_last_reply(self, messages: list[dict[str, Any]]) -> str:
        """What the template writes after the content of the last message (a reply), an empty one included: found by
        rendering a marker in its place."""
        text = self._render(_reply_as_marker(messages), generation_prompt=False)
        at = text.rfind(_REPLY)
        return text[at + len(_REPLY):] if at >= 0 else ""

    def _closer(self) -> str:
        """What the template puts after the last reply that the cache does not hold yet."""
        closer = self._after_last_reply(self.messages)
        if self._last_reply_ended:  # the stop token was generated; generate feeds it with the next turn
            stop = self.tokenizer.decode(self.ids[0, -1:], skip_special_tokens=False)
            # a stop id the template does not close with (eos_token_id=[..., "!"]) ended the reply's text: the
            # template's closer still follows it, as _after_reply feeds it
            closer = closer[len(stop) :] if closer.startswith(stop) else closer
        return closer

    def _stop_after(self, message: dict[str, Any], reply: str) -> list[int]:
        """The stop token a generated ``reply`` would have ended on: the model's eos id that the template writes right
        after the reply (``<|im_end|>``, ``<|eot_id|>``); none when the template closes a reply otherwise, and the next
        turn then feeds that closer as text."""
        closer = self._after_last_reply(self.messages + [message, {"role": "assistant", "content": reply}])
        for e in [*_ids(self.model.generation_config.eos_token_id), *_ids(self.tokenizer.eos_token_id)]:
            if closer.startswith(self.tokenizer.decode([e], skip_special_tokens=False)):
                return [e]
        return []
