"""Probe behind eval/results/experiments/smollm2-value-norm-fidelity.md and smollm2-key-norm-fidelity.md: within each KV head of
SmolLM2-135M, how do an entry's log value norm (``log ||v W_O||``, as ``GlobalGatesPolicy(value_weight=...)``
computes it) and its negative log key norm rank against the attention the continuation pays it (the oracle's
score, ``retention/eval/oracle.py``) and against the shipped gates' score? Spearman's rho per (layer, KV head) over the
context's entries past the 4 sinks, averaged over heads and items; where the oracle's per-head top 10% falls
among the value-norm quartiles; and the share of the per-head oracle's picks kept when each head keeps the
gates' own number of entries (their global top-B at 10%, sinks included), ranked by
``log beta^age - w log ||k||``.

    python -m retention.eval.norm_probe 8   # fidelity items of seed 31, ~3 min on 2 CPU cores
    (output kept in eval/results/experiments/smollm2-norm-probe.txt)
"""

from __future__ import annotations

import statistics
import sys

import torch

from retention import attach_gates, load_gates
from retention.cache import RetentionCache
from retention.cache.select import select_keep
from retention.models import shipped_gates
from retention.policies.base import EntryView
from retention.policies.scoring import value_metrics

from .methods import prefill
from .models import load_eval_model
from .oracle import FutureAttention
from .tasks.fidelity import fidelity

SINKS, FRACTION = 4, 0.1
KEY_WEIGHTS = (0.0, 0.5, 1.0, 2.0, 3.0, 4.0, 8.0)


def ranks(x: torch.Tensor) -> torch.Tensor:
    return x.argsort(-1).argsort(-1).float()


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Rank correlation of each row of ``a`` and ``b`` ``(R, N)``, averaged over rows."""
    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(-1, keepdim=True), rb - rb.mean(-1, keepdim=True)
    return float(((ra * rb).sum(-1) / (ra.norm(dim=-1) * rb.norm(dim=-1))).mean())


def main(n_items: int = 8) -> None:
    model, tok = load_eval_model("smollm2-135m")
    att = attach_gates(model, load_gates(shipped_gates("smollm2-135m")), mode="score")  # as the eval's `gates: null`
    metric = value_metrics(model)
    L, H = model.config.num_hidden_layers, model.config.num_key_value_heads
    R = L * H
    layer, head = torch.arange(L).repeat_interleave(H), torch.arange(H).repeat(L)
    rho, quartiles, kept = [], [], {w: [] for w in KEY_WEIGHTS}
    for item in fidelity(tok, 4096, n_items, seed=31):
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
    mean = statistics.mean
    print(f"{len(rho)} fidelity items of seed 31, 4096-token contexts, {R} KV heads")
    names = ("log value norm vs future attention", "-log key norm vs future attention", "gates vs future attention",
             "log value norm vs gates", "-log key norm vs gates")
    for i, name in enumerate(names):
        print(f"rho({name}): {mean(r[i] for r in rho):+.3f}")
    print("share of the oracle's per-head top 10% in each value-norm quartile (lowest first): "
          + ", ".join(f"{mean(x[j] for x in quartiles):.3f}" for j in range(4)))
    print("share of the per-head oracle's picks kept at the gates' split, by key_weight: "
          + ", ".join(f"{w:g}: {mean(kept[w]):.3f}" for w in KEY_WEIGHTS))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8)
