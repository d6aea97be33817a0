"""The blocked PyTorch reference of retention-gated attention against brute force (float64 inputs).

The reference computes in fp32 internally, so against a float64 brute force the errors are fp32
round-off: ~1e-6 relative; tolerances 1e-5 leave room for sums over a few hundred keys.
"""

import pytest
import torch
import torch.nn.functional as F

import retention.ops.retention_attention.reference as ref
from retention.ops.retention_attention import retention_attention, retention_attention_naive, retention_attention_ref

TOL = dict(rtol=1e-5, atol=1e-5)


def inputs(B, Tq, Tk, Hq, Hkv, D=16, lb_scale=0.5, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Tq, Hq, D, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, Tk, Hkv, D, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, Tk, Hkv, D, generator=g, dtype=torch.float64, requires_grad=True)
    lb = (-torch.rand(B, Hkv, Tk, generator=g, dtype=torch.float64) * lb_scale).requires_grad_()
    return q, k, v, lb


CASES = {
    "mha": (2, 33, 33, 2, 2, None),
    "gqa3": (2, 40, 40, 6, 2, None),
    "gqa4-packed": (1, 50, 50, 4, 1, [0, 10, 11, 30, 50]),
    "batch-packed": (2, 40, 40, 3, 1, [0, 13, 40, 55, 80]),
    "row-crossing": (2, 40, 40, 3, 1, [0, 13, 55, 80]),  # a document over the row boundary is two
    "decode": (2, 5, 20, 4, 1, None),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("block", [16, 1 << 24])
def test_reference_matches_brute_force_with_gradients(case, block, monkeypatch):
    B, Tq, Tk, Hq, Hkv, cu = CASES[case]
    monkeypatch.setattr(ref, "_BLOCK_ELEMENTS", block * B * Hq * Tk)  # force several query blocks
    cu = None if cu is None else torch.tensor(cu)
    q, k, v, lb = inputs(B, Tq, Tk, Hq, Hkv)
    out, lse = retention_attention_ref(q, k, v, lb, cu_seqlens=cu)
    out_n, lse_n = retention_attention_naive(q, k, v, lb, cu_seqlens=cu)
    torch.testing.assert_close(out, out_n, **TOL)
    torch.testing.assert_close(lse.double(), lse_n, **TOL)  # the LSE is always fp32
    dout = torch.randn_like(out)
    grads = torch.autograd.grad((out * dout).sum(), [q, k, v, lb])
    grads_n = torch.autograd.grad((out_n * dout).sum(), [q, k, v, lb])
    for name, a, b in zip("q k v log_beta".split(), grads, grads_n):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"d{name}")


def test_zero_log_beta_is_causal_softmax_attention():
    q, k, v, _ = inputs(2, 24, 24, 4, 2)
    lb = torch.zeros(2, 2, 24, dtype=torch.float64)
    out = retention_attention(q, k, v, lb)
    want = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    ).transpose(1, 2)
    torch.testing.assert_close(out, want, **TOL)


def test_packed_documents_equal_running_each_alone():
    cu = [0, 7, 19, 32]
    q, k, v, lb = inputs(1, 32, 32, 4, 2)
    packed = retention_attention(q, k, v, lb, cu_seqlens=torch.tensor(cu))
    for s, e in zip(cu[:-1], cu[1:]):
        alone = retention_attention(q[:, s:e], k[:, s:e], v[:, s:e], lb[..., s:e])
        torch.testing.assert_close(packed[:, s:e], alone, **TOL)


def test_strong_decay_attends_to_the_diagonal():
    q, k, v, _ = inputs(1, 10, 10, 2, 2)
    lb = torch.full((1, 2, 10), -80.0, dtype=torch.float64)
    out = retention_attention(q, k, v, lb)
    torch.testing.assert_close(out, v.detach(), rtol=1e-6, atol=1e-6)


def test_long_sequence_runs_in_bounded_blocks(monkeypatch):
    seen = []
    real = ref._Blocks.bias_and_mask

    def spy(self, t0, t1, k0, k1, lb):
        seen.append((t1 - t0) * (k1 - k0))
        return real(self, t0, t1, k0, k1, lb)

    monkeypatch.setattr(ref._Blocks, "bias_and_mask", spy)
    monkeypatch.setattr(ref, "_BLOCK_ELEMENTS", 1 << 20)
    T = 3000
    q = torch.randn(1, T, 2, 8)
    k = torch.randn(1, T, 1, 8)
    lb = -torch.rand(1, 1, T)
    out = retention_attention(q, k, k, lb, backend="reference")
    assert out.shape == (1, T, 2, 8) and torch.isfinite(out).all()
    assert len(seen) > 1 and max(seen) * 2 <= 1 << 20  # (B * Hq) * block elements: never T x T


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(cu_seqlens=torch.tensor([0, 5, 9])), "end at batch \\* seqlen"),
        (dict(backend="cuda"), "backend must be"),
    ],
)
def test_bad_arguments_are_clear_errors(kwargs, match):
    q, k, v, lb = inputs(1, 8, 8, 2, 2)
    with pytest.raises(ValueError, match=match):
        retention_attention(q, k, v, lb, **kwargs)


def test_shape_errors():
    q, k, v, lb = inputs(1, 8, 8, 3, 2)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        retention_attention(q, k, v, lb)
    q, k, v, lb = inputs(1, 8, 8, 2, 2)
    with pytest.raises(ValueError, match="log_beta must be"):
        retention_attention(q, k, v, lb[..., :4])


def test_empty_batch():
    # the first key of each block was the min over an empty batch ("min(): Expected reduction dim"); SDPA and the
    # Triton kernel return empty results
    q, k, v, lb = (x.detach()[:0].requires_grad_() for x in inputs(1, 8, 8, 2, 1))
    out, lse = retention_attention_ref(q, k, v, lb)
    assert out.shape == (0, 8, 2, 16) and lse.shape == (0, 2, 8)
    assert [g.shape for g in torch.autograd.grad(out.sum(), (q, k, v, lb))] == [q.shape, k.shape, v.shape, lb.shape]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("span", [None, 2.0])
def test_sdpa_path_matches_brute_force_with_gradients(case, span, monkeypatch):
    import retention.ops.retention_attention.sdpa as sdpa
    from retention.ops.retention_attention import retention_attention_sdpa

    if span is not None:  # chunks of 4 queries (span / max|log_beta| with log_beta in [-0.5, 0])
        monkeypatch.setattr(sdpa, "SPAN", span)
        monkeypatch.setattr(sdpa, "MIN_CHUNK", 1)
    B, Tq, Tk, Hq, Hkv, cu = CASES[case]
    cu = None if cu is None else torch.tensor(cu)
    q, k, v, lb = inputs(B, Tq, Tk, Hq, Hkv)
    calls = []
    real = sdpa.F.scaled_dot_product_attention
    monkeypatch.setattr(sdpa.F, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(a[0].shape[2]) or real(*a, **kw))
    out = retention_attention_sdpa(q, k, v, lb, cu_seqlens=cu)
    assert span is None or max(calls) <= 4 < Tq  # chunked as asked
    out_n, _ = retention_attention_naive(q, k, v, lb, cu_seqlens=cu)
    torch.testing.assert_close(out, out_n, **TOL)  # computed in fp32 like the reference
    dout = torch.randn_like(out)
    grads = torch.autograd.grad((out * dout).sum(), [q, k, v, lb])
    grads_n = torch.autograd.grad((out_n * dout).sum(), [q, k, v, lb])
    for name, a, b in zip("q k v log_beta".split(), grads, grads_n):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"d{name}")


def test_sdpa_path_keeps_fp32_accuracy_on_a_long_sequence_with_strong_decays():
    # the folded bias cancels two products of ~ chunk * |log_beta|: unchunked (one centre for 1500 queries) this
    # case is 1e-4 off; chunks keep it near fp32's own error
    g = torch.Generator().manual_seed(0)
    T = 1500
    q = 2 * torch.randn(1, T, 2, 32, generator=g, dtype=torch.float64)
    k = 2 * torch.randn(1, T, 1, 32, generator=g, dtype=torch.float64)
    v = torch.randn(1, T, 1, 32, generator=g, dtype=torch.float64)
    lb = -3 * torch.rand(1, 1, T, generator=g, dtype=torch.float64)  # trained gates reach beta = 0.06
    from retention.ops.retention_attention import retention_attention_sdpa

    out = retention_attention_sdpa(q, k, v, lb)
    torch.testing.assert_close(out, retention_attention_naive(q, k, v, lb)[0], rtol=0, atol=3e-5)


def test_sdpa_path_stays_fp32_under_bf16_autocast():
    # SDPA is on autocast's bf16 list: in bf16 the appended positions lost the decay (0.22 off here)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 300, h, 32, generator=g) for h in (4, 2, 2))
    lb = -0.5 * torch.rand(1, 2, 300, generator=g)
    want = retention_attention_naive(*(x.bfloat16().double() for x in (q, k, v)), lb.double())[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = retention_attention(q, k, v, lb)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-2)  # bf16 rounding of outputs up to ~2


def test_dispatch_takes_sdpa_on_cpu_and_the_blocked_reference_for_beta_near_zero(monkeypatch):
    import retention.ops.retention_attention as ra
    from retention.ops.retention_attention.sdpa import MIN_CHUNK, SPAN, chunk_length

    calls = []
    sdpa, ref = ra.retention_attention_sdpa, ra.retention_attention_ref

    def spy_sdpa(*a, **k):  # counts the calls that return: a refused one falls through to the reference
        out = sdpa(*a, **k)
        calls.append("sdpa")
        return out

    monkeypatch.setattr(ra, "retention_attention_sdpa", spy_sdpa)
    monkeypatch.setattr(ra, "retention_attention_ref", lambda *a, **k: calls.append("ref") or ref(*a, **k))
    q, k, v, lb = inputs(1, 200, 200, 2, 2)
    strong = torch.full_like(lb, -SPAN / (MIN_CHUNK - 1))  # chunks would be shorter than MIN_CHUNK queries
    assert chunk_length(lb, 200) == 200 and chunk_length(strong, 200) is None and chunk_length(strong, 60) == 60
    retention_attention(q, k, v, lb)
    retention_attention(q, k, v, strong)  # a short sequence (below) is exact with any decay
    retention_attention(q, k, v, lb.detach().masked_fill(torch.rand(lb.shape) < 0.1, float("-inf")))
    retention_attention(q[:, :60], k[:, :60], v[:, :60], strong[..., :60])
    assert calls == ["sdpa", "ref", "ref", "sdpa"]
    calls.clear()
    with ra.default_backend("reference"):  # what bench_train's step-ref times, and a way to check a run
        retention_attention(q, k, v, lb)
        assert calls == ["ref"]
        with ra.default_backend("auto"):
            retention_attention(q, k, v, lb)
    retention_attention(q, k, v, lb)
    assert calls == ["ref", "sdpa", "sdpa"]
    with pytest.raises(ValueError, match="backend must be"), ra.default_backend("sdpa"):
        pass
    with pytest.raises(ra.sdpa_path.TooSteepError, match="blocked reference"):
        ra.sdpa_path.retention_attention_sdpa(q, k, v, strong)
    with pytest.raises(ValueError, match="as many queries as keys"):  # bad input is still an error, not a fallback
        retention_attention(q[:, :50], k, v, lb, cu_seqlens=torch.tensor([0, 200]))


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_log_beta_at_or_below_the_floor_means_beta_zero(backend):
    # 0 * -inf on the diagonal was NaN in the output and every gradient; such a token now counts for itself only
    q, k, v, lb = inputs(1, 12, 12, 2, 1)
    lb = lb.detach().float()
    q, k, v = (x.detach().float().requires_grad_() for x in (q, k, v))
    beta_zero = lb.clone()
    lb[0, 0, 5], beta_zero[0, 0, 5] = float("-inf"), -1e4
    lb.requires_grad_()
    out = retention_attention(q, k, v, lb, backend=backend)
    torch.testing.assert_close(out, retention_attention_naive(q, k, v, beta_zero)[0], rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(out.square().sum(), [q, k, v, lb])
    assert all(torch.isfinite(g).all() for g in grads)


def test_float_cu_seqlens_is_refused_on_every_path():
    # the CPU paths truncated 2.5 to 2 where the Triton kernels refuse a float tensor
    from retention.ops.capacity import capacity_sum

    q, k, v, lb = inputs(1, 8, 8, 2, 2)
    cu = torch.tensor([0.0, 2.5, 8.0])
    for backend in ("auto", "reference"):
        with pytest.raises(ValueError, match="integer tensor"):
            retention_attention(q, k, v, lb, cu_seqlens=cu, backend=backend)
        with pytest.raises(ValueError, match="integer tensor"):
            capacity_sum(lb, cu, backend=backend)


def test_packed_documents_need_as_many_queries_as_keys_on_the_sdpa_path_too():
    # the short-sequence SDPA path computed an answer the blocked reference and the Triton kernel refuse
    q, k, v, lb = inputs(1, 8, 8, 2, 2)
    for backend in ("auto", "reference"):
        with pytest.raises(ValueError, match="as many queries as keys"):
            retention_attention(q[:, :4], k, v, lb, cu_seqlens=torch.tensor([0, 3, 8]), backend=backend)
