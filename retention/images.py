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


class ImageSourceError(ValueError):
    """An image source :func:`load_rgb` cannot read; the message says what was given and what is wrong."""


def _shown(source: str, width: int = 60) -> str:
    """A source for a message: base64 data would fill the screen."""
    return source if len(source) <= width else f"{source[:width]}... ({len(source):,} characters)"


def _base64_bytes(data: str) -> bytes:
    import base64
    import binascii

    try:
        return base64.b64decode("".join(data.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageSourceError(f"not valid base64 ({e})") from None


def _url_bytes(url: str, timeout: float | None) -> bytes:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers={"User-Agent": "retention"}),
                                    timeout=timeout) as response:
            return response.read()
    except (urllib.error.URLError, OSError, ValueError) as e:  # HTTPError is a URLError; a timeout an OSError
        raise ImageSourceError(f"cannot download {_shown(url)}: {getattr(e, 'reason', None) or e}") from None


def load_rgb(source: Image.Image | str | Path, timeout: float | None = 30.0) -> Image.Image:
    """An image from any source transformers' ``load_image`` takes, read as :func:`open_rgb` reads a file (upright by
    its EXIF orientation, transparency on white; ``load_image`` itself drops transparency to black): a PIL image (as
    :func:`as_rgb` gives it), a
    local path (``str`` or ``Path``, ``~`` expanded), an ``http(s)://`` URL (downloaded now, ``timeout`` seconds at
    most), a ``data:image/...;base64,`` URI or a bare base64 string of an image file's bytes.

    :class:`ImageSourceError` (a ``ValueError``) naming the problem: a missing file, a download that fails, data that
    is no image, a source of another type."""
    import io

    from PIL import UnidentifiedImageError

    if isinstance(source, Image.Image):  # as given: turned upright already, or on purpose not (as the chat took it)
        return as_rgb(source)
    if not isinstance(source, (str, Path)):
        hint = " (an array: PIL.Image.fromarray(array))" if hasattr(source, "shape") else ""
        raise ImageSourceError("an image is a PIL image, a path, an http(s) URL, a data URI or base64 data, got a "
                               f"{type(source).__name__}{hint}")
    if isinstance(source, str) and source.startswith(("http://", "https://")):
        data = _url_bytes(source, timeout)
    elif isinstance(source, str) and source.startswith("data:"):
        head, comma, payload = source.partition(",")
        if not comma or not head.startswith("data:image/") or not head.endswith(";base64"):
            raise ImageSourceError(f"a data URI must read data:image/<type>;base64,<data>, got {_shown(source)}")
        data = _base64_bytes(payload)
    elif isinstance(source, str) and not Path(source).expanduser().exists() and _looks_base64(source):
        data = _base64_bytes(source)  # no such file, and long base64 text: an image file's bytes
    else:
        path = Path(source).expanduser()
        try:
            return open_rgb(path)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ImageSourceError(f"no image file at {_shown(str(path))} (give a local file's path, an http(s) URL, "
                                   "a data:image/...;base64, URI or base64 data)") from None
        except UnidentifiedImageError:
            raise ImageSourceError(f"{_shown(str(path))} is no image file PIL can read") from None
        except OSError as e:
            raise ImageSourceError(f"cannot read {_shown(str(path))}: {e}") from None
    try:
        return open_rgb(io.BytesIO(data))
    except (UnidentifiedImageError, OSError) as e:
        raise ImageSourceError(f"{_shown(source)} holds no image PIL can read ({type(e).__name__})") from None


def _looks_base64(text: str) -> bool:
    """Whether ``text`` reads as base64 data rather than a file name: 32 characters or more of the base64 alphabet
    (a file name as short, or with a dot, is taken as a path)."""
    import re

    return len(text) >= 32 and re.fullmatch(r"[A-Za-z0-9+/=\s]+", text) is not None
