"""Facts phrased many ways, for training (issue 74): the mixture's retrieval source that names no test.

Each item states one to four facts (a subject, an attribute, a value) in real text of the training pool, each in
one of many sentence frames, with or without an intro line, in one turn or pasted earlier in a dialogue; one fact
is asked with a paraphrased question, with or without an answer prefix. About 7 subject kinds x 14 attributes x 12
frames x 8 questions: thousands of surface forms, so gates learn to keep what reads like a stated fact rather than
one template. Its names, places, value formats and wording occur in no held-out family
(``tests/test_tasks_heldout.py`` holds them apart).
"""

from __future__ import annotations

import random
import string
from typing import TYPE_CHECKING, Callable

from .base import Item, fit_conversation, fit_length, item_id, place, rng_for
from .haystack import passage

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_PEOPLE = ["Dr. Abernathy", "Ms. Whitcombe", "Mr. Oyelaran", "Professor Tanaka-Reyes", "Captain Ferreira",
           "Aunt Gwendolyn", "Councillor Brightwater", "Nurse Adebayo", "Judge Halloran", "Coach Petrakis"]
_GROUPS = ["the Juniper project", "the Tuesday book club", "unit 7B", "the night shift", "team Falcon",
           "the river survey", "the east wing", "the spring audit", "the pilot programme", "the chess league"]
_THINGS = ["the blue cabinet", "the spare laptop", "the delivery van", "the garden shed", "the main server",
           "the lab freezer", "the back office", "the old safe", "the projector", "the bike rack"]
_CITIES = ["Harrogate", "Winnipeg", "Porto Alegre", "Nagoya", "Aberdeen", "Savannah", "Cluj", "Tampere",
           "Hobart", "Leeds", "Tucson", "Rennes"]
_COLOURS = ["teal", "crimson", "ochre", "lavender", "olive", "charcoal", "amber", "turquoise", "maroon"]
_WORDS = ["pelican", "lantern", "quartz", "meadow", "harbour", "violin", "cobalt", "saffron", "glacier", "thimble"]


def _digits(rng: random.Random, lo: int, hi: int) -> str:
    return str(rng.randrange(10 ** (lo - 1), 10 ** hi))


def _token(rng: random.Random) -> str:
    """A mixed code such as ``7QX4-2``: letters and digits, unlike any held-out code format."""
    chars = string.ascii_uppercase + string.digits
    return "".join(rng.choice(chars) for _ in range(4)) + f"-{rng.randrange(10)}"


def _date(rng: random.Random) -> str:
    return f"{rng.randrange(2026, 2040)}-{rng.randrange(1, 13):02d}-{rng.randrange(1, 29):02d}"


# attribute -> (the subjects it fits, how its values are drawn)
_ATTRIBUTES: dict[str, tuple[list[str], Callable[[random.Random], str]]] = {
    "access code": (_THINGS + _GROUPS, _token),
    "badge number": (_PEOPLE, lambda r: _digits(r, 4, 6)),
    "room number": (_PEOPLE + _GROUPS, lambda r: _digits(r, 3, 3)),
    "order number": (_GROUPS + _PEOPLE, lambda r: _digits(r, 6, 8)),
    "serial number": (_THINGS, _token),
    "booking reference": (_PEOPLE + _GROUPS, _token),
    "favourite colour": (_PEOPLE, lambda r: r.choice(_COLOURS)),
    "home city": (_PEOPLE, lambda r: r.choice(_CITIES)),
    "meeting city": (_GROUPS, lambda r: r.choice(_CITIES)),
    "start date": (_GROUPS + _PEOPLE, _date),
    "inspection date": (_THINGS, _date),
    "budget": (_GROUPS, lambda r: f"{r.randrange(2, 950)},{r.randrange(0, 1000):03d} pounds"),
    "password hint": (_PEOPLE + _THINGS, lambda r: r.choice(_WORDS)),
    "code word": (_GROUPS + _PEOPLE, lambda r: r.choice(_WORDS)),
}
# a subject's own wording: "Dr. Abernathy's badge number" but "the badge number of the Juniper project"
_FRAMES = [
    "{S_poss} {A} is {V}.",
    "The {A} of {S} is {V}.",
    "For the record, {S_poss} {A} is {V}.",
    "{S} has {V} listed as the {A}.",
    "It was noted that the {A} for {S} is {V}.",
    "Please keep in mind: {S_poss} {A} is {V}.",
    "{V} is the {A} that belongs to {S}.",
    "According to the notes, {S} uses the {A} {V}.",
    "In case anyone asks, the {A} for {S} is {V}.",
    "Remember that {S_poss} {A} is {V}.",
    "{S}: {A} {V}.",
    "We were told the {A} of {S} had been set to {V}.",
]
_QUESTIONS = [
    "What is {S_poss} {A}?",
    "What is the {A} of {S}?",
    "Which {A} does {S} have?",
    "Tell me the {A} for {S}.",
    "Can you find the {A} of {S} in the text?",
    "What {A} was given for {S}?",
    "Look back at the text: what is {S_poss} {A}?",
    "I need the {A} for {S}. What is it?",
]
_PREFIXES = ["", "", "{S_poss} {A} is", "The {A} for {S} is", "Answer:"]
_INTROS = ["", "", "", "Read the following text; you may be asked about it afterwards.\n",
           "Some details are mentioned in the passage below.\n", "Here is a document to read.\n",
           "The text below contains a few facts worth noting.\n"]
_PASTE = ["Could you read this for me?", "Here is some text I am working with.", "Have a look at this passage.",
          "I am pasting a document below."]
_ACK = ["Done, I have read it.", "Okay, I have gone through it.", "Read it. What would you like to know?",
        "Got it, ask away."]


def _words(template: str, subject: str, attribute: str, value: str = "") -> str:
    poss = subject + ("'" if subject.endswith("s") else "'s")
    out = template.format(S=subject, S_poss=poss, A=attribute, V=value)
    # a sentence's first letter capitalised, unless it is the value's (the answer is asked as stated)
    return out[0].upper() + out[1:] if out and not template.startswith("{V}") else out


def varied_facts(tokenizer: PreTrainedTokenizerBase, length: int, n: int, seed: int = 0, split: str = "eval",
                 source: str = "auto", facts: int = 0) -> list[Item]:
    """``facts`` facts (0: one to four, drawn per item) in ``length`` tokens of the ``split`` pool's text, each in
    a frame drawn from many; one is asked. Half the items are dialogues (the text pasted, then the question in a
    later turn), half a context followed by the question."""
    items = []
    for i in range(n):
        rng = rng_for("varied_facts", split, length, seed, i)
        count = facts or rng.randint(1, 4)
        stated: list[tuple[str, str, str]] = []
        while len(stated) < count:  # distinct (subject, attribute) pairs: each question has one answer
            attribute = rng.choice(list(_ATTRIBUTES))
            subjects, draw = _ATTRIBUTES[attribute]
            subject = rng.choice(subjects)
            if all((subject, attribute) != (s, a) for s, a, _ in stated):
                stated.append((subject, attribute, draw(rng)))
        sentences = [_words(rng.choice(_FRAMES), s, a, v) for s, a, v in stated]
        depths = [rng.random() for _ in stated]
        subject, attribute, value = stated[rng.randrange(count)]
        question = _words(rng.choice(_QUESTIONS), subject, attribute)
        prefix = _words(rng.choice(_PREFIXES), subject, attribute)
        intro = rng.choice(_INTROS)
        filler = passage(rng, length // 6 + 16, split, source)

        def text(k: int) -> str:  # the first k filler sentences with the facts placed in them
            return place(filler[:k], sentences, depths)

        item_key = item_id("varied_facts", split, length, seed, i)
        meta = {"facts": sentences, "depths": depths}
        if rng.random() < 0.5:
            context, _ = fit_length(tokenizer, length, lambda k: intro + text(k), len(filler))
            items.append(Item("varied_facts", item_key, context, question, [value], answer_prefix=prefix, meta=meta))
            continue
        paste, ack = rng.choice(_PASTE), rng.choice(_ACK)
        messages = fit_conversation(tokenizer, length, paste + ("\n" + intro.strip() if intro else ""), ack,
                                    text, len(filler))
        items.append(Item("varied_facts", item_key, "", question, [value], messages=messages, answer_prefix=prefix,
                          meta=meta))
    return items
