"""Triton capacity sum (interpreter mode on CPU) against the blocked reference and brute force.

Both compute exp and sums in fp32 from the same fp32 log_beta, so forward sums (<= T) agree to
~1e-6 relative; gradients multiply by distances up to T, tolerance 1e-4 relative to their scale.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from retention.ops.capacity import capacity_sum, capacity_sum_naive, capacity_sum_ref

kernel = pytest.importorskip("retention.ops.capacity.triton_kernel")


def check(B, N, T, lb_lo, cu, reduce, dtype=torch.float32):
    g = torch.Generator().manual_seed(T + N)
    lb = (lb_lo + (-1e-6 - lb_lo) * torch.rand(B, N, T, generator=g)).to(dtype).requires_grad_()
    cu = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    got = kernel.capacity_sum_triton(lb, cu, reduce)
    ref_lb = lb.detach().float().requires_grad_()
    want = capacity_sum_ref(ref_lb, cu, reduce)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    dS = torch.randn(want.shape, generator=g)
    (a,) = torch.autograd.grad((got * dS).sum(), lb)
    (b,) = torch.autograd.grad((want * dS).sum(), ref_lb)
    assert a.dtype == dtype
    rtol = 1e-4 if dtype == torch.float32 else 2e-3  # fp16 gradients are rounded to 11 bits
    assert (a.float() - b).abs().max() <= rtol * b.abs().max() + 1e-4


@pytest.mark.parametrize("T", [1, 17, 63, 128])
@pytest.mark.parametrize("reduce", [True, False])
def test_matches_reference(T, reduce):
    check(2, 3, T, -0.5, None, reduce)


@pytest.mark.parametrize("lb_lo", [-1e-6, -0.05, -5.0])
def test_decay_range(lb_lo):
    check(1, 4, 50, lb_lo, None, True)


@pytest.mark.parametrize("reduce", [True, False])
def test_packed_documents(reduce):
    check(2, 3, 40, -0.3, [0, 7, 8, 33, 60, 80], reduce)


def test_fp16_log_beta_input():
    check(1, 2, 30, -0.3, None, True, dtype=torch.float16)


@pytest.mark.slow
@pytest.mark.parametrize("T", [300, 1000])
def test_long(T):
    check(1, 2, T, -0.05, None, True)


def test_reference_matches_brute_force_and_dispatch(monkeypatch):
    lb = -torch.rand(1, 2, 20) * 0.2
    torch.testing.assert_close(capacity_sum_ref(lb), capacity_sum_naive(lb), rtol=1e-5, atol=1e-5)
    calls = []
    real = kernel.capacity_sum_triton
    monkeypatch.setattr(kernel, "capacity_sum_triton", lambda *a: calls.append(1) or real(*a))
    capacity_sum(lb)
    assert calls == []
    monkeypatch.setenv("RETENTION_FORCE_TRITON", "1")
    torch.testing.assert_close(capacity_sum(lb), capacity_sum_ref(lb), rtol=1e-5, atol=1e-5)
    assert calls == [1]
