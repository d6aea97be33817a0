"""Images read one way on every path (the chat and its command line, the eval harness, training data): RGB, with
any transparency laid on white as transformers' image processors lay it (``convert_to_rgb``), not dropped as
PIL's ``convert("RGB")`` drops it (often to black). One transparent PNG then shows the same pixels to a chat, its
saved transcript, the eval and the data the gates train on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from PIL import Image


def as_rgb(image: Image.Image) -> Image.Image:
    """``image`` as an RGB image of its own (a copy when it already is RGB), transparency composited on white."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")  # a new image even from RGB: the caller's may change or close later


def open_rgb(source: str | Path | Any) -> Image.Image:
    """The image in a file (a path, ``~`` expanded, or a binary file object) as :func:`as_rgb` gives it, read whole
    now and turned upright by its EXIF orientation (a phone photo), as transformers' ``load_image`` reads a file;
    ``FileNotFoundError`` or PIL's ``UnidentifiedImageError`` otherwise."""
    from PIL import ImageOps

    if isinstance(source, (str, Path)):
        source = Path(source).expanduser()
    with Image.open(source) as image:
        return as_rgb(ImageOps.exif_transpose(image))
