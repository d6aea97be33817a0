"""Held-out family 2: records inside structured text (a staff roster, a service config file, a worker log): one
record carries a field no other record has (a note, a key, an error), asked by that field in a later turn. The
whole document is structured text, generated."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from ..base import Item, fit_conversation, item_id, rng_for
from .common import person

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_SERVICES = ["billing", "search", "thumbnails", "mailer", "ledger", "geocoder", "payments", "archive", "reports",
             "scheduler", "uploads", "metrics", "webhooks", "sessions", "inventory", "pricing", "audit", "exports"]
_REGIONS = ["north", "south", "east", "west", "central"]
_JOBS = ["nightly-backup", "reindex", "thumbnail-sweep", "invoice-run", "cache-warm", "log-rotate", "sync-ledger"]

# Each format: routine records by the hundred, and one record with a field found nowhere else in the document,
# asked by that field. (A first version asked one routine record among hundreds of lookalikes: the full cache of
# SmolLM2-135M answered 0 of 10 at 4k, copying another row's value; the family measures what a budget keeps of a
# record the model can find, as the needle families do.)
_ROLES = ["picker", "packer", "driver", "forklift operator", "clerk", "cleaner", "inspector", "loader"]
_UNIQUE_NOTES = [("alarm code", "keyholder, alarm code {v}"), ("locker number", "first-aider, kit in locker {v}"),
                 ("radio channel", "fire warden, radio channel {v}"), ("van number", "on call, drives van {v}")]
_UNIQUE_SECTIONS = [("database.primary", "the primary database"), ("queue.broker", "the message broker"),
                    ("cache.redis", "the redis cache"), ("mail.smtp_relay", "the SMTP relay")]
_FAILED_JOBS = ["restore-archive", "rebuild-search-index", "rotate-tls-certs", "migrate-billing-db"]


def _table(rng: random.Random, rows: int):
    """A staff roster whose notes column is empty but in one row; the number that note holds is asked."""
    lines = [f"| {person(rng)} | {rng.choice(_ROLES)} | shift {rng.choice('ABC')} | ext. {rng.randrange(1000, 9999)} "
             "| - |" for _ in range(rows)]
    what, note = rng.choice(_UNIQUE_NOTES)
    value = str(rng.randrange(100, 9999))
    t = rng.randrange(rows)
    lines[t] = lines[t].removesuffix("| - |") + f"| {note.format(v=value)} |"
    return (lines, "| name | role | shift | phone | notes |\n|---|---|---|---|---|",
            "Here is the staff roster exported from the depot's rota system.",
            f"One row of that roster has a note that gives a {what}. Which {what} is it?", value,
            f'That note reads: "{note.format(v="").rstrip()}'), t


def _config(rng: random.Random, rows: int):
    """Service sections of an ini file, and one section of another kind with a key no other section has."""
    pool = [f"{s}-{r}-{k}" for s in _SERVICES for r in _REGIONS for k in range(1, 7)]
    names = rng.sample(pool, min(rows, len(pool)))

    def section(name: str) -> str:
        return (f"[{name}]\nhost = 10.{rng.randrange(256)}.{rng.randrange(256)}.{rng.randrange(1, 255)}\n"
                f"port = {rng.randrange(2000, 9999)}\nworkers = {rng.randrange(1, 33)}\n"
                f"timeout_s = {rng.choice([5, 10, 15, 30, 60])}\n")

    key, what = rng.choice(_UNIQUE_SECTIONS)
    value = str(rng.randrange(20, 5000))
    lines = [section(f"service.{n}") for n in names]
    t = rng.randrange(len(names))
    lines[t] = section(key) + f"max_connections = {value}\n"
    return (lines, "# services.ini (generated, do not edit by hand)\n",
            "This is the services config file from our deployment.",
            f"What is max_connections set to for {what} ([{key}]) in that config file?", value,
            f"Under [{key}] it says: max_connections ="), t


def _log(rng: random.Random, rows: int):
    """A worker log of finished jobs; one job failed, its exit code asked."""
    ids = rng.sample(range(10000, 99999), rows)
    stamps = sorted(rng.randrange(0, 14 * 86400) for _ in ids)  # two weeks of June, in order

    def when(s: int) -> str:
        return f"2025-06-{10 + s // 86400} {s // 3600 % 24:02d}:{s // 60 % 60:02d}:{s % 60:02d}"

    lines = [f"{when(s)} INFO worker-{rng.randrange(1, 64)} job {j} ({rng.choice(_JOBS)}) finished in "
             f"{rng.randrange(101, 99999)} ms" for s, j in zip(stamps, ids)]
    job, code = rng.choice(_FAILED_JOBS), str(rng.randrange(2, 256))
    t = rng.randrange(rows)
    lines[t] = (f"{when(stamps[t])} ERROR worker-{rng.randrange(1, 64)} job {ids[t]} ({job}) failed with exit code "
                f"{code}")
    return (lines, "", "These are the last lines of the worker log from last night.",
            f"The {job} job failed last night. Which exit code did it fail with, according to the log?", code,
            f"The {job} job failed with exit code"), t


_FORMATS = {"table": _table, "config": _config, "log": _log}


def records(tokenizer: PreTrainedTokenizerBase, length: int, n: int, seed: int = 0, split: str = "eval",
            source: str = "auto") -> list[Item]:
    """A structured document (roster, config file or log, by turns) of ``length`` tokens of conversation; the one
    record with a field no other has is asked by that field. ``split``/``source`` are ignored: generated text,
    evaluation only."""
    items = []
    for i in range(n):
        rng = rng_for("records", "eval", length, seed, i)
        fmt = list(_FORMATS)[i % 3]
        cap = length // 8 + 8  # more records than fit; the asked one is kept among those that do
        (lines, header, opener, question, answer, prefix), t = _FORMATS[fmt](rng, cap)
        # the asked record moved to a random place among the first ones, so it survives the cut to length
        row = lines.pop(t)
        depth = rng.uniform(0.05, 0.95)

        def build(k: int) -> str:
            kept = lines[:k]
            kept.insert(round(depth * k), row)
            return (header + "\n" if header else "") + "\n".join(kept)

        messages = fit_conversation(tokenizer, length, opener, "Thanks, I have it open. What do you need?",
                                    build, len(lines))
        items.append(Item("records", item_id("records", "eval", length, seed, i), "", question, [answer],
                          messages=messages, answer_prefix=prefix, meta={"format": fmt, "depth": depth}))
    return items
