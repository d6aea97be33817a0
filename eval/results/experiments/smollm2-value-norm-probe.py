"""Probe behind smollm2-value-norm-fidelity.md: within each KV head of SmolLM2-135M, how does an entry's
log value norm (``log ||v W_O||``, as ``GlobalGatesPolicy(value_weight=...)`` computes it) rank against the
attention the continuation pays it (the oracle's score, ``eval/oracle.py``) and against the shipped gates'
score? Spearman's rho per (layer, KV head) over the context's entries past the 4 sinks, averaged over heads and
items; and where the oracle's per-head top 10% falls among the value-norm quartiles.

    .venv/bin/python eval/results/experiments/smollm2-value-norm-probe.py 8   # items of seed 31, ~2 min
"""

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from eval.methods import prefill  # noqa: E402
from eval.models import load_eval_model  # noqa: E402
from eval.oracle import FutureAttention  # noqa: E402
from eval.tasks.fidelity import fidelity  # noqa: E402
from retention import attach_gates, load_gates  # noqa: E402
from retention.cache import RetentionCache  # noqa: E402
from retention.policies.base import EntryView  # noqa: E402
from retention.policies.global_gates import value_metrics  # noqa: E402

SINKS = 4


def ranks(x: torch.Tensor) -> torch.Tensor:
    return x.argsort(-1).argsort(-1).float()


def spearman(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(R,)``: rank correlation of each row of ``a`` and ``b`` ``(R, N)``."""
    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(-1, keepdim=True), rb - rb.mean(-1, keepdim=True)
    return (ra * rb).sum(-1) / (ra.norm(dim=-1) * rb.norm(dim=-1))


def main(n_items: int) -> None:
    model, tok = load_eval_model("smollm2-135m")
    root = Path(__file__).resolve().parents[3]
    att = attach_gates(model, load_gates(root / "checkpoints" / "smollm2-135m-global"), mode="score")
    metric = value_metrics(model)
    L, H = model.config.num_hidden_layers, model.config.num_key_value_heads
    layer, head = torch.arange(L).repeat_interleave(H), torch.arange(H).repeat(L)
    rows = []
    for item in fidelity(tok, 4096, n_items, seed=31):
        ctx, cont = item.meta["context_ids"], item.meta["continuation_ids"]
        future = FutureAttention(window=len(cont), budget_scope="head")
        att.reset()
        cache = RetentionCache(model, budget=None, policy=future)
        with torch.no_grad():
            prefill(model, cache, ctx + cont, None)
        R, T = L * H, len(ctx)
        view = cache.store.gather(torch.arange(R))
        entries = EntryView(view.log_beta, view.pos, view.valid, torch.full((R,), T + len(cont) - 1),
                            torch.zeros(R, dtype=torch.long), layer, head)
        fut = future.score(entries)[:, SINKS:T]
        v = view.values.float()
        lvn = 0.5 * torch.log(torch.einsum("rld,rde,rle->rl", v, metric[layer, head], v).clamp_min(1e-30))[:, SINKS:T]
        gate = (T - view.pos[:, SINKS:T]) * view.log_beta[:, SINKS:T]  # the gates' score at the compression step
        top = torch.zeros_like(fut, dtype=torch.bool).scatter_(1, fut.topk(T // 10, -1).indices, True)
        quantile = ranks(lvn) / lvn.shape[1]
        share = [float((top & (quantile >= a) & (quantile < a + 0.25)).sum() / top.sum()) for a in (0, 0.25, 0.5, 0.75)]
        rows.append((float(spearman(lvn, fut).mean()), float(spearman(gate, fut).mean()),
                     float(spearman(lvn, gate).mean()), share))
    mean = statistics.mean
    print(f"{len(rows)} fidelity items of seed 31, 4096-token contexts, {L * H} KV heads")
    print("mean rho(log value norm, future attention) %.3f; rho(gates, future attention) %.3f; "
          "rho(log value norm, gates) %.3f" % tuple(mean(r[i] for r in rows) for i in range(3)))
    print("share of the oracle's per-head top 10%% in each value-norm quartile (lowest first): %s"
          % ", ".join(f"{mean(r[3][j] for r in rows):.3f}" for j in range(4)))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8)
