"""Multi-turn dialogue memory: personal facts stated in the first turns of a long conversation and
asked at the end. In between, realistic turns: the user shares passages of real text (speeches or
documentation) and asks about them; the assistant answers by quoting the passage."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any, Sequence

from .haystack import passage
from .base import Item, count_tokens, item_id, render_chat, rng_for

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

NAMES = ["Ada", "Bruno", "Chiara", "Dmitri", "Esther", "Farid", "Greta", "Hiro", "Ines", "Jonas", "Kofi", "Lena"]
CITIES = ["Lisbon", "Oslo", "Nairobi", "Quito", "Kyoto", "Tallinn", "Porto", "Hobart", "Lyon", "Cusco", "Tromso"]
PETS = [("parrot", "Pixel"), ("tortoise", "Basil"), ("cat", "Mochi"), ("dog", "Waffle"), ("rabbit", "Clover")]
JOBS = ["a nurse", "a carpenter", "a pilot", "a librarian", "a chemist", "a baker", "an architect", "a violinist"]
ASKS = ["What do you make of this passage?", "Can you pick out the key sentence here?",
        "What stands out to you in this part?", "Here is the next bit I read. Thoughts?",
        "Which line here matters most, in your view?"]
REPLIES = ["The key line seems to be: \"{s}\"", "What stands out is this: \"{s}\" It sets the tone of the passage.",
           "I would single out: \"{s}\"", "The central point is captured by \"{s}\""]


def _facts(rng: random.Random) -> list[tuple[str, str, str]]:
    """(statement, question, answer) for the user's name, city, pet and job."""
    name, city, job = rng.choice(NAMES), rng.choice(CITIES), rng.choice(JOBS)
    kind, pet = rng.choice(PETS)
    return [
        (f"My name is {name}.", "What is my name?", name),
        (f"I live in {city}.", "Which city do I live in?", city),
        (f"I have a {kind} called {pet}.", f"What is the name of my {kind}?", pet),
        (f"I work as {job}.", "What is my job?", job.split(" ", 1)[1]),
    ]


def dialogue_memory(tokenizer: PreTrainedTokenizerBase, length: int, n: int, seed: int = 0, split: str = "eval",
                    source: str = "auto", facts: int = 2) -> list[Item]:
    """``facts`` facts (of name / city / pet / job) in the opening turns; one is asked at the end.

    ``length`` counts the rendered conversation (chat template included) before the question.
    """
    items = []
    for i in range(n):
        rng = rng_for("dialogue_memory", split, length, seed, i)
        stated = rng.sample(_facts(rng), facts)
        opening = [
            {"role": "user", "content": "Hi! A bit about me before we start: " + " ".join(s for s, _, _ in stated)
             + " I am reading some old texts and would like to discuss them with you."},
            {"role": "assistant", "content": "Nice to meet you! I am happy to discuss them. Please share a passage."},
        ]
        turns = talk_about_passages(tokenizer, rng, opening, length, split, source)
        lo = len(turns) // 2
        _, question, answer = stated[rng.randrange(facts)]
        items.append(Item("dialogue_memory", item_id("dialogue_memory", split, length, seed, i), "",
                          question + " Answer in a few words.", [answer], messages=opening + turns[: 2 * lo],
                          meta={"facts": [s for s, _, _ in stated]}))
    return items


def talk_about_passages(tokenizer: PreTrainedTokenizerBase, rng: random.Random, opening: list[dict[str, Any]],
                        length: int, split: str, source: str, asks: Sequence[str] = ASKS,
                        replies: Sequence[str] = REPLIES) -> list[dict[str, str]]:
    """Turns after ``opening`` in which the user shares passages of real text and the assistant quotes them: whole
    exchanges while the rendered conversation fits ``length`` tokens, then a last one cut to fit. ``asks``: what the
    user says after a passage; ``replies``: the assistant's, ``{s}`` standing for the sentence it quotes."""
    def fits(msgs: list[dict[str, Any]]) -> bool:
        return count_tokens(tokenizer, render_chat(tokenizer, msgs)) <= length

    def exchange(sents: list[str], ask: str, reply: str) -> list[dict[str, str]]:
        quote = sents[min(len(sents) - 1, hash_index)]
        return [{"role": "user", "content": " ".join(sents) + "\n\n" + ask},
                {"role": "assistant", "content": reply.format(s=quote)}]

    if not fits(opening):  # was returned as it was: a conversation past its length, under that length's name
        have = count_tokens(tokenizer, render_chat(tokenizer, opening))
        raise ValueError(f"length {length} is too short: the dialogue's opening turns alone are {have} tokens; "
                         "raise the length")
    turns: list[dict[str, str]] = []
    while True:  # whole exchanges while they fit, then a last one cut to fit
        sents = passage(rng, rng.randint(3, 8), split, source)
        ask, reply, hash_index = rng.choice(asks), rng.choice(replies), rng.randrange(3)
        if fits(opening + turns + exchange(sents, ask, reply)):
            turns += exchange(sents, ask, reply)
            continue
        for k in range(len(sents) - 1, 0, -1):
            if fits(opening + turns + exchange(sents[:k], ask, reply)):
                turns += exchange(sents[:k], ask, reply)
                break
        else:  # not even one sentence fits: the longest prefix of its words that does (short contexts)
            words = sents[0].split()
            for k in range(len(words) - 1, 3, -1):
                if fits(opening + turns + exchange([" ".join(words[:k])], ask, reply)):
                    turns += exchange([" ".join(words[:k])], ask, reply)
                    break
        return turns
