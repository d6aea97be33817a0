"""retention/cache/attention.py's padded attention against a head-by-head brute force, and the cache's choice of
its mask-free path (only while nothing is evicted or padded)."""

import pytest
import torch

from retention.attach import attach_gates
from retention.cache import RetentionCache, attention, dispatch
from retention.compat import cache_kwargs
from retention.policies import get_policy
from tiny_models import tiny_qwen3


def brute_force(query, keys, values, key_pos, valid, query_pos, scale):
    """One (sequence, query head, query) at a time: softmax over the valid keys at or before the query."""
    B, Hq, Q, D = query.shape
    G = Hq // keys.shape[1]
    out = torch.zeros(B, Q, Hq, D, dtype=torch.float64)
    for b in range(B):
        for hq in range(Hq):
            h = hq // G
            for q in range(Q):
                seen = valid[b, h] & (key_pos[b, h] >= 0) & (key_pos[b, h] <= query_pos[b, q])
                scores = keys[b, h, seen].double() @ query[b, hq, q].double() * scale
                out[b, q, hq] = scores.softmax(0) @ values[b, h, seen].double()
    return out


@pytest.mark.parametrize("Q", [7, 3, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_mask_free_path_equals_the_masked_one_and_brute_force(Q, dtype):
    """Every stream holding positions 0..N-1 (then the view's invalid tail) and the queries at N-Q..N-1 (a prompt's
    first chunk when Q = N, a later chunk, one decoding step): both paths give the brute force's output, with 3
    query heads per KV head."""
    g = torch.Generator().manual_seed(Q)
    B, H, G, N, L, D = 2, 2, 3, 7, 16, 8  # N entries held per stream, the view padded to L (a page) as the cache's
    query = torch.randn(B, H * G, Q, D, generator=g)
    keys, values = torch.randn(B, H, L, D, generator=g), torch.randn(B, H, L, D, generator=g)
    key_pos = torch.where(torch.arange(L) < N, torch.arange(L), -1).expand(B, H, L)
    valid = (torch.arange(L) < N).expand(B, H, L)
    query_pos = torch.arange(N - Q, N).expand(B, Q)
    args = (query.to(dtype), keys.to(dtype), values.to(dtype), key_pos, valid, query_pos, 0.3)
    expected = brute_force(*args)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for held in (None, N):
        got = attention.padded_attention(*args, held=held)
        assert got.shape == (B, Q, H * G, D) and got.dtype == dtype
        torch.testing.assert_close(got.double(), expected, atol=tol, rtol=tol)


def test_the_masked_path_is_what_evicted_and_padded_streams_need():
    """After eviction (streams of different lengths, gaps in positions) and with padding the mask-free path would
    be wrong: the masked one still equals the brute force, and the mask-free one does not."""
    g = torch.Generator().manual_seed(0)
    B, H, G, L, Q, D = 1, 2, 2, 6, 2, 8
    query = torch.randn(B, H * G, Q, D, generator=g)
    keys, values = torch.randn(B, H, L, D, generator=g), torch.randn(B, H, L, D, generator=g)
    key_pos = torch.tensor([[[0, 3, 5, 8, 9, -1], [1, 2, 4, 6, 8, 9]]])
    valid = torch.tensor([[[True] * 5 + [False], [True] * 6]])
    query_pos = torch.tensor([[8, 9]])
    args = (query, keys, values, key_pos, valid, query_pos, 0.3)
    torch.testing.assert_close(attention.padded_attention(*args).double(), brute_force(*args), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(attention.padded_attention(*args, held=6).double(), brute_force(*args), atol=1e-3)


@pytest.fixture
def spied(monkeypatch):
    """Whether each call the cache makes, in order, takes the mask-free path."""
    calls = []
    real = attention.padded_attention

    def spy(*args, held=None):
        calls.append(held is not None)
        return real(*args, held=held)

    monkeypatch.setattr(dispatch, "padded_attention", spy)
    return calls


def _feed(model, cache, ids, mask=None):
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=True, **cache_kwargs(cache))


def test_the_cache_skips_the_mask_until_the_first_eviction(spied):
    model = tiny_qwen3()
    attach_gates(model, mode="score")
    layers = model.config.num_hidden_layers
    cache = RetentionCache(model, budget=RetentionCache.budget_for(model, 8), policy=get_policy("global_gates"),
                           slack=0)
    ids = torch.randint(1, 100, (1, 30), generator=torch.Generator().manual_seed(1))
    held = []
    for start in range(0, 18, 6):
        _feed(model, cache, ids[:, start : start + 6])
        held.append(int(cache.store.lengths.min()))
    # chunks 1 and 2 fit (eviction runs before a forward, once the cache is past its budget): positions 0..11 held
    assert held[:2] == [6, 12] and spied[: 2 * layers] == [True] * (2 * layers)
    # evicted before chunk 3: gaps in the positions and streams of different lengths, so the mask
    assert held[2] < 18 and spied[2 * layers :] == [False] * layers


def test_the_cache_keeps_the_mask_for_left_padded_batches(spied):
    model = tiny_qwen3()
    attach_gates(model, mode="score")
    ids = torch.randint(1, 100, (2, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    cache = RetentionCache(model)
    _feed(model, cache, ids, mask)
    _feed(model, cache, ids[:, :1], torch.cat([mask, torch.ones_like(ids[:, :1])], 1))
    assert spied and not any(spied)
    unpadded = RetentionCache(model)
    spied.clear()
    _feed(model, unpadded, ids)
    assert spied and all(spied)
