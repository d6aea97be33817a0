"""Standard long-context sets from the Hub, as :class:`~eval.tasks.Item` lists (for GPU users).

Each loader calls ``datasets.load_dataset`` with the set's Hub id; ``data_files`` points the same code at
local files in the same format (what the tests do, and what offline users do with downloaded copies).
"""

from __future__ import annotations

from typing import Any, Callable

from .tasks import Item

HUB_IDS = {
    "ruler": "simonjegou/ruler",  # columns: context, question, answer (list), task
    "longbench": "THUDM/LongBench",  # per-subset configs; columns: context, input, answers, _id
    "longbench_v2": "THUDM/LongBench-v2",  # columns: _id, context, question, choice_A..D, answer (letter)
    "mmdu": "laolao77/MMDU",  # columns: id, conversations (list of {from, value}), image paths; judged score optional
}


def _load(name: str, subset: str | None, split: str, data_files: Any) -> Any:
    import datasets

    if data_files is not None:
        return datasets.load_dataset("json", data_files=data_files, split="train")
    try:
        return datasets.load_dataset(HUB_IDS[name], subset, split=split)
    except Exception as e:  # offline, no access, unknown subset
        raise RuntimeError(f"cannot load {HUB_IDS[name]!r} ({subset or 'default'}, {split}): {e}; "
                           "download it where the Hub is reachable and pass data_files=") from None


def load_ruler(subset: str = "4096", split: str = "test", data_files: Any = None, limit: int | None = None) -> list[Item]:
    ds = _load("ruler", subset, split, data_files)
    return [Item(f"ruler/{r.get('task', 'ruler')}", f"ruler-{i}", r["context"], r["question"],
                 list(r["answer"]) if isinstance(r["answer"], list) else [r["answer"]])
            for i, r in enumerate(ds) if limit is None or i < limit]


def load_longbench(subset: str = "hotpotqa", split: str = "test", data_files: Any = None, limit: int | None = None) -> list[Item]:
    ds = _load("longbench", subset, split, data_files)
    return [Item(f"longbench/{subset}", r.get("_id", f"lb-{i}"), r["context"], r["input"], list(r["answers"]))
            for i, r in enumerate(ds) if limit is None or i < limit]


def load_longbench_v2(split: str = "train", data_files: Any = None, limit: int | None = None) -> list[Item]:
    ds = _load("longbench_v2", None, split, data_files)
    items = []
    for i, r in enumerate(ds):
        if limit is not None and i >= limit:
            break
        choices = "\n".join(f"({c}) {r[f'choice_{c}']}" for c in "ABCD")
        q = f"{r['question']}\n{choices}\nAnswer with the letter of the correct choice, e.g. (A)."
        items.append(Item("longbench_v2", r["_id"], r["context"], q, [f"({r['answer']})"]))
    return items


def load_mmdu(split: str = "train", data_files: Any = None, limit: int | None = None,
              judge: Callable[[str, str], float] | None = None) -> list[Item]:
    """MMDU dialogues: earlier turns become ``messages`` (image placeholders kept as text markers; pass
    the images to a Qwen3-VL processor when running), the last human turn is the question and the
    reference reply the answer. ``judge(reply, reference) -> score`` is stored for a pluggable judged score."""
    ds = _load("mmdu", None, split, data_files)
    items = []
    for i, r in enumerate(ds):
        if limit is not None and i >= limit:
            break
        turns = [{"role": "user" if t["from"] in ("human", "user") else "assistant", "content": t["value"]}
                 for t in r["conversations"]]
        *history, question, reference = turns
        items.append(Item("mmdu", str(r.get("id", i)), "", question["content"], [reference["content"]],
                          messages=history, meta={"images": r.get("image", []), "judge": judge}))
    return items
