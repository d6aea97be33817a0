"""Probe behind experiments/norms/smollm2-value-norm-fidelity.md and smollm2-key-norm-fidelity.md:
within each KV head of SmolLM2-135M, how do an entry's log value norm (``log ||v W_O||``, as
``GlobalGatesPolicy(value_weight=...)`` computes it) and its negative log key norm rank against the attention the
continuation pays it (the oracle's score, ``retention/eval/oracle.py``) and against the shipped gates' score?
Spearman's rho per (layer, KV head) over the context's entries past the 4 sinks, averaged over heads and items;
where the oracle's per-head top 10% falls among the value-norm quartiles; and the share of the per-head oracle's
picks kept when each head keeps the gates' own number of entries (their global top-B at 10%, sinks included),
ranked by ``log beta^age - w log ||k||``.

    python -m retention.eval.norm_probe 8   # fidelity items of seed 31, ~3 min on 2 CPU cores
    (output kept in experiments/norms/smollm2-norm-probe.txt)

``--model``, ``--gates``, ``--length`` and ``--seed`` probe another model, checkpoint or item set.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch

from retention.cache import RetentionCache
from retention.cache.select import select_keep
from retention.policies.base import EntryView
from retention.policies.scoring import value_metrics

from .methods import prefill
from .models import load_probe_model
from .oracle import FutureAttention
from .tasks.fidelity import fidelity

SINKS, FRACTION = 4, 0.1
KEY_WEIGHTS = (0.0, 0.5, 1.0, 2.0, 3.0, 4.0, 8.0)


def ranks(x: torch.Tensor) -> torch.Tensor:
    """Rank of each entry within its row (0 = smallest; ties in index order), as float."""
    return x.argsort(-1).argsort(-1).float()


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Rank correlation of each row of ``a`` and ``b`` ``(R, N)``, averaged over rows."""
    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(-1, keepdim=True), rb - rb.mean(-1, keepdim=True)
    return float(((ra * rb).sum(-1) / (ra.norm(dim=-1) * rb.norm(dim=-1))).mean())


def probe(model: Any, tok: Any, n_items: int = 8, length: int = 4096, seed: int = 31) -> dict[str, Any]:
    """Run the probe on ``n_items`` fidelity items of ``length`` context tokens; ``model`` has gates attached in
    ``score`` mode (``model.retention``). Returns per item: ``rho`` (5 Spearman correlations, in the order of
    :data:`RHO_NAMES`), ``quartiles`` (4 shares of the oracle's per-head top 10%, lowest value norm first; they
    sum to 1) and ``kept`` (``{key_weight: share of the per-head oracle's picks kept}``)."""
    att = model.retention
    metric = value_metrics(model)
    L, H = model.config.num_hidden_layers, model.config.num_key_value_heads
    R = L * H
    layer, head = torch.arange(L).repeat_interleave(H), torch.arange(H).repeat(L)
    rho, quartiles, kept = [], [], {w: [] for w in KEY_WEIGHTS}
    for item in fidelity(tok, length, n_items, seed=seed):
        ctx, cont = item.meta["context_ids"], item.meta["continuation_ids"]
        future = FutureAttention(window=len(cont), budget_scope="head")
        att.reset()
        cache = RetentionCache(model, budget=None, policy=future)
        with torch.no_grad():
            prefill(model, cache, ctx + cont, None)
        T = len(ctx)
        view = cache.store.gather(torch.arange(R))
        in_ctx = view.valid & (view.pos < T)
        entries = EntryView(view.log_beta, view.pos, in_ctx, torch.full((R,), T + len(cont) - 1),
                            torch.zeros(R, dtype=torch.long), layer, head)
        fut = future.score(entries)
        v = view.values.float()
        lvn = 0.5 * torch.log(torch.einsum("rld,rde,rle->rl", v, metric[layer, head], v).clamp_min(1e-30))
        lkn = torch.log(view.keys.float().norm(dim=-1).clamp_min(1e-30))
        gate = (T - view.pos) * view.log_beta  # the gates' log score when the context is compressed
        body = slice(SINKS, T)  # one-shot prefill: every stream holds positions 0..T+len(cont)-1 in order
        rho.append((spearman(lvn[:, body], fut[:, body]), spearman(-lkn[:, body], fut[:, body]),
                    spearman(gate[:, body], fut[:, body]), spearman(lvn[:, body], gate[:, body]),
                    spearman(-lkn[:, body], gate[:, body])))
        top = torch.zeros_like(fut[:, body], dtype=torch.bool).scatter_(1, fut[:, body].topk(T // 10, -1).indices, True)
        q = ranks(lvn[:, body]) / (T - SINKS)
        quartiles.append([float((top & (q >= a) & (q < a + 0.25)).sum() / top.sum()) for a in (0, 0.25, 0.5, 0.75)])
        # each head's share of the gates' global top-B (sinks always in), then the oracle's picks kept within it
        sink = view.pos < SINKS
        neg = torch.finfo(torch.float32).min
        gate_ranked = torch.where(sink, torch.full_like(gate, float("inf")), gate).masked_fill(~in_ctx, neg)
        share = select_keep(gate_ranked, view.pos, in_ctx, torch.zeros(R, dtype=torch.long),
                            torch.tensor([int(FRACTION * T) * R])).sum(1)
        oracle = fut.masked_fill(~in_ctx, neg)
        for w in KEY_WEIGHTS:
            mixed = torch.where(sink, gate_ranked, gate_ranked - w * lkn).masked_fill(~in_ctx, neg)
            hit = 0
            for r in range(R):
                k = int(share[r])
                hit += len(set(oracle[r].topk(k).indices.tolist()) & set(mixed[r].topk(k).indices.tolist()))
            kept[w].append(hit / int(share.sum()))
    return {"rho": rho, "quartiles": quartiles, "kept": kept, "items": len(rho), "length": length, "seed": seed,
            "heads": R}


RHO_NAMES = ("log value norm vs future attention", "-log key norm vs future attention", "gates vs future attention",
             "log value norm vs gates", "-log key norm vs gates")


def report(result: dict[str, Any]) -> str:
    """The probe's printout: one line per correlation, then the quartile shares and the kept shares."""
    mean = statistics.mean
    rho, quartiles, kept = result["rho"], result["quartiles"], result["kept"]
    lines = [f"{result['items']} fidelity items of seed {result['seed']}, {result['length']}-token contexts, "
             f"{result['heads']} KV heads"]
    lines += [f"rho({name}): {mean(r[i] for r in rho):+.3f}" for i, name in enumerate(RHO_NAMES)]
    lines.append("share of the oracle's per-head top 10% in each value-norm quartile (lowest first): "
                 + ", ".join(f"{mean(x[j] for x in quartiles):.3f}" for j in range(4)))
    lines.append("share of the per-head oracle's picks kept at the gates' split, by key_weight: "
                 + ", ".join(f"{w:g}: {mean(kept[w]):.3f}" for w in KEY_WEIGHTS))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from retention.cli import positive_int

    ap = argparse.ArgumentParser(prog="python -m retention.eval.norm_probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("items", nargs="?", type=positive_int, default=8, help="fidelity items to probe (default 8)")
    ap.add_argument("--model", default="smollm2-135m", help="model spec, as the eval harness takes it")
    ap.add_argument("--gates", default=None,
                    help="gate checkpoint (folder or Hub id); default: the model's shipped gates")
    ap.add_argument("--length", type=positive_int, default=4096, help="context tokens per item (default 4096)")
    ap.add_argument("--seed", type=int, default=31,
                    help="item seed (default 31, untouched by training and the goal sets)")
    args = ap.parse_args(argv)
    if args.length < 10 * (SINKS + 1):
        ap.error(f"--length: need a context of at least {10 * (SINKS + 1)} tokens (got {args.length}); "
                 f"the probe keeps 10% past {SINKS} sinks")
    from retention.cli import run_reporting_user_errors

    return run_reporting_user_errors(ap, lambda: run(args, ap))


def run(args: argparse.Namespace, ap: argparse.ArgumentParser) -> int:
    """The probe and its printout, from :func:`main`'s arguments; the gates are read before the model loads."""
    model, tok = load_probe_model(args.model, args.gates, ap.error)
    print(report(probe(model, tok, args.items, args.length, args.seed)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
