"""Write the held-out item lists (seeds 0-2, 4096 tokens): id, task, question, answer prefix, answers and the sha256
of the prompt's token ids under SmolLM2's tokenizer, so a later change to a generator shows as a changed set.

    python experiments/generalization/items.py          # rewrites items/heldout-4096-seed{0,1,2}.jsonl
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from retention.tasks import generate
from retention.tasks.prompt import prompt_ids

HERE = Path(__file__).resolve().parent
# the families the full-cache screen kept (README.md), all five question families and both prose genres
KEPT = ("prose_facts", "records", "late_recall", "ruler_niah", "span_cloze", "fidelity_news", "fidelity_wiki")
SEEDS, LENGTH, ITEMS = (0, 1, 2), 4096, 10


def rows(tokenizer, seed: int) -> list[dict]:
    out = []
    for task in KEPT:
        for item in generate(task, tokenizer, LENGTH, ITEMS, seed=seed):
            _, full = prompt_ids(tokenizer, item)
            out.append({"id": item.id, "task": task, "question": item.question, "answer_prefix": item.answer_prefix,
                        "answers": item.answers,
                        "sha256": hashlib.sha256(json.dumps(full).encode()).hexdigest()})
    return out


def path(seed: int) -> Path:
    return HERE / "items" / f"heldout-{LENGTH}-seed{seed}.jsonl"


def main() -> None:
    from transformers import AutoTokenizer

    from retention.models import embedded_model_dir

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir(progress=False))
    for seed in SEEDS:
        path(seed).write_text("".join(json.dumps(r) + "\n" for r in rows(tokenizer, seed)))
        print(f"{path(seed)}: {ITEMS * len(KEPT)} items")


if __name__ == "__main__":
    main()
