"""The protocol for dialogue items with images (MMDU, image_memory): each runs through
:class:`retention.chat.RetentionChat`.

A vision-language item's images belong to its turns, so the text protocol (:mod:`retention.eval.protocol`: token ids
in one prefill) cannot feed it. Here the history's turns go through a chat with :meth:`RetentionChat.add_turn` (each
turn's images first, then its text, at M-RoPE positions continued from the cache; the references' replies as the
assistant's), the cache is compressed to the budget (query-agnostic: the question has not arrived), and the question
is sent. Text and image entries compete for one budget; each row records how many of the kept entries are image
tokens.

* ``one_shot``: the history is fed with nothing evicted, then each budget compresses its own copy of that cache
  (one prefill for all budgets, as the text protocol does).
* ``streaming``: each budget feeds the history on its own, evicting whenever the cache passes budget + slack. The
  budget must be known before the history's length is: ``{tokens: N}`` or ``{entries: N}``, not a fraction.

Items: :class:`~retention.tasks.Item` with ``messages`` (``<image k>`` markers in their text, as
:func:`retention.eval.loaders.load_mmdu` writes them) and ``meta["images"]``, the image files in marker order.
"""

from __future__ import annotations

import copy
import warnings
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from retention.tasks.base import Item
from retention.tasks.image_items import IMAGE_TASKS, dialogue_turns, image_files, is_multimodal_item  # noqa: F401

from .budgets import Budget
from .methods import FullCache, Method, kv_streams, snapshot_cache
from .metrics import score_reply

if TYPE_CHECKING:
    from transformers import PreTrainedModel, ProcessorMixin

    from retention.cache import RetentionCache


@contextmanager
def _chat_position_warning_off():
    """Silence RetentionChat's warning about running past the model's positions (it points a chat user to /reset):
    the sweep says it per item instead, and marks the rows (``past_positions``)."""
    from retention.chat import PastPositionsWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PastPositionsWarning)
        yield


def check_images(items: list[Item]) -> None:
    """:class:`~retention.eval.loaders.DatasetUnavailableError` naming the first missing image and where it was
    looked for (before any model loads)."""
    from .loaders import DatasetUnavailableError

    for item in items:
        if not is_multimodal_item(item):
            continue
        for path in image_files(item):
            if not path.is_file():
                raise DatasetUnavailableError(
                    f"{item.id}: image {path} not found; the item's image paths are relative to "
                    f"{item.meta.get('image_root') or 'the working folder'}: unpack the set's images there, or pass "
                    "params: {image_root: FOLDER} with the folder that holds them")


def _system(item: Item) -> str | None:
    first = (item.messages or [{}])[0]
    return first.get("content") if first.get("role") == "system" else None


def kept_image_entries(cache: RetentionCache, ids: torch.Tensor, image_token_id: int) -> int:
    """How many entries the cache keeps of image tokens (``ids``: the conversation, ``(1, T)``)."""
    from retention.cache.hf import kept_where

    return kept_where(cache, ids[0] == image_token_id)


class History:
    """A dialogue's history fed through a chat under ``policy`` and a budget of ``entries`` (``None``: nothing evicted,
    a one-shot history that budgets, and methods that can share it (:func:`shares_history`), start from): ``chat``
    (its cache holds the history), the model's M-RoPE delta after it, and the item's pictures."""

    def __init__(self, model: PreTrainedModel, processor: ProcessorMixin, item: Item, policy: Any, chunk: int,
                 max_new_tokens: int, entries: int | None = None) -> None:
        from retention.images import open_rgb

        from retention.attach import unwrap
        from retention.chat import RetentionChat

        base = unwrap(model)
        self.pictures = [open_rgb(p) for p in image_files(item)]
        gates = "untrained" if getattr(base, "retention", None) is None else None  # full: any gates, none scoring
        self.chat = RetentionChat(model, processor, gates, policy=policy, chunk_size=chunk,
                                  max_new_tokens=max_new_tokens, system=_system(item))
        self.chat.cache.set_budget(entries)
        turns, _ = dialogue_turns(item)
        with _chat_position_warning_off():
            for text, reply, shown in turns:
                self.chat.add_turn(text, reply, images=[self.pictures[k - 1] for k in shown])
        self.rope_delta = base.model.rope_deltas

    def fork(self, cache: Any) -> Any:
        """A chat that goes on from the history with ``cache`` (a copy of the history's, the method's policy): the
        history chat itself stays as it was for the next budget or method."""
        from retention.attach import unwrap

        c = copy.copy(self.chat)  # shares the model; the conversation's state is copied below
        c.cache = cache
        c.messages, c._image_turns = list(self.chat.messages), list(self.chat._image_turns)
        unwrap(c.model).model.rope_deltas = self.rope_delta
        c.attachment.set_mode("score")  # as a new chat sets it: its cache needs the gates' scores, attention is ungated
        return c


def shares_history(method: Method, prefill_mode: str) -> bool:
    """Whether ``method`` can start from a :class:`History` another method fed: one-shot, scored by the sweep's gates
    (none of its own), and a policy that reads no queries (those observe each chunk as it is fed)."""
    from .methods import PolicyCache

    if prefill_mode != "one_shot":
        return False
    return isinstance(method, FullCache) or (isinstance(method, PolicyCache) and method.gates is None
                                             and not method.policy(False).needs_queries)


def shared_history(model: PreTrainedModel, processor: ProcessorMixin, item: Item, chunk: int) -> History:
    """The history that every method :func:`shares_history` starts from (score mode: gates scoring, nothing gated)."""
    with model.retention.use_mode("score"):
        return History(model, processor, item, None, chunk, 32)


@torch.no_grad()
def run_chat_item_budgets(model: PreTrainedModel, processor: ProcessorMixin, item: Item, method: Method,
                          budgets: list[Budget | None], *, prefill_mode: str = "one_shot", chunk: int = 512,
                          max_new_tokens: int = 32, history: History | None = None) -> list[dict[str, Any]]:
    """Score one multimodal dialogue item under ``method`` at each budget (see the module docstring); rows as
    :func:`retention.eval.protocol.run_item_budgets` gives them, plus ``image_tokens`` (the context's),
    ``kept_image_entries`` and, for a dialogue that ran past the model's positions, ``past_positions``.
    ``history``: the item's history fed once for every method that :func:`shares_history` (from
    :func:`shared_history`)."""
    from retention.attach import unwrap
    from retention.cache import RetentionCache

    _, asked = dialogue_turns(item)
    L, H, _ = kv_streams(model)
    image_token = unwrap(model).config.image_token_id
    streaming = prefill_mode == "streaming"
    policy = None if isinstance(method, FullCache) else method.policy(streaming)
    if history is not None and not shares_history(method, prefill_mode):
        raise ValueError(f"method {method.label} cannot start from a shared history "
                         "(see retention.eval.multimodal.shares_history)")
    new_tokens = item.max_new_tokens or max_new_tokens

    with method.active(model):
        method.prepare(model, item)
        own = None if streaming or history is not None else History(model, processor, item, policy, chunk, new_tokens)
        rows, warned = [], False
        for budget in budgets:
            if streaming and budget is not None and budget.kind == "fraction":
                raise ValueError(f"{item.id}: a streaming prefill evicts before the history's length is known; give "
                                 "the budget as {tokens: N} or {entries: N}, or use prefill: one_shot")
            if streaming:  # evicting as it is fed, under this budget
                fed = History(model, processor, item, policy, chunk, new_tokens,
                              budget.entries(0, L * H) if budget is not None and method.uses_budget else None)
                c, pictures = fed.chat, fed.pictures
            elif own is not None:
                c, pictures = own.fork(snapshot_cache(own.chat.cache, model)), own.pictures
            else:  # the shared history, scored by this method's policy
                cache = RetentionCache(model, None, policy)
                cache.copy_from(history.chat.cache)
                c, pictures = history.fork(cache), history.pictures
            context = c.ids.shape[1]
            entries = budget.entries(context, L * H) if budget is not None and method.uses_budget else None
            row: dict[str, Any] = {"context_tokens": context, "budget_entries": entries}
            try:
                c.cache.set_budget(entries)
                method.compress(c.cache)
            except ValueError as e:  # a budget below what the cache's options require: recorded, not fatal
                if type(e).__name__ != "CacheBudgetError":
                    raise
                rows.append({**row, "score": None, "error": str(e)})
                continue
            row.update(method.memory(c.cache, model), image_tokens=int((c.ids[0] == image_token).sum()),
                       kept_image_entries=kept_image_entries(c.cache, c.ids, image_token))
            with _chat_position_warning_off():
                reply = c.send(item.question, images=[pictures[k - 1] for k in asked], max_new_tokens=new_tokens)
            if c.max_positions is not None and c.ids.shape[1] > c.max_positions:
                row["past_positions"] = True
                if not warned:
                    warned = True
                    warnings.warn(f"{item.id}: the dialogue runs to {c.ids.shape[1]:,} tokens, past the model's "
                                  f"{c.max_positions:,} positions (max_position_embeddings): its rows score positions "
                                  "the model never trained on (marked past_positions)", stacklevel=2)
            rows.append({**row, "score": score_reply(item.metric, reply, item.answers), "reply": reply})
        return rows
