"""KV budgets of a sweep: a fraction of the context, absolute KV entries, or tokens per KV head.

One entry is one token in one KV head of one layer (the cache's unit); a model with L layers and
H_kv KV heads holds ``tokens * L * H_kv`` entries for ``tokens`` tokens. In configs::

    budgets: [0.1, "25%", {entries: 20000}, {tokens: 64}, "20000 entries", "64 tokens"]

A bare number must lie in (0, 1] (a fraction): a bare 64 would be ambiguous between entries and tokens.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

KINDS = ("fraction", "entries", "tokens")


@dataclass(frozen=True)
class Budget:
    kind: str  # one of KINDS
    value: float

    @property
    def key(self) -> str:
        """Canonical text stored in results (``fraction=0.1``, ``entries=20000``, ``tokens=64``)."""
        # counts in full: ``:g`` wrote 1234567 entries as 1.23457e+06, a key parse_budget refused (report, pool,
        # publish) and that 1234570 entries shared
        return f"{self.kind}={self.value:g}" if self.kind == "fraction" else f"{self.kind}={int(self.value)}"

    @property
    def label(self) -> str:
        if self.kind == "fraction":
            return f"{self.value * 100:g}%"
        return f"{int(self.value)} entries" if self.kind == "entries" else f"{int(self.value)} tok/head"

    def entries(self, context_tokens: int, streams: int) -> int:
        """Entries for a context of ``context_tokens`` tokens in a model with ``streams`` = L * H_kv."""
        from retention.budget import entries_for_fraction, entries_for_tokens

        if self.kind == "fraction":
            return entries_for_fraction(self.value, context_tokens, streams)
        if self.kind == "tokens":
            return entries_for_tokens(max(1, int(self.value)), streams)
        return int(self.value)


def parse_budget(spec: Any) -> Budget:
    """A :class:`Budget` from a config value; ``ValueError`` says which forms are allowed."""
    allowed = ("a fraction in (0, 1] (0.1 or '10%'), {entries: N}, {tokens: N}, 'N entries' or 'N tokens'")
    if isinstance(spec, Budget):
        return spec
    if isinstance(spec, bool):
        raise ValueError(f"budget {spec!r} is not allowed; use {allowed}")
    if isinstance(spec, (int, float)):
        if 0 < spec <= 1:
            return Budget("fraction", float(spec))
        raise ValueError(f"budget {spec!r}: a bare number must be a fraction in (0, 1]; use {allowed}")
    if isinstance(spec, dict) and len(spec) == 1:
        (kind, value), = spec.items()
        if kind in KINDS and isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            if kind == "fraction" and value > 1:
                raise ValueError(f"budget {spec!r}: a fraction must be in (0, 1]")
            if kind != "fraction" and not float(value).is_integer():  # entries() would cut it, the key would not
                what = "KV entries" if kind == "entries" else "tokens per KV head"
                raise ValueError(f"budget {spec!r}: {kind} must be a whole number of {what}")
            return Budget(kind, float(value))
    if isinstance(spec, str):
        s = spec.strip()
        m = re.fullmatch(r"([0-9.]+)\s*%", s)
        if m and 0 < float(m.group(1)) <= 100:
            return Budget("fraction", float(m.group(1)) / 100)
        m = re.fullmatch(r"([0-9]+)\s*(entries|tokens)", s)
        if m and int(m.group(1)) > 0:
            return Budget(m.group(2), float(m.group(1)))
        # the canonical key itself (``:g`` writes a fraction under 1e-4 with an exponent: fraction=5e-05)
        m = re.fullmatch(r"(fraction|entries|tokens)=([0-9.]+(?:e-[0-9]+)?)", s)
        if m:
            return parse_budget({m.group(1): float(m.group(2))})
    raise ValueError(f"budget {spec!r} is not allowed; use {allowed}")
