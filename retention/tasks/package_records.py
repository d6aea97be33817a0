"""Records in real structured text, for training (issue 74): Debian changelog entries and copyright stanzas.

The context is several installed packages' ``changelog.Debian`` files (entries: a ``package (version)`` header,
bullet points, a `` -- Name <email>  date`` trailer) or their machine-readable ``copyright`` files (stanzas:
``Files:``, ``Copyright:``, ``License:``), one after another; one record is asked by its key (a package and
version, or a package and file pattern) for a field it holds: who signed an upload, its date, the bug it closed, or
a stanza's licence. Hundreds of lookalike records with one asked, in text no template wrote: the skill the held-out
``records`` family measures, learned from a genre the reserved-sources table gives to training (the held-out
family's rosters, config files and logs are generated; nothing here is). Half the items are dialogues.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .base import Item, count_tokens, item_id, longest, render_chat, rng_for
from .haystack import documents

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_ENTRY = re.compile(r"^(?P<pkg>[a-z0-9][a-z0-9+.-]*) \((?P<ver>[^)\s]+)\) [^\n]*;[^\n]*\n.*?"
                    r"^ -- (?P<who>[^<\n]+?) <[^>\n]+>  (?P<date>[A-Z][a-z]{2}, +(?P<day>\d{1,2} [A-Z][a-z]{2} \d{4})"
                    r"[^\n]*)$", re.M | re.S)
_STANZA = re.compile(r"^Files: *(?P<files>[^\n]+)\n(?:[ \t][^\n]*\n)*(?:Copyright:[^\n]*\n(?:[ \t][^\n]*\n)*)?"
                     r"License: *(?P<license>[^\n]+)$", re.M)
_CLOSES = re.compile(r"#(\d{4,7})\b")
# records of at most some 100 tokens: a context fits to within one record of its length, also at 512 tokens
_MAX_CHARS = 400


@dataclass(frozen=True)
class _Record:
    text: str  # the record as it stands in its file
    key: str  # what the question names it by: "bash 5.2-3", "lib/fts.c in coreutils"
    fields: tuple[tuple[str, str], ...]  # (what is asked, the answer)
    file: str  # the file it came from, "/usr/share/doc/bash/changelog.Debian"


def _path(title: str) -> str:
    """``debian:bash/changelog`` -> ``/usr/share/doc/bash/changelog.Debian``."""
    package, kind = title.removeprefix("debian:").split("/")
    return f"/usr/share/doc/{package}/" + ("changelog.Debian" if kind == "changelog" else "copyright")


def _changelog_records(title: str, text: str) -> list[_Record]:
    out = []
    for m in _ENTRY.finditer(text):
        if "\n\n" not in m.group(0) or m.group(0).count("\n -- ") > 1 or len(m.group(0)) > _MAX_CHARS:
            continue
        fields = [("signer", m.group("who").strip()), ("day", m.group("day"))]
        bugs = set(_CLOSES.findall(m.group(0)))
        if len(bugs) == 1:
            fields.append(("bug", bugs.pop()))
        out.append(_Record(m.group(0), f"{m.group('pkg')} {m.group('ver')}", tuple(fields), _path(title)))
    return out


def _copyright_records(title: str, text: str) -> list[_Record]:
    package = title.removeprefix("debian:").split("/")[0]
    out = []
    for m in _STANZA.finditer(text):
        files, licence = m.group("files").strip(), m.group("license").strip()
        if files != "*" and len(files) <= 60 and len(licence) <= 40 and len(m.group(0)) <= _MAX_CHARS:
            out.append(_Record(m.group(0), f"{files} in {package}", (("license", licence),), _path(title)))
    return out


_QUESTIONS = {
    "signer": ["Who signed the {K} upload?", "In those changelogs, which maintainer made the upload of {K}?",
               "Whose name is on the {K} changelog entry?", "Who uploaded {K}?"],
    "day": ["On what date was {K} uploaded?", "When was the {K} changelog entry written?",
            "Which day does the {K} entry carry?"],
    "bug": ["Which Debian bug number did the {K} upload close?", "What bug does the {K} entry say it closes?"],
    "license": ["Which licence covers {K}?", "Under what licence are the files {K}?",
                "What does the copyright file give as the licence of {K}?"],
}
_PREFIXES = {
    "signer": ["", "The {K} upload was signed by", "Answer:"],
    "day": ["", "It was uploaded on", "Answer:"],
    "bug": ["", "It closes bug #", "Answer:"],
    "license": ["", "The licence of {K} is", "Answer:"],
}
_PASTE = ["Here are some Debian package files.", "I copied these files from /usr/share/doc.",
          "These are the packaging notes of a few packages."]
_ACK = ["Thanks, I have the files.", "I have read through them.", "Okay. What do you want to know about them?"]


def _records(split: str, kind: str) -> list[list[_Record]]:
    """The split's files of one kind, each as its records (files with at least two)."""
    parse = _changelog_records if kind == "changelog" else _copyright_records
    files = [parse(d.title, d.text) for d in documents(split, "debian") if d.title.endswith("/" + kind)]
    return [r for r in files if len(r) >= 2]


def package_records(tokenizer: PreTrainedTokenizerBase, length: int, n: int, seed: int = 0, split: str = "eval",
                    source: str = "auto") -> list[Item]:
    """``length`` tokens of installed packages' changelogs (two items in three) or copyright files, one record
    asked by its key. ``source`` must be ``auto`` or ``debian``: the text is always the Debian files."""
    if source not in ("auto", "debian"):
        raise ValueError(f"package_records reads the Debian changelog and copyright files, so its haystack is "
                         f"debian (or auto), not {source!r}")
    items = []
    for i in range(n):
        rng = rng_for("package_records", split, length, seed, i)
        kind = "changelog" if rng.random() < 2 / 3 else "copyright"
        pool = _records(split, kind)
        order = rng.sample(range(len(pool)), len(pool))
        # whole files one after another, each under its path (as `head` prints several files)
        chunks: list[tuple[str, list[_Record]]] = []
        for f in order:
            records = pool[f]
            chunks.append((f"==> {records[0].file} <==\n", records))
        units = [(head, r) for head, records in chunks for r in records]

        def body(k: int) -> str:
            out, last = [], None
            for head, r in units[:k]:
                if head != last:
                    out.append(head)
                    last = head
                out.append(r.text + "\n\n")
            return "".join(out)

        if rng.random() < 0.5:  # a dialogue: the files pasted in a user turn, the question in a later one
            paste, ack = rng.choice(_PASTE), rng.choice(_ACK)

            def shaped(k: int) -> list[dict[str, str]] | str:
                return [{"role": "user", "content": paste + "\n\n" + body(k)}, {"role": "assistant", "content": ack}]
        else:
            def shaped(k: int) -> list[dict[str, str]] | str:
                return body(k)

        def size(k: int) -> int:
            out = shaped(k)
            return count_tokens(tokenizer, out if isinstance(out, str) else render_chat(tokenizer, out))

        # the longest run of whole records that fits (a record is at most some 100 tokens, so length / 8 overfill),
        # then records that would overflow are skipped for later, shorter ones, until the context is within 3%
        cap = min(len(units), length // 8)
        if size(cap) <= length:
            raise ValueError(f"package_records: not enough records ({cap}) for {length} tokens")
        lo = longest(lambda k: size(k) <= length, cap)
        for _ in range(200):
            if size(lo) >= 0.97 * length or lo + 1 >= len(units):
                break
            if size(lo + 1) <= length:
                lo += 1
            else:
                del units[lo]
        out = shaped(lo)
        messages = None if isinstance(out, str) else out
        text = out if isinstance(out, str) else out[0]["content"]
        kept = [r for _, r in units[:lo]]
        keys = [r.key for r in kept]
        askable = [r for r in kept if keys.count(r.key) == 1]
        if not askable:
            raise ValueError(f"package_records: no record with a key of its own fits in {length} tokens")
        record = rng.choice(askable)
        what, answer = rng.choice(record.fields)
        question = rng.choice(_QUESTIONS[what]).format(K=record.key)
        prefix = rng.choice(_PREFIXES[what]).format(K=record.key)
        meta = {"record": record.text, "field": what, "file": record.file}
        key = item_id("package_records", split, length, seed, i)
        if messages:
            items.append(Item("package_records", key, "", question, [answer], messages=messages,
                              answer_prefix=prefix, meta=meta))
        else:
            items.append(Item("package_records", key, text, question, [answer], answer_prefix=prefix, meta=meta))
    return items
