"""Layer budget allocation of PyramidKV and CAKE, checked against brute-force re-implementations of the authors' code
(Zefan-Cai/KVCache-Factory ``pyramidkv_utils.py``; antgroup/cakekv ``modify_llama.py`` / ``cake_cache.py`` /
``utils.py``) on a tiny random model: the observation window is kept on top of each layer's share of the prefix
budget, the total stays within the budget, and the entries kept per (layer, KV head) are the reference's."""

from __future__ import annotations

import math

import pytest
import torch

from retention import attach_gates
from retention.cache import RetentionCache
from retention.compat import cache_kwargs
from retention.policies import EvictionPolicy, get_policy
from retention.policies.pyramidkv import pyramid_budgets
from retention.policies.window import SequenceStats
from tiny_models import tiny_llama

LAYERS, KV_HEADS, Q_HEADS = 4, 3, 9


def reference_pyramid(units: float, layers: int, beta: float, window: int) -> list[float]:
    """PyramidKV's per-head budget of every layer (``units`` per head over all layers): the window on top of a
    linear pyramid of the prefix budget, from ``2p - p / beta`` at the bottom to ``p / beta`` at the top."""
    p = units / layers - window
    lo = p / beta
    hi = 2 * p - lo
    return [window + hi - l * (hi - lo) / (layers - 1) for l in range(layers)]


def reference_adjust(budgets: list[float], total: int, cap: int) -> list[int]:
    """The authors' ``adjust_budgets`` (cake/utils.py): truncate, cap at the prefix handing the excess evenly to
    the layers under it (remainder to the first ones), then add what truncation lost the same way."""
    b = [int(x) for x in budgets]
    excess = sum(max(x - cap, 0) for x in b)
    b = [min(x, cap) for x in b]
    for step in range(2):
        extra = excess if step == 0 else total - sum(b)
        under = [i for i, x in enumerate(b) if x < cap]
        if extra > 0 and under:
            for k, i in enumerate(under):
                b[i] += extra // len(under) + (1 if k < extra % len(under) else 0)
    return b


def prefill(policy: EvictionPolicy, tokens: int, length: int) -> tuple[RetentionCache, dict]:
    """A tiny Llama (4 layers, 9 query / 3 KV heads) prefilled with ``length`` random tokens under ``policy`` at
    ``tokens`` entries per KV head, then compressed; returns the cache and, per layer, the ``(Hq, T, D)`` queries
    and ``(H, T, D)`` keys (after RoPE) the policy observed."""
    model = tiny_llama(num_attention_heads=Q_HEADS, num_key_value_heads=KV_HEADS, hidden_size=144,
                       num_hidden_layers=LAYERS)
    attach_gates(model, mode="score")
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    observe = policy.observe

    def spy(layer: int, query: torch.Tensor, view, query_pos: torch.Tensor) -> None:
        assert view.pos[0, :, :length].tolist() == [list(range(length))] * KV_HEADS  # one prefill, in order
        seen[layer] = (query[0].double().clone(), view.keys[0, :, :length].double().clone())
        observe(layer, query, view, query_pos)

    policy.observe = spy
    cache = RetentionCache(model, budget=RetentionCache.budget_for(model, tokens), policy=policy, slack=0)
    ids = torch.randint(0, 128, (1, length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(input_ids=ids, **cache_kwargs(cache))
    cache.compress()
    return cache, seen


def window_probs(q: torch.Tensor, k: torch.Tensor, window: int) -> torch.Tensor:
    """``(Hq, W, T)`` causal softmax attention of the last ``window`` queries, query head ``g`` on KV head
    ``g // (Hq / H)``, by hand in float64."""
    Hq, T, D = q.shape
    G = Hq // k.shape[0]
    out = torch.zeros(Hq, window, T, dtype=torch.float64)
    for g in range(Hq):
        for j in range(window):
            t = T - window + j
            logits = [float(q[g, t] @ k[g // G, i]) / math.sqrt(D) for i in range(t + 1)]
            m = max(logits)
            e = [math.exp(x - m) for x in logits]
            out[g, j, : t + 1] = torch.tensor([x / sum(e) for x in e], dtype=torch.float64)
    return out


def kept_positions(cache: RetentionCache) -> list[list[list[int]]]:
    """Sorted positions kept in every (layer, KV head) of sequence 0."""
    out = []
    for layer in range(LAYERS):
        v = cache.store.gather_layer(layer)
        out.append([sorted(v.pos[0, h][v.valid[0, h]].tolist()) for h in range(KV_HEADS)])
    return out


def top(scores: list[float], n: int) -> list[int]:
    """Indices of the ``n`` largest ``scores``."""
    return sorted(range(len(scores)), key=lambda i: -scores[i])[:n]


def test_pyramid_keeps_the_window_on_top_of_each_layers_prefix_share():
    """The reported case: 150 entries per head on SmolLM2's 30 layers x 3 KV heads with a 32-token window ran
    292 -> 7 per head (the window inside the pyramid, the top layers keeping less than it); PyramidKV's code
    keeps the window on top of a pyramid of the prefix budget."""
    t = pyramid_budgets(150 * 30 * 3, 30, 3, 20.0, 32)
    want = reference_pyramid(150 * 30, 30, 20.0, 32)
    assert t.shape == (30, 3) and (t == t[:, :1]).all()
    assert [abs(int(b) - w) < 1 for b, w in zip(t[:, 0], want)] == [True] * 30
    assert int(t[0, 0]) == 262 and int(t[-1, 0]) == 38 and (t >= 32).all()
    assert int(t.sum()) == 150 * 30 * 3  # the average per layer is the budget
    assert (t[:-1, 0] >= t[1:, 0]).all()


def test_pyramid_stays_within_a_budget_below_one_entry_per_head():
    """A budget under L x H (20 entries for 90 heads) kept 90 (every head raised to 1)."""
    t = pyramid_budgets(20, 30, 3, 20.0, 32)
    assert int(t.sum()) <= 20 and (t >= 0).all() and t[0, 0] == 1


def test_pyramid_short_contexts_follow_the_authors_code():
    """Under 2 * (capacity - window) tokens the code keeps SnapKV's even split; a bottom layer whose share passes
    the prefix is cut to it and the top layer raised by as much."""
    assert pyramid_budgets(40 * 4 * 3, 4, 3, 4.0, 4, context=60).tolist() == [[40] * 3] * 4  # 60 < 2 * 36
    t = pyramid_budgets(16 * 4 * 3, 4, 3, 4.0, 4, context=24)  # the full pyramid would keep 25 of 24 tokens
    hi = 24 - 4  # max_num cut to the prefix, min_num = 2 * 12 - max_num
    lo = 2 * 12 - hi
    exact = [4 + hi - l * (hi - lo) / 3 for l in range(4)]  # 24, 18.7, 13.3, 8: the largest fraction rounds up
    assert t[:, 0].tolist() == [24, 19, 13, 8] and [abs(b - e) < 1 for b, e in zip(t[:, 0], exact)] == [True] * 4


def test_pyramidkv_keeps_the_reference_entries_in_every_head():
    """End to end on the cache: SnapKV's window scores (no pooling) and the pyramid of the authors' code, every
    (layer, KV head) keeping its top prefix entries plus the window."""
    window, tokens, length = 4, 16, 48
    cache, seen = prefill(get_policy("pyramidkv", window=window, kernel=1, beta=4.0), tokens, length)
    budgets = reference_pyramid(tokens * LAYERS, LAYERS, 4.0, window)
    assert budgets == [25, 19, 13, 7]  # the old split ran 28 -> 4 per head, under the window at the top
    got = kept_positions(cache)
    G = Q_HEADS // KV_HEADS
    for layer, (q, k) in seen.items():
        A = window_probs(q, k, window)
        for h in range(KV_HEADS):
            score = [sum(float(A[h * G + g, :, i].sum()) for g in range(G)) / G for i in range(length - window)]
            want = sorted(top(score, int(budgets[layer]) - window) + list(range(length - window, length)))
            assert got[layer][h] == want, (layer, h)


@pytest.mark.parametrize("tau1, tau2", [(1.0, 1.0), (1.6, 0.6)])
def test_cake_keeps_the_reference_entries_in_every_head(tau1, tau2):
    """CAKE as its authors' code runs it: preference from the summed entropy of each window query's attention
    over the prefix and the summed unbiased variance, the prefix budget shared by preference with the window on
    top, and the indicator mean + gamma * var per query head, avg-pooled (5) over the prefix, mean over the group."""
    window, tokens, length, gamma = 4, 12, 40, 200.0
    policy = get_policy("cake", window=window, tau1=tau1, tau2=tau2)
    cache, seen = prefill(policy, tokens, length)
    n = length - window  # prefix entries
    G = Q_HEADS // KV_HEADS
    prefs, indicators = [], []
    for layer in range(LAYERS):
        q, k = seen[layer]
        A = window_probs(q, k, window)[:, :, :n]  # the window's columns sliced off, not renormalised
        disp = -float((A * torch.log(A + 1e-10)).sum())
        var = A.var(1)  # unbiased over the window queries (torch.var's default)
        prefs.append(disp ** (1 / tau1) * float(var.sum()) ** (1 / tau2))
        assert float(policy.preference[layer][0]) == pytest.approx(prefs[-1], rel=1e-4)
        ind = A.mean(1) + gamma * var  # (Hq, n)
        pooled = [[sum(float(ind[g, i + d]) for d in range(-2, 3) if 0 <= i + d < n) / 5 for i in range(n)]
                  for g in range(Q_HEADS)]
        indicators.append([[sum(pooled[h * G + g][i] for g in range(G)) / G for i in range(n)]
                           for h in range(KV_HEADS)])
    prefix_total = (tokens - window) * LAYERS
    shares = reference_adjust([p / sum(prefs) * prefix_total for p in prefs], prefix_total, n)
    assert sum(shares) == prefix_total
    got = kept_positions(cache)
    for layer in range(LAYERS):
        assert [len(x) for x in got[layer]] == [shares[layer] + window] * KV_HEADS  # at least the window
        for h in range(KV_HEADS):
            want = sorted(top(indicators[layer][h], shares[layer]) + list(range(n, length)))
            assert got[layer][h] == want, (layer, h)


def test_cake_keeps_the_window_on_top_and_caps_a_layer_at_its_prefix():
    """Budgets from set preferences: every layer keeps the window plus its share of the prefix budget, a layer
    whose share passes its prefix is capped and the excess spread evenly over the others (remainder first)."""
    pol = get_policy("cake", window=32)
    prefs = (1.0, 1.0, 0.05, 20.0)
    pol.preference = SequenceStats({l: torch.tensor([p], dtype=torch.float64) for l, p in enumerate(prefs)})
    pol.context = SequenceStats({l: torch.tensor([200.0]) for l in range(4)})
    table = pol.head_budget_table(100 * 4 * 3, 4, 3)
    prefix_total = (100 - 32) * 4
    want = reference_adjust([p / 22.05 * prefix_total for p in (1.0, 1.0, 0.05, 20.0)], prefix_total, 200 - 32)
    assert table[:, 0].tolist() == [w + 32 for w in want] and (table == table[:, :1]).all()
    assert int(table[3, 0]) == 200 and int(table.sum()) == 100 * 4 * 3
    assert (table >= 32).all()  # the reported layers kept 19 and 28 per head, under a window of 32


def test_cake_falls_back_to_the_even_split_without_room_for_the_windows():
    pol = get_policy("cake", window=32)
    pol.preference = SequenceStats({0: torch.tensor([1.0]), 1: torch.tensor([2.0])})
    assert pol.head_budget_table(30 * 2 * 3, 2, 3) is None


def test_lava_layer_budgets_share_the_whole_budget_and_cap_a_layer_at_what_it_holds():
    """``B_l = e_l / sum e * B`` rounded down lost up to L - 1 entries of the budget, and a layer whose share passed
    the entries it holds wasted the excess: the shares now sum to the budget (the remainder to the largest
    fractions, lower layers first) and a capped layer hands the rest to the others in proportion to their entropy."""
    pol = get_policy("lava", window=4)
    pol.entropy = SequenceStats({l: torch.tensor([1.0], dtype=torch.float64) for l in range(3)})
    pol.entries = SequenceStats({l: torch.tensor([100.0], dtype=torch.float64) for l in range(3)})
    assert pol.layer_budget_table(100, 3).tolist() == [34, 33, 33]  # rounded down: [33, 33, 33]
    pol.entropy = SequenceStats({l: torch.tensor([e], dtype=torch.float64) for l, e in enumerate((6.0, 1.0, 1.0))})
    assert pol.layer_budget_table(200, 3).tolist() == [100, 50, 50]  # in proportion: 150, 25, 25


@pytest.mark.parametrize("budget", [6, 31, 150, 239])
def test_lava_keeps_its_whole_budget(budget: int) -> None:
    """End to end on the cache (3 layers x 2 KV heads, 40 tokens: 240 entries): LAVa keeps exactly ``budget``."""
    model = tiny_llama()
    attach_gates(model, mode="score")
    cache = RetentionCache(model, budget=budget, policy=get_policy("lava", window=4), slack=0)
    with torch.no_grad():
        model(input_ids=torch.randint(1, 100, (1, 40), generator=torch.Generator().manual_seed(1)),
              **cache_kwargs(cache))
    cache.compress()
    assert int(cache.store.lengths.sum()) == budget
