"""Capacity sum: Triton kernel (interpreter mode on CPU) against the blocked reference, and the
reference against brute force.

Tolerances: kernel and reference both compute exp and sums in fp32 from the same log_beta values
(the kernel as exp2 of log2-scaled arguments, in another summation order), so sums (<= N * T) agree
to a few fp32 ulps: measured ~1e-7 relative; checked with rtol 1e-5. Gradients multiply by distances
up to T and sum up to T terms of both signs: measured ~3e-7 of their scale; checked at 1e-5 of the
largest value (+1e-5 absolute for gradients that are ~0). For fp16 log_beta the values are the same
(upcast inside both), only the returned gradient is rounded to fp16 (round-off 4.9e-4): 2e-3.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel is imported

import pytest
import torch

import retention.ops.capacity.reference as capref
from retention.ops.capacity import capacity_sum, capacity_sum_naive, capacity_sum_ref

kernel = pytest.importorskip("retention.ops.capacity.triton_kernel")


def gates(B, N, T, lb_lo, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    lb = lb_lo + (-1e-6 - lb_lo) * torch.rand(B, N, T, generator=g)
    return lb.to(device=device, dtype=dtype).requires_grad_()


def check(lb, cu, reduce, streams_per_program=None):
    cu = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    got = kernel.capacity_sum_triton(lb, cu, reduce, streams_per_program)
    ref_lb = lb.detach().float().requires_grad_()
    want = capacity_sum_ref(ref_lb, cu, reduce)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    dS = torch.randn(want.shape, generator=torch.Generator().manual_seed(7)).to(want.device)
    (a,) = torch.autograd.grad((got * dS).sum(), lb)
    (b,) = torch.autograd.grad((want * dS).sum(), ref_lb)
    assert a.dtype == lb.dtype
    rtol = 1e-5 if lb.dtype == torch.float32 else 2e-3
    err, scale = (a.float() - b).abs().max().item(), b.abs().max().item()
    assert err <= rtol * scale + 1e-5, f"d log_beta: max error {err:.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("T", [1, 17, 63, 128])
@pytest.mark.parametrize("reduce", [True, False])
def test_matches_reference(T, reduce):
    check(gates(2, 3, T, -0.5, seed=T), None, reduce)


@pytest.mark.parametrize("lb_lo", [-1e-6, -0.05, -5.0])
def test_decay_range(lb_lo):
    check(gates(1, 4, 50, lb_lo), None, True)


@pytest.mark.parametrize("reduce", [True, False])
def test_packed_documents(reduce):
    # an empty document, one of length 1, and one crossing the row boundary at 40
    check(gates(2, 3, 40, -0.3), [0, 7, 7, 8, 33, 60, 80], reduce)


def test_streams_summed_in_chunks():
    # 5 streams, 2 per program: chunks of 2, 2 and 1 added at the end
    check(gates(2, 5, 30, -0.2), [0, 12, 60], True, streams_per_program=2)


def test_fp16_log_beta_input():
    check(gates(1, 2, 30, -0.3, dtype=torch.float16), None, True)


def test_strided_log_beta_and_sum_backward():
    base = gates(2, 25, 3, -0.4)  # (B, T, N) viewed as (B, N, T)
    lb = base.transpose(1, 2)
    kernel.capacity_sum_triton(lb).sum().backward()  # sum(): dS is an expanded, stride-0 tensor
    got = base.grad.clone()
    base.grad = None
    capacity_sum_ref(lb).sum().backward()
    torch.testing.assert_close(got, base.grad, rtol=1e-5, atol=1e-5)


def test_beta_one_counts_tokens_in_the_document():
    S = kernel.capacity_sum_triton(torch.zeros(1, 2, 10), torch.tensor([0, 4, 10]), reduce=False)
    assert S[0, 0].tolist() == [1, 2, 3, 4, 1, 2, 3, 4, 5, 6]


@pytest.mark.slow
@pytest.mark.parametrize("T", [300, 1000])
@pytest.mark.parametrize("reduce", [True, False])
def test_long(T, reduce):
    check(gates(1, 2, T, -0.05, seed=T), [0, 1, T // 3, T], reduce)


@pytest.mark.parametrize("cu", [None, [0, 5, 5, 30, 41, 80]])
@pytest.mark.parametrize("reduce", [True, False])
def test_reference_matches_brute_force_in_small_blocks(cu, reduce, monkeypatch):
    # a block budget this small forces one stream per block and several position blocks
    monkeypatch.setattr(capref, "_BLOCK_ELEMENTS", 16 * 2 * 40)
    cu = None if cu is None else torch.tensor(cu)
    lb = (-torch.rand(2, 3, 40, dtype=torch.float64) * 0.3).requires_grad_()
    got, want = capacity_sum_ref(lb, cu, reduce), capacity_sum_naive(lb, cu, reduce)
    # the reference computes in fp32 (~1e-7 relative per term) against float64 brute force
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    dS = torch.randn_like(got)
    (ga,) = torch.autograd.grad((got * dS).sum(), lb)
    (gb,) = torch.autograd.grad((want * dS).sum(), lb)
    assert ga.dtype == torch.float64
    torch.testing.assert_close(ga, gb, rtol=1e-4, atol=1e-4)


def test_dispatch_picks_reference_on_cpu_and_triton_when_forced(monkeypatch):
    lb = gates(1, 2, 20, -0.2)
    calls = []
    real = kernel.capacity_sum_triton
    monkeypatch.setattr(kernel, "capacity_sum_triton", lambda *a: calls.append(1) or real(*a))
    monkeypatch.delenv("RETENTION_FORCE_TRITON", raising=False)
    ref = capacity_sum(lb)
    capacity_sum(lb, backend="reference")
    assert calls == []
    monkeypatch.setenv("RETENTION_FORCE_TRITON", "1")
    forced = capacity_sum(lb)
    assert calls == [1]
    torch.testing.assert_close(forced, ref, rtol=1e-5, atol=1e-5)
    assert capacity_sum(lb, backend="reference") is not None and calls == [1]


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="backend must be"):
        capacity_sum(torch.zeros(1, 2, 3), backend="cuda")
    with pytest.raises(ValueError, match="batch, streams, seq"):
        capacity_sum(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="batch, streams, seq"):
        kernel.capacity_sum_triton(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="end at batch \\* seqlen"):
        kernel.capacity_sum_triton(torch.zeros(1, 2, 3), torch.tensor([0, 2]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("reduce", [True, False])
def test_on_gpu(reduce):
    check(gates(2, 48, 700, -0.5, device="cuda"), [0, 3, 400, 700, 1400], reduce)
