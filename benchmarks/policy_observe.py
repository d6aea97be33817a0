"""What a one-shot compression costs each training-free policy, side by side in one run.

A policy that reads attention sees every layer's queries once after a one-shot prefill (``observe``); that, not
the forward, is what separates the policies' costs in an evaluation sweep. For each policy this times ``observe``
over ``--layers`` layers of a ``--context``-token prefill at a model's shapes (random keys and queries: the cost
does not depend on the values) and prints ms per layer and the ratio to SnapKV (one observation window).
It also times H2O's summed attention two ways on the same tensors: from the whole ``(B, H, G, Q, L)`` softmax
(:func:`~retention.policies.window.window_attention`) and a chunk of queries at a time
(:func:`~retention.policies.window.attention_mass`, what H2O uses), and prints their ratio and largest difference.

    python -m benchmarks.policy_observe                            # SmolLM2-135M shapes, 4k context, 3 layers
    python -m benchmarks.policy_observe --context 8192 --layers 2 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch


def fake_view(heads: int, length: int, dim: int, seed: int = 0) -> SimpleNamespace:
    """A one-shot prefill's layer view (``keys``/``values`` ``(1, H, L, D)``, ``pos``/``valid`` ``(1, H, L)``)."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(length).expand(1, heads, length).clone()
    return SimpleNamespace(keys=torch.randn(1, heads, length, dim, generator=g),
                           values=torch.randn(1, heads, length, dim, generator=g),
                           pos=pos, valid=torch.ones(1, heads, length, dtype=torch.bool))


def time_ms(fn, repeats: int) -> tuple[float, float, float]:
    """Median, min and max wall time of ``fn()`` in ms over ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times), min(times), max(times)


def main(argv: list[str] | None = None) -> None:
    from retention.policies import get_policy
    from retention.policies.registry import POLICIES
    from retention.policies.window import attention_mass, window_attention

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=4096, help="prefill length in tokens")
    p.add_argument("--kv-heads", type=int, default=3, help="KV heads per layer (SmolLM2-135M: 3)")
    p.add_argument("--group", type=int, default=3, help="query heads per KV head (SmolLM2-135M: 3)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--hidden", type=int, default=576, help="model width, for the policies that read W_O (576)")
    p.add_argument("--layers", type=int, default=3, help="layers observed per timing (SmolLM2-135M has 30)")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    H, G, L, D = args.kv_heads, args.group, args.context, args.head_dim
    views = [fake_view(H, L, D, seed=i) for i in range(args.layers)]
    queries = [torch.randn(1, H * G, L, D, generator=torch.Generator().manual_seed(100 + i))
               for i in range(args.layers)]
    qpos = torch.arange(L)[None]
    print(f"one-shot observe of a {L}-token prefill, {H} KV heads x {G} query heads, head dim {D}, float32 on cpu "
          f"({torch.get_num_threads()} threads); median of {args.repeats} over {args.layers} layers")

    # W_O of each layer, (Hq, D, hidden), as retention.policies.scoring.output_projections gives it from a model
    w_o = [torch.randn(H * G, D, args.hidden, generator=torch.Generator().manual_seed(200 + i)) * D**-0.5
           for i in range(args.layers)]

    def observe_all(name: str):
        def run():
            policy = get_policy(name)
            if hasattr(policy, "_w_o"):  # bind() without a model
                policy._w_o = w_o
            for layer, (q, view) in enumerate(zip(queries, views)):
                if policy.needs_queries:
                    policy.observe(layer, q, view, qpos)
        return run

    names = [n for n in POLICIES if n not in ("full", "trimkv", "global_gates")]  # gates score in the forward
    rows = {n: time_ms(observe_all(n), args.repeats) for n in names}
    base = rows["snapkv"][0]
    print("| policy | ms per layer | range | vs SnapKV |\n|---|---|---|---|")
    for n, (med, lo, hi) in sorted(rows.items(), key=lambda kv: kv[1][0]):
        k = args.layers
        print(f"| {n} | {med / k:.1f} | {lo / k:.1f}-{hi / k:.1f} | {med / base:.1f}x |")

    dense = time_ms(lambda: [window_attention(q, v, qpos, None).sum(dim=(2, 3)) for q, v in zip(queries, views)],
                    args.repeats)[0]
    chunked = time_ms(lambda: [attention_mass(q, v, qpos) for q, v in zip(queries, views)], args.repeats)[0]
    diff = max(float((window_attention(q, v, qpos, None).sum(dim=(2, 3)) - attention_mass(q, v, qpos)).abs().max())
               for q, v in zip(queries, views))
    print(f"\nH2O's summed attention per layer: whole softmax {dense / args.layers:.0f} ms, chunked "
          f"{chunked / args.layers:.0f} ms (whole / chunked: {dense / chunked:.1f}x); largest difference {diff:.1e}")


if __name__ == "__main__":
    main()
