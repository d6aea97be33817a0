"""Cost of one distillation step against its floor, measured side by side in one run.

step:  teacher forward (gates bypassed) + student forward and backward with retention gates,
       chunked KL + capacity loss (what ``train.py`` runs).
floor: teacher forward + student forward and backward of the same model with plain SDPA and no
       gates (gradients flow to the input embeddings so the backward crosses every layer, as the
       gates' gradients do), the same chunked KL.
step-ref (CPU): the step with the gated attention on the blocked reference instead of the folded SDPA path
       that CPU training takes (:mod:`retention.ops.retention_attention.sdpa`); denormals are flushed as the
       training loop flushes them on CPU.

Timings alternate between the two (median of ``--reps``); peak memory is each variant's own process
(resident-set growth sampled during the step on CPU, ``torch.cuda.max_memory_allocated`` above the
weights on GPU). Prints the ratios. On a GPU it also breaks one step of each variant down by where its device
time goes (the gated attention kernels, the capacity kernels, SDPA, matrix products, the rest), from the profiler's
kernel list, so the step's excess over its floor has names. ``--json FILE`` writes the rows as machine-readable
records (key ``step``, see :mod:`benchmarks.results_file`).

    python -m benchmarks.train_step --seq-len 512 --reps 3
    python -m benchmarks.train_step --seq-len 4096 --dtype bfloat16 --json benchmarks/results/gpu.json   # GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel


def build(
    model_name: str, device: str, dtype: str = "float32"
) -> tuple[PreTrainedModel, dict[str, Callable[[torch.Tensor, torch.Tensor], None]]]:
    import torch

    from retention import attach_gates, load_model
    from retention.losses import capacity_loss, distillation_kl

    model, _ = load_model(model_name, device=device, dtype=dtype)
    for p in model.parameters():
        p.requires_grad_(False)
    decoder, head = model.model, model.get_output_embeddings()

    def floor_step(ids, pos):
        with torch.no_grad():
            h_t = decoder(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
        emb = decoder.embed_tokens(ids).detach().requires_grad_(True)
        h_s = decoder(inputs_embeds=emb, position_ids=pos, use_cache=False).last_hidden_state
        distillation_kl(h_s, h_t, head).backward()

    att = attach_gates(model, bias_init=6.0)
    att.set_mode("teacher")

    def gated_step(ids, pos):
        with torch.no_grad(), att.teacher():
            h_t = decoder(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
        with att.student():
            h_s = decoder(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
        kl = distillation_kl(h_s, h_t, head)
        cap, _ = capacity_loss(att.log_betas(), budget=ids.shape[1] * 4.0)
        (kl + cap).backward()
        att.gates.zero_grad(set_to_none=True)

    steps = {"floor": floor_step, "step": gated_step}
    if torch.device(device).type == "cpu":
        from retention.ops.retention_attention import default_backend

        torch.set_flush_denormal(True)  # as the training loop on CPU, for every variant

        def reference_step(ids, pos):
            with default_backend("reference"):
                gated_step(ids, pos)

        steps["step-ref"] = reference_step
    return model, steps


def inputs(model: PreTrainedModel, seq_len: int, batch: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=g).to(device)
    pos = torch.arange(seq_len, device=device).expand(batch, seq_len)
    return ids, pos


def peak_memory(args: argparse.Namespace, which: str) -> float:
    """Peak memory (MiB) of one step of ``which`` in a fresh process."""
    cmd = [sys.executable, "-m", "benchmarks.train_step", "--measure-peak", which, "--model", args.model,
           "--seq-len", str(args.seq_len), "--batch", str(args.batch), "--device", args.device, "--dtype", args.dtype]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_mib"]


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _measure_peak(args) -> None:
    import threading

    import torch

    model, steps = build(args.model, args.device, args.dtype)
    ids, pos = inputs(model, args.seq_len, args.batch, args.device)
    steps[args.measure_peak](ids, pos)  # warm-up: allocator caches and lazy inits are not the step's
    if torch.device(args.device).type == "cuda":  # cuda:0 too
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        steps[args.measure_peak](ids, pos)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:  # sample the resident set every 2 ms while the step runs
        base, samples, done = _rss_mib(), [], threading.Event()

        def sample():
            while not done.is_set():
                samples.append(_rss_mib())
                time.sleep(0.002)

        th = threading.Thread(target=sample)
        th.start()
        steps[args.measure_peak](ids, pos)
        done.set()
        th.join()
        peak = max(samples + [base]) - base
    print(json.dumps({"peak_mib": peak}))


# below this the floor's peak is sampling noise (on the CPU a short step may add no page the 2 ms samples see, and
# the ratio then read 4754x): no ratio is printed against it
MIN_FLOOR_MIB = 1.0


def memory_ratio(step_mib: float, floor_mib: float) -> str:
    """``step / floor`` peak memory as printed: ``1.23x``, or n/a when the floor is too small to divide by."""
    if not floor_mib >= MIN_FLOOR_MIB:  # NaN (no /proc here) too
        return "n/a (floor below what the sampling sees)"
    return f"{step_mib / floor_mib:.2f}x"


# our Triton kernels by their exact names (SDPA's flash kernels are also called ``flash_fwd_kernel``), then
# kernel-name pieces -> the part of the step they belong to (first match wins)
OURS = {"_fwd_kernel": "gated attention", "_dkdv_kernel": "gated attention", "_dq_kernel": "gated attention",
        "_delta_kernel": "gated attention", "_cap_fwd": "capacity", "_cap_bwd": "capacity"}
CATEGORIES = (
    ("gated attention", ()),
    ("capacity", ()),
    ("sdpa attention", ("flash", "fmha", "attention", "cudnn", "sdpa")),
    ("matmuls", ("gemm", "cutlass", "xmma", "nvjet", "matmul", "wgmma")),
)


def category(kernel: str) -> str:
    """The part of the step a CUDA kernel of this name belongs to (``OURS``, ``CATEGORIES``); ``other`` else."""
    mine = next((k for k in OURS if kernel == k or kernel.startswith(k + "_")), None)  # Triton may add a suffix
    if mine:
        return OURS[mine]
    name = kernel.lower()
    for cat, pieces in CATEGORIES:
        if any(p in name for p in pieces):
            return cat
    return "other"


def breakdown(fn: Callable, ids: torch.Tensor, pos: torch.Tensor) -> dict[str, float]:
    """Device milliseconds of one call of ``fn`` by category of kernel (GPU only)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(ids, pos)
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.events():
        if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        us = getattr(e, "device_time", None)
        us = getattr(e, "cuda_time", 0.0) if us is None else us
        cat = category(e.name)
        out[cat] = out.get(cat, 0.0) + us / 1e3
    return out


def print_breakdown(parts: dict[str, dict[str, float]]) -> None:
    cats = [c for c, _ in CATEGORIES] + ["other"]
    names = list(parts)
    print("device ms of one step by kernel category (profiler):")
    print("| category | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for c in cats + ["total"]:
        vals = [sum(parts[n].values()) if c == "total" else parts[n].get(c, 0.0) for n in names]
        print(f"| {c} | " + " | ".join(f"{v:.1f}" for v in vals) + " |")


def main(argv: list[str] | None = None) -> int:
    from retention.cli import positive_int

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--seq-len", type=positive_int, default=512)
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--reps", type=positive_int, default=3)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="model dtype")
    p.add_argument("--no-memory", action="store_true", help="skip the per-process peak-memory runs")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file (key 'step')")
    p.add_argument("--measure-peak", choices=["floor", "step", "step-ref"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    from retention.cli import checked_device, run_reporting_user_errors

    args.device = checked_device(p, args.device)
    if args.measure_peak:
        return run_reporting_user_errors(p, lambda: _measure_peak(args) or 0)
    return run_reporting_user_errors(p, lambda: run(args))


def run(args: argparse.Namespace) -> int:
    """The timings, the peak-memory runs and the table of :func:`main`, from its checked arguments."""
    import torch

    model, steps = build(args.model, args.device, args.dtype)
    ids, pos = inputs(model, args.seq_len, args.batch, args.device)
    times = {k: [] for k in steps}
    for k in steps:  # warm-up
        steps[k](ids, pos)
    cuda = torch.device(args.device).type == "cuda"  # "cuda:0" as well as "cuda"
    for _ in range(args.reps):
        for k, fn in steps.items():
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn(ids, pos)
            if cuda:
                torch.cuda.synchronize()
            times[k].append(time.perf_counter() - t)
    tokens = args.batch * args.seq_len
    med = {k: statistics.median(v) for k, v in times.items()}
    mem = {} if args.no_memory else {k: peak_memory(args, k) for k in steps}
    print(f"model {args.model} ({args.dtype}), device {args.device}, batch {args.batch} x {args.seq_len} tokens, "
          f"median of {args.reps}")
    print(f"| {'variant':<8} | {'s/step':>7} | {'tokens/s':>9} | {'peak MiB':>9} |")
    print(f"|{'-' * 10}|{'-' * 9}|{'-' * 11}|{'-' * 11}|")
    for k in steps:
        m = f"{mem[k]:9.0f}" if k in mem else "      n/a"
        print(f"| {k:<8} | {med[k]:7.3f} | {tokens / med[k]:9.0f} | {m} |")
    ratio = med["step"] / med["floor"]
    print(f"time ratio step / floor: {ratio:.2f}x (goal <= 1.15x)")
    if "step-ref" in med:
        print(f"time ratio step-ref / step: {med['step-ref'] / med['step']:.2f}x (the folded SDPA path's speed-up)")
        if mem:
            print(f"peak memory ratio step / step-ref: {memory_ratio(mem['step'], mem['step-ref'])}")
    if mem:
        print(f"peak memory ratio step / floor: {memory_ratio(mem['step'], mem['floor'])}")
    parts = {}
    if cuda:
        try:
            parts = {k: breakdown(steps[k], ids, pos) for k in ("floor", "step")}
            print_breakdown(parts)
        except Exception as e:  # the profiler is a help, not the measurement
            print(f"breakdown unavailable: {type(e).__name__}: {e}")
    if args.json:
        from benchmarks.results_file import update

        row = {"dtype": {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[args.dtype], "T": args.seq_len,
               "batch": args.batch, "step_s": round(med["step"], 5), "floor_s": round(med["floor"], 5),
               "ratio": round(ratio, 3), "step_peak_mib": round(mem["step"], 1) if mem else None,
               "floor_peak_mib": round(mem["floor"], 1) if mem else None,
               "breakdown_ms": {k: {c: round(v, 2) for c, v in d.items()} for k, d in parts.items()}}
        import os

        existing = []
        if os.path.exists(args.json):
            with open(args.json) as f:
                existing = [r for r in json.load(f).get("step", [])
                            if (r.get("dtype"), r.get("T"), r.get("batch")) != (row["dtype"], row["T"], row["batch"])]
        device = torch.cuda.get_device_name() if cuda else "cpu"
        update(args.json, "step", existing + [row], device)
        print(f"wrote the step row to {args.json} (key 'step')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
