"""Paged KV store: append, gather, compaction, page reuse and pool growth; property-based pool checks."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from retention.cache import PagedKVStore, PagePool


def _fill(store: PagedKVStore, rows: torch.Tensor, T: int, start: int) -> None:
    """Append T entries whose key[0] = stream id, key[1] = position, so content is traceable."""
    R, D = len(rows), store.pool.head_dim
    pos = (start + torch.arange(T)).expand(R, T)
    keys = torch.zeros(R, T, D)
    keys[..., 0] = rows[:, None].float()
    keys[..., 1] = pos.float()
    store.append(rows, keys, -keys, -(pos.float() / 100), pos.clone())


def test_append_gather_roundtrip_and_page_count():
    store = PagedKVStore(batch=2, num_layers=3, num_kv_heads=2, head_dim=4, page_size=4)
    for step in range(3):
        for layer in range(3):
            _fill(store, store.streams(layer), 5, 5 * step)
    store.check()
    assert store.lengths.tolist() == [15] * 12
    assert store.pool.num_used == 12 * 4  # ceil(15 / 4) pages per stream
    view = store.gather_layer(1)
    assert view.keys.shape == (2, 2, 16, 4)
    assert view.valid.sum().item() == 4 * 15
    rows = store.streams(1).view(2, 2)
    assert torch.equal(view.keys[..., :15, 0], rows[..., None].float().expand(2, 2, 15))
    assert torch.equal(view.pos[..., :15], torch.arange(15).expand(2, 2, 15))
    assert torch.equal(view.values, -view.keys)


def test_compact_keeps_order_positions_and_frees_pages():
    store = PagedKVStore(batch=1, num_layers=1, num_kv_heads=2, head_dim=4, page_size=4)
    rows = store.streams(0)
    _fill(store, rows, 14, 0)
    used_before = store.pool.num_used
    view = store.gather(rows)
    keep = torch.zeros_like(view.valid)
    keep[0, [0, 3, 9, 13]] = True  # stream 0 keeps 4 entries (one page)
    keep[1, :14:2] = True  # stream 1 keeps 7 (two pages)
    store.compact(rows, keep)
    store.check()
    assert store.lengths.tolist() == [4, 7]
    assert store.pool.num_used == used_before - 3 - 2  # 4 pages each -> 1 and 2
    after = store.gather(rows)
    assert after.pos[0, :4].tolist() == [0, 3, 9, 13]
    assert after.keys[0, :4, 1].tolist() == [0.0, 3.0, 9.0, 13.0]  # content moved with its position
    assert after.pos[1, :7].tolist() == list(range(0, 14, 2))
    assert torch.allclose(after.log_beta[1, :7], -torch.arange(0, 14, 2).float() / 100)


def test_pool_grows_and_reuses_freed_pages():
    pool = PagePool(head_dim=2, page_size=2, capacity=2)
    a = pool.alloc(torch.tensor([0, 0, 1]))
    assert pool.capacity >= 3 and sorted(a.tolist()) == sorted(set(a.tolist()))
    pool.keys[a[0]] = 7.0
    pool.grow(10)
    assert pool.capacity == 10 and bool((pool.keys[a[0]] == 7.0).all())  # ids and data survive growth
    pool.free(a[:2])
    b = pool.alloc(torch.tensor([3, 3]))
    assert set(b.tolist()) == set(a[:2].tolist())  # freed pages come back first
    pool.check()


def test_growth_hands_out_freed_pages_before_new_ones():
    """The new pages of a growth went on top of the free stack: a page freed before the growth was passed over
    for new ids (4, 5 here, not 1, 4), against the pool's own rule that freed and low ids come back first."""
    pool = PagePool(head_dim=1, page_size=1, capacity=4)
    assert pool.alloc(torch.zeros(4, dtype=torch.long)).tolist() == [0, 1, 2, 3]
    pool.free(torch.tensor([1]))
    assert pool.alloc(torch.zeros(2, dtype=torch.long)).tolist() == [1, 4] and pool.capacity == 8
    pool.free(torch.tensor([2, 0]))
    pool.grow(9)  # a growth on its own: the freed pages stay on top, the new ones below in ascending order
    got = pool.alloc(torch.zeros(5, dtype=torch.long)).tolist()
    assert sorted(got[:2]) == [0, 2] and got[2:] == [5, 6, 7] and pool.capacity == 16
    pool.check()


def test_double_free_raises():
    pool = PagePool(head_dim=2, page_size=2, capacity=4)
    p = pool.alloc(torch.tensor([0]))
    pool.free(p)
    try:
        pool.free(p)
    except RuntimeError as e:
        assert "double free" in str(e)
    else:
        raise AssertionError("double free not detected")


def test_select_batch_frees_dropped_sequences():
    store = PagedKVStore(batch=3, num_layers=2, num_kv_heads=1, head_dim=4, page_size=2)
    for layer in range(2):
        _fill(store, store.streams(layer), 3, 0)
    store.select_batch(torch.tensor([2, 0]))
    store.check()
    assert store.batch == 2 and store.pool.num_used == 4 * 2
    assert store.gather_layer(0).keys[0, 0, 0, 0].item() == 4.0  # old sequence 2, layer 0 stream id


ops = st.lists(
    st.tuples(st.sampled_from(["append", "evict"]), st.integers(0, 5), st.integers(0, 2**31 - 1)),
    min_size=1,
    max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(ops=ops, page_size=st.integers(1, 5), batch=st.integers(1, 3))
def test_random_append_evict_never_leaks_or_mixes(ops, page_size, batch):
    """Random appends and evictions: no leak, no double free, every entry stays in its own stream."""
    store = PagedKVStore(batch=batch, num_layers=2, num_kv_heads=2, head_dim=3, page_size=page_size, initial_pages=1)
    expected = [[] for _ in range(store.num_streams)]  # positions per stream, in order
    step = 0
    for op, n, seed in ops:
        g = torch.Generator().manual_seed(seed)
        if op == "append":
            layer = seed % 2
            rows = store.streams(layer)
            _fill(store, rows, n, step)
            for r in rows.tolist():
                expected[r] += list(range(step, step + n))
            step += n
        else:
            rows = torch.randperm(store.num_streams, generator=g)[: n + 1]
            view = store.gather(rows, with_kv=False)
            keep = torch.rand(view.valid.shape, generator=g) < 0.5
            store.compact(rows, keep)
            for i, r in enumerate(rows.tolist()):
                expected[r] = [p for j, p in enumerate(expected[r]) if keep[i, j]]
        store.check()
        assert store.lengths.tolist() == [len(e) for e in expected]
    rows = torch.arange(store.num_streams)
    view = store.gather(rows)
    for r in range(store.num_streams):
        n = len(expected[r])
        assert view.pos[r, :n].tolist() == expected[r]
        assert bool((view.keys[r, :n, 0] == r).all()), "an entry moved into another stream"
        assert view.keys[r, :n, 1].tolist() == [float(p) for p in expected[r]]
    store.clear()
    store.check()
    assert store.pool.num_used == 0


def test_select_batch_copies_a_sequence_named_twice():
    """Beam search / repeated samples: duplicates get their own pages with the same entries."""
    store = PagedKVStore(batch=3, num_layers=2, num_kv_heads=2, head_dim=4, page_size=2)
    for layer in range(2):
        _fill(store, store.streams(layer), 5, 0)
    before = [store.gather(store.sequence_streams(b)) for b in range(3)]
    order = torch.tensor([2, 0, 2, 2])
    store.select_batch(order)
    store.check()  # no page in two tables, owners renumbered, nothing leaked
    assert store.batch == 4 and store.pool.num_used == 4 * 4 * 3  # 4 sequences x 4 streams x ceil(5 / 2)
    for new, old in enumerate(order.tolist()):
        got, want = store.gather(store.sequence_streams(new)), before[old]
        for name in ("keys", "values", "log_beta", "pos", "valid"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (new, name)
    # the copies are independent: growing one leaves its twin as it was
    _fill(store, store.sequence_streams(2), 3, 5)
    store.check()
    assert store.lengths.view(4, -1)[2].tolist() == [8] * 4 and store.lengths.view(4, -1)[0].tolist() == [5] * 4
    assert torch.equal(store.gather(store.sequence_streams(3)).keys, before[2].keys)
    with pytest.raises(IndexError, match=r"must lie in \[0, 4\)"):
        store.select_batch(torch.tensor([4]))


def test_host_lengths_follow_every_change():
    """On a GPU the store plans pages from a host copy of the lengths (no device sync per append); here
    the copy is forced apart from the device tensor (on CPU they are one tensor) and must agree after
    appends, compaction, batch selection with repeats and clearing."""
    store = PagedKVStore(batch=2, num_layers=2, num_kv_heads=2, head_dim=4, page_size=4)
    store.host_lengths = store.lengths.clone()

    def agree() -> None:
        assert torch.equal(store.host_lengths, store.lengths)
        store.check()

    for layer in range(2):
        store.append_layer(layer, torch.randn(4, 9, 4), torch.randn(4, 9, 4), torch.randn(4, 9),
                           torch.arange(9).expand(4, 9))
    _fill(store, store.streams(1), 3, 9)
    agree()
    assert store.lengths.tolist() == [9, 9, 12, 12] * 2
    rows = store.streams(0)
    keep = torch.rand(4, 12, generator=torch.Generator().manual_seed(0)) < 0.5
    store.compact(rows, keep)
    agree()
    assert store.lengths[rows].tolist() == (keep[:, :9].sum(1)).tolist()
    store.select_batch(torch.tensor([1, 1, 0]))
    store.host_lengths = store.lengths.clone()
    for layer in range(2):  # cached stream ids follow the new batch
        store.append_layer(layer, torch.randn(6, 1, 4), torch.randn(6, 1, 4), torch.randn(6, 1), torch.full((6, 1), 20))
    agree()
    assert store.gather_layer(1).pos.shape[:2] == (3, 2)
    assert store.longest(1) == int(store.lengths[store.streams(1)].max())
    store.clear()
    agree()
    assert int(store.host_lengths.sum()) == 0


def test_gather_layer_sizes_its_padding_from_the_host_lengths():
    """``gather_layer`` pads to the longest stream as the host copy counts it (reading the device lengths'
    maximum would wait for the GPU once per layer and token); the entries and their mask come from the
    device lengths, so a host count above them only widens the padding."""
    store = PagedKVStore(batch=2, num_layers=2, num_kv_heads=2, head_dim=4, page_size=4)
    for layer in range(2):
        _fill(store, store.streams(layer), 5 + 4 * layer, 0)
    _fill(store, store.streams(1)[:1], 3, 9)  # one stream of layer 1 longer than the rest
    assert store.longest(0) == 5 and store.longest(1) == 12
    want = store.gather(store.streams(1))
    got = store.gather_layer(1)
    assert got.valid.shape == (2, 2, 12)
    for name in ("keys", "values", "log_beta", "pos", "valid"):
        assert torch.equal(getattr(got, name).flatten(0, 1), getattr(want, name))
    store.host_lengths = store.lengths.clone()  # apart, as on a GPU
    store.host_lengths[store.streams(1)[3]] = 14
    wider = store.gather_layer(1)
    assert wider.valid.shape == (2, 2, 16) and store.longest(1) == 14
    assert torch.equal(wider.valid[..., :12].flatten(0, 1), want.valid) and not wider.valid[..., 12:].any()
    assert torch.equal(wider.keys[..., :12, :].flatten(0, 1)[want.valid], want.keys[want.valid])


def test_random_operations_equal_a_list_model():
    """Seeded random appends (by rows and by layer), decode reservations (written or released), compactions, batch
    selections with repeats, clears and pool growth, on a store whose host lengths are apart from the device ones
    (as on a GPU) or not: after every operation each stream holds exactly a plain list's keys, values, log betas and
    positions in order, every page is free or owned by the one stream that lists it, and the pool grows only when
    its free pages cannot hold what is needed."""
    for seed in range(40):
        rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
        B, L, H, D, ps = rng.randint(1, 3), rng.randint(1, 3), rng.randint(1, 2), rng.randint(1, 3), rng.randint(1, 4)
        store = PagedKVStore(B, L, H, D, page_size=ps, initial_pages=rng.choice([None, 1]))
        split = rng.random() < 0.5
        if split:
            store.host_lengths = store.lengths.clone()
        model: list[list[tuple]] = [[] for _ in range(store.num_streams)]

        def draw(R: int, T: int) -> tuple[torch.Tensor, ...]:
            return (torch.randn(R, T, D, generator=g), torch.randn(R, T, D, generator=g),
                    -torch.rand(R, T, generator=g), torch.randint(-1, 1000, (R, T), generator=g))

        def add(rows: list[int], k, v, lb, pos) -> None:
            for i, r in enumerate(rows):
                model[r] += [(k[i, t], v[i, t], float(lb[i, t]), int(pos[i, t])) for t in range(k.shape[1])]

        for _ in range(30):
            op = rng.choice(["rows", "layer", "reserve", "release", "compact", "select", "clear"])
            capacity, peak = store.pool.capacity, 0  # peak: pages held between a reservation and its release
            if op == "rows":
                rows, T = rng.sample(range(store.num_streams), rng.randint(1, store.num_streams)), rng.randint(0, 9)
                k, v, lb, pos = draw(len(rows), T)
                store.append(torch.tensor(rows), k, v, lb, pos)
                add(rows, k, v, lb, pos)
            elif op == "layer":
                layer, T = rng.randrange(L), rng.choice([1, 2, 7])
                k, v, lb, pos = draw(B * H, T)
                store.append_layer(layer, k, v, lb, pos)
                add(store.streams(layer).tolist(), k, v, lb, pos)
            elif op in ("reserve", "release"):
                slot = store.reserve_next()
                if op == "reserve":
                    k, v, lb, pos = draw(store.num_streams, 1)
                    store.write(slot, k[:, 0], v[:, 0], lb[:, 0], pos[:, 0])
                    add(list(range(store.num_streams)), k, v, lb, pos)
                else:
                    peak = store.pool.num_used
                    store.release_next()
            elif op == "compact":
                rows = torch.tensor(rng.sample(range(store.num_streams), rng.randint(1, store.num_streams)))
                keep = torch.rand(store.gather(rows, with_kv=False).valid.shape, generator=g) < rng.random()
                store.compact(rows, keep)
                for i, r in enumerate(rows.tolist()):
                    model[r] = [e for j, e in enumerate(model[r]) if keep[i, j]]
            elif op == "select":
                order = [rng.randrange(B) for _ in range(rng.randint(1, 3))]
                store.select_batch(torch.tensor(order))
                n = L * H
                B, model = len(order), [list(model[b * n + j]) for b in order for j in range(n)]
                if split:
                    store.host_lengths = store.lengths.clone()
            else:
                store.clear()
                model = [[] for _ in model]
            store.check()
            assert torch.equal(store.host_lengths, store.lengths)
            assert store.pool.num_used == sum(-(-len(m) // ps) for m in model)
            assert store.pool.capacity == capacity or max(peak, store.pool.num_used) > capacity, "grew with free pages"
            view = store.gather(torch.arange(store.num_streams))
            for r, m in enumerate(model):
                assert int(view.valid[r].sum()) == len(m), (seed, op, r)
                assert view.pos[r, : len(m)].tolist() == [e[3] for e in m], (seed, op, r)
                assert view.log_beta[r, : len(m)].tolist() == [e[2] for e in m]
                if m:
                    assert torch.equal(view.keys[r, : len(m)], torch.stack([e[0] for e in m]))
                    assert torch.equal(view.values[r, : len(m)], torch.stack([e[1] for e in m]))
