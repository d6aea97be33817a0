"""Multi-turn dialogue memory: personal facts stated early in a long conversation, asked at the end,
with realistic turns in between (the user shares passages of real speeches, the assistant replies)."""

from __future__ import annotations

from ..haystack import filler
from .base import Item, rng_for

NAMES = ["Ada", "Bruno", "Chiara", "Dmitri", "Esther", "Farid", "Greta", "Hiro", "Ines", "Jonas"]
CITIES = ["Lisbon", "Oslo", "Nairobi", "Quito", "Kyoto", "Tallinn", "Porto", "Hobart", "Lyon", "Cusco"]
PETS = ["a parrot named Pixel", "a tortoise named Basil", "a cat named Mochi", "a dog named Waffle"]
REPLIES = ["That is an interesting passage.", "Thanks for sharing that.", "I see, please go on.",
           "That passage reflects its time.", "Noted. What else did you read?"]


def dialogue_memory(tokenizer, length: int, n: int, seed: int = 0, split: str = "eval") -> list[Item]:
    items = []
    for i in range(n):
        rng = rng_for("dialogue_memory", length, seed, i)
        name, city, pet = rng.choice(NAMES), rng.choice(CITIES), rng.choice(PETS)
        fact = rng.choice([
            (f"By the way, my name is {name} and I live in {city}.", "Where do I live?", [city]),
            (f"Before we start: I have {pet}.", "What is the name of my pet?", [pet.split()[-1]]),
            (f"Just so you know, my name is {name}.", "What is my name?", [name]),
        ])
        messages = [{"role": "user", "content": fact[0] + " I will share some passages I am reading."},
                    {"role": "assistant", "content": "Nice to meet you! Please share them."}]
        count = 40
        while count < length - 30:
            passage = " ".join(filler(tokenizer, min(200, length - count), rng, split))
            messages += [{"role": "user", "content": passage}, {"role": "assistant", "content": rng.choice(REPLIES)}]
            count += len(tokenizer(passage, add_special_tokens=False)["input_ids"]) + 20
        items.append(Item("dialogue_memory", f"dialogue_memory-{length}-{seed}-{i}", "", fact[1], fact[2], messages=messages))
    return items
