"""KV budget arithmetic, in one place: tokens per head, a share of the context or a global count -> KV entries.

One entry is one token in one KV head of one layer (the cache's unit). A model of ``L`` layers and ``H_kv`` KV
heads has ``streams = L * H_kv`` of them per token, so ``tokens`` tokens in every head are ``tokens * streams``
entries. Training (``budget.*`` of a config, ``loss.evict_fractions``), the cache
(:meth:`retention.cache.RetentionCache.budget_for` and its eviction slack) and evaluation
(:class:`retention.eval.budgets.Budget`) all count through these functions. Plain integers in, plain integers out:
this module imports nothing of the library, so every layer may use it.
"""

from __future__ import annotations


def streams_of(num_layers: int, num_kv_heads: int) -> int:
    """KV entries one token adds to a full cache: one per layer and KV head (``L * H_kv``)."""
    return int(num_layers) * int(num_kv_heads)


def entries_for_tokens(tokens: int, streams: int) -> int:
    """Entries that hold ``tokens`` tokens in each of ``streams`` (layer, KV head) pairs."""
    return int(tokens) * streams


def entries_for_fraction(fraction: float, context_tokens: int, *streams: int, at_least: int = 1) -> int:
    """Entries that keep ``fraction`` of a ``context_tokens``-token context's ``context_tokens * streams``, rounded,
    and at least ``at_least`` (an eviction-aware training item counts the bare rounding: ``at_least=0``).

    ``streams`` is one number (``L * H_kv``, as evaluation passes it) or its factors (``L, H_kv``, as training
    passes them); the product is taken left to right, as each caller always took it, so a count that lands on a
    tie at .5 rounds as it did (the two orders differ there by one entry, e.g. 1% of 165 tokens x 30 x 3)."""
    product = fraction * context_tokens
    for factor in streams:
        product *= factor
    return max(at_least, round(product))


def training_entries(tokens_per_head: int | None, global_entries: int | None, streams: int) -> int:
    """A training config's budget (``budget.global_entries``, else ``budget.tokens_per_head`` in every head) in
    entries for a model with ``streams`` = layers x KV heads."""
    return global_entries if global_entries is not None else entries_for_tokens(tokens_per_head, streams)


def capacity_target(total: int, streams: int, form: str) -> float:
    """The capacity loss's budget ``M``: ``total`` entries for the whole model (``form`` ``global``), or their
    share per KV head (``per_head``, TRIM-KV's form)."""
    return total / streams if form == "per_head" else float(total)


def default_slack(streams: int, page_size: int) -> int:
    """Entries a streaming cache may hold past its budget before it evicts: one page in every stream (eviction then
    runs once per page of new tokens rather than at every token)."""
    return streams * page_size
