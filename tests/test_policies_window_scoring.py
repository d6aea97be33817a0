"""Observation-window policies against brute-force versions of their published selection, computed here from the
queries the cache hands them: pooling and statistics over the entries before the window only (SnapKV's code scores
``attn[..., -window:, :-window]``; LAVa's code also takes its value norms and entropy there), and ReST-KV's adaptive
window smoothing with the per-head budget enforced at eviction, whenever the cache sets it."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import torch

from retention import attach_gates
from retention.cache import RetentionCache
from retention.compat import cache_kwargs
from retention.policies import get_policy
from retention.policies.scoring import max_pool
from tiny_models import tiny_llama

T, L, H, HQ = 80, 3, 3, 9  # context tokens, layers, KV heads, query heads (G = 3 per KV head)
Seen = dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # layer -> query, keys, values


def run(name: str, per_head: int, preset: bool = False, **params: Any) -> tuple[Any, Seen, list[list[int]], Any]:
    """Prefill ``T`` tokens into a cache of policy ``name`` with no budget, then give it ``per_head`` entries per
    (layer, KV head) and compress, as the evaluation harness does. ``preset``: the policy hears the budget first.

    Returns the policy, what it observed per layer (query ``(HQ, T, D)`` after RoPE, keys and values ``(H, T, D)``,
    float32),
    the positions kept per stream (rows in (layer, head) order) and the model."""
    model = tiny_llama(num_attention_heads=HQ, num_key_value_heads=H, hidden_size=144)
    attach_gates(model, bias_init=0.0, mode="score")
    policy = get_policy(name, **params)
    budget = RetentionCache.budget_for(model, per_head)
    if preset:
        policy.set_budget(budget, L, H)
    seen: Seen = {}
    observe = policy.observe

    def spy(layer: int, query: torch.Tensor, view: Any, query_pos: torch.Tensor) -> None:
        assert bool(view.valid[0, :, :T].all()) and view.pos[0, 0, :T].tolist() == list(range(T))
        seen[layer] = (query[0].clone(), view.keys[0, :, :T].clone(), view.values[0, :, :T].clone())
        observe(layer, query, view, query_pos)

    policy.observe = spy
    cache = RetentionCache(model, budget=None, policy=policy, slack=0)
    with torch.no_grad():
        ids = torch.randint(0, 128, (1, T), generator=torch.Generator().manual_seed(0))
        model(input_ids=ids, **cache_kwargs(cache))
        cache.set_budget(budget)
        cache.compress()
    view = cache.store.gather(torch.arange(L * H), with_kv=False)
    return policy, seen, [sorted(view.pos[r][view.valid[r]].tolist()) for r in range(L * H)], model


def attention(q: torch.Tensor, k: torch.Tensor, window: int) -> torch.Tensor:
    """``(HQ, window, T)`` causal softmax attention of the last ``window`` queries ``q`` ``(HQ, T, D)`` over the keys
    ``k`` ``(H, T, D)`` (query head ``j`` reads KV head ``j // G``), by the textbook formula."""
    G = HQ // H
    q, k = q.double(), k.double()
    out = torch.zeros(HQ, window, T, dtype=torch.float64)
    for j in range(HQ):
        for w in range(window):
            t = T - window + w
            logits = k[j // G, : t + 1] @ q[j, t] / math.sqrt(q.shape[-1])
            out[j, w, : t + 1] = torch.softmax(logits, 0)
    return out


def pool_prefix(s: list[float], kernel: int) -> list[float]:
    """Max over each entry's ``kernel`` centred neighbours, all in ``s`` (the prefix: nothing past its end)."""
    r = kernel // 2
    return [max(s[max(0, i - r) : i + r + 1]) for i in range(len(s))]


def assert_top(kept: list[tuple[int, int]], score: dict[tuple[int, int], float], k: int) -> None:
    """``kept`` is ``k`` entries of ``score`` (candidate -> reference score) scoring at least every other one (a
    tie may go either way)."""
    assert len(kept) == k and set(kept) <= set(score)
    dropped = [score[c] for c in score if c not in set(kept)]
    low = min(score[c] for c in kept)
    assert not dropped or low >= max(dropped) - 1e-6 * max(score.values()), (low, max(dropped))


def test_max_pool_within_pools_each_entry_over_its_neighbours_inside_only():
    s = torch.tensor([[1.0, 5.0, 2.0, 0.5, 9.0, 8.0]])
    inside = torch.tensor([[True, True, True, True, False, False]])
    assert max_pool(s, 3, within=inside).tolist() == [[5.0, 5.0, 5.0, 2.0, 9.0, 8.0]]
    assert max_pool(s, 3).tolist() == [[5.0, 5.0, 5.0, 9.0, 9.0, 9.0]]  # the window's 9 leaked into entry 3
    grid = torch.rand(2, 3, 4, 6, generator=torch.Generator().manual_seed(0))  # (B, H, W, L) with a (B, H, L) mask
    mask = torch.rand(2, 3, 6, generator=torch.Generator().manual_seed(1)) > 0.3
    want = torch.stack([max_pool(grid[:, :, w], 5, within=mask) for w in range(4)], 2)
    torch.testing.assert_close(max_pool(grid, 5, within=mask[:, :, None]), want)


def test_snapkv_pools_the_prefix_only_and_keeps_its_top_entries():
    """SnapKV (FasterDecoding/SnapKV): sum of the window's attention over ``attn[..., -w:, :-w]``, mean over the GQA
    group, max-pooled over those columns, top ``budget - w`` plus the window; PyramidKV scores the same way."""
    w, kernel, per_head = 8, 7, 20
    policy, seen, kept, _ = run("snapkv", per_head, window=w, kernel=kernel)
    kin = [get_policy("pyramidkv", window=w, kernel=kernel)]
    for layer in range(L):
        q, k, v = seen[layer]
        A = attention(q, k, w)
        view = SimpleNamespace(keys=k[None], values=v[None], pos=torch.arange(T).expand(1, H, T),
                               valid=torch.ones(1, H, T, dtype=torch.bool))
        same = [p.layer_scores(layer, q[None], view, torch.arange(T)[None])[0] for p in kin]  # (H, T) each
        for h in range(H):
            s = (A[3 * h : 3 * h + 3].sum(1).mean(0))[: T - w].tolist()
            ref = torch.tensor(pool_prefix(s, kernel), dtype=torch.float64)
            for got in [policy.stats.tables[layer][0, h, : T - w]] + [x[h, : T - w] for x in same]:
                torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-7)
            row = kept[layer * H + h]
            assert row[-w:] == list(range(T - w, T))  # the window
            assert_top([(0, i) for i in row[:-w]], {(0, i): x for i, x in enumerate(ref.tolist())}, per_head - w)


def test_lava_scores_pools_and_allocates_from_the_prefix_only():
    """LAVa (Eq. 5-7, MGDDestiny/Lava ``calcul_attn_score``): ``max_k ||V[k]||_1 / w * sum_j A^j[i]`` over the entries
    before the window, max over the group, pooled there; the layer's entropy over those scores / (H N) sets its
    budget; per layer the top ``B_l - H w`` entries over all heads plus the window are kept."""
    w, kernel, per_head = 8, 7, 24
    policy, seen, kept, _ = run("lava", per_head, window=w, kernel=kernel)
    N = T - w
    entropy, refs = [], []
    for layer in range(L):
        q, k, v = seen[layer]
        A, v = attention(q, k, w), v.double()
        ref = {}
        for h in range(H):
            vmax = float(v[h, :N].abs().sum(-1).max())
            s = [max(float(A[j, :, i].sum()) for j in range(3 * h, 3 * h + 3)) * vmax / w for i in range(N)]
            for i, x in enumerate(pool_prefix(s, kernel)):
                ref[(h, i)] = x
            want = torch.tensor([ref[(h, i)] for i in range(N)], dtype=torch.float64)
            torch.testing.assert_close(policy.stats.tables[layer][0, h, :N].double(), want, rtol=1e-5, atol=1e-7)
        total = sum(ref.values())
        entropy.append(-sum(x / total * math.log(x / total) for x in ref.values() if x > 0) / (H * N))
        refs.append(ref)
        assert math.isclose(float(policy.entropy[layer][0]), entropy[-1], rel_tol=1e-4)
    # updated: whole shares summing to the budget, the remainder to the largest fractions (all were rounded down)
    exact = [e / sum(entropy) * per_head * L * H for e in entropy]
    budget = [math.floor(x) for x in exact]
    for layer in sorted(range(L), key=lambda l: (budget[l] - exact[l], l))[: per_head * L * H - sum(budget)]:
        budget[layer] += 1
    for layer in range(L):
        rows = kept[layer * H : layer * H + H]
        assert all(r[-w:] == list(range(N, T)) for r in rows)
        assert_top([(h, i) for h, r in enumerate(rows) for i in r[:-w]], refs[layer], budget[layer] - H * w)


def restkv_reference(seen: Seen, model: Any, w: int, b: int, alpha: float, beta: float) -> list[dict[int, float]]:
    """ReST-KV's final scores of the prefix ``{position: score}`` per stream (rows in (layer, head) order), by
    the paper's formulas: ``I_t[n] = A_t[n] / (1 - A_t[n]) ||o_t - v_n W_O^h||`` (mean over the group), an EMA over
    the window's queries, the drift of the mean index of the top-``b`` prefix entries between the window's front
    and rear halves, and the average over ``2 floor(max_h |dD| / beta) + 1`` neighbouring prefix entries."""
    N, D, G = T - w, 16, HQ // H
    out = []
    for layer in range(L):
        q, k, v = seen[layer]
        A, v = attention(q, k, w), v.double()
        W_O = model.model.layers[layer].self_attn.o_proj.weight.detach().double()  # (hidden, HQ * D)
        ema, front, rear = [], [], []
        for h in range(H):
            I = torch.zeros(w, T, dtype=torch.float64)
            for j in range(G * h, G * h + G):
                vw = v[h] @ W_O[:, j * D : (j + 1) * D].T  # (T, hidden)
                o = A[j] @ vw  # (w, hidden)
                I += A[j] / (1 - A[j]) * torch.cdist(o, vw) / G
            e = I[0]
            for t in range(1, w):
                e = alpha * I[t] + (1 - alpha) * e
            ema.append(e[:N].tolist())
            front.append(I[: w // 2, :N].mean(0))
            rear.append(I[w // 2 :, :N].mean(0))
        idx = lambda s: float(s.topk(b).indices.double().mean())  # noqa: E731
        drift = max(abs(idx(rear[h]) - idx(front[h])) for h in range(H))
        r = int(drift / beta)  # half the window
        for h in range(H):
            out.append({i: sum(ema[h][max(0, i - r) : i + r + 1]) / len(ema[h][max(0, i - r) : i + r + 1])
                        for i in range(N)})
    return out


def test_restkv_smooths_over_the_prefix_with_the_budget_set_at_compression():
    """The harness prefills with no budget and sets it just before ``compress()``: the drift must still come from
    the top-``b`` entries with ``b`` that per-head budget (not b = 1, what the policy held when it observed)."""
    w, per_head, alpha, beta = 8, 20, 0.5, 1.0
    _, seen, kept, model = run("restkv", per_head, window=w, alpha=alpha, beta=beta)
    ref = restkv_reference(seen, model, w, per_head, alpha, beta)
    top = lambda scores: [sorted(sorted(r, key=r.get)[-(per_head - w) :]) for r in scores]  # noqa: E731
    assert top(ref) != top(restkv_reference(seen, model, w, 1, alpha, beta))  # b matters here
    for r, row in enumerate(kept):
        assert row[-w:] == list(range(T - w, T))
        assert_top([(0, i) for i in row[:-w]], {(0, i): x for i, x in ref[r].items()}, per_head - w)
    _, _, preset, _ = run("restkv", per_head, preset=True, window=w, alpha=alpha, beta=beta)
    assert preset == kept  # the order in which the policy hears the budget does not matter
