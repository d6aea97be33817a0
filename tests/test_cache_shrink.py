"""A compressed cache gives its free pages back (issue 77, item 11), and ``copy_from`` into a policy that reads
queries replays them or refuses (item 12)."""

from __future__ import annotations

import pytest
import torch

from retention.attach import attach_gates
from retention.cache import PagedKVStore, RetentionCache
from retention.cache.pool import PagePool
from retention.compat import cache_kwargs
from retention.policies import get_policy
from retention.policies.recorder import QueryRecorder
from tiny_models import tiny_llama


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = tiny_llama()
    attach_gates(m, mode="score")
    return m


def _prompt(n: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(1, 100, (1, n), generator=torch.Generator().manual_seed(seed))


def _prefill(model, cache: RetentionCache, ids: torch.Tensor) -> None:
    with torch.no_grad():
        model(input_ids=ids, **cache_kwargs(cache), use_cache=True)


def _greedy_logits(model, cache: RetentionCache, last: torch.Tensor, steps: int) -> torch.Tensor:
    """``steps`` greedy one-token forwards from token ``last`` ``(1, 1)``: the logits ``(steps, V)``."""
    out = []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=last, **cache_kwargs(cache), use_cache=True).logits[0, -1]
            out.append(logits)
            last = logits.argmax().view(1, 1)
    return torch.stack(out)


def _entries(store: PagedKVStore) -> list[tuple[torch.Tensor, ...]]:
    """Every stream's entries in order: (keys, values, log_beta, pos), read through the block tables."""
    rows = torch.arange(store.num_streams)
    view = store.gather(rows)
    return [(view.keys[r][view.valid[r]], view.values[r][view.valid[r]], view.log_beta[r][view.valid[r]],
             view.pos[r][view.valid[r]]) for r in rows.tolist()]


def test_the_pool_gives_back_its_free_pages_and_keeps_the_used_ones_in_order():
    pool = PagePool(head_dim=4, page_size=2, capacity=4)
    pages = pool.alloc(torch.arange(12))  # grows to 12 pages
    for i, p in enumerate(pages.tolist()):
        pool.keys[p] = float(i)
    pool.free(pages[[0, 3, 4, 5, 9, 10]])
    kept = pages[[1, 2, 6, 7, 8, 11]]
    new_id = pool.shrink(spare=2)
    assert pool.capacity == 6 + 2 and pool.num_used == 6 and pool.num_free == 2
    pool.check()
    assert new_id[kept].tolist() == list(range(6))  # in id order, to the lowest ids
    assert [float(pool.keys[new_id[p], 0, 0]) for p in kept.tolist()] == [1.0, 2.0, 6.0, 7.0, 8.0, 11.0]
    assert bool((new_id[pages[[0, 3, 4, 5, 9, 10]]] == -1).all())
    more = pool.alloc(torch.arange(5))  # the 2 spare pages, then growth again
    assert sorted(more.tolist())[:2] == [6, 7] and pool.capacity >= 11
    pool.check()
    with pytest.raises(ValueError, match="spare must be >= 0"):
        pool.shrink(-1)


def test_compress_releases_the_pages_and_decoding_is_the_same(model):
    """After a prefill compressed to its budget the pool held its peak (more than a full cache of the prompt would
    need once compressed); with release it holds the used pages plus one spare page a stream, and decoding from it
    gives the very same logits."""
    ids = _prompt(150)
    budget = RetentionCache.budget_for(model, 10)
    kept = RetentionCache(model, budget=None)
    _prefill(model, kept, ids[:, :-1])
    held_full = kept.memory_report()["held_bytes"]
    released = RetentionCache(model, budget=budget, slack=0)
    released.copy_from(kept)
    kept.budget, kept.slack = released.budget, 0  # the same budget for the twin that keeps its pages
    kept.compress(release=False)
    released.compress()
    before, after = kept.memory_report(), released.memory_report()
    assert before["kept_entries"] == after["kept_entries"] <= budget
    assert before["held_bytes"] == held_full  # compress(release=False) gives nothing back
    store = released.store
    per_page = store.pool.page_bytes() + store.page_size * 12 + 8
    spare = store.num_streams
    table = store.block_table.numel() * 8 + 2 * store.lengths.numel() * 8
    assert after["held_bytes"] - after["used_bytes"] == spare * per_page + table
    assert store.pool.capacity == store.pool.num_used + spare
    assert after["held_bytes"] < before["held_bytes"] / 3, (before["held_bytes"], after["held_bytes"])
    assert "held" in str(after) and "used" in str(after)
    store.check()
    for a, b in zip(_entries(kept.store), _entries(store)):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    last = ids[:, -1:]
    torch.testing.assert_close(_greedy_logits(model, released, last, 20), _greedy_logits(model, kept, last, 20),
                               rtol=0, atol=0)
    assert released.evictions > 1  # decoding past the budget evicted again, on the shrunk pool, and grew it back
    store.check()


def test_shrink_then_beams_and_an_unused_cache(model):
    cache = RetentionCache(model, budget=RetentionCache.budget_for(model, 6), slack=0)
    cache.shrink()  # nothing held yet: nothing to do
    ids = _prompt(60, seed=5)
    _prefill(model, cache, ids)
    cache.compress()
    cache.batch_repeat_interleave(2)  # the copies get fresh pages of the shrunk pool
    cache.store.check()
    nxt = torch.tensor([[7], [7]])
    with torch.no_grad():
        logits = model(input_ids=nxt, **cache_kwargs(cache), use_cache=True).logits[:, -1]
    # two rows of one batch: the same up to rounding
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="spare_pages must be an integer >= 0"):
        cache.shrink(-2)


def test_shrink_is_refused_inside_a_planned_step(model):
    """A planned (CUDA-graph) step writes to pool slots fixed before it: moving the pages then would misplace the
    token, so shrink refuses there; between steps it is fine (the decoder records its graph again)."""
    cache = RetentionCache(model, budget=RetentionCache.budget_for(model, 6))
    _prefill(model, cache, _prompt(40))
    n = cache.store.num_streams
    with cache.planned_slots(torch.zeros(cache.num_layers, n, dtype=torch.long), torch.zeros(n, dtype=torch.long)):
        with pytest.raises(RuntimeError, match="planned decode step"):
            cache.shrink()
    cache.shrink()
    cache.store.check()


@pytest.mark.parametrize("name", ["snapkv", "h2o", "tova"])
def test_copy_from_replays_recorded_queries_as_a_direct_prefill_would(model, name):
    ids = _prompt(80, seed=9)
    budget = RetentionCache.budget_for(model, 8)
    direct = RetentionCache(model, budget=budget, policy=get_policy(name))
    _prefill(model, direct, ids)
    direct.compress()
    shared = RetentionCache(model, budget=None, policy=QueryRecorder())
    _prefill(model, shared, ids)
    copied = RetentionCache(model, budget=budget, policy=get_policy(name))
    copied.copy_from(shared)
    copied.compress()
    for a, b in zip(_entries(direct.store), _entries(copied.store)):
        assert torch.equal(a[3], b[3])  # the same positions kept in every stream
    # a source that recorded no queries: refused, naming the way out, instead of keeping the newest tokens
    plain = RetentionCache(model, budget=None)
    _prefill(model, plain, ids)
    blind = RetentionCache(model, budget=budget, policy=get_policy(name))
    with pytest.raises(ValueError, match=rf"policy '{name}' reads the prefill's queries.*QueryRecorder"):
        blind.copy_from(plain)
    # the same policy with other options observed with other settings: refused too
    if name == "snapkv":
        other = RetentionCache(model, budget=None, policy=get_policy(name, window=4))
        _prefill(model, other, ids)
        with pytest.raises(ValueError, match="recorded none"):
            RetentionCache(model, budget=budget, policy=get_policy(name)).copy_from(other)
