"""Memory a compressed retention cache holds, side by side in one run.

Prefill N tokens of real text (State of the Union haystack, one forward) into a RetentionCache with the shipped gates,
compress it to ``--fraction`` of the context, and print, for ``compress(release=False)`` (the pool keeps the size it
grew to) and ``compress()`` (the free pages given back, :meth:`RetentionCache.shrink`), the MiB the cache holds and
uses against a full cache of the same tokens, as ratios to the full cache.

    python -m benchmarks.cache_memory                        # SmolLM2-135M, 3k tokens, 10%
    python -m benchmarks.cache_memory --tokens 4096 --fraction 0.05
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    import torch

    from retention import attach_gates, load_model
    from retention.cache import RetentionCache
    from retention.compat import cache_kwargs
    from retention.hub import load_gates
    from retention.models import shipped_gates
    from retention.tasks.haystack import documents

    p = argparse.ArgumentParser(prog="python -m benchmarks.cache_memory", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tokens", type=int, default=3072)
    p.add_argument("--fraction", type=float, default=0.1)
    args = p.parse_args(argv)
    model, tok = load_model(args.model)
    found = shipped_gates(model)
    attach_gates(model, load_gates(found, model=model) if found else None, mode="score")
    text = "\n\n".join(d.text for d in documents("eval")[:8])
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"][: args.tokens]])
    budget = RetentionCache.budget_for(model, max(1, round(args.fraction * ids.shape[1])))
    rows = []
    for release in (False, True):
        cache = RetentionCache(model, budget=budget)
        with torch.no_grad():
            model(input_ids=ids, **cache_kwargs(cache), use_cache=True)
        cache.compress(release=release)
        r = cache.memory_report()
        rows.append((f"compress(release={release})", r["held_bytes"], r["used_bytes"], r["full_cache_bytes"]))
    mib = 2**20
    print(f"{args.model}: {ids.shape[1]} tokens compressed to {args.fraction:.0%} ({budget} entries)")
    print(f"{'':<24} {'held MiB':>9} {'used MiB':>9} {'full MiB':>9} {'held/full':>9}")
    for name, held, used, full in rows:
        print(f"{name:<24} {held / mib:>9.1f} {used / mib:>9.1f} {full / mib:>9.1f} {held / full:>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
