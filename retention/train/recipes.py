"""The training recipes users start from (``configs/`` of a checkout, ``retention/configs/`` in a wheel), and
``retention init-config NAME [DEST]``, which copies one out to edit: with the files of its ``base:`` chain beside it,
so the copy stays a readable diff and still loads."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import yaml

from . import config as config_module
from .config import ConfigError


def available_recipes() -> list[str]:
    """Names a bare ``--config`` accepts (the checkout's and the packaged, without duplicates), sub-folders'
    files (``accelerate/zero2.yaml``, ``deepspeed/zero3.json``) included."""
    names: set[str] = set()
    for folder in config_module.CONFIG_DIRS:
        if folder.is_dir():
            names |= {p.relative_to(folder).as_posix() for p in folder.rglob("*")
                      if p.suffix in (".yaml", ".json") and "__pycache__" not in p.parts}
    return sorted(names)


def _recipe(name: str) -> tuple[Path, Path]:
    """``(file, its recipes folder)`` for a recipe's name; ConfigError listing the names when there is none."""
    if Path(name).is_absolute() or ".." in Path(name).parts:
        raise ConfigError(f"init-config copies a packaged recipe by name, not a path ({name!r}); "
                          f"the names: {available_recipes()}")
    for folder in config_module.CONFIG_DIRS:
        for candidate in (folder / name, folder / f"{name}.yaml"):
            if candidate.is_file():
                return candidate, folder
    raise ConfigError(f"no recipe named {name!r}; the names: {available_recipes()}")


def _base_chain(path: Path) -> list[Path]:
    """``path`` and the files its ``base:`` keys name, in order (relative to each naming file's folder)."""
    chain = [path]
    while path.suffix == ".yaml":
        base = (yaml.safe_load(path.read_text()) or {}).get("base")
        if not isinstance(base, str):
            break
        path = path.parent / base
        if path in chain or not path.is_file():
            break  # load_config names the cycle or the missing file
        chain.append(path)
    return chain


def copy_recipe(name: str, dest: str | Path = ".", force: bool = False) -> list[Path]:
    """Copy the recipe ``name`` into the folder ``dest`` (created), with each file its ``base:`` chain names at the
    same place relative to it, so the copy loads as the recipe does. Returns the files written, the recipe first.
    FileExistsError naming the files when one exists already (``force`` to overwrite)."""
    src, folder = _recipe(name)
    dest = Path(dest)
    chain = _base_chain(src)
    targets = []
    for f in chain:
        try:
            targets.append((f, dest / f.resolve().relative_to(folder.resolve())))
        except ValueError:
            raise ConfigError(f"{src} names a base outside the recipes folder ({f}): copy them by hand") from None
    existing = [str(t) for _, t in targets if t.exists()]
    if existing and not force:
        raise FileExistsError(f"init-config would overwrite {existing}: edit those, pass another DEST, or --force")
    for f, t in targets:
        t.parent.mkdir(parents=True, exist_ok=True)
        tmp = t.with_name(f".{t.name}.tmp")
        shutil.copyfile(f, tmp)
        tmp.replace(t)  # atomic: a copy is whole or absent
    return [t for _, t in targets]


def _init_config(args: argparse.Namespace) -> int:
    if args.name is None:
        print("recipes (retention init-config NAME [DEST]):")
        for name in available_recipes():
            print(f"  {name}")
        return 0
    try:
        written = copy_recipe(args.name, args.dest, force=args.force)
    except (ConfigError, OSError) as e:
        print(f"retention init-config: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {written[0]}" + (f" and its base files {', '.join(map(str, written[1:]))}" if written[1:] else ""))
    if written[0].suffix == ".yaml" and written[0].parent.name != "accelerate":
        print(f"edit it, then: retention train --config {written[0]}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("init-config", help="copy a packaged training recipe (and its base: files) to edit")
    p.add_argument("name", nargs="?", default=None,
                   help="recipe name, e.g. smollm2.yaml or accelerate/zero2.yaml (none: list them)")
    p.add_argument("dest", nargs="?", default=".", help="folder to copy it into (default: the working folder)")
    p.add_argument("--force", action="store_true", help="overwrite files that exist")
    p.set_defaults(func=_init_config)
