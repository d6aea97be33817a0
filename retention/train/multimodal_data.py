"""Training data for vision-language models: conversations with images (``multimodal`` sources and the
``image_memory`` task), encoded by the model's processor and packed whole into rows of ``seq_len`` tokens.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .config import DataConfig, SourceConfig
from .data import synthetic_items, synthetic_reply, template_key
from .images import IMAGE_CHECK_RECORDS, check_record_images, image_root_of, load_image  # noqa: F401
from .sources import SHAREGPT_ROLES, DataError, iter_source, source_fingerprint, to_messages  # noqa: F401

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, ProcessorMixin


def image_tokens(processor: ProcessorMixin, height: int, width: int) -> int:
    """Tokens an image of ``height`` x ``width`` pixels takes after the processor's resize and patch merging."""
    ip = processor.image_processor
    return ip.get_number_of_image_patches(height, width, {}) // getattr(ip, "merge_size", 2) ** 2


def assistant_mask(ids: list[int], tokenizer: PreTrainedTokenizerBase) -> list[bool]:
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


def encode_multimodal(processor: ProcessorMixin, messages: list[dict[str, Any]], seq_len: int,
                      root: Path | None = None) -> dict | None:
    """One conversation through the model's processor: ids, mask and vision inputs; None if longer than seq_len."""
    images = [
        load_image(c.get("image"), root)
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


def conversation_length(processor: ProcessorMixin, messages: list[dict[str, Any]], root: Path | None = None) -> int:
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

    def __init__(self, records: list[tuple[list[dict[str, Any]], Path | None]], rows: list[list[int]],
                 processor: ProcessorMixin, seq_len: int) -> None:
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
            if (enc is None
                    or sum(int(p["input_ids"].shape[1]) for p in parts) + enc["input_ids"].shape[1] > self.seq_len):
                continue  # longer than its estimate (should not happen): leave it out rather than overflow
            parts.append(enc)
        if not parts:
            raise DataError(f"row {i}: no conversation fits data.seq_len = {self.seq_len}")
        return concat_encoded(parts)


def concat_encoded(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Encoded conversations -> one packed row (see :class:`EncodedConversations`)."""
    lengths = [int(p["input_ids"].shape[1]) for p in parts]
    out = {k: torch.cat([p[k] for p in parts], dim=1) for k in ("input_ids", "loss_mask", "mm_token_type_ids")
           if k in parts[0]}
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
    from retention.tasks.image_items import IMAGE_TASKS

    return source.kind == "multimodal" or (source.kind == "synthetic" and source.path in IMAGE_TASKS)


def image_task_conversations(source: SourceConfig, processor: ProcessorMixin,
                             seq_len: int) -> list[list[dict[str, Any]]]:
    """A synthetic image task's items (training haystacks, the source's seed) as multimodal conversations: each turn's
    photos then its text, the answer as the last reply. The text fills ``source.length`` tokens (default: the row less
    128 tokens and the photos' own tokens)."""
    import dataclasses

    from retention.tasks.image_items import dialogue_turns, image_files

    if source.length is None:  # the row less room for the question and answer, and the photos' own tokens
        import inspect

        from retention.tasks import TASKS

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
                                         {"role": "assistant",
                                          "content": [{"type": "text", "text": synthetic_reply(item)}]}])
    return conversations


def build_multimodal(cfg: DataConfig, processor: ProcessorMixin,
                     cache: Path | None = None) -> tuple[EncodedConversations, EncodedConversations]:
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
        root = image_root_of(source)
        records += [(to_messages(record), root) for record in iter_source(source)]
    if not records:
        raise DataError(f"the multimodal sources {[s.path for s in cfg.sources]} hold no conversations")
    # seq_len: an image task's default length is the row's less its photos; the fingerprints: edited local records
    key = hashlib.sha256(json.dumps([[vars(s) for s in cfg.sources], len(records), len(processor.tokenizer),
                                     getattr(processor.tokenizer, "name_or_path", ""),
                                     template_key(processor.tokenizer), cfg.seq_len,
                                     [source_fingerprint(s) for s in cfg.sources]],
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
        raise DataError(f"no multimodal conversation fits data.seq_len = {cfg.seq_len} "
                        f"(shortest: {min(lengths)} tokens)")
    n_eval = max(1, int(len(rows) * cfg.eval_fraction)) if cfg.eval_fraction > 0 and len(rows) > 1 else 0
    train = EncodedConversations(records, rows[: len(rows) - n_eval], processor, cfg.seq_len)
    held = EncodedConversations(records, rows[len(rows) - n_eval :], processor, cfg.seq_len)
    train[0]  # fail now, not mid-run, when the processor cannot read the data
    return train, held
