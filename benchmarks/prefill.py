"""Prefill cost of the retention cache, side by side in one run.

For each context length N: prefill N tokens of real text (in one forward, as the eval harness's ``prefill:
one_shot``, or in ``--chunk``-token chunks) into
  cache    RetentionCache without a budget: while nothing is evicted or padded, attention runs as plain lower-right
           causal SDPA (``padded_attention(held=N)``)
  masked   the same cache with a boolean mask built per KV head (the path taken after the first eviction or with
           left padding, and the only one before 2026-11-28)
  plain    transformers' DynamicCache (gates still scoring): prefill without our cache machinery
  bare     the same with the gates bypassed (teacher mode): the model's own prefill cost
and print the median milliseconds and the ratio to ``plain``. ``--repeats R`` runs every setting R times in
interleaved rounds, so machine noise hits all settings alike.

    python -m benchmarks.prefill                       # N = 1k, 2k, 4k on CPU, one forward each
    python -m benchmarks.prefill --contexts 4096 --chunk 512 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from transformers import PreTrainedModel

SETTINGS = ("cache", "masked", "plain", "bare")


@contextmanager
def masked_attention() -> Iterator[None]:
    """The retention cache with its mask-free path off: every layer builds the per-head mask."""
    from retention.cache import dispatch

    real = dispatch.padded_attention
    dispatch.padded_attention = lambda *args, held=None: real(*args, held=None)
    try:
        yield
    finally:
        dispatch.padded_attention = real


def prefill_ms(model: PreTrainedModel, ids: list[int], setting: str, chunk: int) -> float:
    """Milliseconds to prefill ``ids`` in ``chunk``-token forwards (0: one forward) into the setting's cache."""
    import torch
    from transformers import DynamicCache

    from retention.cache import RetentionCache
    from retention.compat import cache_kwargs

    device = next(model.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    cache = DynamicCache() if setting in ("plain", "bare") else RetentionCache(model)
    x = torch.tensor([ids], device=device)
    step = chunk or x.shape[1]
    mode = "teacher" if setting == "bare" else "score"
    with torch.no_grad(), model.retention.use_mode(mode):
        with masked_attention() if setting == "masked" else nullcontext():
            sync()
            t = time.perf_counter()
            for s in range(0, x.shape[1], step):
                model(input_ids=x[:, s : s + step], **cache_kwargs(cache), use_cache=True)
            sync()
    return (time.perf_counter() - t) * 1e3


def main(argv: list[str] | None = None) -> int:
    from retention.cli import non_negative_int, positive_int

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--contexts", type=positive_int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--chunk", type=non_negative_int, default=0, help="prefill chunk in tokens (0: one forward)")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="model dtype")
    p.add_argument("--repeats", type=positive_int, default=1,
                   help="interleaved rounds over every setting (noisy machines)")
    args = p.parse_args(argv)
    from retention.cli import checked_device, run_reporting_user_errors

    args.device = checked_device(p, args.device)
    args.contexts = list(dict.fromkeys(args.contexts))  # a repeated N would be timed twice and printed twice
    return run_reporting_user_errors(p, lambda: run(args))


def run(args: argparse.Namespace) -> int:
    """The measurements and the table of :func:`main`, from its checked arguments."""
    import torch

    from retention import attach_gates, load_model

    from benchmarks.decode import real_text_ids

    model, tok = load_model(args.model, dtype=args.dtype, device=args.device)
    attach_gates(model, None, mode="score")  # untrained gates: the cost is the same as trained ones'
    ids = real_text_ids(tok, max(args.contexts))
    if torch.device(args.device).type == "cuda":  # one untimed round: kernel selection and allocator warm-up
        for n in args.contexts:
            for setting in SETTINGS:
                prefill_ms(model, ids[:n], setting, args.chunk)
    else:  # the process's one-time setup (lazy inits, first allocations) is not the first timed setting's: on the
        # CPU it made the first row read 13x its repeat; one prefill per setting (smallest N) is enough there
        for setting in SETTINGS:
            prefill_ms(model, ids[: min(args.contexts)], setting, args.chunk)
    runs: dict[tuple[int, str], list[float]] = {(n, s): [] for n in args.contexts for s in SETTINGS}
    for _ in range(args.repeats):
        for n in args.contexts:
            for setting in SETTINGS:
                runs[(n, setting)].append(prefill_ms(model, ids[:n], setting, args.chunk))
    how = f"{args.chunk}-token chunks" if args.chunk else "one forward"
    print(f"model {args.model} ({args.dtype} on {args.device}), prefill in {how}, milliseconds"
          + (f", median of {args.repeats} interleaved rounds (range in brackets)" if args.repeats > 1 else ""))
    print("| N | cache | ms | vs plain |")
    print("|---|---|---|---|")
    for n in args.contexts:
        plain = statistics.median(runs[(n, "plain")])
        for setting in SETTINGS:
            ms = runs[(n, setting)]
            spread = f" [{min(ms):.0f}-{max(ms):.0f}]" if len(ms) > 1 else ""
            print(f"| {n} | {setting} | {statistics.median(ms):.0f}{spread} | {statistics.median(ms) / plain:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
