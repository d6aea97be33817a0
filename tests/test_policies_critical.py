"""CriticalKV, DefensiveKV / Layer-DefensiveKV and AdaKV's safeguard on the real cache against brute-force
references written from the authors' code (FFY0/DefensiveKV kvpress presses: ``criticalkv_press.py``
``CriticalAdaKVPress``, ``efficient_defensivekv_press.py``, ``adakv_press.py``): a tiny Llama prefills a
random context, the cache compresses it, and the kept positions of every (layer, KV head) must be the
reference's. The reference reads attention from an eager forward of the same weights (no cache, no gates)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from retention import attach_gates
from retention.cache import RetentionCache
from retention.compat import cache_kwargs
from retention.policies import get_policy
from retention.policies.adakv import safeguard
from tiny_models import tiny_llama

CONFIG = dict(num_attention_heads=9, num_key_value_heads=3, hidden_size=144)
T, W = 64, 8  # context length, observation window


def eager_forward(ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Per layer: attention ``(Hq, T, T)`` float64, values ``(H, T, D)`` and ``W_O`` per query head
    ``(Hq, D, hidden)``, from an eager forward of the tiny model (same seed, so the same weights)."""
    model = tiny_llama(attn_implementation="eager", **CONFIG)
    H, D = model.config.num_key_value_heads, model.config.head_dim
    values, hooks = [], []
    for layer in model.model.layers:
        hooks.append(layer.self_attn.v_proj.register_forward_hook(
            lambda m, i, o: values.append(o[0].view(-1, H, D).transpose(0, 1).double())))
    with torch.no_grad():
        out = model(input_ids=ids, output_attentions=True)
    for h in hooks:
        h.remove()
    w_o = [layer.self_attn.o_proj.weight.detach().double().T.reshape(-1, D, model.config.hidden_size)
           for layer in model.model.layers]
    return [a[0].double() for a in out.attentions], values, w_o


def l1_norms(v: torch.Tensor, w_o: torch.Tensor) -> torch.Tensor:
    """``(H, T)``: ``||v_i W_O^g||_1`` averaged over each KV head's query heads (the authors' ``vwl1norm``)."""
    H = v.shape[0]
    G = w_o.shape[0] // H
    return torch.stack([torch.stack([(v[h] @ w_o[h * G + g]).abs().sum(-1) for g in range(G)]).mean(0)
                        for h in range(H)])


def cache_kept(name: str, budget: int, ids: torch.Tensor, **params: object) -> list[list[list[int]]]:
    """Kept positions ``[layer][head]`` after the cache compresses the prefilled ``ids`` with policy ``name``."""
    model = tiny_llama(**CONFIG)
    attach_gates(model, mode="score")
    cache = RetentionCache(model, budget=budget, policy=get_policy(name, window=W, **params), slack=0)
    with torch.no_grad():
        model(input_ids=ids, **cache_kwargs(cache))
    cache.compress()
    L, H = model.config.num_hidden_layers, model.config.num_key_value_heads
    view = cache.store.gather(torch.arange(L * H), with_kv=False)
    return [[sorted(view.pos[l * H + h][view.valid[l * H + h]].tolist()) for h in range(H)] for l in range(L)]


def top_per_row(score: torch.Tensor, k: list[int] | torch.Tensor) -> torch.Tensor:
    """``(H, N)`` bool: each row's ``k[h]`` best entries (``score`` has no ties in these tests)."""
    keep = torch.zeros_like(score, dtype=torch.bool)
    for h in range(score.shape[0]):
        keep[h, score[h].topk(int(k[h])).indices] = True
    return keep


def critical_adakv_reference(attn: torch.Tensor, v: torch.Tensor, w_o: torch.Tensor, layer_budget: int,
                             alpha: float, critical: bool, kernel: int = 1) -> list[list[int]]:
    """``CriticalAdaKVPress(SnapKV)`` (or ``AdaKVPress`` without ``critical``) on one layer, SnapKV's score being
    this repo's (window mean, group mean, max-pooled over the prefix alone as AdaKV's code does). attn ``(Hq, T, T)``,
    v ``(H, T, D)``; returns kept positions."""
    H = v.shape[0]
    G = attn.shape[0] // H
    s = attn[:, T - W :, :].sum(1).view(H, G, T).mean(1) / W  # (H, T)
    s[:, : T - W] = F.max_pool1d(s[None, :, : T - W], kernel, stride=1, padding=kernel // 2)[0]
    s[:, T - W :] = s[:, : T - W].max() + 1.0  # the window holds the top score (kvpress pads it with the max)
    big = 1e30
    n_kept = layer_budget // H
    s = torch.where(top_per_row(s, [int(alpha * n_kept)] * H), torch.full_like(s, big), s)  # safeguard
    keep_flat = s.flatten().topk(layer_budget).indices // T
    budgets = torch.bincount(keep_flat, minlength=H)
    if not critical:
        return [sorted((s[h] >= s.flatten().topk(layer_budget).values[-1]).nonzero().flatten().tolist())
                for h in range(H)]
    s = torch.where(top_per_row(s, (budgets * 0.5).long()), torch.full_like(s, big), s)  # stage 1
    s = (s + 1e-4) * l1_norms(v, w_o)  # stage 2
    keep = top_per_row(s, budgets)
    return [sorted(keep[h].nonzero().flatten().tolist()) for h in range(H)]


@pytest.mark.parametrize("budget", [180, 405])  # per-head share 20 (floor 4 < window) and 45 (floor 9 > window)
def test_criticalkv_is_the_authors_two_stage_selection(budget: int) -> None:
    ids = torch.randint(1, 100, (1, T), generator=torch.Generator().manual_seed(1))
    attn, values, w_o = eager_forward(ids)
    got = cache_kept("criticalkv", budget, ids, kernel=1)
    L = len(attn)
    want = [critical_adakv_reference(attn[l], values[l], w_o[l], budget // L, 0.2, True) for l in range(L)]
    assert got == want


@pytest.mark.parametrize("alpha, kernel", [(0.2, 1), (1.0, 1)])
def test_adakv_safeguard_counts_the_window_first(alpha: float, kernel: int) -> None:
    """The window takes the floor's places first (kvpress AdaKV's safeguard)."""
    ids = torch.randint(1, 100, (1, T), generator=torch.Generator().manual_seed(2))
    attn, values, w_o = eager_forward(ids)
    budget = 405
    got = cache_kept("adakv", budget, ids, kernel=kernel, alpha=alpha)
    L = len(attn)
    assert got == [critical_adakv_reference(attn[l], values[l], w_o[l], budget // L, alpha, False, kernel)
                   for l in range(L)]


def test_adakv_pools_the_prefix_alone() -> None:
    """AdaKV's code max-pools ``attn[..., :-window]``: the entry before the window borrows none of its attention."""
    from test_policies import D, entries_for, layer_view

    from retention.policies.window import window_attention

    view = layer_view(L=8)
    q = torch.randn(1, 2, 3, D, generator=torch.Generator().manual_seed(4))
    qpos = torch.tensor([[5, 6, 7]])
    pol = get_policy("adakv", window=3, kernel=3)
    pol.observe(0, q, view, qpos)
    s = window_attention(q, view, qpos, 3).sum(3).mean(2)[0, 0]  # (8,)
    want = [max(s[max(0, i - 1) : min(i + 2, 5)]).item() for i in range(5)]  # neighbours among positions 0..4
    torch.testing.assert_close(pol.stats.lookup(entries_for(view))[0, :5], torch.tensor(want))


def test_safeguard_window_takes_the_floor_first() -> None:
    """Unit case: a floor of 3 with a 2-token window lifts one prefix entry (the best), not the best three."""
    score = torch.tensor([[5.0, 4.0, 3.0, 0.1, 0.2]])
    valid = torch.ones_like(score, dtype=torch.bool)
    window = torch.tensor([[False, False, False, True, True]])
    lifted = (safeguard(score, valid, 3, first=window) > score) & ~window
    assert lifted.tolist() == [[True, False, False, False, False]]


def defensive_reference(attn: torch.Tensor, v: torch.Tensor, w_o: torch.Tensor, share: int) -> torch.Tensor:
    """``efficient_defensivekv_press.py``'s (and ``efficient_layer_defensivekv_press.py``'s) scores ``(H, T - W)`` of
    one layer's prefix (before the window is padded back): the norm enters as each head's share of the position's
    norm over the KV heads, ``WoV_norm / WoV_norm.sum(dim=-2)``. Updated: this once multiplied by the raw norm (the
    paper's text) and divided Layer-DefensiveKV's by the layer's sum."""
    H = v.shape[0]
    G = attn.shape[0] // H
    n = T - W
    a = attn[:, T - W :, :n]  # window queries over the prefix (softmax over every key, then truncated)
    window_bias = a[..., -W:].sum(-1).mean()
    sc = a.reshape(H, G, W, n)
    ave = sc.mean(1).mean(1)
    base = sc.sum(-1, keepdim=True)
    pooled = F.avg_pool1d(sc.reshape(H * G, W, n), kernel_size=5, padding=2, stride=1).view(H, G, W, n)
    pooled = pooled / pooled.sum(-1, keepdim=True) * base
    risk = pooled.amax(1).amax(1)
    risk = risk.clamp(min=risk.mean(-1, keepdim=True))
    norm = l1_norms(v[:, :n], w_o)
    s = risk * (norm / norm.sum(0, keepdim=True))
    normalized = ave / ave.sum(-1, keepdim=True)
    sorted_scores, order = normalized.sort(-1, descending=True)
    count = torch.argmax((sorted_scores.cumsum(-1) >= 0.9 - window_bias).int(), dim=-1).clamp(max=share - W)
    stage1 = torch.zeros_like(s, dtype=torch.bool)
    for h in range(H):
        stage1[h, order[h, : int(count[h])]] = True
    return torch.where(stage1, s.max(), s)


@pytest.mark.parametrize("name, budget", [("defensivekv", 270), ("defensivekv", 450),
                                          ("layer_defensivekv", 270), ("layer_defensivekv", 450)])
def test_defensivekv_is_the_authors_scoring(name: str, budget: int) -> None:
    ids = torch.randint(1, 100, (1, T), generator=torch.Generator().manual_seed(3))
    attn, values, w_o = eager_forward(ids)
    L, H = len(attn), values[0].shape[0]
    got = cache_kept(name, budget, ids)
    scores = torch.stack([defensive_reference(attn[l], values[l], w_o[l], budget // (L * H))
                          for l in range(L)])  # (L, H, T - W)
    # the stage-1 entries share their layer's top score: ties go to the newer token, then the lower layer / head
    # (the cache's rule; the authors' topk leaves them to the kernel)
    ranked = sorted(((float(scores[l, h, i]), i, -l, -h) for l in range(L) for h in range(H) for i in range(T - W)),
                    reverse=True)
    keep = torch.zeros(L, H, T - W, dtype=torch.bool)
    if name == "defensivekv":  # each layer keeps its top B / L, the window's H * W included
        for l in range(L):
            for _, i, _, h in [r for r in ranked if r[2] == -l][: budget // L - H * W]:
                keep[l, -h, i] = True
    else:  # one selection over every layer
        for _, i, l, h in ranked[: budget - L * H * W]:
            keep[-l, -h, i] = True
    keep = keep.view(L, H, T - W)
    want = [[sorted(keep[l, h].nonzero().flatten().tolist()) + list(range(T - W, T)) for h in range(H)]
            for l in range(L)]
    assert got == want


@pytest.mark.parametrize("name", ["adakv", "criticalkv"])
def test_safeguard_floor_goes_to_real_entries_not_left_padding(name: str) -> None:
    """A left-padded row's padding slots (pos -1) look up position 0's score: the safeguard gave them the floor's
    places before position 0 itself, so a head of a padded row lost its floor. The padded row must keep what the
    same row keeps alone."""
    from retention.cache.select import select_keep
    from retention.policies import EntryView

    T, pad = 8, 3
    pol = get_policy(name, window=2, alpha=1.0)
    table = torch.zeros(1, 2, T)
    g = torch.Generator().manual_seed(0)
    table[0, 0] = torch.rand(T, generator=g) + 10.0  # head 0 outscores head 1 everywhere
    table[0, 1] = torch.rand(T, generator=g)
    table[0, 1, 0] = 5.0  # head 1's sink: its best entry
    pol.stats.tables[0] = table
    pol.norms.tables[0] = torch.ones(1, 2, T)
    pol.set_budget(total=8, num_layers=1, num_heads=2)  # one layer of 8 entries; floor int(1.0 * 4) = 4 per head

    def kept(p: int) -> list[list[int]]:
        pos = torch.cat([torch.full((p,), -1), torch.arange(T)]).expand(2, -1).clone()
        entries = EntryView(log_beta=torch.zeros(2, T + p), pos=pos, valid=torch.ones(2, T + p, dtype=torch.bool),
                            step=torch.full((2,), T - 1), seq=torch.zeros(2, dtype=torch.long),
                            layer=torch.zeros(2, dtype=torch.long), head=torch.arange(2), start=torch.full((2,), p))
        real = entries.valid & (entries.pos >= 0)  # the cache drops padding at eviction
        keep = select_keep(pol.score(entries), pos, real, torch.zeros(2, dtype=torch.long), torch.tensor([8]))
        return [sorted(pos[h][keep[h]].tolist()) for h in range(2)]

    alone = kept(0)
    assert len(alone[1]) == 4 and 0 in alone[1]  # head 1 keeps its floor of 4, the window and its sink among them
    assert kept(pad) == alone
