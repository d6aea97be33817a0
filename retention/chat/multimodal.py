"""Images in a chat: a turn's content parts and images read as RGB, and a turn with images fed with M-RoPE
positions continued from the cache (Qwen3-VL), which ``generate`` cannot do across turns."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..attach import unwrap
from ..compat import cache_kwargs
from .errors import ChatInputError

_IMAGE_KEYS = ("image", "url", "path", "base64")  # where transformers' chat templates find an image part's source


def _read_image(source: Any, what: str) -> Any:
    """``source`` read as :func:`retention.images.load_rgb` reads it; :class:`ChatInputError` naming ``what`` (``image
    0``, ``part 2``) and the problem otherwise."""
    from PIL import Image

    from ..images import ImageSourceError, load_rgb

    if not isinstance(source, (str, Path, Image.Image)):  # an array would chat but never save
        raise ChatInputError(f"{what} is a {type(source).__name__}: give a PIL image, an image file's path, an "
                             "http(s) URL, a data:image/...;base64, URI or base64 data"
                             + (" (an array: PIL.Image.fromarray(array))" if hasattr(source, "shape") else ""))
    try:
        return load_rgb(source)
    except ImageSourceError as e:
        shown = source if not isinstance(source, str) or len(source) <= 60 else f"{source[:60]}..."
        raise ChatInputError(f"{what} ({shown}) cannot be read as an image: {e}") from None


def _turn_images(images: Any, read: bool = True) -> list[Any]:
    """A turn's images as RGB PIL images read now (:func:`retention.images.load_rgb`), so the turn, its saved
    transcript and a resumed chat show the same pixels whatever later happens to the files: ``images`` a list of PIL
    images and image sources (paths as ``str`` or ``Path``, http(s) URLs, data URIs, base64 data), or one of them
    alone. :class:`ChatInputError` naming the entry that is neither, or one that cannot be read as an image.
    ``read=False`` (a text-only model, which refuses any image by name) only makes the list."""
    from PIL import Image

    if images is None:
        return []
    if isinstance(images, (str, Path, Image.Image)):  # one image: a bare path string was split into characters
        images = [images]
    if not isinstance(images, (list, tuple)):
        raise ChatInputError(f"images must be a list of PIL images or image paths, got {type(images).__name__}")
    if not read:
        return list(images)
    return [_read_image(image, f"image {k}") for k, image in enumerate(images)]


def _turn_parts(content: Any, images: Any, read: bool = True) -> tuple[list[dict[str, Any]], list[Any]]:
    """A user turn as the chat keeps it: ``(parts, images)``, ``parts`` the message's content in order (``{"type":
    "text", "text"}`` and ``{"type": "image"}``, one per image, so the chat template puts each image's tokens where
    its part stands) and ``images`` the images read (:func:`_turn_images`), in the order of their parts.

    ``content`` is the turn's text (its ``images`` go first, as ``images=`` always put them), or a list of content
    parts as Qwen3-VL and transformers' chat templates take them: ``{"type": "text", "text": ...}`` (or a bare
    string), ``{"type": "image", "image" | "url" | "path" | "base64": source}``; or a whole user message ``{"role":
    "user", "content": ...}``. :class:`ChatInputError` naming the part and the problem otherwise (a video part, say),
    before any model work; ``read=False`` (a text-only model) checks the parts without reading images."""
    from .options import _check_text

    if isinstance(content, dict) and "content" in content:  # a message, as in transformers' messages list
        if content.get("role", "user") != "user":
            raise ChatInputError(f"a turn is the user's: got a message whose role is {content.get('role')!r}")
        content = content["content"]
    if isinstance(content, str):
        _check_text("the message", content)
        images = _turn_images(images, read)
        return [{"type": "image"} for _ in images] + [{"type": "text", "text": content}], images
    if not isinstance(content, (list, tuple)):
        raise ChatInputError(f"the message must be a str or a list of content parts ({{\"type\": \"text\", "
                             f"\"text\": ...}}, {{\"type\": \"image\", \"image\": ...}}), got "
                             f"{type(content).__name__}: {content!r:.60}")
    if images is not None:
        raise ChatInputError("images= goes with a text message; a list of content parts gives its images as "
                             "{\"type\": \"image\", \"image\": ...} parts where they stand: put them there")
    if not content:
        raise ChatInputError("the message is an empty list of content parts: give text, images or both")
    parts, read_images = [], []
    for k, part in enumerate(content):
        if isinstance(part, str):
            part = {"type": "text", "text": part}
        if not isinstance(part, dict):
            raise ChatInputError(f"part {k} is a {type(part).__name__}: a content part is {{\"type\": \"text\", "
                                 f"\"text\": ...}} or {{\"type\": \"image\", \"image\": ...}}")
        kind = part.get("type")
        if kind == "text":
            _check_text(f"part {k}'s text", part.get("text"))
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image":
            given = [key for key in _IMAGE_KEYS if part.get(key) is not None]
            if len(given) != 1:
                raise ChatInputError(f"part {k} (an image) must give its image under one of "
                                     f"{', '.join(map(repr, _IMAGE_KEYS))}, got "
                                     + (f"{', '.join(given)}" if given else f"keys {sorted(part)}"))
            source = part[given[0]]
            read_images.append(_read_image(source, f"part {k}") if read else source)
            parts.append({"type": "image"})
        elif kind == "video" or (isinstance(kind, str) and "video" in kind):
            raise ChatInputError(f"part {k} is a video: this chat does not take video; extract frames (e.g. ffmpeg "
                                 "-i clip.mp4 -vf fps=1 frame%03d.png) and give them as image parts")
        else:
            raise ChatInputError(f"part {k} has type {kind!r}: a chat turn takes \"text\" and \"image\" parts")
    return parts, read_images


class MultimodalMixin:
    """M-RoPE positions of :class:`~retention.chat.RetentionChat` (a vision-language model keeps one
    ``rope_deltas``; each chat keeps its own, ``_rope_deltas``, and puts it back before it runs the model)."""

    def _mark_images(self, ids: torch.Tensor) -> None:
        """Tell the cache which of the conversation's ``ids`` ``(1, T)`` are image tokens, so a policy sees the
        modality of every entry (``EntryView.is_image``); a text-only chat marks none (the view's flag stays None)."""
        if self.multimodal:
            self.cache.mark_image_tokens(ids[0] == unwrap(self.model).config.image_token_id)

    def _own_positions(self) -> None:
        """Put this conversation's M-RoPE offset on the model (another chat on the same model may have moved it)."""
        if self.multimodal:
            unwrap(self.model).model.rope_deltas = self._rope_deltas

    def _keep_positions(self) -> None:
        if self.multimodal:
            self._rope_deltas = unwrap(self.model).model.rope_deltas

    def _rope_delta(self) -> int:
        """A multimodal model's M-RoPE position minus true index for text tokens after the images so far (0 before)."""
        prev = unwrap(self.model).model.rope_deltas
        return int(prev.flatten()[0]) if prev is not None else 0

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
