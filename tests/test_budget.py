"""The budget arithmetic of retention/budget.py against the formulas its callers used before it existed (training,
the eviction-aware objective, the cache, evaluation), and those callers through it."""

import pytest

from retention.budget import (capacity_target, default_slack, entries_for_fraction, entries_for_tokens, streams_of,
                              training_entries)
from retention.eval.budgets import parse_budget


def test_tokens_per_head_and_global_entries_as_training_and_the_cache_count_them():
    streams = streams_of(30, 3)  # SmolLM2-135M: 30 layers x 3 KV heads
    assert streams == 90
    assert entries_for_tokens(384, streams) == 34560  # the shipped stage 3's budget: "34560 entries in all"
    assert training_entries(384, None, streams) == 34560
    assert training_entries(None, 20, 6) == 20  # budget.global_entries wins over tokens per head
    assert training_entries(4, 20, 6) == 20
    assert capacity_target(34560, streams, "per_head") == 384.0  # TRIM-KV's M: per KV head
    assert capacity_target(34560, streams, "global") == 34560.0
    assert isinstance(capacity_target(24, 6, "global"), float)


def test_a_share_of_the_context_rounds_as_each_caller_did():
    streams = 90
    for fraction in (0.01, 0.05, 0.1, 0.2, 0.33):
        for ctx in range(1, 3000, 7):
            # evaluation (Budget.entries): the product with L * H_kv, at least one entry
            assert entries_for_fraction(fraction, ctx, streams) == max(1, round(fraction * ctx * streams))
            # the eviction-aware objective: layers and heads apart, no floor
            assert entries_for_fraction(fraction, ctx, 30, 3, at_least=0) == round(fraction * ctx * 30 * 3)
    # the two orders meet a tie at .5 differently, kept as they were: 1% of 165 tokens x 90 streams is 148.5
    assert entries_for_fraction(0.01, 165, 90) == 148 and entries_for_fraction(0.01, 165, 30, 3) == 149
    assert entries_for_fraction(1e-6, 10, 90) == 1 and entries_for_fraction(1e-6, 10, 30, 3, at_least=0) == 0


@pytest.mark.parametrize("spec, context, want", [
    (0.1, 4096, 36864), ("25%", 1000, 22500), ({"entries": 20000}, 4096, 20000), ({"tokens": 64}, 4096, 5760),
    ("64 tokens", 0, 5760), (0.0001, 1, 1),
])
def test_eval_budgets_count_through_it(spec, context, want):
    assert parse_budget(spec).entries(context, 90) == want


def test_the_cache_counts_tokens_and_its_slack_through_it():
    from retention.attach import attach_gates
    from retention.cache import RetentionCache
    from tiny_models import tiny_llama

    model = tiny_llama()  # 3 layers x 2 KV heads
    attach_gates(model, None, mode="score", seed=0)
    assert RetentionCache.budget_for(model, tokens=64) == entries_for_tokens(64, streams_of(3, 2)) == 384
    cache = RetentionCache(model, budget=384, page_size=16)
    assert cache.slack == default_slack(6, 16) == 96  # one page in every (layer, KV head) stream
