"""Triton retention-gated attention (interpreter mode on CPU) against the fp32 reference.

Tolerances: fp32 inputs run the same math as the reference (exact fp32 dot products in the
interpreter), so outputs agree to ~1e-6 and gradients to ~1e-5 (sums over up to ~1000 keys; d log_beta
also multiplies by distances up to T). fp16 inputs are rounded once to 10 mantissa bits and the
kernel feeds fp16 P / dS into its matmuls (as FlashAttention does): errors are ~1e-3 of the values'
scale, so the check is ``max |err| <= rtol * max |ref| + atol`` with rtol 2e-2.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is imported

import pytest
import torch

from retention.ops.retention_attention import retention_attention, retention_attention_ref

triton_kernel = pytest.importorskip("retention.ops.retention_attention.triton_kernel")
run = triton_kernel.retention_attention_triton


def make(B, Tq, Tk, Hq, Hkv, D, dtype, lb_lo, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Tq, Hq, D, generator=g).to(dtype).requires_grad_()
    k = torch.randn(B, Tk, Hkv, D, generator=g).to(dtype).requires_grad_()
    v = torch.randn(B, Tk, Hkv, D, generator=g).to(dtype).requires_grad_()
    # log_beta spread between lb_lo and -1e-6 (from nearly no decay to strong decay)
    lb = (lb_lo + (-1e-6 - lb_lo) * torch.rand(B, Hkv, Tk, generator=g)).requires_grad_()
    return q, k, v, lb


def compare(q, k, v, lb, cu=None):
    out, lse = run(q, k, v, lb, cu_seqlens=cu)
    ref_in = [x.detach().float().requires_grad_() for x in (q, k, v)] + [lb.detach().clone().requires_grad_()]
    ref_out, ref_lse = retention_attention_ref(*ref_in, cu_seqlens=cu)
    dout = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad((out.float() * dout).sum(), [q, k, v, lb])
    ref_grads = torch.autograd.grad((ref_out * dout).sum(), ref_in)
    rtol, atol = (1e-4, 1e-5) if q.dtype == torch.float32 else (2e-2, 1e-3)
    pairs = [("out", out.float(), ref_out), ("lse", lse, ref_lse)] + [
        (f"d{n}", a.float(), b) for n, a, b in zip(("q", "k", "v", "log_beta"), grads, ref_grads)
    ]
    for name, a, b in pairs:
        assert a.shape == b.shape, name
        err, scale = (a - b).abs().max().item(), b.abs().max().item()
        assert err <= rtol * scale + atol, f"{name}: max error {err:.3g} (scale {scale:.3g})"
    assert out.dtype == q.dtype and grads[0].dtype == q.dtype and grads[3].dtype == lb.dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T", [1, 17, 63])
@pytest.mark.parametrize("G", [1, 3, 4])
def test_matches_reference_ragged_lengths_and_gqa(dtype, T, G):
    compare(*make(2, T, T, 2 * G, 2, 16, dtype, lb_lo=-1.0, seed=T + G))


@pytest.mark.parametrize("lb_lo", [-1e-5, -0.3, -5.0])
def test_decay_from_none_to_strong(lb_lo):
    compare(*make(1, 40, 40, 4, 1, 32, torch.float32, lb_lo=lb_lo))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_packed_documents(dtype):
    q, k, v, lb = make(2, 48, 48, 4, 2, 16, dtype, lb_lo=-0.5)
    compare(q, k, v, lb, cu=torch.tensor([0, 5, 6, 30, 60, 96], dtype=torch.int32))


@pytest.mark.parametrize("D", [64, 80])
def test_model_head_dims(D):
    compare(*make(1, 33, 33, 6, 2, D, torch.float16, lb_lo=-0.2))


def test_decode_step_with_fewer_queries_than_keys():
    compare(*make(2, 3, 29, 4, 2, 16, torch.float32, lb_lo=-0.5))


@pytest.mark.slow
@pytest.mark.parametrize("T", [128, 300, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_long_sequences(T, dtype):
    compare(*make(1, T, T, 4, 1, 64, dtype, lb_lo=-0.1))


def test_dispatch_uses_reference_on_cpu_and_triton_when_forced(monkeypatch):
    q, k, v, lb = make(1, 9, 9, 2, 2, 16, torch.float32, lb_lo=-0.5)
    calls = []
    real = triton_kernel.retention_attention_triton
    monkeypatch.setattr(triton_kernel, "retention_attention_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    ref = retention_attention(q, k, v, lb)
    assert calls == []
    monkeypatch.setenv("RETENTION_FORCE_TRITON", "1")
    forced = retention_attention(q, k, v, lb)
    assert calls == [1]
    torch.testing.assert_close(forced, ref, rtol=1e-5, atol=1e-6)


def test_bad_inputs_are_clear_errors():
    q, k, v, lb = make(1, 8, 8, 2, 2, 16, torch.float32, lb_lo=-0.5)
    with pytest.raises(ValueError, match="share a dtype"):
        run(q, k.half(), v, lb)
    with pytest.raises(ValueError, match="end at batch \\* seqlen"):
        run(q, k, v, lb, cu_seqlens=torch.tensor([0, 3]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 needs a GPU: the interpreter's bf16 is wrong")
@pytest.mark.parametrize("D", [64, 128])
def test_bf16_on_gpu(D):
    q, k, v, lb = (x.detach().cuda().requires_grad_() for x in make(2, 300, 300, 8, 2, D, torch.bfloat16, lb_lo=-0.2))
    compare(q, k, v, lb)


def test_kernel_benchmark_runs_on_cpu(capsys):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("bench_kernels", Path(__file__).parent.parent / "eval" / "bench_kernels.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--seq", "16", "--dims", "16", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    assert "cannot be measured here" in out
    rows = [line for line in out.splitlines() if line.startswith("| 16 | 16 | triton-interp")]
    assert len(rows) == 1 and float(rows[0].split("|")[6]) < 1e-4  # the kernel agrees with the reference
