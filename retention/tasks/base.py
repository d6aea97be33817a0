"""What a task produces (items with a context, a question and the answers that count) and the
helpers every generator shares: per-item seeded randomness and fitting a context to a token length."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class Item:
    """One evaluation item.

    ``context`` is what gets compressed before ``question`` arrives (query-agnostic protocol);
    ``messages`` (dialogue tasks) replaces ``context`` with earlier chat turns. ``answers`` are the
    references ``metric`` compares the reply with (``recall``: the share of them found in the reply).
    ``answer_prefix`` starts the assistant's reply (as RULER does) so small models answer directly.
    Fidelity items carry a ``continuation`` (scored by KL / top-1 against the full cache) instead.
    """

    task: str
    id: str
    context: str
    question: str
    answers: list[str]
    messages: list[dict[str, str]] | None = None
    continuation: str | None = None
    answer_prefix: str = ""
    metric: str = "recall"
    max_new_tokens: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)


def item_id(task: str, split: str, length: int, seed: int, i: int) -> str:
    return f"{task}-{split}-{length}-{seed}-{i}"


def rng_for(task: str, split: str, length: int, seed: int, i: int) -> random.Random:
    """Independent randomness per item: item i does not depend on how many items are drawn."""
    return random.Random(f"{task}/{split}/{length}/{seed}/{i}")


def count_tokens(tokenizer: PreTrainedTokenizerBase, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def fit_length(tokenizer: PreTrainedTokenizerBase, target: int, build: Callable[[int], str],
               max_units: int) -> tuple[str, int]:
    """The longest ``build(k)`` (``k <= max_units`` units of filler) with at most ``target`` tokens.

    Binary search on ``k``: the whole text is tokenised each time, so seams between sentences and
    inserted needles are counted exactly as the model will see them.
    """
    least = count_tokens(tokenizer, build(0))
    if least > target:  # was returned as it was: a context past its length, under that length's name
        raise ValueError(f"length {target} is too short: the task's text without filler (instructions, needles) is "
                         f"{least} tokens; raise the length")
    if count_tokens(tokenizer, build(max_units)) <= target:
        raise ValueError(f"not enough filler ({max_units} units) for {target} tokens")
    k = longest(lambda k: count_tokens(tokenizer, build(k)) <= target, max_units)
    return build(k), k


def longest(fits: Callable[[int], bool], hi: int) -> int:
    """The largest ``k`` in ``[0, hi)`` with ``fits(k)``, for ``fits`` true at 0, false at ``hi`` and monotone: a
    binary search, since each call tokenises a whole text."""
    lo = 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def place(filler: list[str], inserts: list[str], depths: list[float]) -> str:
    """Insert sentences into a haystack at relative depths in [0, 1] (stable as the haystack is cut)."""
    out = list(filler)
    for s, d in sorted(zip(inserts, depths), key=lambda p: -p[1]):  # deepest first keeps earlier indices valid
        out.insert(round(d * len(filler)), s)
    return " ".join(out)


def magic_number(rng: random.Random) -> str:
    return str(rng.randrange(1_000_000, 9_999_999))


# Keys for needles: common, single-token-ish English nouns (distinct from each other).
KEYS = ["amber", "falcon", "harbor", "meadow", "lantern", "quartz", "willow", "canyon", "ember", "glacier",
        "orchid", "pepper", "raven", "saffron", "thistle", "velvet", "walnut", "zephyr", "cobalt", "juniper",
        "compass", "marble", "violet", "beacon", "copper", "island", "mirror", "prairie", "summit", "tundra"]


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]],
                add_generation_prompt: bool = False) -> str:
    """The prompt string of a conversation: the tokenizer's chat template, or a plain fallback."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    text = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages)
    return text + ("Assistant:" if add_generation_prompt else "")


def fit_conversation(tokenizer: PreTrainedTokenizerBase, length: int, opener: str, ack: str,
                     build: Callable[[int], str], max_units: int) -> list[dict[str, str]]:
    """``[user: opener + document, assistant: ack]`` with the longest ``build(k)`` whose rendered conversation has
    at most ``length`` tokens: the question then comes in a turn of its own, after the assistant's reply."""
    def msgs(k: int) -> list[dict[str, str]]:
        return [{"role": "user", "content": opener + "\n\n" + build(k)}, {"role": "assistant", "content": ack}]

    def size(k: int) -> int:
        return count_tokens(tokenizer, render_chat(tokenizer, msgs(k)))

    if size(0) > length:
        raise ValueError(f"length {length} is too short: the conversation without its document is {size(0)} tokens")
    if size(max_units) <= length:
        raise ValueError(f"not enough text ({max_units} units) for {length} tokens")
    return msgs(longest(lambda k: size(k) <= length, max_units))
