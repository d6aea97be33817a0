"""Capacity sum: Triton kernel in interpreter mode (CPU) against the blocked reference, and the
reference against brute force. Tolerances and why: ``kernel_checks.py``; the compiled kernel on a GPU:
``test_gpu_kernels.py``.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel is imported

import pytest
import torch

import retention.ops.capacity.reference as capref
from kernel_checks import capacity_check as check, capacity_inputs as gates
from retention.ops.capacity import capacity_sum, capacity_sum_naive, capacity_sum_ref

kernel = pytest.importorskip("retention.ops.capacity.triton_kernel")


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



@pytest.mark.parametrize("reduce", [True, False])
def test_empty_packed_batch(reduce):
    # the kernel's row bounds were an arange with step T = 0 ("step must be nonzero"); the reference returned zeros
    lb = torch.zeros(2, 3, 0, requires_grad=True)
    for fn in (capacity_sum_ref, kernel.capacity_sum_triton):
        S = fn(lb, torch.tensor([0, 0]), reduce)
        assert S.shape == ((2, 0) if reduce else (2, 3, 0))
        assert torch.autograd.grad(S.sum(), lb)[0].shape == lb.shape


@pytest.mark.parametrize("reduce", [True, False])
def test_empty_batch(reduce):
    # the reference took the first key of each block as a min over the (empty) batch and raised; the kernel did not
    lb = torch.zeros(0, 3, 20, requires_grad=True)
    for fn in (capacity_sum_ref, kernel.capacity_sum_triton):
        S = fn(lb, None, reduce)
        assert S.shape == ((0, 20) if reduce else (0, 3, 20))
        assert torch.autograd.grad(S.sum(), lb)[0].shape == lb.shape


@pytest.mark.parametrize("reduce", [True, False])
def test_log_beta_at_or_below_the_floor_means_beta_zero(reduce):
    # below -2.4e38 (and at -inf) exp2(0 * log_beta * log2(e)) was NaN in the kernel (the reference: NaN at -inf);
    # such a token now counts 1 at its own position and 0 later, as beta = 0 does
    lb = gates(2, 3, 30, -0.3)
    with torch.no_grad():
        lb[0, 1, 4], lb[1, 2, 17] = float("-inf"), -3e38
    check(lb, [0, 10, 60], reduce)
    beta_zero = lb.detach().clone()
    beta_zero[0, 1, 4] = beta_zero[1, 2, 17] = -1e4
    cu = torch.tensor([0, 10, 60])
    want = capacity_sum_naive(beta_zero, cu, reduce)
    for got in (kernel.capacity_sum_triton(lb, cu, reduce), capacity_sum_ref(lb, cu, reduce)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
