"""Images in a chat: a turn's images read as RGB, and a turn with images fed with M-RoPE positions continued from the
cache (Qwen3-VL), which ``generate`` cannot do across turns."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..attach import unwrap
from ..compat import cache_kwargs
from .errors import ChatInputError

def _turn_images(images: Any, read: bool = True) -> list[Any]:
    """A turn's images as RGB PIL images read now (:func:`retention.images.as_rgb`), so the turn, its saved
    transcript and a resumed chat show the same pixels whatever later happens to the files: ``images`` a list of PIL
    images and image paths (``str`` or ``Path``), or one of them alone. :class:`ChatInputError` naming the entry
    that is neither, or a file that is missing or no image. ``read=False`` (a text-only model, which refuses any
    image by name) only makes the list."""
    from PIL import Image, UnidentifiedImageError

    from ..images import as_rgb, open_rgb

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


class MultimodalMixin:
    """M-RoPE positions of :class:`~retention.chat.RetentionChat` (a vision-language model keeps one
    ``rope_deltas``; each chat keeps its own, ``_rope_deltas``, and puts it back before it runs the model)."""

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
