"""Reports from a results file: a markdown table (task x length x method x budget, the full cache
first, with the KV memory kept in entries and bytes) and PNG plots of quality against KV memory."""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from retention.policies.registry import POLICIES
from retention.tasks import HELD_OUT_TASKS

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
            # multimodal items (retention.eval.multimodal): the share of the kept entries that are image tokens
            "image_share": statistics.mean(r["kept_image_entries"] / r["kept_entries"] if r["kept_entries"] else 0.0
                                           for r in ok) if ok and all("kept_image_entries" in r for r in ok) else None,
            "metric": rs[0].get("metric", "recall"),
            "n": len(ok),
            "errors": len(rs) - len(ok),
            "past_positions": sum(bool(r.get("past_positions")) for r in ok),  # longer than the model's positions
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
    images = any(v["image_share"] is not None for v in s.values())  # a column only where some rows show images
    lines = ["| task | length | method | budget | score | KL | KV kept (entries) | "
             + ("image share | " if images else "") + "KV MiB | of full | n |",
             "|---|---|---|---|---|---|---|" + ("---|" if images else "") + "---|---|---|"]
    for g in _order(s):
        task, length, method, budget = g
        v = s[g]
        kl = "" if v["kl"] is None else f"{v['kl']:.3g}"
        notes = ([f"{v['errors']} failed"] * bool(v["errors"])
                 + [f"{v['past_positions']} past positions"] * bool(v["past_positions"]))
        n = f"{v['n']}" + (f" ({', '.join(notes)})" if notes else "")
        share = "" if not images else ("| " if v["image_share"] is None or not v["n"] else f"{v['image_share']:.0%} | ")
        if v["n"]:
            lines.append(f"| {task} | {length} | {method} | {budget_label(budget)} | {v['score']:.1f} | {kl} | "
                         f"{v['kept_entries']:,.0f} | {share}{v['kv_bytes'] / 2**20:.2f} | "
                         f"{v['kv_fraction']:.0%} | {n} |")
        else:
            lines.append(f"| {task} | {length} | {method} | {budget_label(budget)} | - | | | {share}| | {n} |")
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
            stem = re.sub(r"[^\w.-]+", "-", task)  # a Hub set's task names its subset: ruler/vt -> ruler-vt.png
            path = out_dir / (f"{stem}.png" if field == "score" else f"{stem}_kl.png")
            fig.tight_layout()
            fig.savefig(path, dpi=120)
            plt.close(fig)
            paths.append(path)
    return paths


def write_report(results: str | Path, out_dir: str | Path | None = None) -> Path:
    """``report.md`` (table, a plot per task and, where :func:`gap_plot` can draw it, ``gaps.png``) next to the
    results (or in ``out_dir``); returns its path."""
    rows = read_results(results)
    if not rows:
        raise ValueError(f"{results} holds no results")
    out = Path(out_dir) if out_dir else Path(results).parent
    out.mkdir(parents=True, exist_ok=True)
    pngs = plot(rows, out)
    gaps = gap_plot(rows, out / "gaps.png")  # with intervals: needs two budgets and 5 items a task
    pngs += [gaps] if gaps else []
    models = sorted({str(r.get("model", "?")) for r in rows})
    protocols = sorted({f"{r.get('protocol', '?')} / {r.get('prefill', '?')}" for r in rows})
    head = (f"# Quality vs KV memory\n\nmodel: {', '.join(models)}; protocol / prefill: {', '.join(protocols)}; "
            "score: the task's metric in % (fidelity: top-1 agreement with the full cache); "
            "KV kept: entries (token x KV head x layer) when the question arrives.\n\n")
    md = out / "report.md"
    summary = f"## Summary\n\n{family_summaries(rows)}\n\n" if has_budgets(rows) else ""
    md.write_text(head + summary + "## Per task, length, method and budget\n\n" + markdown_table(rows) + "\n\n"
                  + "\n".join(f"![{p.stem}]({p.name})" for p in pngs) + "\n")
    return md


def has_budgets(rows: list[dict[str, Any]]) -> bool:
    """Whether any row ran under a KV budget (else :func:`summary_table` has no column to show)."""
    return any(r["budget"] != "full" for r in rows)


def overview(rows: list[dict[str, Any]]) -> str:
    """What a command prints when a sweep's rows are in: :func:`family_summaries` (the mean over tasks per method and
    budget, with the gaps) where budgets ran, else the per-row :func:`markdown_table` (full-cache rows only)."""
    return family_summaries(rows) if has_budgets(rows) else markdown_table(rows)


def families(rows: list[dict[str, Any]]) -> list[tuple[str | None, list[dict[str, Any]]]]:
    """``[(heading, rows)]``: the held-out task families (:data:`retention.tasks.HELD_OUT_TASKS`, templates and genres
    no training source uses) and the in-distribution ones, in that order, when the rows hold both; else
    ``[(None, rows)]``. A mean over both would let the templates the gates trained on hide how they do on the others,
    so every summary reports the two side by side (issue 74)."""
    held = [r for r in rows if r["task"] in HELD_OUT_TASKS]
    if not held or len(held) == len(rows):
        return [(None, rows)]
    return [("Held-out families (templates and genres no training source uses)", held),
            ("In-distribution families (the templates the gates trained on)",
             [r for r in rows if r["task"] not in HELD_OUT_TASKS])]


def family_summaries(rows: list[dict[str, Any]], pairs: list[tuple[str, str]] = ()) -> str:
    """:func:`summary_table` (and :func:`pair_table` for ``pairs``) of each of :func:`families`, under its heading."""
    parts = []
    for title, part in families(rows):
        text = summary_table(part) + ("\n\n" + pair_table(part, list(pairs)) if pairs else "")
        parts.append(text if title is None else f"**{title}.** {text}")
    return "\n\n".join(parts)


def family_pair_tables(rows: list[dict[str, Any]], pairs: list[tuple[str, str]]) -> str:
    """:func:`pair_table` of each of :func:`families` under its heading: a gap averaged over held-out and
    in-distribution tasks together would let the trained templates hide the others."""
    return "\n\n".join(pair_table(part, pairs) if title is None else f"**{title}.** {pair_table(part, pairs)}"
                       for title, part in families(rows))


# -- the summary published with a gate checkpoint ------------------------------------------------------
def _task_means(rows: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, float]]:
    """(method, budget key) -> {task: mean score over items and lengths}, plus the mean KV share
    kept (``__kv__``) and the mean KV bytes kept (``__bytes__``). Only cells scored on every task the full cache
    was (:func:`partial_cells` are left out): a cell a staged or running sweep has scored on some tasks only would
    otherwise shrink every mean of the table to the tasks it has."""
    means = _all_task_means(rows)
    left_out = set(partial_cells(means))
    return {k: d for k, d in means.items() if k not in left_out}


def partial_cells(means: dict[tuple[str, str], dict[str, float]]) -> list[tuple[str, str]]:
    """The (method, budget) cells of :func:`_all_task_means` that lack a task the full cache was scored on (none
    without full-cache rows: then the tables average the tasks every cell has)."""
    full = next((d for k, d in means.items() if k[1] == "full"), None)
    if full is None:
        return []
    need = set(full) - set(_STATS)
    return sorted(k for k, d in means.items() if not need <= set(d))


def _all_task_means(rows: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, float]]:
    """:func:`_task_means` with every cell, complete or not."""
    s = {g: v for g, v in summarise(rows).items() if v["n"]}
    out: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for (task, _length, method, budget), v in s.items():
        out[(method, budget)][task].append(v["score"])
        out[(method, budget)]["__kv__"].append(v["kv_fraction"])
        out[(method, budget)]["__bytes__"].append(v["kv_bytes"])
    return {k: {t: statistics.mean(x) for t, x in d.items()} for k, d in out.items()}


_STATS = ("__kv__", "__bytes__")
LEARNED_POLICIES = tuple(n for n, cls in POLICIES.items() if getattr(cls, "uses_gates", False))  # scored by gates


# read the future (retention/eval/oracle.py): ceilings to read a gap against, no baselines
REFERENCE_POLICIES = ("oracle",)


def _methods_running(rows: list[dict[str, Any]], policies: tuple[str, ...]) -> set[str]:
    """The method labels whose rows ran one of ``policies`` (their ``policy`` field; a label such as
    ``stage2_sink4`` says nothing). Rows without the field fall back to the label's prefix."""
    return {r["method"] for r in rows if str(r.get("policy", r["method"])).startswith(policies)}


def learned_methods(rows: list[dict[str, Any]]) -> set[str]:
    """The method labels whose rows ran a learned policy."""
    return _methods_running(rows, LEARNED_POLICIES)


def reference_methods(rows: list[dict[str, Any]]) -> set[str]:
    """The method labels whose rows ran a reference that sees what no method may: never the "best
    training-free" a learned method is compared with."""
    return _methods_running(rows, REFERENCE_POLICIES)


def _size(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def _common_tasks(means: dict) -> list[str]:
    return sorted(set.intersection(*[set(d) - set(_STATS) for d in means.values()])) if means else []


def _paired_differences(rows: list[dict[str, Any]], a: tuple[str, str], b: tuple[str, str],
                        tasks: list[str]) -> dict[str, list[Any]] | None:
    """Per task, one array per length of ``score(a) - score(b)`` over the items both scored (same item ids), in item
    order; ``None`` unless every task of ``tasks`` has some."""
    import numpy as np

    scores: dict[tuple, dict[str, float]] = defaultdict(dict)  # (method, budget, task, length) -> item -> score
    for r in rows:
        if r.get("score") is not None and r["task"] in tasks:
            scores[(r["method"], r["budget"], r["task"], r["length"])][str(r["item"])] = float(r["score"])
    per_task: dict[str, list] = defaultdict(list)
    for task, length in sorted({(k[2], k[3]) for k in scores}):
        sa, sb = scores.get((*a, task, length), {}), scores.get((*b, task, length), {})
        if sa or sb:
            per_task[task].append(np.array([sa[i] - sb[i] for i in sorted(set(sa) & set(sb))]))
    return per_task if set(per_task) == set(tasks) else None


def paired_task_gaps(rows: list[dict[str, Any]], a: tuple[str, str], b: tuple[str, str],
                     tasks: list[str]) -> dict[str, float] | None:
    """Task -> the gap ``a - b`` in points over the items both scored (items, then lengths); ``None`` unless every
    (task, length) of ``tasks`` has such items. It differs from the difference of the two task means where one
    method scored items the other did not (a run still going, failed rows with ``score: None``)."""
    import numpy as np

    diffs = _paired_differences(rows, a, b, tasks)
    if diffs is None or any(len(d) == 0 for ds in diffs.values() for d in ds):
        return None
    return {t: float(np.mean([d.mean() for d in ds])) for t, ds in diffs.items()}


def paired_gap(rows: list[dict[str, Any]], a: tuple[str, str], b: tuple[str, str], tasks: list[str]) -> float | None:
    """The gap ``a - b`` in points over the items both scored, averaged as the summary averages scores (items, then
    lengths, then ``tasks``): the point :func:`paired_gap_interval` brackets, the mean of :func:`paired_task_gaps`."""
    gaps = paired_task_gaps(rows, a, b, tasks)
    return None if gaps is None else statistics.mean(gaps.values())


def paired_gap_interval(rows: list[dict[str, Any]], a: tuple[str, str], b: tuple[str, str], tasks: list[str],
                        level: float = 0.95, draws: int = 4000, seed: int = 0,
                        min_items: int = 5) -> tuple[float, float] | None:
    """A ``level`` interval for the gap ``mean score of a - mean score of b`` (points; ``a`` and ``b`` are
    (method, budget key) pairs), by a paired bootstrap over items.

    The gap is averaged as the summary averages scores: over each (task, length)'s items, then lengths,
    then ``tasks``. Each draw resamples, within every (task, length), the items both methods scored (same
    item ids) with replacement; the interval is the draws' percentiles. ``None`` when some (task, length)
    has fewer than ``min_items`` such items: with 2 or 3 a bootstrap is far too narrow to mean anything
    (two items with equal gaps give a zero-width interval). Seeded: the same rows give the same interval.
    """
    import numpy as np

    diffs = _paired_differences(rows, a, b, tasks)
    if diffs is None or any(len(d) < max(min_items, 2) for ds in diffs.values() for d in ds):
        return None
    rng = np.random.default_rng(seed)
    per_task = {t: [d[rng.integers(0, len(d), size=(draws, len(d)))].mean(axis=1) for d in ds]
                for t, ds in diffs.items()}
    gaps = np.mean([np.mean(v, axis=0) for v in per_task.values()], axis=0)
    lo, hi = np.quantile(gaps, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


GAP_NOTE = ("Gaps in points; in brackets a 95% interval from a paired bootstrap over items (the same items resampled "
            "for both methods within each task, 4,000 draws). With few items per task one item moves a task's score a "
            "lot: read the interval before the point.")


def gap_cell(rows: list[dict[str, Any]], a: tuple[str, str], b: tuple[str, str], tasks: list[str],
             value: float) -> tuple[str, bool]:
    """``("+1.2 [-0.3, +2.8]", True)``: the gap ``a - b`` (``value``, the difference of the two means) with its
    :func:`paired_gap_interval`; where there is one, the point is the gap over the items both scored, as its
    interval is (failed rows aside). ``False``: no interval (too few items)."""
    ci = paired_gap_interval(rows, a, b, tasks)
    if ci is not None:
        value = paired_gap(rows, a, b, tasks)
    return f"{value:+.1f}" + ("" if ci is None else f" [{ci[0]:+.1f}, {ci[1]:+.1f}]"), ci is not None


def _partial_note(rows: list[dict[str, Any]]) -> str:
    """What the tables say when some cells are left out (:func:`partial_cells`), else nothing."""
    left = [k for _, part in families(rows) for k in partial_cells(_all_task_means(part))]
    if not left:
        return ""
    return (f" Not yet scored on every task, so shown as -: {len(left)} cell{'s' if len(left) > 1 else ''} "
            f"({', '.join(f'{m} {budget_label(b)}' for m, b in left[:4])}{', ...' if len(left) > 4 else ''}).")


def summary_table(rows: list[dict[str, Any]]) -> str:
    """Mean score over tasks, one row per method and one column per budget (the full cache first),
    each cell with the KV share and bytes actually kept; then the gap to the full cache and to the best
    training-free baseline at each budget, with a 95% paired-bootstrap interval where every task has five or
    more items (:func:`paired_gap_interval`). Cells average only the tasks every method ran."""
    means = _task_means(rows)
    budgets = sorted({b for _, b in means if b != "full"}, key=lambda b: parse_budget(b).value)
    methods = sorted({m for m, b in means if b != "full"})
    tasks = _common_tasks(means)
    avg = {k: statistics.mean(d[t] for t in tasks) for k, d in means.items()} if tasks else {}
    full = next((avg[k] for k in avg if k[1] == "full"), None)
    head = "| method | " + " | ".join(budget_label(b) for b in budgets) + " |"
    lines = [f"Mean score over {len(tasks)} tasks ({', '.join(tasks)}); in brackets the KV cache kept (% of the full "
             "cache, and its size in memory when the question arrives)." + _partial_note(rows),
             "", head, "|---|" + "---|" * len(budgets)]
    if full is not None:
        size = _size(next(d["__bytes__"] for k, d in means.items() if k[1] == "full"))
        lines.append("| full cache | " + " | ".join(f"{full:.1f} (100%, {size})" for _ in budgets) + " |")
    for m in methods:
        cells = [f"{avg[(m, b)]:.1f} ({means[(m, b)]['__kv__']:.0%}, {_size(means[(m, b)]['__bytes__'])})"
                 if (m, b) in avg else "-" for b in budgets]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    learned = sorted(learned_methods(rows) & set(methods))
    references = sorted(reference_methods(rows) & set(methods))
    baselines = [m for m in methods if m not in learned and m not in references]
    if learned and (baselines or full is not None):
        shown: list[bool] = []  # whether any cell has an interval (then the note under the table says what it is)

        def gap(m: str, b: str, other: tuple[str, str], value: float) -> str:
            text, ci = gap_cell(rows, (m, b), other, tasks, value)
            shown.append(ci)
            return text

        full_key = next((k for k in avg if k[1] == "full"), None)
        lines += ["", "| learned | budget | score | vs full cache | vs best training-free (which) |",
                  "|---|---|---|---|---|"]
        for m in learned:
            for b in budgets:
                if (m, b) not in avg:
                    continue
                best = max(((avg[(x, b)], x) for x in baselines if (x, b) in avg), default=None)
                vs_full = "" if full is None else gap(m, b, full_key, avg[(m, b)] - full)
                vs_best = "" if best is None else f"{gap(m, b, (best[1], b), avg[(m, b)] - best[0])} ({best[1]})"
                lines.append(f"| {m} | {budget_label(b)} | {avg[(m, b)]:.1f} | {vs_full} | {vs_best} |")
        if any(shown):
            lines += ["", GAP_NOTE]
        if references:
            lines += ["", f"{', '.join(references)}: references that read the continuation "
                      "(`retention/eval/oracle.py`), so not counted as the best training-free method."]
    return "\n".join(lines)


def headline_table(rows: list[dict[str, Any]]) -> str:
    """The results in one table, for a README: one row per method, the mean over the held-out families and over the
    in-distribution ones (:func:`families`) at each budget side by side, with a row of the KV kept; then each learned
    method's gaps to the full cache and to the best training-free method of each family, with paired intervals.
    Methods in order: the full cache, the learned ones, then the others by their held-out score at 10% (or the
    smallest budget). Rows of one family only give :func:`summary_table`."""
    parts = families(rows)
    if len(parts) == 1 or not has_budgets(rows):
        return summary_table(rows)
    stats, part_rows = [], {}  # per family: (short name, tasks, means, avg), and its rows
    for title, part in parts:
        means = _task_means(part)
        tasks = _common_tasks(means)
        avg = {k: statistics.mean(d[t] for t in tasks) for k, d in means.items()} if tasks else {}
        name = "held-out" if title.startswith("Held-out") else "in-distribution"
        stats.append((name, tasks, means, avg))
        part_rows[name] = part
    budgets = sorted({b for *_, avg in stats for _, b in avg if b != "full"}, key=lambda b: parse_budget(b).value)
    goal = "fraction=0.1" if "fraction=0.1" in budgets else budgets[0]
    methods = sorted({m for *_, avg in stats for m, b in avg if b != "full"})
    learned = [m for m in methods if m in learned_methods(rows)]
    references = reference_methods(rows)
    baselines = [m for m in methods if m not in learned and m not in references]
    held_avg = stats[0][3]
    baselines.sort(key=lambda m: (-held_avg.get((m, goal), float("-inf")), m))
    full = {name: next((k for k in avg if k[1] == "full"), None) for name, _, _, avg in stats}

    def cell(avg: dict, key: tuple[str, str]) -> str:
        return f"{avg[key]:.1f}" if key in avg else "-"

    head = "| method | " + " | ".join(f"{name} {budget_label(b)}" for name, *_ in stats for b in budgets) + " |"
    lines = [" ".join(f"{name.capitalize()}: mean over {len(tasks)} famil{'y' if len(tasks) == 1 else 'ies'} "
                      f"({', '.join(tasks)})."
                      for name, tasks, _, _ in stats) + " Scores in %, fidelity as top-1 agreement with the full "
             "cache; KV kept: the cache's size in memory when the question arrives, mean over methods."
             + _partial_note(rows), "",
             head, "|---|" + "---|" * (len(budgets) * len(stats))]
    kv = []
    for _, _, means, _ in stats:
        for b in budgets:
            sizes = [d["__bytes__"] for (m, bb), d in means.items() if bb == b]
            kv.append(_size(statistics.mean(sizes)) if sizes else "-")
    lines.append("| KV kept | " + " | ".join(kv) + " |")
    if all(full.values()):
        size = _size(stats[0][2][full[stats[0][0]]]["__bytes__"])
        lines.append(f"| full cache ({size}) | "
                     + " | ".join(cell(avg, full[name]) for name, _, _, avg in stats for _ in budgets) + " |")
    for m in learned + sorted(references & set(methods)) + baselines:
        label = f"**{m}**" if m in learned else m
        lines.append(f"| {label} | " + " | ".join(cell(avg, (m, b)) for _, _, _, avg in stats for b in budgets) + " |")
    if not learned:
        return "\n".join(lines)
    lines += ["", "| learned | budget | " + " | ".join(f"{name}: vs full cache | vs best training-free (which)"
                                                        for name, *_ in stats) + " |",
              "|---|---|" + "---|---|" * len(stats)]
    shown = False
    for m in learned:
        for b in budgets:
            cells = []
            for name, tasks, _, avg in stats:
                if (m, b) not in avg:
                    cells += ["", ""]
                    continue
                vs_full, ci = ("", False) if full[name] is None else gap_cell(part_rows[name], (m, b), full[name],
                                                                               tasks, avg[(m, b)] - avg[full[name]])
                shown |= ci
                best = max(((avg[(x, b)], x) for x in baselines if (x, b) in avg), default=None)
                vs_best = ""
                if best is not None:
                    text, ci = gap_cell(part_rows[name], (m, b), (best[1], b), tasks, avg[(m, b)] - best[0])
                    vs_best, shown = f"{text} ({best[1]})", shown or ci
                cells += [vs_full, vs_best]
            if any(cells):
                lines.append(f"| {m} | {budget_label(b)} | " + " | ".join(cells) + " |")
    return "\n".join(lines + (["", GAP_NOTE] if shown else []))


def parse_pairs(specs: list[str] | None) -> list[tuple[str, str]]:
    """``["a,b", ...]`` (the ``--pair`` option) -> ``[("a", "b"), ...]``; ValueError naming the fix otherwise."""
    pairs = []
    for spec in specs or []:
        parts = [x.strip() for x in spec.split(",")]
        if len(parts) != 2 or not all(parts) or parts[0] == parts[1]:
            raise ValueError(f"--pair {spec!r}: give two different method labels as A,B (A minus B is reported), "
                             "e.g. --pair gates_new,global_gates_sink4")
        pairs.append((parts[0], parts[1]))
    return pairs


def check_pairs(pairs: list[tuple[str, str]], labels: set[str]) -> None:
    """ValueError if a ``--pair`` names a method that the results (or the config) do not have; ``full``
    is the full cache."""
    for a, b in pairs:
        missing = [m for m in (a, b) if m not in labels]
        if missing:
            raise ValueError(f"--pair {a},{b}: no method labelled {', '.join(map(repr, missing))}; "
                             f"the methods are {', '.join(sorted(labels))}")


def pair_table(rows: list[dict[str, Any]], pairs: list[tuple[str, str]]) -> str:
    """The gap ``A - B`` for each ``(A, B)`` in ``pairs`` (method labels; ``full`` is the full cache) at
    every budget both ran (with ``full`` on either side: every budget of the other): mean over the tasks of
    :func:`summary_table` with its 95% paired-bootstrap interval (:func:`paired_gap_interval`), then the gap
    on each task. Two learned methods are compared on the same items, which the gaps of each to the full
    cache hide."""
    means = _task_means(rows)
    tasks = _common_tasks(means)
    check_pairs(pairs, {m for m, _ in means})
    body = []
    for a, b in pairs:
        # the full cache ran at "full" only: against it, the gap is at each budget of the other method, either side
        over = b if a == "full" else a
        for budget in sorted({k[1] for k in means if k[0] == over},
                             key=lambda x: -1 if x == "full" else parse_budget(x).value):
            ka = (a, "full") if a == "full" else (a, budget)
            kb = (b, "full") if b == "full" else (b, budget)
            if ka not in means or kb not in means:
                continue
            # over the items both scored where there are any, so the task columns average to the gap beside them
            paired = paired_task_gaps(rows, ka, kb, tasks)
            per_task = [means[ka][t] - means[kb][t] if paired is None else paired[t] for t in tasks]
            ci = paired_gap_interval(rows, ka, kb, tasks)
            point = statistics.mean(per_task)
            gap = f"{point:+.1f}" + ("" if ci is None else f" [{ci[0]:+.1f}, {ci[1]:+.1f}]")
            body.append(f"| {a} - {b} | {budget_label(budget)} | {gap} | "
                        + " | ".join(f"{g:+.1f}" for g in per_task) + " |")
    lines = ["Paired gaps, A minus B in points (the mean over tasks with a 95% paired-bootstrap interval over the "
             "items both scored, then each task).", "",
             "| A - B | budget | gap | " + " | ".join(tasks) + " |", "|---|---|---|" + "---|" * len(tasks)]
    lines += body or ["| (no budget that both methods of a pair ran) | | | " + " | ".join("" for _ in tasks) + " |"]
    return "\n".join(lines)


def task_table(rows: list[dict[str, Any]], budget: str) -> str:
    """Score per task at one budget (a budget key such as ``fraction=0.1``), one row per method,
    the full cache first: where the mean in :func:`summary_table` comes from."""
    means = _task_means(rows)
    tasks = _common_tasks(means)
    keys = [k for k in means if k[1] == "full"] + sorted(k for k in means if k[1] == budget)
    lines = [f"Score per task at {budget_label(budget)} of the cache "
             "(%; fidelity: top-1 agreement with the full cache).",
             "", "| method | " + " | ".join(tasks) + " |", "|---|" + "---|" * len(tasks)]
    for k in keys:
        name = "full cache" if k[1] == "full" else k[0]
        lines.append(f"| {name} | " + " | ".join(f"{means[k][t]:.1f}" for t in tasks) + " |")
    return "\n".join(lines)


def summary_plot(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Mean score over tasks against the KV cache kept, a line per method, the full cache dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    means = _task_means(rows)
    tasks = _common_tasks(means)
    fig, ax = plt.subplots(figsize=(9.0, 4.6))
    methods = sorted({m for m, b in means if b != "full"})
    learned = sorted(learned_methods(rows) & set(methods))
    baselines = [m for m in methods if m not in learned]
    # learned methods: strong colours, solid, each its own marker; baselines: the pale half of tab20,
    # dashed, so no two lines share a colour and style with up to 20 methods
    strong, pale = plt.get_cmap("tab10"), plt.get_cmap("tab20")
    for i, m in enumerate(learned + baselines):
        pts = sorted((means[k]["__kv__"] * 100, statistics.mean(means[k][t] for t in tasks))
                     for k in means if k[0] == m)
        if m in learned:
            style = dict(color=strong(i % 10), marker="osD^v"[i % 5], linewidth=2.2, linestyle="-")
        else:
            j = i - len(learned)
            style = dict(color=pale((2 * j + 1) % 20 if j < 10 else (2 * j) % 20), marker=".", linewidth=1.0,
                         linestyle=(0, (3, 1)))
        ax.plot(*zip(*pts), label=m, **style)
    for k, d in means.items():
        if k[1] == "full":
            ax.axhline(statistics.mean(d[t] for t in tasks), color="black", linestyle="--", linewidth=1,
                       label="full cache")
    ax.set_xlabel("KV cache kept (% of the full cache)")
    ax.set_ylabel(f"mean score over {len(tasks)} tasks (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the plot: never over a line
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def gap_points(rows: list[dict[str, Any]], level: float = 0.95) -> dict[str, list[tuple[float, float, float, float]]]:
    """Per method (the full cache and references left out): ``(KV kept %, gap, lo, hi)`` at each of its budgets
    by KV kept, where gap is its mean score over tasks minus the full cache's (points) and ``lo, hi`` the
    gap's ``level`` paired-bootstrap interval over the items both scored (:func:`paired_gap_interval`;
    ``lo == hi == gap`` with fewer than 5 items a task). Empty without full-cache rows."""
    means = _task_means(rows)
    tasks = _common_tasks(means)
    full = next((k for k in means if k[1] == "full"), None)
    if full is None:
        return {}
    refs = reference_methods(rows)
    score = {k: statistics.mean(means[k][t] for t in tasks) for k in means}
    out: dict[str, list] = defaultdict(list)
    for k in means:
        if k[1] != "full" and k[0] not in refs:
            ci = paired_gap_interval(rows, k, full, tasks, level=level)
            gap = score[k] - score[full] if ci is None else paired_gap(rows, k, full, tasks)
            out[k[0]].append((means[k]["__kv__"] * 100, gap, *(ci or (gap, gap))))
    return {m: sorted(p) for m, p in sorted(out.items())}


def gap_plot(rows: list[dict[str, Any]], path: str | Path, level: float = 0.95) -> Path | None:
    """:func:`gap_points` drawn against the KV cache kept: learned methods solid with their intervals shaded,
    training-free policies pale and dashed with error bars, the full cache at 0. Paired gaps, because items
    differ far more from each other than methods do on one item. ``None`` (no file) without full-cache rows,
    or unless some learned method has two budgets or more and intervals (5 items a task or more)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = gap_points(rows, level)
    learned = sorted(learned_methods(rows) & set(points))
    if not any(len(points[m]) > 1 and any(lo < hi for _, _, lo, hi in points[m]) for m in learned):
        return None  # one budget's gaps are a table's job (the page has it); a curve needs two
    means = _task_means(rows)
    tasks = _common_tasks(means)
    full = statistics.mean(means[next(k for k in means if k[1] == "full")][t] for t in tasks)
    fig, ax = plt.subplots(figsize=(9.0, 4.8))
    strong, pale = plt.get_cmap("tab10"), plt.get_cmap("tab20")
    ax.axhline(0, color="black", linestyle="--", linewidth=1, label=f"full cache ({full:.1f})")
    for j, m in enumerate(m for m in points if m not in learned):
        x, y, lo, hi = zip(*points[m])
        ax.errorbar(x, y, yerr=[[a - b for a, b in zip(y, lo)], [b - a for a, b in zip(y, hi)]],
                    color=pale((2 * j + 1) % 20 if j < 10 else (2 * j) % 20), marker=".", linewidth=1.0,
                    linestyle=(0, (3, 1)), elinewidth=0.8, capsize=2, label=m)
    for i, m in enumerate(learned):
        x, y, lo, hi = zip(*points[m])
        ax.fill_between(x, lo, hi, color=strong(i % 10), alpha=0.18, linewidth=0)  # a band needs 2 budgets: bars too
        ax.errorbar(x, y, yerr=[[a - b for a, b in zip(y, lo)], [b - a for a, b in zip(y, hi)]], color=strong(i % 10),
                    marker="osD^v"[i % 5], linewidth=2.2, elinewidth=1.2, capsize=3, label=m)
    ax.set_xlabel("KV cache kept (% of the full cache)")
    ax.set_ylabel("mean score minus the full cache's (points)")
    ax.set_title(f"{level:.0%} paired-bootstrap intervals over items", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
