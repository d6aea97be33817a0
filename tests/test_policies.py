"""Baseline eviction policies: hand-checkable cases computed here from each paper's formula, the
registry, and budget accounting on the real cache in both modes."""

import math
from types import SimpleNamespace

import pytest
import torch

from retention import attach_gates
from retention.compat import cache_kwargs
from retention.cache import RetentionCache
from retention.cache.select import select_keep
from retention.policies import EntryView, get_policy, policy_params
from retention.policies.pyramidkv import pyramid_budgets
from tiny_models import tiny_llama

D = 4


def layer_view(L=6, H=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, H, L, D, generator=g)
    pos = torch.arange(L).expand(1, H, L).clone()
    return SimpleNamespace(keys=keys, values=torch.randn(1, H, L, D, generator=g), pos=pos,
                           valid=torch.ones(1, H, L, dtype=torch.bool))


def entries_for(view, layer=0, step=None):
    H, L = view.pos.shape[1], view.pos.shape[2]
    step = int(view.pos.max()) if step is None else step
    return EntryView(
        log_beta=torch.zeros(H, L), pos=view.pos[0].clone(), valid=view.valid[0].clone(),
        step=torch.full((H,), step), seq=torch.zeros(H, dtype=torch.long),
        layer=torch.full((H,), layer), head=torch.arange(H),
    )


def attention(q, k, qpos, kpos):
    """Softmax weights of one query over keys at or before it, by hand."""
    logits = [sum(a * b for a, b in zip(q, kk)) / math.sqrt(D) if kp <= qpos else -math.inf for kk, kp in zip(k, kpos)]
    m = max(logits)
    e = [math.exp(x - m) for x in logits]
    return [x / sum(e) for x in e]


def kept(policy, entries, budget):
    score = policy.score(entries)
    R = entries.pos.shape[0]
    keep = select_keep(score, entries.pos, entries.valid, torch.arange(R), torch.full((R,), budget))
    return [sorted(entries.pos[r][keep[r]].tolist()) for r in range(R)]


def test_streamingllm_keeps_sinks_and_recent():
    view = layer_view(L=10)
    assert kept(get_policy("streamingllm", sink=2), entries_for(view), 5) == [[0, 1, 7, 8, 9]]


def test_h2o_accumulates_attention_and_keeps_recent():
    view = layer_view(L=6)
    q = torch.randn(1, 2, 3, D, generator=torch.Generator().manual_seed(5))  # G = 2 query heads, 3 queries
    qpos = torch.tensor([[3, 4, 5]])
    pol = get_policy("h2o", recent=1)
    pol.observe(0, q, view, qpos)
    acc = [0.0] * 6
    for gq in range(2):
        for t in range(3):
            w = attention(q[0, gq, t].tolist(), view.keys[0, 0].tolist(), int(qpos[0, t]), list(range(6)))
            acc = [a + b for a, b in zip(acc, w)]
    score = pol.score(entries_for(view))
    torch.testing.assert_close(score[0, :5], torch.tensor(acc[:5]), rtol=1e-5, atol=1e-6)
    assert score[0, 5] == math.inf
    top2 = sorted(range(5), key=lambda i: -acc[i])[:2]
    assert kept(pol, entries_for(view), 3) == [sorted(top2 + [5])]


def test_attention_mass_matches_every_querys_softmax_in_any_entry_order():
    """H2O's chunked sum, brute force per query: entries out of position order, padding and evicted slots, two
    sequences, a chunk that ends mid-forward and one whose queries see only some entries (causality cut)."""
    from retention.policies.window import attention_mass

    g = torch.Generator().manual_seed(11)
    B, H, G, L, Q = 2, 2, 3, 9, 5
    keys = torch.randn(B, H, L, D, generator=g)
    pos = torch.stack([torch.randperm(L, generator=g) for _ in range(B * H)]).view(B, H, L)
    valid = torch.rand(B, H, L, generator=g) > 0.2
    pos[0, 1, 3] = -1  # a free slot
    view = SimpleNamespace(keys=keys, pos=pos, valid=valid)
    q = torch.randn(B, H * G, Q, D, generator=g)
    qpos = torch.tensor([[2, 3, 6, 7, 8], [4, 5, 6, 7, 8]])
    want = torch.zeros(B, H, L)
    for b in range(B):
        for h in range(H):
            seen = [i for i in range(L) if bool(valid[b, h, i]) and pos[b, h, i] >= 0]
            for hq in range(h * G, (h + 1) * G):
                for t in range(Q):
                    vis = [i for i in seen if pos[b, h, i] <= qpos[b, t]]
                    if not vis:  # a query that sees nothing gives no mass (softmax over nothing)
                        continue
                    w = attention(q[b, hq, t].tolist(), [keys[b, h, i].tolist() for i in vis], 0, [0] * len(vis))
                    for i, wi in zip(vis, w):
                        want[b, h, i] += wi
    for chunk in (1, 2, 5, 64):
        torch.testing.assert_close(attention_mass(q, view, qpos, chunk=chunk), want, rtol=1e-5, atol=1e-6)


def test_tova_uses_the_last_query_averaged_over_heads():
    view = layer_view(L=6, H=2)
    q = torch.randn(1, 4, 2, D, generator=torch.Generator().manual_seed(7))  # 2 KV heads x G=2
    qpos = torch.tensor([[4, 5]])
    pol = get_policy("tova")
    pol.observe(0, q, view, qpos)
    per_head = [
        attention(q[0, hq, 1].tolist(), view.keys[0, hq // 2].tolist(), 5, list(range(6))) for hq in range(4)
    ]
    want = torch.tensor([sum(h[i] for h in per_head) / 4 for i in range(6)])
    score = pol.score(entries_for(view))
    torch.testing.assert_close(score[0], want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(score[1], want, rtol=1e-5, atol=1e-6)  # one score per layer


def test_tova_averages_each_position_over_the_heads_that_hold_it():
    """A layer budget that is not a multiple of the KV heads keeps its last position in some heads only; the next
    observation averaged that position's new attention in those heads with the score an earlier observation left in
    the others (stale), instead of over the heads that hold it."""
    view = layer_view(L=6, H=2)
    q = torch.randn(1, 4, 1, D, generator=torch.Generator().manual_seed(8))  # 2 KV heads x G=2, one query
    pol = get_policy("tova")
    pol.observe(0, q, view, torch.tensor([[5]]))  # every position in both heads
    pol.stats.tables[0][0, :, 2] = 7.0  # head 1's stale score for position 2, kept by head 0 alone below
    view.valid[0, 1, 2] = False  # head 1 has dropped position 2 (its slot stays, invalid)
    q2 = torch.randn(1, 4, 1, D, generator=torch.Generator().manual_seed(9))
    pol.observe(0, q2, view, torch.tensor([[5]]))
    per_head = []
    for hq in range(4):
        kv = hq // 2
        keep = [i for i in range(6) if view.valid[0, kv, i]]
        w = attention(q2[0, hq, 0].tolist(), view.keys[0, kv, keep].tolist(), 5, keep)
        per_head.append(dict(zip(keep, w)))
    want = [sum(h[i] for h in per_head if i in h) / sum(i in h for h in per_head) for i in range(6)]
    torch.testing.assert_close(pol.score(entries_for(view))[0], torch.tensor(want), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["snapkv", "pyramidkv"])
def test_snapkv_window_sum_and_max_pooling(name):
    view = layer_view(L=8)
    q = torch.randn(1, 2, 4, D, generator=torch.Generator().manual_seed(3))
    qpos = torch.tensor([[4, 5, 6, 7]])
    pol = get_policy(name, window=2, kernel=3)
    pol.observe(0, q, view, qpos)
    summed = [0.0] * 8
    for gq in range(2):
        for t in (2, 3):  # the last two queries form the window
            w = attention(q[0, gq, t].tolist(), view.keys[0, 0].tolist(), int(qpos[0, t]), list(range(8)))
            summed = [a + b / 2 for a, b in zip(summed, w)]  # mean over the group
    # updated: pooled over the 6 entries before the window only (SnapKV's code pools attn[..., -w:, :-w]); entry 5 once
    # took the window's summed[6]
    pooled = [max(summed[max(0, i - 1) : min(i + 2, 6)]) for i in range(6)]
    score = pol.score(entries_for(view))
    torch.testing.assert_close(score[0, :6], torch.tensor(pooled[:6]), rtol=1e-5, atol=1e-6)
    assert (score[0, 6:] == math.inf).all()  # the observation window is kept


def test_pyramid_budgets_decrease_with_depth():
    # the window is kept on top of each layer's pyramid share of the prefix budget, as in PyramidKV's code
    # (KVCache-Factory pyramidkv_utils.py); this test had the window inside the pyramid (tests/test_policies_allocation)
    t = pyramid_budgets(total=3000, num_layers=3, num_heads=2, beta=20, window=32)
    assert t.shape == (3, 2) and (t[:-1, 0] > t[1:, 0]).all() and int(t.sum()) == 3000
    p = 500 - 32  # prefix entries per head and layer on average
    assert t[0, 0] == 32 + round(2 * p - p / 20) and t[2, 0] == 32 + round(p / 20)


def test_random_is_seeded():
    view = layer_view(L=12)
    e = entries_for(view)
    assert kept(get_policy("random", seed=1), e, 4) == kept(get_policy("random", seed=1), e, 4)
    assert kept(get_policy("random", seed=1), e, 4) != kept(get_policy("random", seed=2), e, 4)


def test_registry_errors_name_the_fix():
    with pytest.raises(ValueError, match="unknown policy 'snap'; available: \\[.*'snapkv'"):
        get_policy("snap")
    with pytest.raises(ValueError, match="has no parameter\\(s\\) \\['window'\\]; "
                                         "allowed: \\['budget_scope', 'mode', 'recent'\\]"):
        get_policy("h2o", window=4)
    with pytest.raises(ValueError, match="mode must be one of"):
        get_policy("snapkv", mode="sometimes")
    assert "mode" in policy_params("streamingllm")


POLICY_CASES = [
    ("random", {}), ("streamingllm", {}), ("h2o", {"recent": 4}), ("tova", {}), ("snapkv", {"window": 4}),
    ("pyramidkv", {"window": 4, "beta": 2.0}), ("trimkv", {}), ("global_gates", {"horizon": 4}),
    ("adakv", {"window": 4}), ("criticalkv", {"window": 4}), ("lava", {"window": 4}), ("cake", {"window": 4}),
    ("restkv", {"window": 4}), ("defensivekv", {"window": 4}), ("layer_defensivekv", {"window": 4}),
]


@pytest.mark.parametrize("mode", ["streaming", "one_shot"])
@pytest.mark.parametrize("name, params", POLICY_CASES)
def test_every_policy_keeps_exactly_its_budget(name, params, mode):
    model = tiny_llama()
    attach_gates(model, bias_init=0.0, mode="score")
    L, H, tokens = 3, 2, 10
    policy = get_policy(name, mode=mode, **params)
    budget = RetentionCache.budget_for(model, tokens)  # 60 entries
    cache = RetentionCache(model, budget=budget, policy=policy, slack=0)
    used = {}  # the allocation the eviction used (streaming policies refresh it as queries arrive)
    for hook in ("layer_budget_table", "head_budget_table"):
        real = getattr(policy, hook)
        setattr(policy, hook, lambda *a, _r=real, _h=hook, **kw: used.setdefault(_h, _r(*a, **kw)))
    ids = torch.randint(0, 100, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids[:, :30], **cache_kwargs(cache))  # prefill
        model(input_ids=ids[:, 30:31], **cache_kwargs(cache))  # compresses to the budget, then appends one token
    per_head = cache.store.lengths.view(L, H) - 1  # minus the token appended after the eviction
    layer_table, head_table = used.get("layer_budget_table"), used.get("head_budget_table")
    if policy.budget_scope == "global":
        assert int(per_head.sum()) == budget
    elif policy.budget_scope == "layer":
        want = [budget // L] * L if layer_table is None else layer_table.tolist()
        assert per_head.sum(1).tolist() == want
    elif head_table is not None:  # PyramidKV's pyramid, CAKE's preferences
        assert per_head.tolist() == head_table.tolist()
        if name == "pyramidkv":
            assert head_table.tolist() == pyramid_budgets(budget, L, H, 2.0, 4, context=30).tolist()
    else:
        assert per_head.flatten().tolist() == [tokens] * (L * H)


def test_full_cache_never_evicts():
    model = tiny_llama()
    attach_gates(model, mode="score")
    cache = RetentionCache(model, budget=12, policy=get_policy("full"), slack=0)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 100, (1, 20)), **cache_kwargs(cache))
        model(input_ids=torch.randint(0, 100, (1, 1)), **cache_kwargs(cache))
    assert int(cache.store.lengths.sum()) == 21 * 3 * 2


def test_global_gates_recent_window_keeps_the_newest_tokens_whatever_their_beta():
    """The gates rank by beta^age; ``recent`` lifts the newest tokens (and ``sink`` the first) above them."""
    view = layer_view(L=10)
    entries = entries_for(view)
    # fresh tokens get a low beta (dropped at once by the gates alone), old ones a beta near 1
    entries.log_beta = torch.tensor([[-0.01] * 6 + [-2.0] * 4])
    assert kept(get_policy("global_gates", sink=0), entries, 4) == [[2, 3, 4, 5]]
    assert kept(get_policy("global_gates", sink=0, recent=2), entries, 4) == [[4, 5, 8, 9]]
    assert kept(get_policy("global_gates", sink=1, recent=2), entries, 4) == [[0, 5, 8, 9]]
    with pytest.raises(ValueError, match="recent must be >= 0"):
        get_policy("global_gates", recent=-1)


@pytest.mark.parametrize("name, params", POLICY_CASES)
def test_a_dropped_cache_is_freed_at_once_without_the_cyclic_gc(name, params):
    """A reference cycle through the cache would keep its pages until Python's cyclic GC ran: a long eval
    sweep (a few caches of hundreds of MB per item) grew to 24 GB that way. Dropping it must free it."""
    import gc
    import weakref

    model = tiny_llama()
    attach_gates(model, bias_init=0.0, mode="score")
    cache = RetentionCache(model, budget=RetentionCache.budget_for(model, 10), policy=get_policy(name, **params),
                           slack=0)
    ids = torch.randint(0, 100, (1, 31), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids[:, :30], **cache_kwargs(cache))
        model(input_ids=ids[:, 30:], **cache_kwargs(cache))  # evicts
    assert cache.store is not None and int(cache.store.lengths.sum()) < 3 * 2 * 31
    refs = [weakref.ref(cache), weakref.ref(cache.store), weakref.ref(cache.policy)]
    gc.collect()
    gc.disable()
    try:
        del cache
        assert [r() is None for r in refs] == [True] * 3
    finally:
        gc.enable()


@pytest.mark.parametrize("name,params,problem", [
    ("snapkv", {"window": 2.5}, "window must be an integer, got 2.5"),
    ("snapkv", {"kernel": "7"}, "kernel must be an integer, got '7'"),
    ("global_gates", {"sink": True}, "sink must be an integer, got True"),
    ("h2o", {"recent": -1}, "recent must be >= 0"),
    ("cake", {"gamma": -1.0}, "gamma must be >= 0"),
    # NaN passed every "< 0" check (garbage replies under cake); an even kernel failed in max_pool while generating
    ("cake", {"gamma": float("nan")}, "gamma must be a finite number, got nan"),
    ("global_gates", {"horizon": float("inf")}, "horizon must be an integer, got inf"),
    ("restkv", {"beta": float("nan")}, "beta must be a finite number"),
    *[(name, {"kernel": k}, f"kernel must be odd and >= 1 .1: no pooling., got {k}")
      for name in ("snapkv", "adakv", "criticalkv", "cake", "lava", "defensivekv", "layer_defensivekv")
      for k in (2, 0)],
    (None, {}, "unknown policy None"),
    # a string switch was truthy (AdaKV silently scored as CriticalKV); ``name`` in params raised a TypeError
    ("adakv", {"value_norm": "no"}, "value_norm must be true or false, got 'no'"),
    ("adakv", {"value_norm": 1}, "value_norm must be true or false, got 1"),
    ("snapkv", {"name": "x"}, "policy 'snapkv' has no parameter.s. \\['name'\\]"),
])
def test_a_parameter_of_the_wrong_kind_or_sign_is_named(name, params, problem):
    """A float window, a string kernel from a hand-written config, a negative H2O window or CAKE weight were taken
    and failed (or silently changed the ranking) once the cache scored; each is refused when the policy is built."""
    with pytest.raises(ValueError, match=problem):
        get_policy(name, **params)
    assert get_policy("cake", gamma=1).gamma == 1  # an integer where a number is asked is fine


def test_padded_slots_of_a_view_leave_the_score_of_position_0_alone():
    """PositionStats.write let the padded slots of a gathered view (pos -1, clamped to 0) overwrite the score stored
    for position 0, so every observation-window policy and TOVA dropped the first token (the attention sink)
    whenever a layer's length was not a multiple of the page size."""
    from retention.policies.window import PositionStats

    view = layer_view(L=6, H=2)
    pad = 2  # gather pads each stream to whole pages; fresh slots hold pos -1
    view.pos = torch.cat([view.pos, torch.full((1, 2, pad), -1)], -1)
    view.valid = torch.cat([view.valid, torch.zeros(1, 2, pad, dtype=torch.bool)], -1)
    values = torch.rand(1, 2, 6 + pad, generator=torch.Generator().manual_seed(0)) + 1.0
    stats = PositionStats()
    stats.write(0, values, view)
    torch.testing.assert_close(stats.tables[0][0, :, :6], values[0, :, :6])
    # a slot left stale by compaction (invalid, but holding a real position) must not overwrite it either
    view.pos[..., -1] = 3
    stats.write(1, values, view)
    torch.testing.assert_close(stats.tables[1][0, :, :6], values[0, :, :6])
    stats.write(2, values, view, accumulate=True)
    stats.write(2, values, view, accumulate=True)
    torch.testing.assert_close(stats.tables[2][0, :, :6], 2 * values[0, :, :6])


def test_restkv_smooths_with_the_per_head_budget_it_is_given():
    def kept(preset: bool) -> list[list[int]]:
        model = tiny_llama(num_attention_heads=9, num_key_value_heads=3, hidden_size=144)
        attach_gates(model, bias_init=0.0, mode="score")
        policy = get_policy("restkv", window=16, beta=1.0)
        budget = RetentionCache.budget_for(model, 20)
        if preset:  # what the smoothing should use: the per-head budget the cache enforces
            policy.set_budget(budget, 3, 3)
        cache = RetentionCache(model, budget=budget, policy=policy, slack=0)
        with torch.no_grad():
            model(input_ids=torch.randint(0, 128, (1, 120), generator=torch.Generator().manual_seed(0)),
                  **cache_kwargs(cache))
            cache.compress()
        view = cache.store.gather(torch.arange(9), with_kv=False)
        return [sorted(view.pos[r][view.valid[r]].tolist()) for r in range(9)]

    assert kept(preset=False) == kept(preset=True)
