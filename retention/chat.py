"""Long multimodal dialogue with one retention cache across turns.

``RetentionChat`` keeps the model, its tokenizer or processor, the gates and a single
:class:`~retention.cache.RetentionCache` for the whole conversation. Each :meth:`~RetentionChat.send`
feeds only the new part of the conversation (the chat template's closing of the last reply and the
new user turn); the cache evicts down to its budget during prefill (chunked) and decoding, so memory
stays bounded however long the dialogue gets. The ``retention chat`` command is :mod:`retention.chat_cli`.
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from .attach import attach_gates, check_gates_match, model_stem, text_config_of, unwrap
from .compat import cache_kwargs
from .gates import UNTRAINED_SEED, RetentionGates
from .models import is_multimodal, text_mrope_positions
from .policies.base import EvictionPolicy
from .templates import template_variables_problem


# generate() options that turn on assisted decoding (a draft model or prompt lookup)
_ASSISTED = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit")
# generation-config settings that change the logits or end a reply and that the graph path does not apply, at their
# no-op values: a model whose config sets one decodes through generate, not GraphDecoder
_PLAIN_GENERATION = {"no_repeat_ngram_size": 0, "bad_words_ids": None, "suppress_tokens": None,
                     "begin_suppress_tokens": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
                     "sequence_bias": None, "min_length": 0, "min_new_tokens": None, "renormalize_logits": False,
                     "exponential_decay_length_penalty": None, "guidance_scale": None,
                     "encoder_repetition_penalty": 1.0, "stop_strings": None}
# sampling settings the graph path applies itself (with transformers' own logits warpers, in generate's order, after
# the repetition penalty); one left unset (None) in the call and the generation config takes transformers' global
# default, as generate does
_SAMPLING = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": None}
# sampling warpers the graph path does not apply: a model whose generation config sets one samples through generate
_OTHER_SAMPLING = {"top_h": None, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0}


class ChatInputError(ValueError):
    """A turn cannot be processed as given; the message names the problem and the fix."""


class ChatSetupError(ValueError):
    """Model, gates and options do not fit together; the message names the fix."""


class PastPositionsWarning(UserWarning):
    """A conversation may run past the model's ``max_position_embeddings`` (said once per conversation)."""


# what RetentionChat.save writes (a JSON object); resume reads this version only
TRANSCRIPT_FORMAT, TRANSCRIPT_VERSION = "retention-chat", 1


def _read_json(path: Path, missing: str, not_json: str) -> Any:
    """A JSON file's data; :class:`ChatInputError` with ``missing`` when there is no such file, ``not_json`` (the
    parser's message in place of ``{error}``) when it does not parse."""
    import json

    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, IsADirectoryError):
        raise ChatInputError(missing) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ChatInputError(not_json.replace("{error}", str(e))) from None


def read_transcript(path: str | Path) -> dict[str, Any]:
    """A conversation :meth:`RetentionChat.save` wrote, checked as a file (``retention chat --resume`` reads it before
    the model loads); :class:`ChatInputError` naming the problem otherwise. The model checks come in ``resume``."""
    path = Path(path).expanduser()
    data = _read_json(path, f"no saved conversation at {path}: give the file that save() (/save) wrote",
                      f"{path} is not a saved conversation (not JSON: {{error}})")
    if not isinstance(data, dict) or data.get("format") != TRANSCRIPT_FORMAT:
        raise ChatInputError(f"{path} is not a saved conversation: save() (/save in retention chat) writes one")
    if data.get("version") != TRANSCRIPT_VERSION:
        raise ChatInputError(f"{path} is a version {data.get('version')} transcript; this retention reads version "
                             f"{TRANSCRIPT_VERSION}")
    missing = [k for k in ("model", "vocab", "messages", "ids", "reply_ended", "image_turns") if k not in data]
    if missing:
        raise ChatInputError(f"{path} lacks {', '.join(missing)}: it is not a whole saved conversation")
    from .cache.hf import is_count  # an int, not a bool (JSON's true is an int in Python)

    ids, vocab = data["ids"], data["vocab"]
    if not isinstance(ids, list) or not ids:
        raise ChatInputError(f"{path} holds an empty conversation: nothing to resume")
    if not is_count(vocab) or not all(is_count(i) and 0 <= i < vocab for i in ids):
        raise ChatInputError(f"{path} holds token ids outside its vocabulary ({vocab}): the file is damaged")
    if not isinstance(data["model"], str) or not isinstance(data["reply_ended"], bool):
        raise ChatInputError(f"{path} holds a model that is no name or a reply_ended that is no true/false: the file "
                             "is damaged")
    messages = data["messages"]
    if not (isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("content"), (str, list)) for m in messages)):
        raise ChatInputError(f"{path} holds messages that are no list of {{role, content}}: the file is damaged")
    roles = [m.get("role") for m in messages]
    turns = roles[1:] if roles[0] == "system" else roles
    if not turns or len(turns) % 2 or turns != ["user", "assistant"] * (len(turns) // 2):
        raise ChatInputError(f"{path} holds messages that do not go (system,) user, assistant, ... ending with a "
                             f"reply, as save() writes them (got {', '.join(map(str, roles))[:120]}): the file is "
                             "damaged")
    if not isinstance(data["image_turns"], list):
        raise ChatInputError(f"{path} holds image_turns that are no list: the file is damaged")
    for t in data["image_turns"]:
        if not (isinstance(t, dict) and is_count(t.get("start")) and is_count(t.get("length"))
                and 0 <= t["start"] < t["start"] + t["length"] <= len(ids) and isinstance(t.get("images"), list)):
            raise ChatInputError(f"{path} holds an image turn that does not fit its token ids: the file is damaged")
    return data


def read_history(path: str | Path) -> tuple[str | None, list[tuple[str, str, list[str]]]]:
    """A conversation log to go on from (``retention chat --history``): JSON, a list of ``{role, content}`` messages
    (or ``{"messages": [...]}``, or ShareGPT's ``{"conversations": [{from, value}]}``), user and assistant turns in
    turn, ending with a reply; a content may be a list of ``{"type": "text", "text"}`` and ``{"type": "image",
    "image": PATH}`` parts (paths relative to the file's folder). Returns ``(system, [(text, reply, image paths)])``
    for :meth:`RetentionChat.add_turn`; :class:`ChatInputError` naming the problem, before any model loads."""
    path = Path(path).expanduser()
    data = _read_json(path, f"no conversation log at {path}",
                      f"{path} is not JSON ({{error}}): give a list of {{role, content}} messages")
    if isinstance(data, dict) and data.get("format") == TRANSCRIPT_FORMAT:
        raise ChatInputError(f"{path} is a conversation /save wrote: go on with it by --resume {path}")
    if isinstance(data, dict):
        data = data.get("messages", data.get("conversations"))
    roles = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
    if not isinstance(data, list) or not data or not all(isinstance(m, dict) for m in data):
        raise ChatInputError(f"{path} holds no messages: give a list of {{role, content}} (or ShareGPT conversations)")
    messages = []
    for k, m in enumerate(data):
        said, content = m.get("role", m.get("from")), m.get("content", m.get("value"))
        role = roles.get(said) if isinstance(said, str) else None
        if role is None or content is None:
            raise ChatInputError(f"{path}, message {k}: give each message a role (user, assistant or system) and a "
                                 f"content, got {sorted(m)}" + (f" (role {said!r})" if said is not None else ""))
        if not isinstance(content, (str, list)):
            raise ChatInputError(f"{path}, message {k}: a content is text or a list of parts, got "
                                 f"{type(content).__name__} {content!r:.60}")
        text, images = content, []
        if isinstance(content, list):
            content = [{"type": "text", "text": c} if isinstance(c, str) else c for c in content]
            if not all(isinstance(c, dict) for c in content):
                raise ChatInputError(f"{path}, message {k}: a content list holds {{\"type\": \"text\", \"text\"}} and "
                                     f"{{\"type\": \"image\", \"image\": PATH}} parts, got {content!r:.80}")
            text = " ".join(str(c.get("text", "")) for c in content if c.get("type") == "text")
            for c in content:
                if c.get("type") == "image":
                    shown = Path(str(c.get("image") or c.get("path") or c.get("url") or "")).expanduser()
                    shown = shown if shown.is_absolute() else path.parent / shown
                    if not shown.is_file():
                        raise ChatInputError(f"{path}, message {k}: image {shown} not found")
                    images.append(str(shown))
        messages.append((role, str(text), images))
    system = messages.pop(0)[1] if messages[0][0] == "system" else None
    if len(messages) % 2 or any(r != want for (r, _, _), want in zip(messages, ["user", "assistant"] * len(messages))):
        raise ChatInputError(f"{path}: the turns must go user, assistant, user, assistant... and end with a reply "
                             "(type the next message in the chat); got " + ", ".join(r for r, _, _ in messages))
    if any(images for r, _, images in messages if r == "assistant"):
        raise ChatInputError(f"{path}: images go in user turns only")
    return system, [(u[1], a[1], u[2]) for u, a in zip(messages[::2], messages[1::2])]


def _png_base64(image: Any) -> str:
    """An image of a turn (a PIL image, as :func:`_turn_images` made it) as base64 PNG: the transcript keeps its
    pixels."""
    import base64
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _png_image(data: str) -> Any:
    import base64
    import io

    from .images import open_rgb

    return open_rgb(io.BytesIO(base64.b64decode(data)))


def _turn_images(images: Any, read: bool = True) -> list[Any]:
    """A turn's images as RGB PIL images read now (:func:`retention.images.as_rgb`), so the turn, its saved
    transcript and a resumed chat show the same pixels whatever later happens to the files: ``images`` a list of PIL
    images and image paths (``str`` or ``Path``), or one of them alone. :class:`ChatInputError` naming the entry
    that is neither, or a file that is missing or no image. ``read=False`` (a text-only model, which refuses any
    image by name) only makes the list."""
    from PIL import Image, UnidentifiedImageError

    from .images import as_rgb, open_rgb

    if images is None:
        return []
    if isinstance(images, (str, Path, Image.Image)):  # one image: a bare path string was split into characters
        images = [images]
    if not isinstance(images, (list, tuple)):
        raise ChatInputError(f"images must be a list of PIL images or image paths, got {type(images).__name__}")
    if not read:
        return list(images)
    out = []
    for k, image in enumerate(images):
        if isinstance(image, Image.Image):
            out.append(as_rgb(image))
        elif isinstance(image, (str, Path)):
            try:
                out.append(open_rgb(image))
            except (OSError, UnidentifiedImageError) as e:  # missing, a folder, not an image
                raise ChatInputError(f"image {k} ({image}) cannot be read as an image: {e}") from None
        else:  # an array would chat but never save, and None or a number failed deep in the processor
            raise ChatInputError(f"image {k} is a {type(image).__name__}: give a PIL image or an image file's path "
                                 "(an array: PIL.Image.fromarray(array))")
    return out


def _load_gates(gates: RetentionGates | str | Path | None, model: nn.Module) -> RetentionGates | None:
    """Built gates as given; ``None``: the gates shipped for an embedded model (if any, and no gates
    are attached yet); ``"untrained"``: none; else a checkpoint folder or Hub repo id."""
    if isinstance(gates, RetentionGates) or gates == "untrained":
        return None if gates == "untrained" else gates
    if gates is None:
        from .models import shipped_gates

        if getattr(unwrap(model), "retention", None) is not None:
            return None  # keep what is attached
        gates = shipped_gates(model)
        if gates is None:
            return None
    from .hub import load_gates

    return load_gates(gates)  # checked against the model by the caller, with the fix in the message


def shown_reply(reply: str) -> str:
    """A reply's text as chat templates show it in later turns: without a reasoning part (``...</think>``)."""
    return reply.split("</think>")[-1].strip()


def text_after_reply(render: Callable[[list[dict[str, Any]]], str], messages: list[dict[str, Any]],
                     message: dict[str, Any], text: str) -> str | None:
    """What a chat template renders after the last reply of ``messages`` once ``message`` (its text ``text``) follows,
    generation prompt included: the reply's closer, the new turn and the prompt. ``render(messages)`` renders with
    the generation prompt. ``None`` when the template does not show the reply before the new turn.

    Markers stand in for the new turn's text and for the reply (whose shown text may differ from the generated one: a
    reasoning part left out; or be empty), so the closer is found wherever the template puts them."""
    marker = "\x1eretention-turn\x1e"  # stands in for the text, to find where the new turn begins
    content = marker if isinstance(message["content"], str) else [
        {**c, "text": marker} if c.get("type") == "text" else c for c in message["content"]]
    rendered = render(_reply_as_marker(messages) + [{**message, "content": content}])
    at = rendered.find(marker)
    start = rendered.rfind(_REPLY, 0, at) if at >= 0 else -1
    return rendered[start + len(_REPLY) :].replace(marker, text) if start >= 0 else None


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


class RetentionChat:
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
        from .cache import RetentionCache

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
            from .policies.registry import get_policy

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

    # -- session state -----------------------------------------------------------------------------
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

    def _own_positions(self) -> None:
        """Put this conversation's M-RoPE offset on the model (another chat on the same model may have moved it)."""
        if self.multimodal:
            unwrap(self.model).model.rope_deltas = self._rope_deltas

    def _keep_positions(self) -> None:
        if self.multimodal:
            self._rope_deltas = unwrap(self.model).model.rope_deltas

    def memory(self) -> dict[str, Any]:
        """The cache's memory report (see :meth:`RetentionCache.memory_report`); a vision-language chat adds
        ``image_tokens`` (seen so far) and ``kept_image_entries`` (entries of image tokens kept, all layers and
        heads)."""
        if stale := self._stale_tokens():
            warnings.warn(f"the report counts the entries of {stale:+,} tokens the conversation does not hold "
                          "(the last turn failed midway); the next turn feeds the conversation again without them",
                          stacklevel=2)
        report = self.cache.memory_report()
        if self.multimodal and self.ids.shape[1]:
            from .cache.hf import kept_where

            image = self.ids[0] == unwrap(self.model).config.image_token_id
            report.update(image_tokens=int(image.sum()), kept_image_entries=kept_where(self.cache, image))
        return report

    # -- saving and resuming -----------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write the conversation to ``path`` (JSON, atomically: an interrupted save leaves the earlier file whole):
        its messages, every token id, and the images of each turn that had some (as PNG), so that :meth:`resume`
        can rebuild it later, in another process, under any budget or policy. Returns the path."""
        import json

        from .io import atomic_write_bytes

        if not self.ids.shape[1]:
            raise ChatInputError("nothing to save yet: the conversation is empty")
        path = Path(path).expanduser()  # "/save ~/chat.json" in the chat: no shell expands it
        if path.is_dir():
            raise ChatInputError(f"{path} is a folder: give the file to save to, e.g. {path / 'chat.json'}")
        data = {
            "format": TRANSCRIPT_FORMAT,
            "version": TRANSCRIPT_VERSION,
            "model": getattr(text_config_of(self.model), "_name_or_path", "") or "",
            "vocab": len(self.tokenizer),
            "messages": self.messages,
            "ids": self.ids[0].tolist(),
            "reply_ended": self._last_reply_ended,
            "image_turns": [{**t, "images": [_png_base64(im) for im in t["images"]]} for t in self._image_turns],
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, json.dumps(data, ensure_ascii=False).encode())
        return path

    def resume(self, path: str | Path) -> None:
        """Replace the conversation with the one :meth:`save` wrote to ``path`` and go on from it.

        Its tokens are fed through this chat's cache in chunks of ``chunk_size`` (turns with images as they were
        fed live), so the budget and policy are this chat's own: a conversation saved without a budget can go on
        under one. The file is checked before anything changes: a transcript of another tokenizer, or one with
        images for a text-only model, is a :class:`ChatInputError` and the current conversation stays."""
        self._refuse_while_streaming("resume()")
        data = self._read_transcript(Path(path))
        ids = torch.tensor([data["ids"]], dtype=torch.long, device=self.device)
        turns = [{**t, "images": [_png_image(s) for s in t["images"]]} for t in data["image_turns"]]
        self._clear()
        self._warn_past_positions(ids.shape[1])
        self._refeed(ids, turns)
        self.messages = data["messages"]
        self._last_reply_ended = bool(data["reply_ended"])

    def _refeed(self, ids: torch.Tensor, turns: list[dict[str, Any]]) -> None:
        """Feed a conversation's ``ids`` ``(1, T)`` and its image ``turns`` through the (empty) cache in chunks, turns
        with images as they were fed live, and make them this chat's (the last token goes with the next turn)."""
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

    def _read_transcript(self, path: Path) -> dict[str, Any]:
        data = read_transcript(path)
        this = getattr(text_config_of(self.model), "_name_or_path", "") or ""
        if data["vocab"] != len(self.tokenizer):
            raise ChatInputError(
                f"{path} was saved with {data['model'] or 'another model'} ({data['vocab']:,} tokens in its "
                f"vocabulary); this chat runs {this or 'a model'} with {len(self.tokenizer):,}: its token ids mean "
                "other text here; resume it with the model it was saved with"
            )
        if data["image_turns"] and not self.multimodal:
            raise ChatInputError(f"{path} holds images but {type(unwrap(self.model)).__name__} is a text-only model: "
                                 "resume it with the vision-language model it was saved with")
        if model_stem(data["model"]) != model_stem(this):
            warnings.warn(f"{path} was saved with {data['model'] or 'another model'}; going on with "
                          f"{this or 'this model'} (same vocabulary size)", stacklevel=3)
        return data

    def _rope_delta(self) -> int:
        """A multimodal model's M-RoPE position minus true index for text tokens after the images so far (0 before)."""
        prev = unwrap(self.model).model.rope_deltas
        return int(prev.flatten()[0]) if prev is not None else 0

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
    def add_turn(self, text: str, reply: str, images: Sequence[Any] | None = None) -> None:
        """Add a user turn (with images for vision-language models) and a reply given, not generated: a known
        history (a benchmark's earlier turns, another chat's log) fed through this chat's cache as if the model
        had said ``reply`` and then stopped. Its tokens compete for the budget like any others."""
        self._refuse_while_streaming("add_turn()")
        images = _turn_images(images, read=self.multimodal)
        _check_text("the reply", reply)
        turn = self._encode_turn(text, images)  # validates; nothing is changed before this returns
        full = torch.cat([self.ids, turn["input_ids"]], dim=1)
        said = self.tokenizer(reply, add_special_tokens=False, return_tensors="pt")["input_ids"].to(self.device)
        stop = torch.tensor([self._stop_after(turn["message"], reply)], dtype=torch.long, device=self.device)
        out = torch.cat([full, said, stop.view(1, -1)], dim=1)
        self._warn_past_positions(out.shape[1])
        self._repair()
        self._own_positions()
        if "pixel_values" in turn:
            self._prefill_multimodal(turn)
        self._feed(out, out.shape[1] - 1)  # the stop token goes with the next turn, as after send()
        self._commit(full, out, turn, {})
        self._last_reply_ended = bool(stop.numel())  # the tokenizer's eos may close turns where generate's names none

    def _stop_after(self, message: dict[str, Any], reply: str) -> list[int]:
        """The stop token a generated ``reply`` would have ended on: the model's eos id that the template writes right
        after the reply (``<|im_end|>``, ``<|eot_id|>``); none when the template closes a reply otherwise, and the next
        turn then feeds that closer as text."""
        closer = self._after_last_reply(self.messages + [message, {"role": "assistant", "content": reply}])
        for e in [*_ids(self.model.generation_config.eos_token_id), *_ids(self.tokenizer.eos_token_id)]:
            if closer.startswith(self.tokenizer.decode([e], skip_special_tokens=False)):
                return [e]
        return []

    def send(self, text: str, images: Sequence[Any] | None = None, **generation_kwargs: Any) -> str:
        """Add a user turn (with images for vision-language models), generate and return the reply."""
        return "".join(self.stream(text, images, **generation_kwargs))

    def stream(self, text: str, images: Sequence[Any] | None = None, **generation_kwargs: Any) -> Iterator[str]:
        """Like :meth:`send`, yielding the reply as it is generated.

        Stopping early (``break``, ``close()``, or Ctrl-C while it waits for the next piece) stops generation at the
        next token and keeps the reply so far as the assistant's turn, as if ``max_new_tokens`` had ended it there:
        the cache and the history stay in step and the chat goes on."""
        from transformers import StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer

        from .cache.hf import is_count

        self._refuse_while_streaming("a new turn")
        images = _turn_images(images, read=self.multimodal)
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
        turn = self._encode_turn(text, images)  # validates; nothing is changed before this returns
        self._streaming = True  # until this turn is committed (or fails): see _refuse_while_streaming
        try:
            self._repair()
            full = torch.cat([self.ids, turn["input_ids"]], dim=1)
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

    def _setting(self, kwargs: dict[str, Any], name: str, default: Any) -> Any:
        """A generation setting as generate resolves it: the call's, else the model's generation config's, else
        transformers' global ``default``."""
        value = kwargs[name] if name in kwargs else getattr(self.model.generation_config, name, None)
        return default if value is None else value

    def _graphs_decode(self, kwargs: dict[str, Any]) -> bool:
        """Whether this reply can decode through GraphDecoder: greedy or sampled (temperature, top_k, top_p, min_p),
        with at most a repetition penalty changing the logits (the model's generation config included). Otherwise it
        goes through generate, with a warning that says why."""
        plain = {"do_sample", "max_new_tokens", "min_new_tokens", "eos_token_id", "stopping_criteria",
                 "prefill_chunk_size", "repetition_penalty", "pad_token_id", *_SAMPLING}
        others = {**_PLAIN_GENERATION, **(_OTHER_SAMPLING if kwargs.get("do_sample") else {})}
        gc = self.model.generation_config
        changed = {name: getattr(gc, name, None) for name, default in others.items()
                   if getattr(gc, name, default) not in (default, None)}
        why = (f"{', '.join(sorted(set(kwargs) - plain))} given" if set(kwargs) - plain else
               f"the model's generation config sets {changed}" if changed else None)
        if why:
            warnings.warn(f"cuda_graphs: this reply decodes with generate, since {why}", stacklevel=4)
        return why is None

    def _graph_processors(self, kwargs: dict[str, Any], prompt_length: int, eos: list[int]) -> Any:
        """The logits processors generate would apply to this reply's scores, in its order: the repetition penalty,
        no eos before min_new_tokens, then (when sampling) temperature, top-k, top-p and min-p."""
        from transformers import (LogitsProcessorList, MinNewTokensLengthLogitsProcessor, MinPLogitsWarper,
                                  RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
                                  TopPLogitsWarper)

        out = LogitsProcessorList()
        penalty = self._setting(kwargs, "repetition_penalty", 1.0)
        if penalty != 1.0:
            out.append(RepetitionPenaltyLogitsProcessor(penalty))
        if (kwargs.get("min_new_tokens") or 0) > 0 and eos:
            out.append(MinNewTokensLengthLogitsProcessor(prompt_length, kwargs["min_new_tokens"], eos,
                                                         device=str(self.device)))
        if not kwargs.get("do_sample"):
            return out
        s = {name: self._setting(kwargs, name, default) for name, default in _SAMPLING.items()}
        if s["temperature"] != 1.0:
            out.append(TemperatureLogitsWarper(s["temperature"]))
        if s["top_k"] != 0:
            out.append(TopKLogitsWarper(s["top_k"]))
        if s["top_p"] < 1.0:
            out.append(TopPLogitsWarper(s["top_p"]))
        if s["min_p"] is not None:
            out.append(MinPLogitsWarper(s["min_p"]))
        return out

    def _graph_generate(self, full: torch.Tensor, kwargs: dict[str, Any], streamer: Any) -> torch.Tensor:
        """Decoding as ``generate`` does it (chunked prefill, min_new_tokens, eos, stopping criteria, the streamer,
        greedy or sampled from the processed scores), each step after the first a
        :class:`~retention.cache.GraphDecoder` replay. Returns ``full`` plus the reply, ``(1, T + n)``; the cache
        holds every token but the last, as after generate."""
        from .cache import GraphDecoder
        from .compat import cache_kwargs

        given = kwargs.get("eos_token_id")  # as generate reads them: given ids replace the generation config's
        eos = sorted(set(_ids(given if given is not None else self.model.generation_config.eos_token_id)))
        criteria = kwargs.get("stopping_criteria") or []
        # built before the prefill, so a setting the processors refuse (top_k=-1) leaves the cache as it was
        processors, sample = self._graph_processors(kwargs, full.shape[1], eos), bool(kwargs.get("do_sample"))
        streamer.put(full)  # the prompt, which the streamer skips (as generate hands it over)
        for start in range(self.cache.get_seq_length(), full.shape[1], self.chunk_size):
            logits = self.model(input_ids=full[:, start : start + self.chunk_size], **cache_kwargs(self.cache),
                                use_cache=True).logits[:, -1]
        if self._decoder is None or self._decoder.cache is not self.cache:
            self._decoder = GraphDecoder(self.model, self.cache, graph=self._graph_replay)
        out = full
        for n in range(kwargs["max_new_tokens"]):
            scores = processors(out, logits.float())  # generate processes float32 scores
            new = (torch.multinomial(scores.softmax(-1), num_samples=1) if sample
                   else scores.argmax(-1, keepdim=True))  # (1, 1)
            out = torch.cat([out, new], dim=1)
            streamer.put(new[0])
            if (int(new) in eos or n + 1 == kwargs["max_new_tokens"]
                    or any(bool(c(out, scores).any()) for c in criteria)):
                break
            logits = self._decoder.step(new)
        streamer.end()
        return out

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

    # -- encoding ----------------------------------------------------------------------------------
    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        return self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                  **self.chat_template_kwargs)

    def _encode_turn(self, text: str, images: list[Any]) -> dict[str, Any]:
        _check_text("the message", text)
        if images and not self.multimodal:
            raise ChatInputError(
                f"{len(images)} image(s) given but {type(unwrap(self.model)).__name__} is a text-only model: "
                "send text only, or load a vision-language model (e.g. Qwen3-VL)"
            )
        if self.multimodal:
            content: Any = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        else:
            content = text
        message = {"role": "user", "content": content}
        new_full = self._render(self.messages + [message], generation_prompt=True)
        if len(self.ids[0]) == 0:
            delta = new_full
        else:
            history = self._render(self.messages, generation_prompt=False)
            if new_full.startswith(history):  # ChatML, Llama, Qwen3-VL: each turn renders after the last
                delta = self._closer() + new_full[len(history) :]
            else:  # the template renders the last reply otherwise once a turn follows (Qwen3's think blocks)
                delta = self._after_reply(message, text)
        if self.multimodal:
            enc = self.processor(text=[delta], images=images or None, return_tensors="pt")
        else:
            enc = self.tokenizer(delta, add_special_tokens=False, return_tensors="pt")
        # a turn longer than the budget is fine: it is prefilled in chunks and competes for the budget like every
        # earlier entry (a pasted document, then questions about it, is what the cache is for)
        return {**{k: v.to(self.device) if torch.is_tensor(v) else v for k, v in enc.items()}, "message": message,
                "images": images}

    def _after_reply(self, message: dict[str, Any], text: str) -> str:
        """What follows the last reply when ``message`` is added, for templates that render a reply differently once
        a turn follows it (Qwen3 drops the empty ``<think>`` block of an answered turn). The cache keeps the reply as
        it was generated; only the turn's own text (the reply's closer, the message, the generation prompt) is fed."""
        after = text_after_reply(lambda m: self._render(m, generation_prompt=True), self.messages, message, text)
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

    def _prefill_multimodal(self, turn: dict[str, Any]) -> None:
        """Feed a turn holding images (all but its last token) with M-RoPE positions continued from the cache.

        generate() cannot do this part: its position logic expects every image of the conversation
        in one call. The turn's images are encoded in one forward (an image is never split).
        """
        base = unwrap(self.model)
        ids = turn["input_ids"]
        past, start, T = self.cache.get_seq_length(), self.ids.shape[1], ids.shape[1]
        # the cache may lack the tokens before the turn that generate had not fed yet (the last reply's last token):
        # they go first, as text
        lead = start - past
        mm = turn.get("mm_token_type_ids")
        if mm is None:
            mm = (ids == base.config.image_token_id).int()
        pos3, _ = base.model.get_rope_index(
            ids, image_grid_thw=turn["image_grid_thw"], attention_mask=torch.ones_like(ids), mm_token_type_ids=mm
        )
        delta = self._rope_delta()
        pos3 = pos3 + start + delta  # the turn's first token sits at true index `start`
        fed = lead + T - 1  # all but the turn's last token, which generate() feeds
        before = (torch.arange(past, start, device=ids.device) + delta).expand(3, 1, lead)
        text = torch.arange(past, past + fed, device=ids.device)[None, None]
        positions = torch.cat([text, torch.cat([before, pos3], dim=-1)[..., :fed]], dim=0)
        mm = torch.cat([torch.zeros(1, lead, dtype=mm.dtype, device=mm.device), mm], dim=1)[:, :fed]
        with torch.no_grad():
            self.model(
                input_ids=torch.cat([self.ids, ids], 1)[:, past : past + fed],
                attention_mask=torch.ones(1, past + fed, dtype=torch.long, device=ids.device),
                pixel_values=turn["pixel_values"],
                image_grid_thw=turn["image_grid_thw"],
                mm_token_type_ids=mm,
                position_ids=positions,
                **cache_kwargs(self.cache),
                use_cache=True,
                logits_to_keep=1,
            )
        # generate() places the last token, at true index start + T - 1, at that index plus rope_deltas
        base.model.rope_deltas = torch.tensor([[int(pos3[0, 0, -1]) - (start + T - 1)]], device=ids.device)


def _check_counts(**given: tuple[Any, int, str]) -> None:
    """ChatSetupError naming the argument unless each ``name=(value, least, meaning)`` is an integer >= least, as
    :func:`retention.cache.hf.is_count` reads one (a ``budget_tokens`` of None is allowed: no budget)."""
    from .cache.hf import is_count

    for name, (value, least, meaning) in given.items():
        if name == "budget_tokens" and value is None:
            continue
        if not is_count(value) or value < least:
            raise ChatSetupError(f"{name} must be an integer >= {least} ({meaning}), got {value!r}")


def _check_text(what: str, text: Any, error: type[Exception] = ChatInputError) -> None:
    """``error`` unless ``text`` is a string (a None or a list rendered as a Jinja error or a TypeError deep in the
    template) of Unicode characters (:func:`not_unicode`)."""
    if not isinstance(text, str):
        raise error(f"{what} must be a str, got {type(text).__name__}: {text!r:.60}")
    bad = not_unicode(text)
    if bad:
        raise error(f"{what} holds {bad}, which is no character (a byte that is not UTF-8, as pasted from a file in "
                    "another encoding, or half a surrogate pair): type it again, or give UTF-8 text "
                    "(text.encode('utf-8', 'replace').decode() replaces such characters with ?)")


def not_unicode(text: str) -> str | None:
    """Where ``text`` holds a lone surrogate (``'\\udce9' at character 3``), or None: Python reads a byte that is not
    UTF-8 from a terminal or a pipe as one (``surrogateescape``), and the tokenizer refused it with a TypeError that
    ended ``retention chat``, conversation and all."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"{text[e.start:e.end]!r} at character {e.start}"
    return None


# the ranges generate's logits processors accept, checked before a turn starts (they raise only once it runs);
# the sampling ones matter only when sampling, as generate ignores them otherwise
GENERATION_RANGES: dict[str, tuple[str, Callable[[float], bool], bool]] = {
    "temperature": ("above 0 (for greedy replies leave out sampling)", lambda v: v > 0, True),
    "top_k": ("an integer >= 0 (0: every token)", lambda v: v >= 0 and float(v).is_integer(), True),
    "top_p": ("in (0, 1]", lambda v: 0 < v <= 1, True),
    "min_p": ("in [0, 1]", lambda v: 0 <= v <= 1, True),
    "repetition_penalty": ("above 0 (1 changes nothing, above 1 discourages repeats)", lambda v: v > 0, False),
}


def generation_value_problem(name: str, value: Any) -> str | None:
    """What is wrong with a sampling setting's ``value`` (``"must be ..., got ..."``), or ``None`` when generate
    takes it; :data:`GENERATION_RANGES` names the settings."""
    import math
    import numbers

    allowed, ok, _ = GENERATION_RANGES[name]
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or not ok(value):
        return f"must be {allowed}, got {value!r}"
    return None


def _check_generation_values(options: dict[str, Any], error: type[Exception]) -> None:
    """``error`` naming the first setting of ``options`` (a reply's merged generate options) out of its range."""
    for name, (_, _, sampling) in GENERATION_RANGES.items():
        if options.get(name) is not None and (options.get("do_sample") or not sampling):
            if problem := generation_value_problem(name, options[name]):
                raise error(f"{name} {problem}")


def _check_one_reply(options: dict[str, Any], error: type[Exception]) -> None:
    """``error`` when ``options`` ask generate for more than one reply's ids (beams, several sequences, an output
    object): a chat keeps one reply per turn in its cache."""
    for key in ("num_beams", "num_return_sequences"):
        if (options.get(key) or 1) > 1:
            raise error(f"{key}={options[key]}: a chat keeps one reply per turn in its cache; for beams or several "
                        "samples call model.generate with a RetentionCache directly (it supports both)")
    if options.get("return_dict_in_generate"):  # failed in the commit, after the reply, its entries left behind
        raise error("return_dict_in_generate: a chat returns the reply's text and keeps its tokens (chat.ids); for "
                    "scores or hidden states call model.generate with a RetentionCache directly")


# generate() keywords that are neither GenerationConfig fields nor in its signature
_GENERATE_EXTRAS = frozenset({"tokenizer", "assistant_tokenizer"})
# generate() arguments the chat passes itself (given again, generate raised a TypeError at every turn), and instead
_CHAT_PASSES = {"streamer": "stream() yields the reply as it is generated",
                "inputs": "send() takes the message; the chat feeds the conversation before it"}


def _check_generation_options(model: nn.Module, options: dict[str, Any], error: type[Exception]) -> None:
    """``error`` naming the keys of ``options`` that ``generate`` would refuse as unused model inputs (a typo, or a
    policy option): neither fields of the model's GenerationConfig nor ``generate``'s own arguments."""
    import inspect

    from transformers import GenerationConfig

    from .policies.registry import POLICIES

    if passed := sorted(k for k in options if k in _CHAT_PASSES):
        raise error(f"{', '.join(passed)}: the chat passes {'it' if len(passed) == 1 else 'them'} to generate itself ("
                    + "; ".join(_CHAT_PASSES[k] for k in passed) + ")")
    config = getattr(unwrap(model), "generation_config", None) or GenerationConfig()
    own = set(inspect.signature(unwrap(model).generate).parameters) | _GENERATE_EXTRAS
    unknown = sorted(k for k in options if k not in own and not hasattr(config, k))
    if not unknown:
        return
    policy_options = sorted({k for k in unknown for cls in POLICIES.values()
                             if k in getattr(cls, "__dataclass_fields__", {})})
    hint = ((f"; {', '.join(policy_options)} {'is an option' if len(policy_options) == 1 else 'are options'} of "
             "the eviction policy: pass policy=GlobalGatesPolicy(...) (or the policy's own class) with it")
            if policy_options else "")
    raise error(f"unknown option(s) {', '.join(unknown)}: a chat's keyword arguments are generate()'s "
                f"(GenerationConfig fields such as temperature or repetition_penalty){hint}")
