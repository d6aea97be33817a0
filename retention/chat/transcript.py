"""A conversation on disk: the transcript :meth:`RetentionChat.save` writes and :meth:`RetentionChat.resume` reads
back, and the conversation logs ``retention chat --history`` goes on from."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from ..attach import model_stem, text_config_of, unwrap
from .errors import ChatInputError

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
    from ..cache.hf import is_count  # an int, not a bool (JSON's true is an int in Python)

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

    from ..images import open_rgb

    return open_rgb(io.BytesIO(base64.b64decode(data)))


class TranscriptMixin:
    """:meth:`save` and :meth:`resume` of :class:`~retention.chat.RetentionChat`."""

    def save(self, path: str | Path) -> Path:
        """Write the conversation to ``path`` (JSON, atomically: an interrupted save leaves the earlier file whole):
        its messages, every token id, and the images of each turn that had some (as PNG), so that :meth:`resume`
        can rebuild it later, in another process, under any budget or policy. Returns the path."""
        import json

        from ..io import atomic_write_bytes

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
