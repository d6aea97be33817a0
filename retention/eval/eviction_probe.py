"""Probe behind the experiments README's "Folded evictions and a cross-head consensus": two inference-side
variants of the shipped gates' eviction, screened on the fidelity gap (top-1 agreement and KL of a teacher-forced
continuation against the full cache, at 10% of the context, one-shot compression as the goal check runs it).

* ``fold:a`` keeps what the gates keep (at the budget less one entry per (layer, KV head) stream) and folds each
  stream's evicted entries into one extra entry: their mean key and mean value, with a logit bias ``a * log n``
  (``n`` entries folded). With ``a = 1`` the folded entry draws ``n exp(q . k_mean)``, Jensen's lower bound on the
  evicted entries' softmax mass; ``a < 1`` draws less. Nothing dropped then vanishes from the softmax outright.
* ``consensus:w`` keeps the gates' split of the budget (how many entries each stream keeps) and reorders within
  each stream by ``z + w * c``: ``z`` the gates' log score z-scored within the stream, ``c`` the mean ``z`` of the
  same token over every stream (a token that many heads rank high may be content every head should keep).
* ``base`` is the shipped policy, ``GlobalGatesPolicy(sink=4)``.

    python -m retention.eval.eviction_probe 6 --seed 34 --variants base,fold:0.25,fold:0.5,fold:0.65,fold:0.8
    python -m retention.eval.eviction_probe 24 --seed 33 --variants base,fold:0.5,fold:1   # ~25 min on 2 CPU cores
    python -m retention.eval.eviction_probe 6 --seed 34 --variants base,consensus:0.5,consensus:1,consensus:2
    (output kept in experiments/eviction-probe/smollm2-eviction-probe.txt)
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from retention.cache import RetentionCache
from retention.cache.attention import visible_keys
from retention.compat import cache_kwargs
from retention.policies.base import EntryView, protect
from retention.policies.global_gates import GlobalGatesPolicy, lookahead_log_score, reorder_within_rows

from .budgets import parse_budget
from .metrics import kl_and_top1
from .models import load_probe_model
from .protocol import SharedPrefill, reference_logits
from .tasks.fidelity import fidelity

SINKS, FRACTION = 4, 0.1


def parse_variant(spec: str) -> tuple[str, float]:
    """``"base"``, ``"fold:a"`` or ``"consensus:w"`` -> ``(kind, value)``; a bad spec names the allowed forms."""
    kind, _, value = spec.partition(":")
    try:
        if kind == "base" and not value:
            return kind, 0.0
        if kind in ("fold", "consensus") and value:
            v = float(value)
            if v >= 0:
                return kind, v
    except ValueError:
        pass
    raise ValueError(f"variant {spec!r}: use base, fold:A (A >= 0, the folded entry's bias is A log n) or "
                     "consensus:W (W >= 0, the weight of the cross-head mean)")


def folded_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_pos: torch.Tensor,
                     valid: torch.Tensor, query_pos: torch.Tensor, scale: float, fold_key: torch.Tensor,
                     fold_value: torch.Tensor, fold_bias: torch.Tensor) -> torch.Tensor:
    """:func:`retention.cache.attention.padded_attention` (its masked path) with one more entry per KV head that
    every real query sees: ``fold_key`` / ``fold_value`` ``(B, H, D)``, its logit raised by ``fold_bias`` ``(B, H)``
    (``-inf``: nothing folded there). Shapes as ``padded_attention``; returns ``(B, Q, Hq, D)``."""
    B, Hq, Q, D = query.shape
    H = keys.shape[1]
    G = Hq // H
    q = query.reshape(B, H, G * Q, D)
    k = torch.cat([keys.to(q.dtype), fold_key[:, :, None].to(q.dtype)], 2)
    v = torch.cat([values.to(q.dtype), fold_value[:, :, None].to(q.dtype)], 2)
    ok = visible_keys(key_pos, valid, query_pos, G)
    mask = torch.zeros(ok.shape, dtype=q.dtype, device=q.device).masked_fill(~ok, -float("inf"))
    extra = fold_bias.to(q.dtype)[:, :, None, None].expand(B, H, G * Q, 1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.cat([mask, extra], -1), scale=scale)
    return out.reshape(B, Hq, Q, D).transpose(1, 2)


class FoldedCache(RetentionCache):
    """A :class:`RetentionCache` that folds each stream's evicted entries into one extra entry (see the module
    docstring); ``alpha``: the folded entry's logit bias is ``alpha * log n``. The folded entry lives beside the
    pages (one key and value per stream): give the cache a budget one entry per stream lower to count it."""

    alpha: float = 1.0

    def _paged_decode(self, key_states: torch.Tensor, T: int) -> bool:
        return False  # the folded entry is read by the padded path only

    def evict(self, seqs: torch.Tensor, budgets: torch.Tensor) -> None:
        store, n = self.store, self.streams_per_seq
        rows = (seqs[:, None] * n + torch.arange(n, device=store.lengths.device)[None]).flatten()
        before = store.gather(rows, with_kv=True)
        super().evict(seqs, budgets)
        after = store.gather(rows, with_kv=False)
        real = before.valid & (before.pos >= 0)
        top = int(before.pos.max()) + 2
        kept = torch.zeros(len(rows), top, dtype=torch.bool, device=rows.device)
        kept.scatter_(1, torch.where(after.valid & (after.pos >= 0), after.pos, top - 1), True)
        kept[:, top - 1] = False
        dropped = (real & ~kept.gather(1, before.pos.clamp_min(0))).float()
        if not hasattr(self, "_fold"):  # running sums over every eviction: (streams, D), (streams, D), (streams,)
            S, D, dev = store.num_streams, before.keys.shape[-1], before.keys.device
            self._fold = [torch.zeros(S, D, device=dev), torch.zeros(S, D, device=dev), torch.zeros(S, device=dev)]
        ks, vs, cnt = self._fold
        ks[rows] += (dropped[..., None] * before.keys.float()).sum(1)
        vs[rows] += (dropped[..., None] * before.values.float()).sum(1)
        cnt[rows] += dropped.sum(1)

    def retention_attend(self, layer: int, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
        if not hasattr(self, "_fold"):
            return super().retention_attend(layer, query, scaling)
        view, qpos, _ = self._views.pop(layer)
        B, H = self.store.batch, self.num_kv_heads
        rows = self.store.streams(layer)  # ordered (b, h)
        ks, vs, cnt = (t[rows] for t in self._fold)
        n = cnt.clamp_min(1)[:, None]
        bias = torch.where(cnt > 0, self.alpha * torch.log(cnt.clamp_min(1)), torch.full_like(cnt, -float("inf")))
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return folded_attention(query, view.keys, view.values, view.pos, view.valid, qpos, scale,
                                (ks / n).view(B, H, -1), (vs / n).view(B, H, -1), bias.view(B, H))


@dataclass
class ConsensusPolicy(GlobalGatesPolicy):
    """``GlobalGatesPolicy`` whose order within each stream is ``z + weight * c`` (see the module docstring), at
    the gates' own split of the budget; ``weight = 0`` is the gates' order."""

    weight: float = 0.0

    def score(self, entries: EntryView) -> torch.Tensor:
        base = super().score(entries)
        if self.weight == 0:
            return base
        s = lookahead_log_score(entries.log_beta, entries.step[:, None] - entries.pos + 1, self.horizon)
        real = entries.valid & (entries.pos >= 0)
        count = real.sum(1, keepdim=True).clamp_min(1)
        mean = torch.where(real, s, 0).sum(1, keepdim=True) / count
        sd = (torch.where(real, (s - mean) ** 2, 0).sum(1, keepdim=True) / count).sqrt().clamp_min(1e-6)
        z = torch.where(real, (s - mean) / sd, 0)
        # the mean z of each (sequence, position) over the streams that hold it
        top = int(entries.pos.max()) + 2
        slot = torch.where(real, entries.seq[:, None] * top + entries.pos, 0).flatten()
        size = (int(entries.seq.max()) + 1) * top
        total = torch.zeros(size, device=z.device).scatter_add_(0, slot, z.flatten())
        held = torch.zeros(size, device=z.device).scatter_add_(0, slot, real.float().flatten()).clamp_min(1)
        consensus = (total / held)[slot].view_as(z)
        order = protect(z + self.weight * consensus, entries.sinks(self.sink))
        return reorder_within_rows(base, order, real)


def variant_cache(model: Any, shared: SharedPrefill, kind: str, value: float, budget: int) -> RetentionCache:
    """A cache holding the shared prefill, compressed by one variant (``budget`` entries for ``base``)."""
    L, H = model.config.num_hidden_layers, model.config.num_key_value_heads
    if kind == "fold":
        cache = FoldedCache(model, budget=None, policy=GlobalGatesPolicy(sink=SINKS))
        cache.copy_from(shared.cache)
        cache.alpha = value
        cache.set_budget(budget - L * H)  # the folded entries count
    else:
        policy = ConsensusPolicy(sink=SINKS, weight=value if kind == "consensus" else 0.0)
        cache = RetentionCache(model, budget=None, policy=policy)
        cache.copy_from(shared.cache)
        cache.set_budget(budget)
    cache.compress()
    return cache


@torch.no_grad()
def probe(model: Any, tok: Any, n_items: int, variants: list[str], length: int = 4096,
          seed: int = 33) -> list[dict[str, Any]]:
    """One row per (item, variant): ``item``, ``variant``, ``top1`` (%), ``kl`` (nats). ``model`` has gates
    attached in ``score`` mode."""
    from tqdm import tqdm

    L, H = model.config.num_hidden_layers, model.config.num_key_value_heads
    parsed = [(v, *parse_variant(v)) for v in variants]
    rows = []
    for item in tqdm(fidelity(tok, length, n_items, seed=seed), total=n_items, desc="eviction probe", unit="item"):
        ctx, cont = item.meta["context_ids"], item.meta["continuation_ids"]
        ref = reference_logits(model, item)
        budget = parse_budget(FRACTION).entries(len(ctx), L * H)  # as the eval harness counts 10%
        with model.retention.use_mode("score"):
            shared = SharedPrefill(model, ctx)
            for name, kind, value in parsed:
                cache = variant_cache(model, shared, kind, value, budget)
                logits = model(input_ids=torch.tensor([cont], device=model.device), **cache_kwargs(cache),
                               use_cache=True).logits[0]
                kl, top1 = kl_and_top1(ref, logits)
                rows.append({"item": item.id, "variant": name, "top1": top1, "kl": kl})
    return rows


def paired_interval(diffs: list[float], draws: int = 4000, seed: int = 0) -> tuple[float, float]:
    """95% interval of the mean of ``diffs`` by a bootstrap over items (seeded)."""
    g = torch.Generator().manual_seed(seed)
    d = torch.tensor(diffs, dtype=torch.float64)
    means = d[torch.randint(0, len(d), (draws, len(d)), generator=g)].mean(1)
    return float(means.quantile(0.025)), float(means.quantile(0.975))


def report(rows: list[dict[str, Any]], against: str = "base") -> str:
    """A table: each variant's mean top-1 and KL, its paired gap to ``against`` and the items up / down."""
    by: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["variant"], {})[r["item"]] = r
    ref = by.get(against, {})
    lines = [f"| variant | items | top-1 % | KL | top-1 gap to {against} | items up / down |",
             "|---|---|---|---|---|---|"]
    for name, got in by.items():
        items = list(got)
        gap = ""
        if name != against and len(ref) and all(i in ref for i in items) and len(items) > 1:
            diffs = [got[i]["top1"] - ref[i]["top1"] for i in items]
            lo, hi = paired_interval(diffs)
            gap = f"{statistics.mean(diffs):+.1f} [{lo:+.1f}, {hi:+.1f}]"
            updown = f"{sum(d > 0 for d in diffs)} / {sum(d < 0 for d in diffs)}"
        else:
            updown = ""
        lines.append(f"| {name} | {len(items)} | {statistics.mean(got[i]['top1'] for i in items):.1f} | "
                     f"{statistics.mean(got[i]['kl'] for i in items):.4f} | {gap} | {updown} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from retention.cli import positive_int, run_reporting_user_errors

    ap = argparse.ArgumentParser(prog="python -m retention.eval.eviction_probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("items", nargs="?", type=positive_int, default=24, help="fidelity items to probe (default 24)")
    ap.add_argument("--variants", default="base,fold:0.5,fold:1",
                    help="comma-separated: base, fold:A, consensus:W (default base,fold:0.5,fold:1)")
    ap.add_argument("--model", default="smollm2-135m", help="model spec, as the eval harness takes it")
    ap.add_argument("--gates", default=None, help="gate checkpoint (folder or Hub id); default: the shipped gates")
    ap.add_argument("--length", type=positive_int, default=4096, help="context tokens per item (default 4096)")
    ap.add_argument("--seed", type=int, default=33,
                    help="item seed (default 33, untouched by training and the goal sets)")
    args = ap.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    try:
        for v in variants:
            parse_variant(v)
    except ValueError as e:
        ap.error(f"--variants: {e}")
    if "base" not in variants:
        ap.error("--variants: include base, the shipped policy the others are read against")
    if args.length < 10 * (SINKS + 1):
        ap.error(f"--length: need a context of at least {10 * (SINKS + 1)} tokens (got {args.length})")
    return run_reporting_user_errors(ap, lambda: run(args, variants, ap))


def run(args: argparse.Namespace, variants: list[str], ap: argparse.ArgumentParser) -> int:
    """The probe and its table, from :func:`main`'s arguments; the gates are read before the model loads."""
    model, tok = load_probe_model(args.model, args.gates, ap.error)
    rows = probe(model, tok, args.items, variants, args.length, args.seed)
    print(f"{args.items} fidelity items of seed {args.seed}, {args.length}-token contexts, {FRACTION:.0%} kept")
    print(report(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
