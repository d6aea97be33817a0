"""Reports from a results file: a markdown table (task x length x method x budget, the full cache
first, with the KV memory kept in entries and bytes) and PNG plots of quality against KV memory."""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from .budgets import parse_budget
from .runner import read_results

Group = tuple[str, int, str, str]  # task, length, method, budget key


def budget_label(key: str) -> str:
    return "full" if key == "full" else parse_budget(key).label


def summarise(rows: list[dict[str, Any]]) -> dict[Group, dict[str, Any]]:
    """Means per (task, length, method, budget) over scored items; errors are counted apart."""
    groups: dict[Group, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["task"], r["length"], r["method"], r["budget"])].append(r)
    out = {}
    for k, rs in groups.items():
        ok = [r for r in rs if r.get("score") is not None]
        mean = (lambda f: statistics.mean(r[f] for r in ok)) if ok else (lambda f: float("nan"))
        out[k] = {
            "score": mean("score"),
            "kl": statistics.mean(r["kl"] for r in ok) if ok and all("kl" in r for r in ok) else None,
            "kept_entries": mean("kept_entries"),
            "kv_bytes": mean("kv_bytes"),
            "kv_fraction": statistics.mean(r["kv_bytes"] / r["full_cache_bytes"] if r["full_cache_bytes"] else 1.0
                                           for r in ok) if ok else float("nan"),
            "metric": rs[0].get("metric", "recall"),
            "n": len(ok),
            "errors": len(rs) - len(ok),
        }
    return out


def _order(s: dict[Group, dict]) -> list[Group]:
    def key(g: Group):
        task, length, method, budget = g
        return (task, length, budget != "full", -s[g]["kv_fraction"] if s[g]["n"] else 0, method)
    return sorted(s, key=key)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """One row per (task, length, method, budget); score is the task's metric in %, KL in nats."""
    s = summarise(rows)
    lines = ["| task | length | method | budget | score | KL | KV kept (entries) | KV MiB | of full | n |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for g in _order(s):
        task, length, method, budget = g
        v = s[g]
        kl = "" if v["kl"] is None else f"{v['kl']:.3g}"
        n = f"{v['n']}" + (f" ({v['errors']} failed)" if v["errors"] else "")
        if v["n"]:
            lines.append(f"| {task} | {length} | {method} | {budget_label(budget)} | {v['score']:.1f} | {kl} | "
                         f"{v['kept_entries']:,.0f} | {v['kv_bytes'] / 2**20:.2f} | {v['kv_fraction']:.0%} | {n} |")
        else:
            lines.append(f"| {task} | {length} | {method} | {budget_label(budget)} | - | | | | | {n} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], out_dir: str | Path) -> list[Path]:
    """One PNG per task: score against KV kept (% of the full cache), a line per method and length,
    the full cache as a dashed level; fidelity also gets a KL plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    s = {g: v for g, v in summarise(rows).items() if v["n"]}
    paths = []
    for task in sorted({g[0] for g in s}):
        lengths = sorted({g[1] for g in s if g[0] == task})
        fields = [("score", f"score ({s[next(g for g in s if g[0] == task)]['metric']}, %)")]
        if any(v["kl"] is not None for g, v in s.items() if g[0] == task):
            fields.append(("kl", "KL(full || method), nats"))
        for field, ylabel in fields:
            fig, ax = plt.subplots(figsize=(6.4, 4.2))
            methods = sorted({g[2] for g in s if g[0] == task and g[3] != "full"})
            colors = {m: f"C{i}" for i, m in enumerate(methods)}
            styles = ["-", "--", ":", "-."]
            for li, length in enumerate(lengths):
                suffix = f" @{length}" if len(lengths) > 1 else ""
                for g, v in s.items():
                    if g[0] == task and g[1] == length and g[3] == "full" and field == "score":
                        ax.axhline(v["score"], color="black", linestyle=styles[li % 4], linewidth=1,
                                   label=f"{g[2]} (full cache){suffix}")
                for m in methods:
                    pts = sorted((v["kv_fraction"] * 100, v[field]) for g, v in s.items()
                                 if g[0] == task and g[1] == length and g[2] == m and g[3] != "full")
                    if pts:
                        ax.plot(*zip(*pts), marker="o", color=colors[m], linestyle=styles[li % 4], label=m + suffix)
            ax.set_xlabel("KV cache kept (% of the full cache)")
            ax.set_ylabel(ylabel)
            ax.set_title(task)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
            path = out_dir / (f"{task}.png" if field == "score" else f"{task}_kl.png")
            fig.tight_layout()
            fig.savefig(path, dpi=120)
            plt.close(fig)
            paths.append(path)
    return paths


def write_report(results: str | Path, out_dir: str | Path | None = None) -> Path:
    """``report.md`` (table + plots) next to the results (or in ``out_dir``); returns its path."""
    rows = read_results(results)
    if not rows:
        raise ValueError(f"{results} holds no results")
    out = Path(out_dir) if out_dir else Path(results).parent
    out.mkdir(parents=True, exist_ok=True)
    pngs = plot(rows, out)
    models = sorted({str(r.get("model", "?")) for r in rows})
    protocols = sorted({f"{r.get('protocol', '?')} / {r.get('prefill', '?')}" for r in rows})
    head = (f"# Quality vs KV memory\n\nmodel: {', '.join(models)}; protocol / prefill: {', '.join(protocols)}; "
            "score: the task's metric in % (fidelity: top-1 agreement with the full cache); "
            "KV kept: entries (token x KV head x layer) when the question arrives.\n\n")
    md = out / "report.md"
    md.write_text(head + markdown_table(rows) + "\n\n" + "\n".join(f"![{p.stem}]({p.name})" for p in pngs) + "\n")
    return md
