"""How much of a decode step is kernel-launch overhead: the bare model (gates bypassed) decoding from a static KV
cache eagerly and replayed as one CUDA graph, beside our budgeted ``RetentionCache`` and transformers'
``DynamicCache``, side by side in one run.

The graphed row is the ceiling a CUDA-graphed decode step could reach for this model: the same arithmetic with
every launch recorded once. On a GPU a 135M model's decode step is bound by host-side launches (see
``benchmarks/results/gpu-h100/``), so the gap between ``static`` and ``static+graph`` is what graphs would buy; the gap
between ``budget`` and ``bare`` is what our cache machinery costs now.

  budget         RetentionCache, B tokens per (layer, KV head), gates scoring (our decode path)
  budget+graph   the same, each step replayed as a recorded CUDA graph (retention.cache.graph_decode; GPU only)
  bare           DynamicCache, gates bypassed (the model's own eager decode)
  static         StaticCache sized N + new tokens, gates bypassed, eager
  static+graph   the same step captured once with torch.cuda.graphs and replayed (GPU only)

    python -m benchmarks.graph_ceiling --model /tmp/smol-random --context 4096 --new 32 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def _timed(step, new_tokens: int, sync) -> float:
    """Median ms of ``step()`` over ``new_tokens`` calls (the first one dropped)."""
    times = []
    for _ in range(new_tokens):
        sync()
        t = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:] or times) * 1e3


def run_round(model: PreTrainedModel, ids: list[int], budget_tokens: int, new_tokens: int,
              chunk: int) -> tuple[dict[str, float], dict[str, list]]:
    """One round over every setting: ms/token and the greedy tokens each decoded (to check they agree)."""
    import torch
    from transformers import DynamicCache, StaticCache

    from retention.cache import RetentionCache
    from retention.compat import cache_kwargs

    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    x = torch.tensor([ids], device=device)
    N = x.shape[1]
    ms, tokens = {}, {}

    def prefill(cache, kw):
        out = None
        for s in range(0, N, chunk):
            out = model(input_ids=x[:, s : s + chunk], **cache_kwargs(cache), use_cache=True, **kw(s) if kw else {})
        return out.logits[:, -1:].argmax(-1)

    with torch.no_grad():
        # our decode path: the gates score, the cache evicts to the budget
        cache = RetentionCache(model, budget=RetentionCache.budget_for(model, budget_tokens))
        tok = [prefill(cache, None)]

        def ours():
            tok[0] = model(input_ids=tok[0], **cache_kwargs(cache), use_cache=True).logits[:, -1:].argmax(-1)
            tokens.setdefault("budget", []).append(int(tok[0]))
        ms["budget"] = _timed(ours, new_tokens, sync)

        if cuda:  # the same cache and budget, each step replayed as a recorded CUDA graph
            from retention.cache.graph_decode import GraphDecoder

            cache = RetentionCache(model, budget=RetentionCache.budget_for(model, budget_tokens))
            tok = [prefill(cache, None)]
            decoder = GraphDecoder(model, cache)

            def ours_graphed():
                tok[0] = decoder.step(tok[0]).argmax(-1, keepdim=True)
                tokens.setdefault("budget+graph", []).append(int(tok[0]))
            ms["budget+graph"] = _timed(ours_graphed, new_tokens, sync)

        with model.retention.use_mode("teacher"):  # gates bypassed: the model's own cost
            cache = DynamicCache()
            tok = [prefill(cache, None)]

            def bare():
                tok[0] = model(input_ids=tok[0], **cache_kwargs(cache), use_cache=True).logits[:, -1:].argmax(-1)
                tokens.setdefault("bare", []).append(int(tok[0]))
            ms["bare"] = _timed(bare, new_tokens, sync)

            # a static cache: fixed shapes and addresses, so one step can be recorded as a graph
            for graphed in (False, True) if cuda else (False,):
                name = "static+graph" if graphed else "static"
                cache = StaticCache(config=model.config, max_cache_len=N + 2 * new_tokens + 8)
                pos = torch.arange(N, device=device)
                first = prefill(cache, lambda s: {"cache_position": pos[s : s + chunk]})
                static_tok = first.clone()
                static_pos = torch.tensor([N], device=device)

                def step():
                    return model(input_ids=static_tok, **cache_kwargs(cache), cache_position=static_pos,
                                 position_ids=static_pos[None], use_cache=True).logits[:, -1:].argmax(-1)

                if graphed:
                    try:
                        replay = _graphed(step, static_tok, static_pos, tokens, name)
                    except Exception as e:  # transformers' step may hold a host sync: say which, keep the other rows
                        print(f"static+graph: the step could not be captured ({type(e).__name__}: {e})")
                        continue
                else:
                    def replay():
                        static_tok.copy_(step())
                        static_pos.add_(1)
                        tokens.setdefault(name, []).append(int(static_tok))
                ms[name] = _timed(replay, new_tokens, sync)
    return ms, tokens


def _graphed(step, static_tok, static_pos, tokens, name):
    """``step`` recorded once as a CUDA graph; returns the replay (one decode step) it stands for."""
    import torch

    # warm up on a side stream (as torch.cuda.graphs asks), then record one step; the warm-up steps write the
    # cache at the current position, which the replays overwrite
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_tok = step()

    def replay():
        graph.replay()
        static_tok.copy_(out_tok)
        static_pos.add_(1)
        tokens.setdefault(name, []).append(int(out_tok))  # a host read, as the eager rows make
    return replay


def main(argv: list[str] | None = None) -> int:
    from retention.cli import positive_int

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--context", type=positive_int, default=1024)
    p.add_argument("--budget", type=positive_int, default=512, help="tokens per (layer, KV head) for the budget row")
    p.add_argument("--new", type=positive_int, default=16, help="decoded tokens timed per setting")
    p.add_argument("--chunk", type=positive_int, default=512)
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="interleaved rounds, at least 2: the first is an untimed warm-up")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N; default: cuda when available, else cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    args = p.parse_args(argv)
    # the first round warms up and is left out of the medians: with one round there would be nothing to report
    if args.repeats < 2:
        p.error(f"--repeats: must be at least 2 (the first round is an untimed warm-up), got {args.repeats}")

    from retention.cli import checked_device, run_reporting_user_errors

    args.device = checked_device(p, args.device)  # as the other benches: a usage error, not a traceback at load
    return run_reporting_user_errors(p, lambda: run(args))


def run(args: argparse.Namespace) -> int:
    """The rounds and the table of :func:`main`, from its checked arguments."""
    from retention import attach_gates, load_model
    from benchmarks.decode import real_text_ids

    device = args.device
    model, tok = load_model(args.model, device=device, dtype=args.dtype)
    attach_gates(model, None, mode="score")
    ids = real_text_ids(tok, args.context)
    rounds = []
    for r in range(args.repeats):
        ms, tokens = run_round(model, ids, args.budget, args.new, args.chunk)
        if r == 0:  # the bare model's greedy tokens, three ways: the graph must decode what eager decoding does
            agree = {k: v == tokens["bare"] for k, v in tokens.items() if not k.startswith("budget")}
            print(f"greedy tokens equal to the eager DynamicCache's: {agree}")
            if "budget+graph" in tokens:
                print("budget+graph decodes the budget row's greedy tokens: "
                      f"{tokens['budget+graph'] == tokens['budget']}")
        else:
            rounds.append(ms)
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    print(f"model {args.model} ({args.dtype} on {device}), N = {args.context}, B = {args.budget}, median ms/token over "
          f"{args.new} steps, median of {len(rounds)} round(s) after a warm-up round")
    print("| setting | ms/token | vs bare | range over rounds |\n|---|---|---|---|")
    for k, v in med.items():
        lo, hi = min(r[k] for r in rounds), max(r[k] for r in rounds)
        print(f"| {k} | {v:.2f} | {v / med['bare']:.2f}x | {lo:.2f}-{hi:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
