"""Items whose turns show images (MMDU, image_memory): which tasks have them, where an item's image files are, and
which images each turn shows. Read by the eval's multimodal protocol and by training's multimodal data.
"""

from __future__ import annotations

import re
from pathlib import Path

from .base import Item

_MARKER = re.compile(r"<image (\d+)>")
IMAGE_TASKS = ("mmdu", "image_memory")  # tasks whose items show images: a vision-language model runs them here


def is_multimodal_item(item: Item) -> bool:
    return bool(item.meta.get("images"))


def image_files(item: Item) -> list[Path]:
    """The item's image files, relative paths resolved against ``meta["image_root"]`` (the data file's folder)."""
    root = Path(item.meta.get("image_root") or ".")
    return [p if (p := Path(s).expanduser()).is_absolute() else root / p for s in item.meta["images"]]


def dialogue_turns(item: Item) -> tuple[list[tuple[str, str, list[int]]], list[int]]:
    """``([(user text, reply, image numbers)], question's image numbers)``: each user turn's ``<image k>`` markers
    name the images it shows (1-based, in ``meta["images"]``); the markers stay in the text as the images' names."""
    msgs = [m for m in item.messages or [] if m["role"] != "system"]
    if any(m["role"] != r for m, r in zip(msgs, ["user", "assistant"] * len(msgs))) or len(msgs) % 2:
        raise ValueError(f"{item.id}: the history must alternate user and assistant turns, ending with a reply")
    n = len(item.meta["images"])
    shown = lambda text: [k for k in map(int, _MARKER.findall(text)) if 1 <= k <= n]  # noqa: E731
    turns = [(u["content"], a["content"], shown(u["content"])) for u, a in zip(msgs[::2], msgs[1::2])]
    return turns, shown(item.question)
