"""Held-out genres: prose that no training source uses (issue 74), for the held-out task families and fidelity.

* ``news``: the Lee news corpus (348 Australian news articles, 2001) inside the ``gensim`` wheel;
* ``wiki``: the shortened English Wikipedia dump (206 articles, 2016) inside the same wheel, its markup stripped.

``pip install --no-deps gensim`` installs them (``make setup`` does); nothing of gensim is imported, its files are
read. Training refuses these genres (:data:`HELD_OUT_SOURCES`): they exist to measure gates on text they never saw.
"""

from __future__ import annotations

import bz2
import functools
import html
import importlib.metadata
import re
import xml.etree.ElementTree as ET
from pathlib import Path

HELD_OUT_SOURCES = ("news", "wiki")
_WIKI = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"


def _data_dir() -> Path:
    try:
        dist = importlib.metadata.distribution("gensim")
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError("the held-out genres 'news' and 'wiki' are read from the gensim wheel's test data: "
                           "pip install --no-deps gensim (make setup installs it)") from None
    return Path(dist.locate_file("gensim/test/test_data"))


def news_articles() -> list[tuple[str, str]]:
    """``(title, text)`` of the Lee corpus's articles: one per line of ``lee_background.cor`` and ``lee.cor``."""
    out = []
    for name in ("lee_background.cor", "lee.cor"):
        lines = (_data_dir() / name).read_text(encoding="utf-8", errors="replace").splitlines()
        out += [(f"news:{name.split('.')[0]}:{k}", line.strip()) for k, line in enumerate(lines) if line.strip()]
    return out


_TEMPLATE = re.compile(r"\{\{[^{}]*\}\}")  # innermost {{...}}: removed repeatedly, so nested ones go too
_TABLE = re.compile(r"\{\|.*?\|\}", re.S)
_REF = re.compile(r"<ref[^>]*/>|<ref[^>]*>.*?</ref>", re.S)
_BLOCK = re.compile(r"<(math|gallery|source|syntaxhighlight|timeline|score)[^>]*>.*?</\1>|<!--.*?-->", re.S)
_TAG = re.compile(r"<[^>]+>")
_FILE_LINK = re.compile(r"\[\[(?:File|Image|Category):[^\[\]]*(?:\[\[[^\]]*\]\][^\[\]]*)*\]\]", re.I)
_LINK = re.compile(r"\[\[(?:[^|\]]*\|)?([^\]]*)\]\]")
_EXTERNAL = re.compile(r"\[https?://\S+ ?([^\]]*)\]")


def strip_wikitext(text: str) -> str:
    """Prose lines of a wikitext page: templates, tables, references, formulas, files and tags removed, links as
    their text, headings, lists and table rows dropped."""
    text = _BLOCK.sub("", _REF.sub("", html.unescape(text)))
    for _ in range(6):
        text, n = _TEMPLATE.subn("", text)
        if not n:
            break
    text = _TABLE.sub("", _FILE_LINK.sub("", text))
    text = _EXTERNAL.sub(r"\1", _LINK.sub(r"\1", text))
    text = _TAG.sub("", text).replace("'''", "").replace("''", "")
    lines = [ln.strip() for ln in text.splitlines()]
    return "\n".join(ln for ln in lines if ln and not ln.startswith(("=", "*", "#", "|", "!", ":", ";", "{", "}")))


def wiki_articles() -> list[tuple[str, str]]:
    """``(title, prose)`` of the dump's articles (redirects and pages under 200 characters of prose left out)."""
    out = []
    with bz2.open(_data_dir() / _WIKI) as f:
        for _, el in ET.iterparse(f):
            if el.tag.rsplit("}", 1)[-1] != "page":
                continue
            title = next((c.text for c in el.iter() if c.tag.endswith("title")), "") or ""
            body = next((c.text for c in el.iter() if c.tag.endswith("text")), "") or ""
            el.clear()
            if body.lstrip().upper().startswith("#REDIRECT"):
                continue
            prose = strip_wikitext(body)
            if len(prose) >= 200:
                out.append((f"wiki:{title}", prose))
    return out


@functools.lru_cache(maxsize=2)
def genre_documents(genre: str) -> tuple[tuple[str, str], ...]:
    """The documents of one held-out genre, ``(title, text)``, in a fixed order."""
    if genre == "news":
        return tuple(news_articles())
    if genre == "wiki":
        return tuple(wiki_articles())
    raise ValueError(f"held-out genre must be one of {list(HELD_OUT_SOURCES)}, got {genre!r}")
