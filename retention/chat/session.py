"""``RetentionChat``: one conversation over one bounded :class:`~retention.cache.RetentionCache`.

This module holds the session: setup (model, gates, cache, options), its state, feeding tokens through the cache,
and a turn (:meth:`~RetentionChat.add_turn`, :meth:`~RetentionChat.send`, :meth:`~RetentionChat.stream`). The chat
template's part is :mod:`retention.chat.template`, images :mod:`retention.chat.multimodal`, graph decoding
:mod:`retention.chat.graphs`, save and resume :mod:`retention.chat.transcript`, argument checks
:mod:`retention.chat.options`.
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from ..attach import attach_gates, check_gates_match, text_config_of, unwrap
from ..compat import cache_kwargs
from ..gates import UNTRAINED_SEED, RetentionGates
from ..models import is_multimodal, text_mrope_positions
from ..policies.base import EvictionPolicy
from ..templates import template_variables_problem
from .errors import ChatInputError, ChatSetupError, PastPositionsWarning
from .graphs import GraphDecodingMixin
from .multimodal import MultimodalMixin, _turn_parts
from .options import (_ASSISTED, _check_counts, _check_generation_options, _check_generation_values,
                      _check_one_reply, _check_text)
from .template import TemplateMixin, _ids
from .transcript import TranscriptMixin


def _load_gates(gates: RetentionGates | str | Path | None, model: nn.Module) -> RetentionGates | None:
    """Built gates as given; ``None``: the gates shipped for an embedded model (if any, and no gates
    are attached yet); ``"untrained"``: none; else a checkpoint folder or Hub repo id."""
    if isinstance(gates, RetentionGates) or gates == "untrained":
        return None if gates == "untrained" else gates
    if gates is None:
        from ..models import shipped_gates

        if getattr(unwrap(model), "retention", None) is not None:
            return None  # keep what is attached
        gates = shipped_gates(model)
        if gates is None:
            return None
    from ..hub import load_gates

    return load_gates(gates)  # checked against the model by the caller, with the fix in the message


class RetentionChat(TranscriptMixin, TemplateMixin, MultimodalMixin, GraphDecodingMixin):
    """A chat session over one bounded KV cache.

    ``budget_tokens``: KV kept per sequence, in tokens per (layer, KV head) on average (the cache
    budget is ``budget_tokens * L * H_kv`` entries, shared globally); ``None`` keeps everything.
    ``gates``: trained gates, a checkpoint folder or Hub repo id, ``"untrained"``, or ``None``: the gates
    already attached, else those shipped for an embedded model (``checkpoints/``), else untrained gates
    (with a warning). ``chunk_size``: prefill chunk in tokens. ``policy``: as :class:`RetentionCache` takes it.
    ``chat_template_kwargs``: passed to every rendering of the chat template, e.g. ``{"enable_thinking": False}``
    for Qwen3's replies without a reasoning block. Other keyword arguments are ``generate``'s, for every reply.
    """

    def __init__(
        self,
        model: nn.Module,
        processor: Any,
        gates: RetentionGates | str | Path | None = None,
        *,
        budget_tokens: int | None = None,
        policy: EvictionPolicy | str | None = None,
        chunk_size: int = 256,
        max_new_tokens: int = 256,
        system: str | None = None,
        protected_window: int = 0,
        page_size: int = 16,
        cuda_graphs: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        **generation_kwargs: Any,
    ) -> None:
        from ..cache import RetentionCache

        _check_counts(budget_tokens=(budget_tokens, 1, "tokens per (layer, KV head); None keeps every entry"),
                      chunk_size=(chunk_size, 1, "prefill chunk in tokens"),
                      max_new_tokens=(max_new_tokens, 1, "the longest reply in tokens"),
                      protected_window=(protected_window, 0, "newest tokens never evicted"),
                      page_size=(page_size, 1, "entries per KV page"))
        # NumPy or one-element tensor counts (as RetentionCache takes them) become plain ints from here on
        budget_tokens = None if budget_tokens is None else int(budget_tokens)
        chunk_size, max_new_tokens, page_size = int(chunk_size), int(max_new_tokens), int(page_size)
        protected_window = int(protected_window)
        if system is not None:
            _check_text("system", system, ChatSetupError)
        _check_generation_options(model, generation_kwargs, ChatSetupError)
        _check_generation_values(generation_kwargs, ChatSetupError)
        _check_one_reply(generation_kwargs, ChatSetupError)  # at setup, not at every send() after it
        self.model, self.processor = model, processor
        self.max_positions: int | None = getattr(text_config_of(model), "max_position_embeddings", None)
        # inputs go where the embeddings are (the first GPU of a model spread with device_map="auto")
        self.device = unwrap(model).get_input_embeddings().weight.device
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.multimodal = is_multimodal(unwrap(model).config)
        if problem := template_variables_problem({} if chat_template_kwargs is None else chat_template_kwargs):
            raise ChatSetupError(f"chat_template_kwargs {problem}")
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        # the policy and cuda_graphs are checked before the gates attach (or replace the attached ones): a failed
        # chat left them on the model, where the next chat's gates=None kept them
        if isinstance(policy, str):  # as RetentionCache resolves a name
            from ..policies.registry import get_policy

            try:
                policy = get_policy(policy)
            except ValueError as e:
                raise ChatSetupError(str(e)) from None
        if cuda_graphs:
            why = ("the model is on the CPU; load it on a CUDA GPU" if self.device.type != "cuda" else
                   f"{type(policy).__name__} reads the queries as they come"
                   if isinstance(policy, EvictionPolicy) and policy.needs_queries else None)
            if why:
                raise ChatSetupError(f"cuda_graphs (--cuda-graphs): {why}; leave it out to decode with generate")
        asked_untrained = isinstance(gates, str) and gates == "untrained"
        gates = _load_gates(gates, model)
        attachment = getattr(unwrap(model), "retention", None)
        if gates is not None:
            try:
                check_gates_match(model, gates.config)
            except ValueError as e:
                raise ChatSetupError(f"{e}. Pass --gates for {text_config_of(model)._name_or_path or 'this model'} "
                                     "or omit it") from None
            if attachment is not None and attachment.gates is not gates:
                attachment.detach()
                attachment = None
        elif asked_untrained and attachment is not None:  # "untrained" means untrained, whatever is attached
            attachment.detach()
            attachment = None
        if attachment is None:
            if gates is None and not asked_untrained:
                warnings.warn(
                    "no gates given: using untrained retention gates (beta ~ 1 everywhere, so eviction is "
                    "nearly by recency only); pass trained gates for learned eviction",
                    stacklevel=2,
                )
            attachment = attach_gates(model, gates, seed=None if gates is not None else UNTRAINED_SEED)
        attachment.set_mode("score")
        self.attachment = attachment
        self.budget_tokens = budget_tokens
        budget = None if budget_tokens is None else RetentionCache.budget_for(model, budget_tokens)
        self.cache = RetentionCache(model, budget, policy, page_size=page_size, protected_window=protected_window)
        if budget is not None and not self.cache.policy.evicts:
            warnings.warn(f"policy {self.cache.policy.name!r} keeps every entry: budget_tokens={budget_tokens} is not "
                          "enforced (leave the budget out, or pick a policy that evicts)", stacklevel=2)
        self.chunk_size, self.max_new_tokens, self.system = chunk_size, max_new_tokens, system
        self.generation_kwargs = {"do_sample": False, **generation_kwargs}
        # replies decode through GraphDecoder (each step a replayed CUDA graph); _graph_replay=False runs the
        # same planned steps eagerly, which is how the CPU tests check the path
        self.cuda_graphs, self._graph_replay, self._decoder = cuda_graphs, True, None
        self._streaming = False  # a stream() is between its first and last piece: no other turn may start
        self._clear()

    def reset(self) -> None:
        """Start a new conversation (the cache's pages go back to its pool)."""
        self._refuse_while_streaming("reset()")
        self._clear()

    def _refuse_while_streaming(self, what: str) -> None:
        """:class:`ChatInputError` while an earlier :meth:`stream` is still open: its generation runs on this chat's
        cache and its reply is committed when it ends, so nothing else may change the conversation meanwhile."""
        if self._streaming:
            raise ChatInputError(f"{what}: an earlier stream() is still open (its reply is being generated into this "
                                 "chat's cache); read it to the end or close() it first (the reply so far is kept)")

    def _clear(self) -> None:
        self.cache.reset()
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": self.system}] if self.system else []
        self.ids = torch.empty(1, 0, dtype=torch.long, device=self.device)
        self._last_reply_ended = False
        self._warned_positions = False
        self._image_turns: list[dict[str, Any]] = []  # {"start", "length", "images"} of each turn with images
        # M-RoPE: this conversation's text positions past its images. The model keeps one rope_deltas, so each chat
        # keeps its own and puts it back before it runs the model (two chats may share one model)
        self._rope_deltas: torch.Tensor | None = None
        if self.multimodal:
            unwrap(self.model).model.rope_deltas = None

    def memory(self) -> dict[str, Any]:
        """The cache's memory report (see :meth:`RetentionCache.memory_report`); a vision-language chat adds
        ``image_tokens`` (seen so far), ``kept_image_entries`` (entries of image tokens kept, all layers and heads) and
        ``kept_text_entries`` (the other kept entries), so ``kept_entries`` splits as text + image."""
        if stale := self._stale_tokens():
            warnings.warn(f"the report counts the entries of {stale:+,} tokens the conversation does not hold "
                          "(the last turn failed midway); the next turn feeds the conversation again without them",
                          stacklevel=2)
        report = self.cache.memory_report()
        if self.multimodal and self.ids.shape[1]:
            from ..cache.hf import kept_where

            image = self.ids[0] == unwrap(self.model).config.image_token_id
            kept_image = kept_where(self.cache, image)
            report.update(image_tokens=int(image.sum()), kept_image_entries=kept_image,
                          kept_text_entries=report["kept_entries"] - kept_image)
        return report

    def _refeed(self, ids: torch.Tensor, turns: list[dict[str, Any]]) -> None:
        """Feed a conversation's ``ids`` ``(1, T)`` and its image ``turns`` through the (empty) cache in chunks, turns
        with images as they were fed live, and make them this chat's (the last token goes with the next turn)."""
        self._mark_images(ids)
        for t in turns:
            start, length = t["start"], t["length"]
            self._feed(ids, max(start - 1, 0))  # as live: the last reply's last token goes with the turn
            self.ids = ids[:, :start]
            vision = self.processor.image_processor(images=t["images"], return_tensors="pt")
            turn = {"input_ids": ids[:, start : start + length],
                    **{k: v.to(self.device) for k, v in vision.items() if k in ("pixel_values", "image_grid_thw")}}
            self._prefill_multimodal(turn)
        self._feed(ids, ids.shape[1] - 1)  # the last token is fed with the next turn, as after send()
        self.ids = ids
        self._image_turns = turns
        self._keep_positions()

    def _stale_tokens(self) -> int:
        """Tokens the cache holds beyond the conversation (0 unless the last turn failed midway)."""
        return self.cache.get_seq_length() - max(self.ids.shape[1] - 1, 0)  # the last token is fed with the next turn

    def _repair(self) -> None:
        """Before a turn: when the last one failed midway (an exception in its prefill or generation, e.g. out of GPU
        memory), the cache holds entries of a turn the conversation does not; feed the conversation again through an
        emptied cache, with a warning, instead of going on from a cache that no longer matches it."""
        if not (stale := self._stale_tokens()):
            return
        warnings.warn(f"the cache holds {stale:+,} tokens the "
                      "conversation does not (the last turn failed midway): feeding the conversation's "
                      f"{self.ids.shape[1]:,} tokens again", stacklevel=3)
        ids, turns, messages, ended, warned = (self.ids, self._image_turns, self.messages, self._last_reply_ended,
                                               self._warned_positions)
        self._clear()
        self._decoder = None
        try:
            self._refeed(ids, turns)
        finally:  # the conversation stays whole even if this feed fails too: the next turn repairs again
            self.ids, self._image_turns = ids, turns
            self.messages, self._last_reply_ended, self._warned_positions = messages, ended, warned

    def _feed(self, ids: torch.Tensor, upto: int) -> None:
        """Feed ``ids[:, cache length : upto]`` through the model into the cache, in chunks (text tokens only)."""
        base = unwrap(self.model)
        with torch.no_grad():
            while (past := self.cache.get_seq_length()) < upto:
                n = min(self.chunk_size, upto - past)
                extra: dict[str, Any] = {}
                if self.multimodal:  # M-RoPE: text positions continue the images' (rope_deltas), on all three axes
                    delta = self._rope_delta()
                    extra["position_ids"] = text_mrope_positions(torch.arange(past, past + n, device=ids.device)[None],
                                                                 delta)
                    base.model.rope_deltas = torch.tensor([[delta]], device=ids.device)
                self.model(
                    input_ids=ids[:, past : past + n],
                    attention_mask=torch.ones(1, past + n, dtype=torch.long, device=ids.device),
                    **cache_kwargs(self.cache),
                    use_cache=True,
                    logits_to_keep=1,
                    **extra,
                )

    # -- one turn ----------------------------------------------------------------------------------
    def add_turn(self, text: str | Sequence[Any] | dict[str, Any], reply: str,
                 images: Sequence[Any] | None = None) -> None:
        """Add a user turn (with images for vision-language models) and a reply given, not generated: a known
        history (a benchmark's earlier turns, another chat's log) fed through this chat's cache as if the model
        had said ``reply`` and then stopped. Its tokens compete for the budget like any others. ``text`` is what
        :meth:`send` takes: a string (``images`` before it) or a list of content parts in order."""
        self._refuse_while_streaming("add_turn()")
        parts, images = _turn_parts(text, images, read=self.multimodal)
        _check_text("the reply", reply)
        turn = self._encode_turn(parts, images)  # validates; nothing is changed before this returns
        full = torch.cat([self.ids, turn["input_ids"]], dim=1)
        said = self.tokenizer(reply, add_special_tokens=False, return_tensors="pt")["input_ids"].to(self.device)
        stop = torch.tensor([self._stop_after(turn["message"], reply)], dtype=torch.long, device=self.device)
        out = torch.cat([full, said, stop.view(1, -1)], dim=1)
        self._warn_past_positions(out.shape[1])
        self._repair()
        self._mark_images(out)
        self._own_positions()
        if "pixel_values" in turn:
            self._prefill_multimodal(turn)
        self._feed(out, out.shape[1] - 1)  # the stop token goes with the next turn, as after send()
        self._commit(full, out, turn, {})
        self._last_reply_ended = bool(stop.numel())  # the tokenizer's eos may close turns where generate's names none

    def send(self, text: str | Sequence[Any] | dict[str, Any], images: Sequence[Any] | None = None,
             **generation_kwargs: Any) -> str:
        """Add a user turn (with images for vision-language models), generate and return the reply.

        ``text``: the message, with its ``images`` (PIL images, paths, http(s) URLs, data URIs or base64 data) going
        before it; or its content parts in order as Qwen3-VL's chat template takes them, each image's tokens where its
        part stands: ``[{"type": "text", "text": "Compare"}, {"type": "image", "image": photo}, {"type": "text",
        "text": "with"}, {"type": "image", "url": "https://..."}]`` (an image part gives its source under ``image``,
        ``url``, ``path`` or ``base64``; ``images`` is then left out); or a whole ``{"role": "user", "content": ...}``
        message. Video parts are refused: give a video's frames as images."""
        return "".join(self.stream(text, images, **generation_kwargs))

    def stream(self, text: str | Sequence[Any] | dict[str, Any], images: Sequence[Any] | None = None,
               **generation_kwargs: Any) -> Iterator[str]:
        """Like :meth:`send`, yielding the reply as it is generated.

        Stopping early (``break``, ``close()``, or Ctrl-C while it waits for the next piece) stops generation at the
        next token and keeps the reply so far as the assistant's turn, as if ``max_new_tokens`` had ended it there:
        the cache and the history stay in step and the chat goes on."""
        from transformers import StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer

        from ..cache.hf import is_count

        self._refuse_while_streaming("a new turn")
        parts, images = _turn_parts(text, images, read=self.multimodal)
        _check_generation_options(self.model, generation_kwargs, ChatInputError)
        kwargs = {**self.generation_kwargs, **generation_kwargs}
        _check_generation_values(kwargs, ChatInputError)
        assisted = sorted(k for k in _ASSISTED if kwargs.get(k) is not None)
        if assisted and self.cache.get_seq_length() > 0:
            # transformers' assisted decoding feeds the whole prompt on its first forward, whatever the cache
            # holds: the earlier turns would be stored twice
            raise ChatInputError(
                f"{', '.join(assisted)}: assisted decoding works on the first turn only, since transformers "
                "re-feeds every earlier turn to a filled cache; pass it to the first send() or drop it"
            )
        _check_one_reply(kwargs, ChatInputError)
        kwargs.setdefault("max_new_tokens", self.max_new_tokens)
        if not is_count(kwargs["max_new_tokens"]) or kwargs["max_new_tokens"] < 1:
            raise ChatInputError(f"max_new_tokens must be an integer >= 1, got {kwargs['max_new_tokens']!r}")
        kwargs["max_new_tokens"] = int(kwargs["max_new_tokens"])
        turn = self._encode_turn(parts, images)  # validates; nothing is changed before this returns
        self._streaming = True  # until this turn is committed (or fails): see _refuse_while_streaming
        try:
            self._repair()
            full = torch.cat([self.ids, turn["input_ids"]], dim=1)
            self._mark_images(full)
            self._own_positions()
            if "pixel_values" in turn:
                self._prefill_multimodal(turn)
            streamer = TextIteratorStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True)
            self._warn_past_positions(full.shape[1] + kwargs["max_new_tokens"])
            uncached = full.shape[1] - self.cache.get_seq_length()
            if uncached > self.chunk_size:
                kwargs["prefill_chunk_size"] = self.chunk_size
            result: dict[str, Any] = {}
            stop = threading.Event()

            class _StopWhenAsked(StoppingCriteria):
                def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kw: Any) -> torch.Tensor:
                    return torch.full((input_ids.shape[0],), stop.is_set(), dtype=torch.bool,
                                      device=input_ids.device)

            kwargs["stopping_criteria"] = StoppingCriteriaList([*(kwargs.get("stopping_criteria") or []),
                                                                 _StopWhenAsked()])

            graphs = self.cuda_graphs and self._graphs_decode(kwargs)
            # generate finds stop strings with the tokenizer, which it refused to go without: the chat has it
            stops = kwargs.get("stop_strings", getattr(self.model.generation_config, "stop_strings", None))
            tokenizer = {"tokenizer": self.tokenizer} if stops and "tokenizer" not in kwargs else {}

            def run() -> None:
                try:
                    with torch.no_grad():
                        if graphs:
                            result["out"] = self._graph_generate(full, kwargs, streamer)
                            return
                        out = self.model.generate(
                            input_ids=full,
                            attention_mask=torch.ones_like(full),
                            **cache_kwargs(self.cache),
                            streamer=streamer,
                            **{"pad_token_id": self.tokenizer.pad_token_id or self.tokenizer.eos_token_id,
                               **kwargs},  # a pad_token_id given wins (a batch of one is never padded anyway)
                            **tokenizer,
                        )
                        # the ids, also when the model's generation config asks for an output object
                        result["out"] = out if torch.is_tensor(out) else out.sequences
                except BaseException as e:  # re-raised in the caller's thread
                    result["error"] = e
                    streamer.end()

            thread = threading.Thread(target=run, daemon=True)
            thread.start()
            try:
                yield from streamer
            except BaseException:  # the caller stopped early: generation must end before the cache is touched again
                stop.set()
                thread.join()
                if "out" in result:
                    self._commit(full, result["out"], turn, kwargs)
                raise
            thread.join()
            if "error" in result:
                raise result["error"]
            self._commit(full, result["out"], turn, kwargs)
        finally:
            self._streaming = False

    def _warn_past_positions(self, tokens: int) -> None:
        """Warn once per conversation when it may run past the model's positions: the cache stays within its
        budget however long the chat, but RoPE past the trained range degrades every reply."""
        if self.max_positions is None or tokens <= self.max_positions or self._warned_positions:
            return
        self._warned_positions = True
        warnings.warn(
            f"this conversation may reach {tokens:,} tokens, past the model's {self.max_positions:,} positions "
            "(max_position_embeddings): the cache stays within its budget, but the model reads positions it was "
            "never trained on and its replies degrade; reset() (/reset in retention chat) starts a new conversation",
            PastPositionsWarning, stacklevel=3,
        )

    def _commit(self, full: torch.Tensor, out: torch.Tensor, turn: dict[str, Any], kwargs: dict[str, Any]) -> None:
        """Record a finished (or stopped) turn: ``out`` is the prompt ``full`` plus the reply generated."""
        message = turn["message"]
        if "pixel_values" in turn:  # what save() needs to feed the turn's images again
            length = int(turn["input_ids"].shape[1])
            self._image_turns.append({"start": full.shape[1] - length, "length": length, "images": turn["images"]})
        reply_ids = out[0, full.shape[1] :]
        eos = {*_ids(self.model.generation_config.eos_token_id), *_ids(kwargs.get("eos_token_id"))}
        self._last_reply_ended = bool(len(reply_ids)) and int(reply_ids[-1]) in eos
        reply = self.tokenizer.decode(reply_ids, skip_special_tokens=True)
        self.ids = out
        self.messages += [message, {"role": "assistant", "content": reply}]
        self._keep_positions()
