"""Markdown tables and PNG plots from a results file: quality against KV memory kept."""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path

from .runner import read_results


def summarise(rows: list[dict]) -> dict[tuple, dict]:
    """(task, method, budget) -> mean score, kept entries, KV bytes, KL (fidelity), item count."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["task"], r["method"], r["budget"])].append(r)
    out = {}
    for k, rs in groups.items():
        out[k] = {
            "score": statistics.mean(r["score"] for r in rs),
            "kept_entries": statistics.mean(r["kept_entries"] for r in rs),
            "kv_bytes": statistics.mean(r["kv_bytes"] for r in rs),
            "full_cache_bytes": statistics.mean(r["full_cache_bytes"] for r in rs),
            "kl": statistics.mean(r["kl"] for r in rs) if "kl" in rs[0] else None,
            "n": len(rs),
        }
    return out


def _budget_label(b) -> str:
    return "full" if b is None else (f"{b:.0%}" if b < 1 else f"{b:g} tok/head")


def markdown_table(rows: list[dict]) -> str:
    s = summarise(rows)
    lines = ["| task | method | budget | score | KV kept (entries) | KV MiB | of full | KL | n |",
             "|---|---|---|---|---|---|---|---|---|"]
    order = sorted(s, key=lambda k: (k[0], k[2] is not None, k[2] or 0, k[1]))
    for task, method, budget in order:
        v = s[(task, method, budget)]
        frac = v["kv_bytes"] / v["full_cache_bytes"] if v["full_cache_bytes"] else 1.0
        kl = "" if v["kl"] is None else f"{v['kl']:.3f}"
        lines.append(f"| {task} | {method} | {_budget_label(budget)} | {v['score']:.1f} | {v['kept_entries']:,.0f} | "
                     f"{v['kv_bytes'] / 2**20:.2f} | {frac:.0%} | {kl} | {v['n']} |")
    return "\n".join(lines)


def plot(rows: list[dict], out_dir: Path) -> list[Path]:
    """One PNG per task: score against the KV fraction kept, a line per method, full cache dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = summarise(rows)
    paths = []
    for task in sorted({k[0] for k in s}):
        fig, ax = plt.subplots(figsize=(6, 4))
        for method in sorted({k[1] for k in s if k[0] == task}):
            pts = sorted((v["kv_bytes"] / max(v["full_cache_bytes"], 1), v["score"])
                         for (t, m, b), v in s.items() if t == task and m == method and b is not None)
            full = [v["score"] for (t, m, b), v in s.items() if t == task and m == method and b is None]
            if full:
                ax.axhline(full[0], linestyle="--", color="black", label=f"{method} (full cache)")
            if pts:
                ax.plot([p[0] * 100 for p in pts], [p[1] for p in pts], marker="o", label=method)
        ax.set_xlabel("KV cache kept (% of full)")
        ax.set_ylabel("score")
        ax.set_title(task)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        path = out_dir / f"{task}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def write_report(results: str | Path, out_dir: str | Path | None = None) -> Path:
    rows = read_results(results)
    if not rows:
        raise ValueError(f"{results} holds no results")
    out = Path(out_dir or Path(results).parent)
    out.mkdir(parents=True, exist_ok=True)
    pngs = plot(rows, out)
    md = out / "report.md"
    md.write_text("# Quality vs KV budget\n\n" + markdown_table(rows) + "\n\n" + "\n".join(f"![{p.stem}]({p.name})" for p in pngs) + "\n")
    return md
