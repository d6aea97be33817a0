"""A training conversation's images: where relative paths resolve, opening them as RGB, and the check before the
model loads that the first records' images exist and decode."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from .schema import DataError, SourceConfig

if TYPE_CHECKING:
    from PIL import Image


def load_image(ref: Any, root: Path | None) -> "Image.Image":
    """One image of a conversation as RGB: a PIL image, a datasets ``{bytes}`` / ``{path}`` dict, or a path (relative
    ones under ``root``)."""
    from PIL import Image

    from retention.images import as_rgb, open_rgb  # transparency as the chat and the eval read it

    if isinstance(ref, Image.Image):
        return as_rgb(ref)
    if isinstance(ref, dict) and ref.get("bytes") is not None:  # HF datasets Image feature
        import io

        return open_rgb(io.BytesIO(ref["bytes"]))
    path = Path(ref["path"] if isinstance(ref, dict) else ref)
    if not path.is_absolute() and root is not None:
        path = root / path
    return open_rgb(path)


# records whose images are opened and decoded before the model loads (a missing image failed after it had)
IMAGE_CHECK_RECORDS = 4


def image_root_of(source: SourceConfig) -> Path | None:
    """The folder a source's relative image paths are resolved under: ``image_root``, else the data file's folder
    (or the data folder itself); ``None`` for a Hub source without one."""
    if source.image_root:
        return Path(source.image_root).expanduser()
    local = Path(source.path).expanduser()
    return local.parent if local.is_file() else local if local.is_dir() else None


def check_record_images(messages: list[dict[str, Any]], source: SourceConfig, where: str) -> int:
    """Open and decode every image of one conversation (``messages``, as :func:`~retention.train.sources.to_messages`
    gives it), as training will; DataError naming the record
    (``where``), the image's path and ``image_root`` when one is missing or does not decode. Returns the count."""
    from PIL import Image, UnidentifiedImageError

    root = image_root_of(source)
    root_text = (f"image_root {source.image_root!r}" if source.image_root else
                 f"no image_root set, so relative paths are read under {root}" if root is not None else
                 "no image_root set, so relative paths are read from the working folder")
    n = 0
    for m in messages:
        for c in m["content"] if isinstance(m["content"], list) else []:
            if not isinstance(c, dict) or c.get("type") != "image" or isinstance(c.get("image"), Image.Image):
                continue
            ref = c.get("image")
            shown = ref if not (isinstance(ref, dict) and ref.get("bytes") is not None) else "<bytes>"
            path = None
            if shown != "<bytes>":
                path = Path(ref["path"] if isinstance(ref, dict) else ref).expanduser()
                if not path.is_absolute() and root is not None:
                    path = root / path
                if not path.is_file():
                    raise DataError(f"{where}: image {shown!r} not found: no file {path} ({root_text}); unpack the "
                                    "dataset's images there (docs/training.md, Qwen3-VL) or set this source's "
                                    "image_root to the folder that holds them")
            try:
                load_image(ref, root)
            except (UnidentifiedImageError, OSError, ValueError) as e:
                raise DataError(f"{where}: image {shown!r} ({path or 'inline bytes'}) does not decode as an image "
                                f"({type(e).__name__}: {e}; {root_text}); replace the file or drop the "
                                "record") from None
            n += 1
    return n
