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


class _Oracle:
    """An independent replay of a :class:`RetentionCache` under :class:`GlobalGatesPolicy` during ``generate``: every
    entry (sequence, layer, head, position, log beta, key, value) in plain Python lists, evicted by the documented
    rule (at the start of a forward a sequence over ``budget + slack`` real entries keeps its top ``budget`` by
    (protected desc, score desc, position desc, layer asc, head asc), sinks and the recent window scoring +inf, left
    padding dropped), and dense attention over exactly the entries it holds."""

    def __init__(self, batch: int, budgets: list, slack: int, policy: GlobalGatesPolicy, window: int, minimum: int):
        self.budgets, self.slack, self.policy, self.window, self.minimum = budgets, slack, policy, window, minimum
        self.entries = [{(layer, h): [] for layer in range(L) for h in range(H)} for _ in range(batch)]
        self.seen, self.start, self.evictions = 0, [0] * batch, 0

    def score(self, lb: float, pos: int, b: int) -> float:
        t, p = self.seen - 1, self.policy
        if pos - self.start[b] < p.sink or pos > t - p.recent:
            return math.inf
        age = t - pos + 1  # horizon H: log sum_{k=1..H} beta^(age + k - 1), directly
        if p.horizon == 1:  # the cache's float32 product, so ties of quantised log betas stay ties
            return float(torch.tensor(float(age)) * torch.tensor(lb))
        return math.log(sum(math.exp(lb * (age + k - 1)) for k in range(1, p.horizon + 1)))

    def forward_starts(self, valid: torch.Tensor | None) -> None:
        if valid is not None:
            for b in range(len(self.start)):
                self.start[b] += int((~valid[b]).sum())
        for b, entries in enumerate(self.entries):
            if self.budgets[b] is None or sum(e[0] >= 0 for es in entries.values() for e in es) <= \
                    self.budgets[b] + self.slack:
                continue
            ranked = []
            for (layer, h), es in entries.items():
                head = [[e[0] >= self.seen - self.window, self.score(e[1], e[0], b), e[0], layer, h, id(e)]
                        for e in es if e[0] >= 0]
                for r in sorted(head, key=lambda r: (-r[1], -r[2]))[: self.minimum]:
                    r[0] = True  # the per-head minimum: each head's own best
                ranked += head
            ranked.sort(key=lambda r: (not r[0], -r[1], -r[2], r[3], r[4]))
            keep = {r[5] for i, r in enumerate(ranked) if r[0] or i < self.budgets[b]}
            for key, es in entries.items():
                entries[key] = [e for e in es if id(e) in keep]
            self.evictions += 1

    def append(self, layer: int, keys, values, lb, valid) -> None:
        for b, entries in enumerate(self.entries):
            for h in range(H):
                for j in range(keys.shape[2]):
                    pos = self.seen + j if valid is None or bool(valid[b, j]) else -1
                    entries[layer, h].append((pos, float(lb[b, h, j]), keys[b, h, j].clone(), values[b, h, j].clone()))

    def attention(self, layer: int, query: torch.Tensor, qpos: torch.Tensor, scale: float) -> torch.Tensor:
        B, Hq, Q, D = query.shape
        out = torch.zeros(B, Q, Hq, D, dtype=torch.float64)
        for b in range(B):
            for h in range(H):
                es = self.entries[b][layer, h]
                k = torch.stack([e[2] for e in es]).double()
                v = torch.stack([e[3] for e in es]).double()
                pos = torch.tensor([e[0] for e in es])
                q = query[b, h * (Hq // H) : (h + 1) * (Hq // H)].double()  # (G, Q, D): the KV head's query heads
                seen = (pos >= 0)[None] & (pos[None] <= qpos[b][:, None])  # (Q, entries): causal by true position
                s = (q @ k.T * scale).masked_fill(~seen[None], -math.inf)
                out[b, :, h * (Hq // H) : (h + 1) * (Hq // H)] = (s.softmax(-1) @ v).transpose(0, 1)
        return out


@pytest.mark.parametrize("batch, lens, budget, slack, horizon, sink, recent, window, minimum, page_size, chunk, ties", [
    (3, (5, 12, 9), 20, 0, 1, 1, 0, 0, 0, 3, None, True),  # left padding, an eviction every step
    (3, (5, 12, 9), [18, 40, 24], 3, 4, 2, 1, 0, 0, 5, 4, False),  # budgets per row, lookahead, chunked prefill
    (2, (11, 4), 36, 0, 1, 4, 2, 0, 0, 3, None, True),  # sinks and recent window fill the whole budget
    (2, (8, 13), 18, 2, 1, 0, 0, 1, 1, 4, 5, True),  # protected window and per-head minimum
    (2, (6, 9), 400, 0, 1, 4, 0, 0, 0, 3, None, False),  # a budget larger than the whole generation: no eviction
    (1, (14,), 9, 5, 4, 0, 0, 0, 0, 1, None, True),  # one entry per page
])
def test_generation_equals_a_brute_force_replay(model, batch, lens, budget, slack, horizon, sink, recent, window,
                                                minimum, page_size, chunk, ties):
    """Through ``generate`` (prefill, several eviction rounds while decoding): after every layer of every forward the
    cache holds exactly the oracle's entries (positions, log betas, keys, values, in order), attention over its pages
    equals dense attention over those entries, and the memory report counts them."""
    g = torch.Generator().manual_seed(sum(lens) + batch)
    T, new = max(lens), 8
    ids, mask = torch.zeros(batch, T, dtype=torch.long), torch.zeros(batch, T, dtype=torch.long)
    for b, n in enumerate(lens):
        ids[b, T - n :], mask[b, T - n :] = torch.randint(1, 100, (n,), generator=g), 1
    policy = GlobalGatesPolicy(horizon=horizon, sink=sink, recent=recent)
    cache = RetentionCache(model, budget=budget, policy=policy, slack=slack, page_size=page_size,
                           protected_window=window, min_per_head=minimum)
    oracle = _Oracle(batch, budget if isinstance(budget, list) else [budget] * batch, slack, policy, window, minimum)
    pre, update, attend = cache.retention_pre_attention, cache.update, cache.retention_attend
    forward: dict = {}

    def scored(layer, log_beta, attention_mask):  # our own log betas: spread out, and quantised for ties
        log_beta = -torch.rand(log_beta.shape, generator=g) * 3
        pre(layer, (log_beta * 2).round() / 2 if ties else log_beta, attention_mask)
        forward[layer] = cache._pending[layer]

    def updated(keys, values, layer, *args, **kwargs):
        log_beta, valid = forward[layer]
        if layer == 0:
            oracle.forward_starts(valid)
        oracle.append(layer, keys, values, log_beta, valid)
        out = update(keys, values, layer, *args, **kwargs)
        view = cache.store.gather_layer(layer)
        for b in range(batch):
            for h in range(H):
                es, n = oracle.entries[b][layer, h], int(view.valid[b, h].sum())
                assert view.pos[b, h, :n].tolist() == [e[0] for e in es], (layer, b, h)
                assert view.log_beta[b, h, :n].tolist() == [e[1] for e in es]
                assert torch.equal(view.keys[b, h, :n], torch.stack([e[2] for e in es]))
                assert torch.equal(view.values[b, h, :n], torch.stack([e[3] for e in es]))
        qpos = oracle.seen + torch.arange(keys.shape[2]).expand(batch, -1)
        forward["qpos"] = qpos if valid is None else qpos.masked_fill(~valid, -1)
        if layer == L - 1:
            oracle.seen += keys.shape[2]
        return out

    def attended(layer, query, scaling):
        out = attend(layer, query, scaling)
        want = oracle.attention(layer, query, forward["qpos"], scaling)
        real = forward["qpos"] >= 0  # a padding query's output is unused
        torch.testing.assert_close(out.double()[real], want[real], atol=1e-5, rtol=1e-5)
        return out

    cache.retention_pre_attention, cache.update, cache.retention_attend = scored, updated, attended
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, **cache_kwargs(cache), max_new_tokens=new,
                       min_new_tokens=new, do_sample=False, pad_token_id=0,
                       **({"prefill_chunk_size": chunk} if chunk else {}))
    cache.store.check()
    assert (cache.evictions >= 2) == (oracle.evictions >= 2) == (budget != 400)  # several rounds, or none at all
    report = cache.memory_report()
    per_head = torch.tensor([[[len(oracle.entries[b][layer, h]) for h in range(H)] for layer in range(L)]
                             for b in range(batch)])
    assert torch.equal(report["entries_per_head"], per_head)
    assert report["kept_entries"] == int(per_head.sum())
    assert report["kv_bytes"] == int(per_head.sum()) * 2 * model.config.head_dim * 4  # keys and values, float32
    assert report["full_cache_entries"] == (T + new - 1) * L * H * batch  # the last token is never fed
    assert report["pages_in_use"] == sum(-(-int(n) // page_size) for n in per_head.flatten())


@pytest.mark.parametrize("name, options", [("adakv", {"window": 4})])
def test_budget_dependent_policies_score_each_row_at_its_own_budget(name, options):
    """AdaKV's safeguard and the SnapKV share depend on the budget: a row of a batch with one budget per sequence
    keeps what it keeps alone at that budget (every row was scored at the first row's budget)."""
    from retention.policies import get_policy

    model = tiny_llama()
    attach_gates(model, mode="score")
    ids = torch.randint(1, 100, (1, 40), generator=torch.Generator().manual_seed(0))
    n = model.config.num_hidden_layers * model.config.num_key_value_heads

    def kept(cache: RetentionCache, row: int) -> list[list[int]]:
        view = cache.store.gather(torch.arange(row * n, row * n + n), with_kv=False)
        return [view.pos[r][view.valid[r]].tolist() for r in range(n)]

    caches = {}
    for budgets, x in ((60, ids), (200, ids), ([200, 60], ids.repeat(2, 1))):
        cache = RetentionCache(model, budget=budgets, policy=get_policy(name, **options), slack=0)
        with torch.no_grad():
            model(input_ids=x, **cache_kwargs(cache))
        cache.compress()
        caches[str(budgets)] = cache
    assert kept(caches["[200, 60]"], 1) == kept(caches["60"], 0)
    assert kept(caches["[200, 60]"], 0) == kept(caches["200"], 0)


def test_a_budget_below_the_sinks_or_one_entry_per_head_is_refused():
    """A global budget smaller than the gates' sinks in every stream dropped some sinks in every head (their +inf
    ties went to the newest), and a per-head policy given fewer entries than streams kept nothing in some heads:
    both are refused when the budget is set, naming the least budget that works."""
    from retention.policies import get_policy

    model = tiny_llama()
    attach_gates(model, mode="score")
    n = model.config.num_hidden_layers * model.config.num_key_value_heads
    with pytest.raises(CacheBudgetError, match=f"sink=4, recent=2: 6 per stream.*>= {6 * n} entries"):
        RetentionCache(model, budget=6 * n - 1, policy=GlobalGatesPolicy(sink=4, recent=2))
    cache = RetentionCache(model, budget=6 * n, policy=GlobalGatesPolicy(sink=4, recent=2))
    with pytest.raises(CacheBudgetError, match="always-kept"):
        cache.set_budget([6 * n, 10])
    with pytest.raises(CacheBudgetError, match=f"per-head policy \\(streamingllm\\).*>= {n} entries"):
        RetentionCache(model, budget=n - 1, policy=get_policy("streamingllm"))
    RetentionCache(model, budget=n, policy=get_policy("streamingllm"))
    RetentionCache(model, budget=1, policy=GlobalGatesPolicy(sink=0))  # nothing held: any budget


def test_trimkv_gates_under_one_global_budget_are_warned_about():
    """Issue 77: TRIM-KV gates (untied, trained for a budget per KV head) ranked by the default global top-B were
    accepted without a word; the per-head policy they were trained for, and global gates, stay silent."""
    import warnings

    from retention.policies.global_gates import GateScopeWarning

    per_head = tiny_llama()
    attach_gates(per_head, mode="score", variant="trimkv")
    with pytest.warns(GateScopeWarning, match="TRIM-KV gates .*GlobalGatesPolicy ranks them under one global budget"
                                              ".*use TrimKVPolicy\\(\\) \\(--policy trimkv"):
        RetentionCache(per_head, budget=64)  # the default policy
    tied = tiny_llama()
    attach_gates(tied, mode="score")
    with warnings.catch_warnings():
        warnings.simplefilter("error", GateScopeWarning)
        RetentionCache(per_head, budget=64, policy=TrimKVPolicy())
        RetentionCache(tied, budget=64)
