"""Global eviction: equals a brute-force top-B, scores match their definition, sizes stay bounded."""

from __future__ import annotations

import math

import pytest
import torch

from hypothesis import given, settings
from hypothesis import strategies as st

from retention.attach import attach_gates
from retention.compat import cache_kwargs
from retention.cache import PagedKVStore, RetentionCache
from retention.cache.hf import CacheBudgetError
from retention.policies import EntryView, GlobalGatesPolicy, TrimKVPolicy, lookahead_log_score
from tiny_models import tiny_llama

L, H = 3, 2  # tiny model: 3 layers, 2 KV heads


@pytest.fixture(scope="module")
def model():
    m = tiny_llama()
    attach_gates(m, mode="score")
    return m


def _filled_cache(model, lb: torch.Tensor, pads: int = 0, keys: torch.Tensor | None = None,
                  values: torch.Tensor | None = None, **opts) -> RetentionCache:
    """A cache whose store holds ``lb`` ``(B, L, H, T)`` log-betas, and ``keys`` / ``values`` ``(B, L, H, T, D)``
    when given (else key[0] = value[0] encodes (layer, head, pos)); the first ``pads`` tokens of every sequence are
    left padding (position -1)."""
    B, _, _, T = lb.shape
    if keys is None:
        keys = torch.zeros(B, L, H, T, 4)
        keys[..., 0] = (torch.arange(L)[:, None, None] * 100 + torch.arange(H)[:, None] * 10000
                        + torch.arange(T)).float()
        values = keys
    D = keys.shape[-1]
    cache = RetentionCache(model, **opts)
    cache.store = PagedKVStore(B, L, H, D, page_size=3)
    pos = torch.arange(T).expand(B * H, T).clone()
    pos[:, :pads] = -1
    for layer in range(L):
        cache.store.append(cache.store.streams(layer), keys[:, layer].reshape(B * H, T, D),
                           values[:, layer].reshape(B * H, T, D), lb[:, layer].reshape(B * H, T), pos)
    cache._seen = [T] * L
    cache._pad_entries = torch.zeros(B, dtype=torch.long)
    cache._start = torch.full((B,), pads, dtype=torch.long)
    return cache


def _kept(cache: RetentionCache, b: int, keys: torch.Tensor | None = None,
          values: torch.Tensor | None = None) -> set[tuple[int, int, int]]:
    """(layer, head, pos) of sequence ``b``'s kept entries, each checked to still carry its own key and value
    (``keys`` / ``values`` as given to :func:`_filled_cache`, or its (layer, head, pos) code)."""
    out = set()
    for layer in range(L):
        v = cache.store.gather_layer(layer)
        for h in range(H):
            for j in range(int(v.valid[b, h].sum())):
                pos = int(v.pos[b, h, j])
                assert pos >= 0, "a padding entry was kept"
                if keys is None:
                    assert int(v.keys[b, h, j, 0]) == layer * 100 + h * 10000 + pos, "content and position separated"
                else:
                    assert torch.equal(v.keys[b, h, j], keys[b, layer, h, pos]), "content and position separated"
                    assert torch.equal(v.values[b, h, j], values[b, layer, h, pos]), "content and position separated"
                out.add((layer, h, pos))
    return out


def _brute_force(lb: torch.Tensor, budget: int, horizon: int, window: int = 0, pads: int = 0, sink: int = 0) -> set:
    """Top-``budget`` by (score desc, pos desc, layer asc, head asc), protected window always in,
    then the first ``sink`` real tokens (score +inf) before every scored entry."""
    T = lb.shape[-1]
    rows = []
    for layer in range(L):
        for h in range(H):
            for i in range(pads, T):
                s = float(lookahead_log_score(lb[layer, h, i], torch.tensor(T - i), horizon))
                s = math.inf if i - pads < sink else s  # the first real tokens
                forced = i >= T - window
                rows.append((not forced, -s, -i, layer, h, (layer, h, i)))
    rows.sort(key=lambda r: r[:5])
    forced = [r[-1] for r in rows if not r[0]]
    free = [r[-1] for r in rows if r[0]]
    return set(forced) | set(free[: max(budget - len(forced), 0)])


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    T=st.integers(1, 12),
    budget=st.integers(6, 60),
    horizon=st.sampled_from([1, 4, 64]),
    ties=st.booleans(),
    batch=st.integers(1, 2),
)
def test_global_eviction_equals_brute_force(model, seed, T, budget, horizon, ties, batch):
    g = torch.Generator().manual_seed(seed)
    lb = -torch.rand(batch, L, H, T, generator=g) * 3
    if ties:  # few distinct values: tie-breaking decides
        lb = (lb * 2).round() / 2
    cache = _filled_cache(model, lb, budget=budget, policy=GlobalGatesPolicy(horizon=horizon, sink=0), slack=0)
    cache.evict(torch.arange(batch), torch.full((batch,), budget))
    cache.store.check()
    for b in range(batch):
        assert _kept(cache, b) == _brute_force(lb[b], budget, horizon)
        assert int(cache.store.lengths.view(batch, -1)[b].sum()) == min(budget, L * H * T)


def test_protected_window_and_padding_tokens(model):
    g = torch.Generator().manual_seed(1)
    lb = -torch.rand(1, L, H, 10, generator=g) * 3
    lb[..., 7:] = -50.0  # the newest tokens score worst but sit in the protected window
    cache = _filled_cache(model, lb, pads=2, budget=24, protected_window=3, slack=0, policy=GlobalGatesPolicy(sink=0))
    cache.evict(torch.tensor([0]), torch.tensor([24]))
    kept = _kept(cache, 0)
    assert kept == _brute_force(lb[0], 24, 1, window=3, pads=2)
    assert all(p >= 2 for _, _, p in kept), "padding tokens must be dropped"


@pytest.mark.parametrize("horizon,pads", [(1, 0), (64, 0), (1, 3)])
def test_sink_tokens_are_kept_whatever_their_gates_say(model, horizon, pads):
    g = torch.Generator().manual_seed(2)
    lb = -torch.rand(1, L, H, 12, generator=g)
    lb[..., pads : pads + 2] = -50.0  # the first real tokens score worst: without sinks they go first
    budget = 2 * L * H + 5
    cache = _filled_cache(model, lb, pads=pads, budget=budget, policy=GlobalGatesPolicy(horizon=horizon, sink=2),
                          slack=0)
    cache.evict(torch.tensor([0]), torch.tensor([budget]))
    kept = _kept(cache, 0)
    assert kept == _brute_force(lb[0], budget, horizon, pads=pads, sink=2)
    assert {(layer, h, p) for layer in range(L) for h in range(H) for p in (pads, pads + 1)} <= kept
    plain = _filled_cache(model, lb, pads=pads, budget=budget, policy=GlobalGatesPolicy(horizon=horizon, sink=0),
                          slack=0)
    plain.evict(torch.tensor([0]), torch.tensor([budget]))
    assert not any(p < pads + 2 for _, _, p in _kept(plain, 0))
    with pytest.raises(ValueError, match="sink must be >= 0"):
        GlobalGatesPolicy(sink=-1)


def test_min_per_head_keeps_starved_heads(model):
    lb = torch.zeros(1, L, H, 8)
    lb[:, 2, 1] = -30.0  # layer 2 head 1 loses every global comparison
    cache = _filled_cache(model, lb, budget=18, min_per_head=2, slack=0, policy=GlobalGatesPolicy(sink=0))
    cache.evict(torch.tensor([0]), torch.tensor([18]))
    per_head = cache.store.entries_per_head()[0]
    assert per_head[2, 1] == 2 and int(per_head.sum()) == 18
    kept = _kept(cache, 0)
    assert {(2, 1, 6), (2, 1, 7)} <= kept  # its own best two: newest wins the tie


def test_trimkv_per_head_budgets(model):
    g = torch.Generator().manual_seed(3)
    lb = -torch.rand(1, L, H, 9, generator=g)
    hb = torch.tensor([[1, 2], [3, 4], [5, 6]])
    cache = _filled_cache(model, lb, budget=21, policy=TrimKVPolicy(head_budgets=hb, sink=0), slack=0)
    cache.evict(torch.tensor([0]), torch.tensor([21]))
    assert torch.equal(cache.store.entries_per_head()[0], hb)
    for layer in range(L):  # each head keeps its own top by myopic score
        for h in range(H):
            order = sorted(range(9), key=lambda i: (-float(lb[0, layer, h, i] * (9 - i)), -i))
            got = {p for (l2, h2, p) in _kept(cache, 0) if (l2, h2) == (layer, h)}
            assert got == set(order[: int(hb[layer, h])])


@pytest.mark.parametrize("horizon", [1, 2, 7, 100])
def test_lookahead_score_matches_direct_sum(horizon):
    lb = torch.tensor([-5.0, -1.0, -0.1, -1e-3, -1e-6, -1e-9, 0.0, float("-inf")], dtype=torch.float64)
    age = torch.tensor(3)
    got = lookahead_log_score(lb.float(), age, horizon).double()
    for a, s in zip(lb.tolist(), got.tolist()):
        want = math.log(sum(math.exp((3 + k - 1) * a) for k in range(1, horizon + 1))) if a > -math.inf else -math.inf
        assert s == pytest.approx(want, rel=1e-5, abs=1e-5)


def test_generate_sizes_never_exceed_budget_plus_slack(model):
    budget, slack = 60, 6
    cache = RetentionCache(model, budget=budget, slack=slack, protected_window=2)
    sizes = []
    hook = model.model.layers[-1].register_forward_hook(lambda *a: sizes.append(int(cache.store.lengths.sum())))
    try:
        torch.manual_seed(0)
        ids = torch.randint(0, 100, (1, 30))
        model.generate(ids, max_new_tokens=25, do_sample=False, **cache_kwargs(cache), prefill_chunk_size=4)
    finally:
        hook.remove()
    chunk_entries = 4 * L * H
    assert max(sizes) <= budget + slack + chunk_entries  # bounded by B + slack + one chunk, not by the prompt
    assert max(sizes[8:]) <= budget + slack + L * H  # decoding: one new token per head at a time
    assert cache.get_seq_length() == 30 + 24  # true token count, not entries kept
    assert cache.evictions > 0
    view = cache.store.gather_layer(0)
    newest = view.pos.masked_fill(~view.valid, -1).amax(-1)
    assert bool((newest == 53).all())  # positions survive compaction; the window keeps the newest


def test_budget_too_small_for_options_is_clear(model):
    with pytest.raises(CacheBudgetError, match="protected window"):
        RetentionCache(model, budget=10, protected_window=4)


@pytest.mark.parametrize("budget,problem", [(0.1, "a number of entries"), ("100", "a number of entries"),
                                            (True, "a number of entries"), ([60, 0.5], "a number of entries"),
                                            (0, "at least 1 entry"), (-3, "at least 1 entry"),
                                            ([60, -1], "at least 1 entry")])
def test_a_budget_that_is_not_a_count_of_entries_is_named(model, budget, problem):
    """A fraction, a string, a bool or a negative count used to fail deep inside (``list(0.1)``) or report the
    "protected window" of an option nobody set."""
    with pytest.raises(CacheBudgetError, match=problem):
        RetentionCache(model, budget=budget)
    with pytest.raises(CacheBudgetError, match=problem):
        RetentionCache(model).set_budget(budget)


@pytest.mark.parametrize("options,problem", [(dict(page_size=4.0), "page_size must be an integer >= 1, got 4.0"),
                                             (dict(page_size=0), "page_size must be an integer >= 1"),
                                             (dict(protected_window=-2), "protected_window must be an integer >= 0"),
                                             (dict(min_per_head=-1), "min_per_head must be an integer >= 0"),
                                             (dict(slack=-5), "slack must be an integer >= 0"),
                                             (dict(initial_pages=0), "initial_pages must be an integer >= 1")])
def test_options_that_are_not_counts_are_named(model, options, problem):
    """A float page size failed in torch.empty, a page size of 0 named "capacity and head_dim", and a negative
    protected window was taken (it then protected nothing)."""
    with pytest.raises(ValueError, match=problem):
        RetentionCache(model, budget=1000, **options)


@pytest.mark.parametrize("tokens", [0, -1, 2.5, True, "64"])
def test_budget_for_takes_a_whole_positive_number_of_tokens(model, tokens):
    """budget_for(model, 2.5) gave the entries of 2 tokens and 0 or -1 gave a budget the cache then refused in
    entries; each is refused naming the tokens."""
    with pytest.raises(CacheBudgetError, match=r"tokens must be a whole number of tokens >= 1.*got"):
        RetentionCache.budget_for(model, tokens)


def test_integer_budgets_of_numpy_and_torch_behave_as_ints(model):
    import numpy as np

    want = RetentionCache(model, budget=60)
    ids = torch.randint(0, 100, (2, 30), generator=torch.Generator().manual_seed(0))
    ref = model.generate(ids, max_new_tokens=6, do_sample=False, **cache_kwargs(want))
    for budget in (np.int64(60), torch.tensor(60), torch.tensor([60, 60]), (60, 60)):
        cache = RetentionCache(model, budget=budget)
        assert cache.budget == (60 if np.ndim(budget) == 0 else [60, 60])
        assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False, **cache_kwargs(cache)), ref)


def test_a_policy_may_be_named(model):
    from retention.policies import EvictionPolicy

    cache = RetentionCache(model, policy="streamingllm", budget=60)
    assert isinstance(cache.policy, EvictionPolicy) and cache.policy.name == "streamingllm"
    with pytest.raises(ValueError, match="unknown policy 'snapkvv'; available: .*'snapkv'"):
        RetentionCache(model, policy="snapkvv", budget=60)
    with pytest.raises(TypeError, match="policy must be an EvictionPolicy"):
        RetentionCache(model, policy=3, budget=60)
    from retention.policies.snapkv import SnapKVPolicy

    with pytest.raises(TypeError, match=r"got the class SnapKVPolicy: pass SnapKVPolicy\(\)"):  # was "got ABCMeta"
        RetentionCache(model, policy=SnapKVPolicy, budget=60)


@pytest.mark.parametrize("scope", ["head", "global"])
@pytest.mark.parametrize("wv, wk", [(1.5, 0.0), (0.0, 2.0), (1.0, 3.0)])
@pytest.mark.parametrize("seed, pads", [(0, 0), (1, 0), (2, 3)])
def test_norm_weighted_gates_equal_brute_force(model, scope, wv, wk, seed, pads):
    """``value_weight`` / ``key_weight``: score ``(T - i) log beta + wv log ||v||_{W_O} - wk log ||k||``, the value
    norm the root mean square of ``v W_O^h`` over the KV head's query heads, each computed here by hand from
    ``o_proj``. ``head``: every head keeps as many entries as the plain gates give it, the weighted score picks
    which; ``global``: the weighted score's top-B over the whole model. Left padding (``pads`` tokens, given the
    highest log beta) is dropped and lends no head a share."""
    B, T, budget, D = 2, 9, 20, 16
    g = torch.Generator().manual_seed(seed)
    lb = -torch.rand(B, L, H, T, generator=g) * 0.5
    lb[..., :pads] = 0.0
    values = torch.randn(B, L, H, T, D, generator=g) * torch.rand(B, L, H, T, 1, generator=g) * 3
    keys = torch.randn(B, L, H, T, D, generator=g) * torch.rand(B, L, H, T, 1, generator=g) * 3
    policy = GlobalGatesPolicy(sink=0, value_weight=wv, key_weight=wk, norm_scope=scope)
    assert policy.needs_kv
    cache = _filled_cache(model, lb, pads, keys, values, budget=budget, policy=policy, slack=0)
    cache.evict(torch.arange(B), torch.full((B,), budget))
    cache.store.check()
    reference = _filled_cache(model, lb, pads, keys, values, budget=budget, policy=GlobalGatesPolicy(sink=0), slack=0)
    reference.evict(torch.arange(B), torch.full((B,), budget))
    G = model.config.num_attention_heads // H
    changed = False
    for b in range(B):
        base, weighted = {}, {}
        for layer in range(L):
            w_o = model.model.layers[layer].self_attn.o_proj.weight  # (hidden, Hq * D)
            for h in range(H):
                for i in range(pads, T):
                    v = values[b, layer, h, i]
                    outs = [v @ w_o[:, (h * G + q) * D:(h * G + q + 1) * D].T for q in range(G)]
                    v_norm = math.sqrt(sum(float(o.square().sum()) for o in outs) / G)
                    k_norm = float(keys[b, layer, h, i].norm())
                    base[layer, h, i] = (T - i) * float(lb[b, layer, h, i])
                    weighted[layer, h, i] = base[layer, h, i] + wv * math.log(v_norm) - wk * math.log(k_norm)
        if scope == "global":
            want = set(sorted(weighted, key=weighted.get, reverse=True)[:budget])
        else:
            plain = sorted(base, key=base.get, reverse=True)[:budget]
            want = set()
            for layer in range(L):
                for h in range(H):
                    k = sum(1 for e in plain if e[:2] == (layer, h))
                    mine = [e for e in weighted if e[:2] == (layer, h)]
                    want |= set(sorted(mine, key=weighted.get, reverse=True)[:k])
        got, plain_kept = _kept(cache, b, keys, values), _kept(reference, b, keys, values)
        assert got == want
        if scope == "head":  # the plain gates' split: as many entries per head as the gates alone keep
            assert sorted(e[:2] for e in got) == sorted(e[:2] for e in plain_kept)
        changed |= got != plain_kept
    assert changed, "the norms changed nothing"


def test_norm_weight_options_are_checked(model):
    with pytest.raises(ValueError, match="value_weight must be >= 0"):
        GlobalGatesPolicy(value_weight=-1.0)
    with pytest.raises(ValueError, match="key_weight must be >= 0"):
        GlobalGatesPolicy(key_weight=-0.5)
    with pytest.raises(ValueError, match="norm_scope must be 'head'"):
        GlobalGatesPolicy(value_weight=1.0, norm_scope="layer")
    assert not GlobalGatesPolicy().needs_kv  # the plain gates gather no keys or values at eviction
    assert GlobalGatesPolicy(key_weight=1.0).needs_kv
    policy = GlobalGatesPolicy(value_weight=1.0)
    policy.bind(model)
    entries = EntryView(torch.zeros(1, 4), torch.arange(4)[None], torch.ones(1, 4, dtype=torch.bool), torch.tensor([3]),
                        torch.tensor([0]), torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="needs the entries' keys and values"):
        policy.score(entries)
