"""Image memory across turns (vision-language models): the user shows photos early in a long dialogue, each with a
number written on it, and at the end asks for the number on one of them. The answer lives in image tokens only (the
assistant never repeats it), so a policy that evicts the photo's entries loses it: text and image entries compete for
one budget. In between, the dialogue-memory task's turns about passages of real text.

The photos are the two that ship with matplotlib (a dependency), or the image files the ``photos`` option lists,
cropped and mirrored per item; they are rendered once into ``<RETENTION_CACHE>/eval-images/`` under names made from
their content, so an item's image names are the same in every run and on every machine (a resumed sweep keeps its
rows). The pool is never taken from whatever else happens to be installed: that would change the items.
"""

from __future__ import annotations

import functools
import hashlib
import random
from pathlib import Path
from typing import TYPE_CHECKING

from .base import Item, item_id, rng_for
from .dialogue import talk_about_passages

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SHOWS = ["Here is a photo from my trip.", "Look at this one.", "Another photo I took.", "And this photo.",
         "One more from the album."]
ACKS = ["Thanks for sharing it!", "What a nice picture.", "Got it, a lovely photo.", "Thank you, noted."]
ORDINALS = ["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth"]


def photo_sources(photos: list[str] | None = None) -> list[Path]:
    """The photo pool: ``photos`` (image files, ``~`` expanded) or, by default, matplotlib's two sample photos.

    A fixed list, so the items of a seed are the same on every machine (they once grew with scikit-image's photos
    when it happened to be installed). Raises ValueError naming a listed file that does not exist."""
    if photos is None:
        import matplotlib

        root = Path(matplotlib.get_data_path()) / "sample_data"
        paths = [root / "grace_hopper.jpg", root / "Minduka_Present_Blue_Pack.png"]
        if not all(p.is_file() for p in paths):
            raise RuntimeError("image_memory: matplotlib's sample photos are missing: reinstall matplotlib")
        return paths
    if isinstance(photos, (str, Path)) or not photos:
        raise ValueError(f"image_memory: photos must be a non-empty list of image files, got {photos!r}")
    paths = [Path(p).expanduser() for p in photos]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise ValueError(f"image_memory: photos lists files that do not exist: {', '.join(missing)}")
    return paths


@functools.lru_cache(maxsize=None)
def _content_key(path: Path) -> str:
    # two photos of one name in different folders must not share rendered crops
    return hashlib.sha1(path.read_bytes()).hexdigest()[:12]


def image_folder() -> Path:
    from retention.models import cache_dir

    return cache_dir() / "eval-images"


def numbered_photo(rng: random.Random, number: str, size: int, sources: list[Path]) -> str:
    """A ``size`` x ``size`` crop of a shipped photo (mirrored at random) with ``number`` in large dark digits on a
    light band at a random height, written once into :func:`image_folder`; returns its file name there, made from
    what it shows."""
    from PIL import Image, ImageDraw, ImageFont, ImageOps

    from retention.io import atomic_write_bytes

    source = rng.choice(sources)
    mirror, fx, fy, band = rng.random() < 0.5, rng.random(), rng.random(), rng.uniform(0.15, 0.75)
    drawn = f"{_content_key(source)}/{mirror}/{fx:.6f}/{fy:.6f}/{band:.6f}/{number}/{size}"
    key = hashlib.sha1(drawn.encode()).hexdigest()[:16]
    path = image_folder() / f"{key}.png"
    if path.is_file():
        return path.name
    im = Image.open(source).convert("RGB")
    side = min(im.size)
    x, y = round(fx * (im.width - side)), round(fy * (im.height - side))
    im = im.crop((x, y, x + side, y + side)).resize((size, size))
    if mirror:
        im = ImageOps.mirror(im)
    draw = ImageDraw.Draw(im)
    font = ImageFont.load_default(size=size // 6)
    left, top, right, bottom = draw.textbbox((0, 0), number, font=font)
    w, h = right - left, bottom - top
    x0, y0 = (size - w) // 2, round(band * size)
    draw.rectangle((x0 - h // 3, y0 - h // 3, x0 + w + h // 3, y0 + h + h // 3), fill=(245, 245, 235))
    draw.text((x0 - left, y0 - top), number, fill=(20, 20, 20), font=font)
    import io

    buf = io.BytesIO()
    im.save(buf, format="PNG")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, buf.getvalue())
    return path.name


def image_memory(tokenizer: PreTrainedTokenizerBase, length: int, n: int, seed: int = 0, split: str = "eval",
                 source: str = "auto", images: int = 2, size: int = 448, photos: list[str] | None = None) -> list[Item]:
    """``images`` photos (``size`` pixels square), one per opening turn, each with a 4-digit number; the question
    asks for the number on one of them (by its place in the dialogue: "the second photo").

    ``length`` counts the rendered text before the question (chat template included); each photo adds its image
    tokens on top (Qwen3-VL: ``(size / 32)^2``, 196 at 448 pixels). ``photos``: image files to crop the photos
    from instead of matplotlib's two.
    """
    if not 1 <= images <= len(ORDINALS):
        raise ValueError(f"image_memory: images must be 1 to {len(ORDINALS)}, got {images}")
    sources = photo_sources(photos)
    items = []
    for i in range(n):
        rng = rng_for("image_memory", split, length, seed, i)
        numbers = rng.sample(range(2100, 10000), images)  # not a year, which the passages may name
        names = [numbered_photo(rng, str(num), size, sources) for num in numbers]
        opening = []
        for k in range(images):
            shows = SHOWS[0] if k == 0 else rng.choice(SHOWS[1:])
            opening += [{"role": "user", "content": f"<image {k + 1}>{shows}"},
                        {"role": "assistant", "content": rng.choice(ACKS)}]
        turns = talk_about_passages(tokenizer, rng, opening, length, split, source)
        asked = rng.randrange(images)
        which = "photo" if images == 1 else f"{ORDINALS[asked]} photo"
        items.append(Item("image_memory", item_id("image_memory", split, length, seed, i), "",
                          f"What is the number written on the {which} I showed you? Answer with the number only.",
                          [str(numbers[asked])], messages=opening + turns[: 2 * (len(turns) // 2)],
                          max_new_tokens=8, meta={"images": names, "image_root": str(image_folder())}))
    return items
