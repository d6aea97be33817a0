"""Held-out family 2: records inside structured text (an inventory table, a service config file, a worker log),
one of them asked by its key in a later turn. The whole document is structured text, generated."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from ..base import Item, item_id, rng_for
from .common import fit_conversation

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_FINISH = ["brass", "galvanised", "matte black", "brushed nickel", "cedar", "oak", "copper", "enamelled", "zinc"]
_PART = ["hinge", "bracket", "drawer pull", "hook", "latch", "shelf pin", "castor", "door stop", "coat rail",
         "gate bolt", "hasp", "sash lock", "cabinet knob", "pulley", "corner brace"]
_SIZE = ["small", "large", "25 mm", "40 mm", "heavy-duty", "slim", "double"]
_SERVICES = ["billing", "search", "thumbnails", "mailer", "ledger", "geocoder", "payments", "archive", "reports",
             "scheduler", "uploads", "metrics", "webhooks", "sessions", "inventory", "pricing", "audit", "exports"]
_REGIONS = ["north", "south", "east", "west", "central"]
_JOBS = ["nightly-backup", "reindex", "thumbnail-sweep", "invoice-run", "cache-warm", "log-rotate", "sync-ledger"]


def _table(rng: random.Random, rows: int) -> tuple[list[str], str, str, str, str]:
    pool = [f"{s} {f} {p}" for s in _SIZE for f in _FINISH for p in _PART]
    keys = rng.sample(pool, min(rows, len(pool)))
    qty = [str(rng.randrange(11, 9999)) for _ in keys]
    lines = [f"| {rng.randrange(10000, 99999)} | {k} | aisle {rng.randrange(1, 40)} | {q} |" for k, q in zip(keys, qty)]
    t = rng.randrange(len(keys))
    return (lines, "| SKU | item | location | units in stock |\n|---|---|---|---|",
            "Here is this week's inventory export from the warehouse system.",
            f"How many units of {keys[t]} are in stock, according to the inventory?", qty[t]), t


def _config(rng: random.Random, rows: int):
    pool = [f"{s}-{r}-{k}" for s in _SERVICES for r in _REGIONS for k in range(1, 7)]
    names = rng.sample(pool, min(rows, len(pool)))
    ports = rng.sample(range(2000, 9999), len(names))
    lines = [f"[service.{n}]\nhost = 10.{rng.randrange(256)}.{rng.randrange(256)}.{rng.randrange(1, 255)}\n"
             f"port = {p}\nworkers = {rng.randrange(1, 33)}\ntimeout_s = {rng.choice([5, 10, 15, 30, 60])}\n"
             for n, p in zip(names, ports)]
    t = rng.randrange(len(names))
    return (lines, "# services.ini (generated, do not edit by hand)\n",
            "This is the services config file from our deployment.",
            f"Which port does the {names[t]} service use in that config file?", str(ports[t])), t


def _log(rng: random.Random, rows: int):
    ids = rng.sample(range(10000, 99999), rows)
    ms = [str(rng.randrange(101, 99999)) for _ in ids]
    stamps = sorted(rng.randrange(0, 14 * 86400) for _ in ids)  # two weeks of June, in order
    lines = [f"2025-06-{10 + s // 86400} {s // 3600 % 24:02d}:{s // 60 % 60:02d}:{s % 60:02d} INFO "
             f"worker-{rng.randrange(1, 64)} job {j} ({rng.choice(_JOBS)}) finished in {m} ms"
             for s, j, m in zip(stamps, ids, ms)]
    t = rng.randrange(rows)
    return (lines, "", "These are the last lines of the worker log from last night.",
            f"How many milliseconds did job {ids[t]} take, according to the log?", ms[t]), t


_FORMATS = {"table": _table, "config": _config, "log": _log}


def records(tokenizer: PreTrainedTokenizerBase, length: int, n: int, seed: int = 0, split: str = "eval",
            source: str = "auto") -> list[Item]:
    """A structured document (table, config file or log, by turns) of ``length`` tokens of conversation; one
    record's value is asked by its key. ``split``/``source`` are ignored: generated text, evaluation only."""
    items = []
    for i in range(n):
        rng = rng_for("records", "eval", length, seed, i)
        fmt = list(_FORMATS)[i % 3]
        cap = length // 8 + 8  # more records than fit; the asked one is kept among those that do
        (lines, header, opener, question, answer), t = _FORMATS[fmt](rng, cap)
        # the asked record moved to a random place among the first ones, so it survives the cut to length
        row = lines.pop(t)
        depth = rng.uniform(0.05, 0.95)

        def build(k: int) -> str:
            kept = lines[:k]
            kept.insert(round(depth * k), row)
            return (header + "\n" if header else "") + "\n".join(kept)

        messages = fit_conversation(tokenizer, length, opener, "Thanks, I have it open. What do you need?",
                                    build, len(lines))
        items.append(Item("records", item_id("records", "eval", length, seed, i), "", question + " Reply with the "
                          "value only.", [answer], messages=messages, meta={"format": fmt, "depth": depth}))
    return items
