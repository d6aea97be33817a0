"""Kernel-vs-reference checks shared by the interpreter-mode tests (CPU) and the compiled-kernel tests
(``test_gpu_kernels.py``). This module sets no ``TRITON_INTERPRET``: the importing test module decides
whether Triton interprets or compiles, and the kernels are imported only when a check runs.

Attention tolerances (kernel on ``dtype`` inputs against the fp32 reference on the same values):

* fp32: the same math in fp32 (IEEE dot products; scores in the log2 domain, sums in another order).
  Measured 1e-7 to 1.1e-6 of each value's scale up to T = 1000 in the interpreter; checked at
  ``2e-5 * max|ref| + 1e-5`` (the atol covers gradients that are mathematically 0).
* fp16: P and dS go into the matmuls in fp16 and out, dq, dk, dv are rounded to fp16 (round-off
  4.9e-4); ``1e-2 * max|ref| + 1e-3``, about 20 fp16 ulps of the largest value.
* bf16 (GPU only: the interpreter's bf16 is wrong): 8 mantissa bits, 8x the fp16 error;
  ``4e-2 * max|ref| + 1e-2``.
* the LSE is computed and stored in fp32 from the same scores: fp32 tolerance for every dtype.

Capacity sums: both sides compute exp and sums in fp32 from the same log_beta (~1e-7 relative),
checked at rtol 1e-5; gradients at 1e-5 of the largest value, 2e-3 when log_beta is fp16.
"""

from __future__ import annotations

import torch

from retention.ops.capacity import capacity_sum_ref
from retention.ops.retention_attention import retention_attention_ref

RTOL = {torch.float32: (2e-5, 1e-5), torch.float16: (1e-2, 1e-3), torch.bfloat16: (4e-2, 1e-2)}
LSE_TOL = (2e-5, 1e-5)


def attention_inputs(B, Tq, Tk, Hq, Hkv, D, dtype, lb_lo, seed=0, device="cpu"):
    """q ``(B, Tq, Hq, D)``, k, v ``(B, Tk, Hkv, D)`` in ``dtype`` and fp32 log_beta ``(B, Hkv, Tk)`` uniform
    in [lb_lo, -1e-6] (no decay to strong decay), all requiring grad."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, D, generator=g) for T, H in ((Tq, Hq), (Tk, Hkv), (Tk, Hkv)))
    lb = lb_lo + (-1e-6 - lb_lo) * torch.rand(B, Hkv, Tk, generator=g)
    q, k, v = (x.to(device=device, dtype=dtype).requires_grad_() for x in (q, k, v))
    return q, k, v, lb.to(device).requires_grad_()


def attention_compare(q, k, v, lb, cu=None) -> dict[str, float]:
    """Triton kernel vs fp32 reference: out, lse and every gradient; returns the relative errors."""
    from retention.ops.retention_attention.triton_kernel import retention_attention_triton

    out, lse = retention_attention_triton(q, k, v, lb, cu_seqlens=cu)
    ref_in = [x.detach().float().requires_grad_() for x in (q, k, v)] + [lb.detach().clone().requires_grad_()]
    ref_out, ref_lse = retention_attention_ref(*ref_in, cu_seqlens=cu)
    dout = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(1)).to(ref_out.device)
    grads = torch.autograd.grad((out.float() * dout).sum(), [q, k, v, lb])
    ref_grads = torch.autograd.grad((ref_out * dout).sum(), ref_in)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert [g.dtype for g in grads] == [q.dtype, k.dtype, v.dtype, lb.dtype]
    pairs = [("out", out, ref_out), ("lse", lse, ref_lse)]
    pairs += [(f"d{n}", a, b) for n, a, b in zip(("q", "k", "v", "log_beta"), grads, ref_grads)]
    errors = {}
    for name, a, b in pairs:
        assert a.shape == b.shape, name
        rtol, atol = LSE_TOL if name == "lse" else RTOL[q.dtype]
        err, scale = (a.float() - b).abs().max().item(), b.abs().max().item()
        assert err <= rtol * scale + atol, f"{name}: max error {err:.3g} (scale {scale:.3g}, dtype {q.dtype})"
        errors[name] = err / max(scale, 1e-30)
    return errors


def capacity_inputs(B, N, T, lb_lo, dtype=torch.float32, seed=0, device="cpu"):
    """log_beta ``(B, N, T)`` uniform in [lb_lo, -1e-6], requiring grad."""
    g = torch.Generator().manual_seed(seed)
    lb = lb_lo + (-1e-6 - lb_lo) * torch.rand(B, N, T, generator=g)
    return lb.to(device=device, dtype=dtype).requires_grad_()


def capacity_check(lb, cu, reduce, streams_per_program=None) -> None:
    """Triton capacity sum and its gradient vs the blocked reference; ``cu``: list of document starts or None."""
    from retention.ops.capacity.triton_kernel import capacity_sum_triton

    cu = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=lb.device)
    got = capacity_sum_triton(lb, cu, reduce, streams_per_program)
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


def paged_inputs(N, G, D, page, lengths, dtype, seed=0, device="cpu"):
    """A paged cache of ``N`` streams with the given ``lengths``: query ``(N, G, D)``, key and value pools
    ``(P, page, D)`` with each stream's pages scattered over the pool (as after evictions), block table
    ``(N, max_pages)`` (-1 past a stream's pages) and lengths ``(N,)``."""
    g = torch.Generator().manual_seed(seed)
    max_pages = max(1, max((n + page - 1) // page for n in lengths))
    P = N * max_pages + 3
    perm = torch.randperm(P, generator=g)
    table = torch.full((N, max_pages), -1, dtype=torch.long)
    for i, n in enumerate(lengths):
        k = (n + page - 1) // page
        table[i, :k] = perm[i * max_pages : i * max_pages + k]
    kp = torch.randn(P, page, D, generator=g).to(device=device, dtype=dtype)
    vp = torch.randn(P, page, D, generator=g).to(device=device, dtype=dtype)
    q = torch.randn(N, G, D, generator=g).to(device=device, dtype=dtype)
    return q, kp, vp, table.to(device), torch.tensor(lengths, device=device)


def student_matches_oracle(model, att, inputs: dict, monkeypatch, rtol=(1e-5, 1e-4), atol=(1e-5, 1e-6)) -> None:
    """A gated model's logits and every gate gradient (of ``mean(logits**2)``) equal a run whose attention
    is the materialised oracle; ``rtol`` / ``atol``: (logits, gradients)."""
    import retention.attach as attach_mod
    from retention.ops.retention_attention import retention_attention_naive

    def run():
        model.zero_grad()
        logits = model(**inputs).logits
        logits.square().mean().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in att.gates.named_parameters()}

    logits, grads = run()
    naive = lambda q, k, v, lb, scale=None, cu_seqlens=None: (  # noqa: E731
        retention_attention_naive(q, k, v, lb, scale, cu_seqlens)[0])
    monkeypatch.setattr(attach_mod, "retention_attention", naive)
    logits_n, grads_n = run()
    torch.testing.assert_close(logits, logits_n, rtol=rtol[0], atol=atol[0])
    for name in grads:
        assert grads[name].abs().sum() > 0, name
        torch.testing.assert_close(grads[name], grads_n[name], rtol=rtol[1], atol=atol[1], msg=name)


def generate_under_budget(model, ids, budget_tokens: int, page_size: int, new_tokens: int):
    """Greedy generation with a ``RetentionCache`` of ``budget_tokens`` per KV head on average ->
    (token ids, evictions)."""
    from retention.cache import RetentionCache
    from retention.compat import cache_kwargs

    cache = RetentionCache(model, budget=RetentionCache.budget_for(model, budget_tokens), page_size=page_size)
    with torch.no_grad():
        out = model.generate(input_ids=ids, **cache_kwargs(cache), max_new_tokens=new_tokens, do_sample=False)
    return out, cache.evictions
