"""Retention-gated attention kernels side by side: time and peak memory, printed as ratios.

GPU (bf16, GQA 4, T = 2k..32k, d = 64/128), forward and forward+backward for
  ours       the Triton retention kernel (decay bias, d log_beta)
  fa2        flash-attn 2 without bias: the speed ceiling (n/a when flash-attn is not installed)
  sdpa       PyTorch SDPA, causal, no bias (its flash backend): the ceiling where flash-attn is missing
  sdpa+bias  PyTorch SDPA with the decay bias materialised as a (T, T) mask per query head
  flex       torch.nn.attention.flex_attention (compiled) with the same score_mod and a causal block mask
All methods run side by side in one process on the same inputs; times are medians of ``--reps``
runs timed with CUDA events after warm-up (compilation, autotuning). Ratios are to fa2 when it is
installed, else to sdpa. Goal: ours fwd+bwd within 1.3x of fa2. ``--json FILE`` also writes the rows of ours and
the baseline as machine-readable records (key ``attention``, see :mod:`benchmarks.results_file`), and the tiles the
autotuner chose for ours are printed.

CPU (no CUDA, or ``--cpu``): the CPU training paths side by side in fp32, ratios to the blocked reference:
  reference      the blocked PyTorch reference (exact; taken where a beta near 0 needs it)
  sdpa-folded    SDPA's fused causal kernel with the decay folded into two extra head dims (the CPU default)
  triton-interp  the Triton kernel in interpreter mode (T <= 256 only: numpy speed, a correctness check)
with denormals flushed as the training loop flushes them. ``--decay`` sets the strongest decay (log_beta drawn
from [-decay, 0]); trained SmolLM2 gates reach about 3.

    python -m benchmarks.kernels              # GPU sweep, or the CPU check without a GPU
    python -m benchmarks.kernels --seq 2048 4096 --dims 128 --reps 20
    python -m benchmarks.kernels --methods ours sdpa --seq 4096 16384 32768 --json benchmarks/results/gpu.json
    python -m benchmarks.kernels --cpu --seq 1024 4096 --kv-heads 3 --group 3 --decay 0.01 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable


def _inputs(B: int, T: int, Hq: int, Hkv: int, D: int, dtype, device: str, decay: float = 0.01):
    """q (B, T, Hq, D), k, v (B, T, Hkv, D) in ``dtype``; log_beta (B, Hkv, T) fp32 in [-decay, 0]."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype).requires_grad_()  # noqa: E731
    q, k, v = mk(B, T, Hq, D), mk(B, T, Hkv, D), mk(B, T, Hkv, D)
    lb = (-decay * torch.rand(B, Hkv, T, generator=g)).to(device).requires_grad_()
    return q, k, v, lb


def _time(fn: Callable[[], None], reps: int, cuda: bool) -> float:
    """Median milliseconds of ``reps`` calls after one warm-up call."""
    import torch

    fn()  # warm-up: compilation, autotuning, allocator
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _methods(q, k, v, lb) -> dict:
    """name -> callable returning the output (B, T, Hq, D), or a string saying why it is unavailable."""
    import torch
    import torch.nn.functional as F

    from retention.ops.retention_attention.triton_kernel import retention_attention_triton

    B, T, Hq, D = q.shape
    G = Hq // k.shape[2]
    out: dict = {"ours": lambda: retention_attention_triton(q, k, v, lb)[0]}
    try:
        from flash_attn import flash_attn_func

        out["fa2"] = lambda: flash_attn_func(q, k, v, causal=True)
    except ImportError:
        out["fa2"] = "n/a: flash-attn not installed"

    def sdpa_bias():
        t = torch.arange(T, device=q.device)
        dist = (t[:, None] - t[None, :]).float()
        bias = (dist * lb[:, :, None, :]).masked_fill(dist < 0, float("-inf"))  # (B, Hkv, T, T), grads to lb
        bias = bias.repeat_interleave(G, dim=1).to(q.dtype)
        return F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias, enable_gqa=True
        ).transpose(1, 2)

    out["sdpa"] = lambda: F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    ).transpose(1, 2)
    out["sdpa+bias"] = sdpa_bias
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = torch.compile(flex_attention)
        mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, T, T, device=q.device)

        def score_mod(score, b, h, qi, ki):
            return score + (qi - ki).to(torch.float32) * lb[b, h // G, ki]

        out["flex"] = lambda: flex(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), score_mod=score_mod, block_mask=mask,
            enable_gqa=True,
        ).transpose(1, 2)
    except Exception as e:  # flex needs a recent torch with a GPU backend
        out["flex"] = f"n/a: {type(e).__name__}"
    return out


def _measure(fn: Callable, params, reps: int, cuda: bool) -> tuple[float, float, float]:
    """Forward ms, forward+backward ms, and peak MiB over the forward+backward (GPU; nan on CPU)."""
    import torch

    def fwd():
        with torch.no_grad():
            fn()

    def fwd_bwd():
        fn().float().sum().backward()
        for p in params:
            p.grad = None

    f = _time(fwd, reps, cuda)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    fb = _time(fwd_bwd, reps, cuda)
    mem = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else float("nan")
    return f, fb, mem


HEADER = "| T | d | method | fwd ms | fwd+bwd ms | {} | fwd ratio | fwd+bwd ratio |"


def _chosen_tiles() -> str:
    """The tiles the autotuner picked for ours, per kernel and key: what the next tuning round starts from."""
    from retention.ops.retention_attention import triton_kernel as tk

    parts = []
    for name in ("_fwd_kernel", "_dkdv_kernel", "_dq_kernel"):
        cache = getattr(getattr(tk, name), "cache", {})
        for key, cfg in cache.items():
            tiles = ",".join(f"{k}={v}" for k, v in cfg.kwargs.items())
            parts.append(f"{name}{tuple(key[:3])}: {tiles} warps={cfg.num_warps} stages={cfg.num_stages}")
    return "; ".join(parts)


DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def gpu_sweep(args: argparse.Namespace) -> None:
    import torch

    Hq = args.kv_heads * args.group
    device = torch.cuda.get_device_name()
    print(f"device: {device}, {'/'.join(args.dtypes)}, batch {args.batch}, GQA {args.group} "
          f"({Hq} query / {args.kv_heads} KV heads), median of {args.reps} after warm-up (CUDA events)")
    print(HEADER.format("peak MiB"))
    print("|---|---|---|---|---|---|---|---|")
    records = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, DTYPES[dtype_name])
        for D in args.dims:
            for T in args.seq:
                q, k, v, lb = _inputs(args.batch, T, Hq, args.kv_heads, D, dtype, "cuda")
                rows: dict = {}
                for name, fn in _methods(q, k, v, lb).items():
                    if args.methods and name not in args.methods:
                        continue
                    if isinstance(fn, str):
                        rows[name] = fn
                        continue
                    try:
                        rows[name] = _measure(fn, (q, k, v, lb), args.reps, True)
                    except torch.cuda.OutOfMemoryError:
                        rows[name] = "out of memory"
                    except Exception as e:  # one failing method must not hide the others
                        rows[name] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
                    finally:
                        for p in (q, k, v, lb):
                            p.grad = None
                        torch.cuda.empty_cache()
                base_name = next((n for n in ("fa2", "sdpa", "sdpa+bias") if isinstance(rows.get(n), tuple)), "fa2")
                base = rows.get(base_name) if isinstance(rows.get(base_name), tuple) else None
                for name, r in rows.items():
                    if isinstance(r, str):
                        print(f"| {T} | {D} | {name} | {r} | | | | |")
                        continue
                    fr = f"{r[0] / base[0]:.2f}x" if base else "n/a"
                    fbr = f"{r[1] / base[1]:.2f}x" if base else "n/a"
                    print(f"| {T} | {D} | {name} | {r[0]:.2f} | {r[1]:.2f} | {r[2]:.0f} | {fr} | {fbr} |")
                print(f"({dtype_name}, T={T}, d={D}: ratios to {base_name if base else 'nothing: no baseline ran'})")
                ours = rows.get("ours")
                if isinstance(ours, tuple) and base:
                    records.append({
                        "dtype": dtype_name, "T": T, "d": D, "baseline": base_name,
                        "ours_fwd_ms": round(ours[0], 4), "sdpa_fwd_ms": round(base[0], 4),
                        "ours_fwdbwd_ms": round(ours[1], 4), "sdpa_fwdbwd_ms": round(base[1], 4),
                        "fwd_ratio": round(ours[0] / base[0], 3), "fwdbwd_ratio": round(ours[1] / base[1], 3),
                        "ours_peak_mib": round(ours[2], 1),
                    })
    if "ours" in (args.methods or ["ours"]):
        print(f"autotuned tiles: {_chosen_tiles()}")
    if args.json and records:
        from benchmarks.results_file import update

        update(args.json, "attention", records, device)
        print(f"wrote {len(records)} rows to {args.json} (key 'attention')")


TRITON_INTERP_MAX_T = 256  # the interpreter runs the kernel in numpy: minutes past this


def cpu_check(args: argparse.Namespace) -> None:
    import torch

    from retention.ops.retention_attention.reference import retention_attention_ref
    from retention.ops.retention_attention.sdpa import chunk_length, retention_attention_sdpa
    from retention.ops.retention_attention.triton_kernel import retention_attention_triton

    torch.set_flush_denormal(True)  # as the training loop on CPU
    Hq = args.kv_heads * args.group
    print("no CUDA device (or --cpu): GPU timings (ours, flash-attn 2, SDPA with bias, flex_attention) are not "
          "measured here;")
    print(f"the CPU paths against the blocked reference instead (fp32, batch {args.batch}, {Hq} query / "
          f"{args.kv_heads} KV heads, median of {args.reps})")
    print("| T | d | decay | method | fwd ms | fwd+bwd ms | max abs err vs ref | fwd ratio | fwd+bwd ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for D in args.dims:
        for T in args.seq:
            for decay in args.decay:
                q, k, v, lb = _inputs(args.batch, T, Hq, args.kv_heads, D, torch.float32, "cpu", decay)
                fns = {"reference": lambda: retention_attention_ref(q, k, v, lb)[0]}
                if chunk_length(lb, T) is not None:
                    fns["sdpa-folded"] = lambda: retention_attention_sdpa(q, k, v, lb)
                if T <= TRITON_INTERP_MAX_T:
                    fns["triton-interp"] = lambda: retention_attention_triton(q, k, v, lb)[0]
                res = {name: _measure(fn, (q, k, v, lb), args.reps, False) for name, fn in fns.items()}
                with torch.no_grad():
                    want = fns["reference"]()
                    err = {name: (fn() - want).abs().max().item() for name, fn in fns.items()}
                base = res["reference"]
                for name, r in res.items():
                    print(f"| {T} | {D} | {decay:g} | {name} | {r[0]:.1f} | {r[1]:.1f} | {err[name]:.1e} | "
                          f"{r[0] / base[0]:.2f}x | {r[1] / base[1]:.2f}x |")
    print("(ratios to the reference, lower is faster; the interpreter runs kernels in numpy, so its speed says "
          "nothing about a GPU)")


def main(argv: list[str] | None = None) -> int:
    from retention.cli import positive_int

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=positive_int, nargs="+", default=None,
                   help="sequence lengths (GPU: 2048..32768, CPU: 64 128)")
    p.add_argument("--dims", type=positive_int, nargs="+", default=None, help="head dims (GPU: 64 128, CPU: 64)")
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--kv-heads", type=positive_int, default=None, help="KV heads (GPU: 8, CPU: 1)")
    p.add_argument("--group", type=positive_int, default=4, help="query heads per KV head (GQA group)")
    p.add_argument("--reps", type=positive_int, default=None, help="timed repetitions (GPU: 10, CPU: 1)")
    p.add_argument("--methods", nargs="+", default=None, choices=["ours", "fa2", "sdpa", "sdpa+bias", "flex"],
                   help="GPU methods to run (default: all)")
    p.add_argument("--dtypes", nargs="+", default=["bf16"], choices=sorted(DTYPES), help="GPU input dtypes")
    p.add_argument("--json", default=None, help="GPU: also write the rows to this JSON file (key 'attention')")
    p.add_argument("--cpu", action="store_true", help="the CPU paths even where a GPU is present")
    p.add_argument("--decay", type=float, nargs="+", default=[0.01],
                   help="CPU: strongest decays, log_beta drawn from [-decay, 0] (default 0.01)")
    args = p.parse_args(argv)
    import torch

    if any(not d >= 0 for d in args.decay):
        p.error(f"--decay: must be >= 0 (log_beta is drawn from [-decay, 0]), got {args.decay}")
    cuda = torch.cuda.is_available() and not args.cpu
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
    args.seq = args.seq or ([2048, 4096, 8192, 16384, 32768] if cuda else [64, 128])
    args.dims = args.dims or ([64, 128] if cuda else [64])
    args.kv_heads = args.kv_heads or (8 if cuda else 1)
    args.reps = args.reps or (10 if cuda else 1)
    (gpu_sweep if cuda else cpu_check)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
