"""Triton retention-gated attention in interpreter mode (CPU) against the fp32 reference.

Each case runs the kernel on inputs of the tested dtype and the blocked fp32 reference on the *same*
values upcast to fp32, so input rounding is not part of the error; the tolerances and why are in
``kernel_checks.py``. The compiled kernel on a GPU is checked in ``test_gpu_kernels.py``.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel is imported (conftest is not relied on)

import pytest
import torch

from kernel_checks import RTOL, attention_compare as compare, attention_inputs as make
from retention.ops.retention_attention import retention_attention, retention_attention_ref

triton_kernel = pytest.importorskip("retention.ops.retention_attention.triton_kernel")
run = triton_kernel.retention_attention_triton

DTYPES = [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 17, 63])
@pytest.mark.parametrize("G", [1, 3, 4])
def test_ragged_lengths_and_gqa(dtype, T, G):
    compare(*make(2, T, T, G, 1, 16, dtype, lb_lo=-1.0, seed=T + G))


def test_gqa_group_of_eight_with_two_kv_heads():
    compare(*make(1, 20, 20, 16, 2, 16, torch.float32, lb_lo=-0.5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lb_lo", [-1e-6, -0.3, -5.0])
def test_decay_from_none_to_strong(dtype, lb_lo):
    compare(*make(1, 40, 40, 2, 1, 32, dtype, lb_lo=lb_lo))


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_documents(dtype):
    # an empty document (5, 5), one of length 1, and one (30, 60) crossing the row boundary at 48
    cu = torch.tensor([0, 5, 5, 6, 30, 60, 96], dtype=torch.int32)
    compare(*make(2, 48, 48, 6, 2, 16, dtype, lb_lo=-0.5), cu=cu)


def test_packed_documents_do_not_see_each_other():
    q, k, v, lb = make(1, 40, 40, 2, 1, 16, torch.float32, lb_lo=-0.2)
    packed, lse = run(q, k, v, lb, cu_seqlens=torch.tensor([0, 13, 40]))
    alone, lse_alone = run(q[:, 13:], k[:, 13:], v[:, 13:], lb[..., 13:])
    torch.testing.assert_close(packed[:, 13:], alone, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse[..., 13:], lse_alone, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("D", [64, 80, 96, 128])
def test_model_head_dims(D):
    # 80 and 96 are padded to 128 inside the kernel and masked
    compare(*make(1, 20, 20, 2, 1, D, torch.float16, lb_lo=-0.2, seed=D))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Tq", [1, 3, 20])
def test_decode_step_with_fewer_queries_than_keys(dtype, Tq):
    compare(*make(2, Tq, 37, 4, 2, 16, dtype, lb_lo=-0.5))


def test_strided_views_and_expanded_grad_need_no_copies_and_agree():
    # q, k as (B, H, T, D) tensors transposed to (B, T, H, D), as the transformers attention hook passes them
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 30, 16, generator=g).requires_grad_()
    k = torch.randn(2, 2, 30, 16, generator=g).requires_grad_()
    v = torch.randn(2, 30, 2, 16, generator=g).requires_grad_()
    lb = (-torch.rand(2, 30, 2, generator=g)).requires_grad_()
    args = (q.transpose(1, 2), k.transpose(1, 2), v, lb.transpose(1, 2))
    assert not args[0].is_contiguous() and not args[3].is_contiguous()
    cu = torch.tensor([0, 11, 60])
    run(*args, cu_seqlens=cu)[0].sum().backward()  # sum(): dout is an expanded, stride-0 tensor
    got = [x.grad.clone() for x in (q, k, v, lb)]
    for x in (q, k, v, lb):
        x.grad = None
    retention_attention_ref(*args, cu_seqlens=cu)[0].sum().backward()
    for name, a, x in zip("q k v log_beta".split(), got, (q, k, v, lb)):
        torch.testing.assert_close(a, x.grad, rtol=2e-5, atol=2e-5, msg=f"d{name}")


def test_empty_sequence():
    q, k, v, lb = make(1, 0, 0, 2, 1, 16, torch.float32, lb_lo=-0.5)
    out, lse = run(q, k, v, lb)
    assert out.shape == (1, 0, 2, 16) and lse.shape == (1, 2, 0)
    # packed too (the reference returns the same): the row bounds were an arange with step T = 0
    out, lse = run(q, k, v, lb, cu_seqlens=torch.tensor([0, 0]))
    assert out.shape == (1, 0, 2, 16) and lse.shape == (1, 2, 0)


def test_segments_are_built_once_per_input_and_again_when_cu_seqlens_changes():
    """Every layer of a forward passes the same shapes and cu_seqlens: the segments (and the host sync that packed
    documents need) come from a cache; an in-place change to cu_seqlens, or another tensor, builds them anew."""
    cu = torch.tensor([0, 5, 9, 16])
    first = triton_kernel.segments(2, 8, 8, cu, torch.device("cpu"))
    assert triton_kernel.segments(2, 8, 8, cu, torch.device("cpu")) is first
    assert first.qlen.tolist() == [5, 3, 1, 7] and first.b.tolist() == [0, 0, 1, 1]
    assert first.t0.tolist() == [0, 5, 0, 1]
    assert (first.max_q, first.max_k) == (7, 7)
    cu[1] = 2  # same tensor, new contents
    again = triton_kernel.segments(2, 8, 8, cu, torch.device("cpu"))
    assert again is not first and again.qlen.tolist() == [2, 6, 1, 7]
    other = triton_kernel.segments(2, 8, 8, cu.clone(), torch.device("cpu"))
    assert other is not again and other.qlen.tolist() == again.qlen.tolist()
    rows = triton_kernel.segments(3, 4, 9, None, torch.device("cpu"))  # decode shape: 4 queries over 9 keys
    assert rows is triton_kernel.segments(3, 4, 9, None, torch.device("cpu"))
    assert rows.qlen.tolist() == [4] * 3 and rows.klen.tolist() == [9] * 3 and (rows.max_q, rows.max_k) == (4, 9)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [128, 300, 1000])
def test_long_sequences(T, dtype):
    compare(*make(1, T, T, 2, 1, 64, dtype, lb_lo=-0.1, seed=T))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_long_packed_gqa3_head_dim_128(dtype):
    cu = torch.tensor([0, 1, 150, 299, 300, 600])
    compare(*make(2, 300, 300, 6, 2, 128, dtype, lb_lo=-5.0), cu=cu)


def test_dispatch_uses_reference_on_cpu_and_triton_when_forced(monkeypatch):
    q, k, v, lb = make(1, 9, 9, 2, 2, 16, torch.float32, lb_lo=-0.5)
    calls = []
    real = triton_kernel.retention_attention_triton
    monkeypatch.setattr(triton_kernel, "retention_attention_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.delenv("RETENTION_FORCE_TRITON", raising=False)
    ref = retention_attention(q, k, v, lb)
    assert calls == []
    monkeypatch.setenv("RETENTION_FORCE_TRITON", "1")
    forced = retention_attention(q, k, v, lb)
    assert calls == [1]
    torch.testing.assert_close(forced, ref, rtol=1e-5, atol=1e-6)
    (g,) = torch.autograd.grad(forced.sum(), lb)  # the dispatch keeps autograd
    (g_ref,) = torch.autograd.grad(ref.sum(), lb)
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-5)


def test_under_autocast_q_k_v_of_mixed_dtypes_run_in_the_autocast_dtype(monkeypatch):
    """Under bf16 autocast on a GPU a model's RoPE returns float32 q and k beside a bf16 v (seen on an H200: the
    kernel refused them, so training with fp32 weights and autocast, the GPU default, failed). As SDPA does, the
    dispatch casts q, k, v to the autocast dtype (fp16 here: the interpreter's bf16 is wrong); log_beta stays fp32."""
    monkeypatch.setenv("RETENTION_FORCE_TRITON", "1")
    q, k, v, lb = make(1, 9, 9, 2, 2, 16, torch.float32, lb_lo=-0.5)
    with pytest.raises(ValueError, match="must share a dtype"):  # without autocast, still a clear error
        retention_attention(q, k, v.half(), lb)
    with torch.autocast("cpu", dtype=torch.float16):
        out = retention_attention(q, k, v.half(), lb)
    assert out.dtype == torch.float16
    same = retention_attention(q.half(), k.half(), v.half(), lb)
    torch.testing.assert_close(out, same)
    (g,) = torch.autograd.grad(out.float().sum(), lb)  # the gates still get their gradient, in fp32
    assert g.dtype == torch.float32 and g.abs().sum() > 0


def test_bad_inputs_are_clear_errors(monkeypatch):
    q, k, v, lb = make(1, 8, 8, 2, 2, 16, torch.float32, lb_lo=-0.5)
    with pytest.raises(ValueError, match="share a dtype"):
        run(q, k.half(), v, lb)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        run(q.double(), k.double(), v.double(), lb)
    with pytest.raises(ValueError, match="end at batch \\* seqlen"):
        run(q, k, v, lb, cu_seqlens=torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="non-decreasing"):
        run(q, k, v, lb, cu_seqlens=torch.tensor([0, 5, 3, 8]))
    with pytest.raises(ValueError, match="integer tensor"):
        run(q, k, v, lb, cu_seqlens=torch.tensor([0.0, 8.0]))
    with pytest.raises(ValueError, match="as many queries as keys"):
        run(q[:, :4], k, v, lb, cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="log_beta must be"):
        run(q, k, v, lb[..., :4])
    monkeypatch.setattr(triton_kernel, "_INTERPRET", False)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        run(q, k, v, lb)


def test_kernel_benchmark_runs_on_cpu(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "benchmarks" / "kernels.py"
    spec = importlib.util.spec_from_file_location("bench_kernels", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--seq", "16", "--dims", "16", "--reps", "1", "--cpu", "--decay", "0.01", "3"]) == 0
    out = capsys.readouterr().out
    assert "are not measured here" in out
    assert "| T | d | decay | method |" in out
    for method in ("sdpa-folded", "triton-interp"):  # both paths agree with the reference at either decay
        rows = [line for line in out.splitlines() if line.startswith("| 16 | 16 |") and f"| {method} |" in line]
        assert len(rows) == 2 and all(float(r.split("|")[7]) < 1e-4 for r in rows), rows


@pytest.mark.parametrize("dtype", DTYPES)
def test_log_beta_at_or_below_the_floor_means_beta_zero(dtype):
    # log_beta * log2(e) overflowed to -inf below -2.4e38 (and -inf itself): 0 * -inf on the diagonal gave NaN in
    # out and every gradient, where the reference is finite; the floor makes such a token count for itself only
    q, k, v, lb = make(1, 20, 20, 2, 1, 16, dtype, lb_lo=-0.5)
    with torch.no_grad():
        lb[0, 0, 3], lb[0, 0, 11] = float("-inf"), -3e38
    errors = compare(q, k, v, lb)
    assert all(e == e for e in errors.values())  # no NaN anywhere (compare checks every gradient)
    beta_zero = lb.detach().clone()
    beta_zero[0, 0, [3, 11]] = -1e4  # decays to exactly 0 one step later, as beta = 0 does
    want = retention_attention_ref(q.detach().float(), k.detach().float(), v.detach().float(), beta_zero)[0]
    rtol, atol = RTOL[dtype]
    torch.testing.assert_close(run(q, k, v, lb)[0].float(), want, rtol=rtol, atol=atol)
