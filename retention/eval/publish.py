"""Publishing results: a stand-alone page (:func:`write_summary`), a gate checkpoint's model card and the
README's results block (:func:`publish`), each checked before an evaluation starts (:func:`check_publish_targets`,
:func:`check_sweep_scores_card`) so a sweep never ends unable to write what it was asked to.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from retention.gates import is_gate_folder
from retention.hub import card_results, model_card
from retention.metadata import META_FILE, read_metadata, write_metadata

from .budgets import parse_budget
from .protocol import PROTOCOL_SUMMARY
from .report import family_summaries, gap_plot, headline_table, markdown_table, summary_plot, task_table
from .runner import read_results


def summary_text(rows: list[dict[str, Any]], src: Path, pairs: list[tuple[str, str]] = (),
                 headline: bool = False) -> str:
    """What a card and a summary file say: the setting, :func:`summary_table` of each family, the paired gaps
    asked for (:func:`pair_table`) and the per-task view at the goal budget (10% where it was run, else
    the smallest budget). ``headline``: what a README says, the setting and :func:`headline_table` (held-out and
    in-distribution families side by side in one table)."""
    models = sorted({str(r.get("model", "?")) for r in rows})
    lengths = sorted({r["length"] for r in rows})
    sources = sorted({r["pooled_from"] for r in rows if r.get("pooled_from")})
    carried = sum(1 for r in rows if r.get("pooled_from"))
    if sources and carried == len(rows):
        made = (f"Pooled by `python -m retention.eval pool` ({src}) from the `python -m retention.eval run` results "
                f"{', '.join(sources)}")
    else:
        made = f"Produced by `python -m retention.eval run` ({src})"
        if sources:  # a run seeded with rows copied from a pooled file: say which rows came from where
            made += (f"; {carried} of its {len(rows)} rows were copied in from runs pooled earlier "
                     f"({', '.join(sources)})")
    protocols = "; ".join(f"{p} ({PROTOCOL_SUMMARY.get(p, 'as its rows record')})"
                          for p in sorted({str(r.get("protocol", "query_agnostic")) for r in rows}))
    setting = (f"Model {', '.join(models)}; contexts of {', '.join(map(str, lengths))} tokens; protocol {protocols}. "
               f"{made}.")
    if headline:
        return setting + "\n\n" + headline_table(rows)
    text = setting + "\n\n" + family_summaries(rows, pairs)
    budgets = sorted({r["budget"] for r in rows if r["budget"] != "full"}, key=lambda b: parse_budget(b).value)
    if budgets:
        text += "\n\n" + task_table(rows, "fraction=0.1" if "fraction=0.1" in budgets else budgets[0])
    return text


def shown_rows(rows: list[dict[str, Any]], methods: list[str] | None) -> list[dict[str, Any]]:
    """The rows of the method labels ``methods`` (all where ``None``; ``full`` is the full cache, always kept);
    ValueError naming the labels the rows hold when one of ``methods`` is not among them."""
    if methods is None:
        return rows
    labels = {r["method"] for r in rows}
    missing = sorted(set(methods) - labels - {"full"})
    if missing:
        raise ValueError(f"methods {missing} have no rows here; the rows hold {sorted(labels)}")
    keep = set(methods) | {"full"}
    return [r for r in rows if r["method"] in keep]


def check_publish_targets(card: str | Path | None = None, readme: str | Path | None = None,
                          summary: str | Path | None = None, card_section: str | None = None,
                          replaces: str | None = None) -> None:
    """Raise (FileNotFoundError / ValueError, naming the fix) if a model card folder, README or summary
    page cannot take the results; cheap, so callers run it before an evaluation."""
    if replaces is not None and card_section is None:
        raise ValueError("--replaces names the card section a new --card-section takes the place of: "
                         "give --card-section too")
    if card_section is not None and (card is None or readme is not None):
        raise ValueError("--card-section adds a section to a model card: give it with --card and without --readme "
                         "(the README's results block holds the card's main results)")
    if card_section is not None and not card_section.strip():
        raise ValueError("--card-section needs a title (the section's heading in the model card)")
    if card is not None and not is_gate_folder(card):
        raise FileNotFoundError(f"--card {card} is not a gate checkpoint (no {META_FILE}); "
                                "export one with train.py --export")
    if readme is not None:
        if not Path(readme).is_file():
            raise FileNotFoundError(f"--readme {readme} does not exist")
        body = Path(readme).read_text()
        if README_START not in body or README_END not in body:
            raise ValueError(f"{readme} has no {README_START} ... {README_END} markers to put the results between")
    if replaces is not None and card is not None and is_gate_folder(card):
        titles = [x["title"] for x in card_results(card)[1]]
        if replaces not in titles:
            raise ValueError(f"--replaces {replaces!r}: {card} has no such section; its sections are "
                             + (", ".join(repr(t) for t in titles) or "none"))
    if summary is not None and Path(summary).suffix != ".md":
        raise ValueError(f"--summary {summary}: give a .md file (the rows are copied beside it as .jsonl)")


def write_summary(results: str | Path, path: str | Path, title: str | None = None,
                  pairs: list[tuple[str, str]] = (), methods: list[str] | None = None) -> list[Path]:
    """A stand-alone results page at ``path`` (markdown: the summary of :func:`publish`, then the table
    per task, length, method and budget) and a copy of the rows beside it (``path`` with ``.jsonl``),
    so the page names the rows it came from; returns both paths. ``pairs``: :func:`pair_table` rows too;
    ``methods``: only these labels (:func:`shown_rows`), and only their rows are copied."""
    import shutil

    from retention.io import atomic_write_bytes

    check_publish_targets(summary=path)
    every = read_results(results)
    rows = shown_rows(every, methods)
    if not rows:
        raise ValueError(f"{results} holds no results")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows_copy = path.with_suffix(".jsonl")
    if len(rows) < len(every):
        from .runner import jsonl

        atomic_write_bytes(rows_copy, jsonl(rows).encode())
    elif Path(results).resolve() != rows_copy.resolve():
        shutil.copyfile(results, rows_copy)
    title = title or f"Results: {Path(results).parent.name}"
    figure = gap_plot(rows, path.with_suffix(".png"))
    body = (f"# {title}\n\nRows: `{rows_copy.name}` ({len(rows)} rows, copied from {results}).\n\n"
            + summary_text(rows, Path(results), pairs)
            + (f"\n\n![gap to the full cache against KV kept, with paired intervals]({figure.name})" if figure else "")
            + "\n\n## Per task, length, method and budget\n\nscore: the task's metric in % (fidelity: top-1 "
            "agreement with the full cache); KL: the answer's KL to the full cache in nats; KV kept: entries "
            "(token x KV head x layer) when the question arrives.\n\n" + markdown_table(rows) + "\n")
    atomic_write_bytes(path, body.encode())
    return [path, rows_copy] + ([figure] if figure else [])


README_START, README_END = "<!-- results:start -->", "<!-- results:end -->"


def check_rows_scored_by_card(rows: list[dict[str, Any]], card: str | Path) -> None:
    """ValueError unless some row was scored by the gates of the checkpoint ``card`` (rows record the fingerprint
    of the gates that scored them as ``gates_id``): a card must not show another checkpoint's results. Rows from
    before ``gates_id`` existed cannot be checked and pass."""
    from retention.gates import RetentionGates

    ids = {r["gates_id"] for r in rows if r.get("gates_id")}
    if not ids:
        return
    own = RetentionGates.from_pretrained(card).fingerprint()
    if own not in ids:
        raise ValueError(f"--card {card}: no row was scored by its gates (fingerprint {own}; the rows' gates are "
                         f"{', '.join(sorted(ids))}): publish into the card of the gates the sweep used, or run the "
                         f"sweep with `gates: {card}`")


def check_sweep_scores_card(cfg: Any, card: str | Path) -> None:
    """Before a sweep: ValueError when none of the gates it scores with is the checkpoint ``card``'s, so that
    publishing into that card would be refused afterwards (:func:`check_rows_scored_by_card`). Sweeps with
    untrained gates, or without gated methods, are left to that check."""
    from retention.gates import RetentionGates
    from retention.hub import checkpoint_folder
    from retention.models import shipped_gates

    from .methods import PolicyCache

    gated = [m for m in cfg.method_list() if isinstance(m, PolicyCache) and m.policy(streaming=False).uses_gates]
    if not gated or cfg.gates == "untrained":
        return
    sweep = cfg.gates or shipped_gates(cfg.model)
    if sweep is None:
        return  # untrained gates for a model without shipped ones: nothing to compare before the model loads
    sources = {str(sweep), *(str(m.gates) for m in gated if getattr(m, "gates", None))}
    own = RetentionGates.from_pretrained(card).fingerprint()
    if own not in {RetentionGates.from_pretrained(checkpoint_folder(s)).fingerprint() for s in sources}:
        raise ValueError(f"--card {card}: this sweep scores with other gates ({', '.join(sorted(sources))}), so its "
                         f"rows cannot go into that card; set `gates: {card}` in the config or publish elsewhere")


def publish(results: str | Path, card: str | Path | None = None, readme: str | Path | None = None,
            card_section: str | None = None, pairs: list[tuple[str, str]] = (),
            replaces: str | None = None, methods: list[str] | None = None) -> list[Path]:
    """Put the summary (table + plot) into a gate checkpoint's model card (``card``: its folder) and
    between the ``<!-- results:start/end -->`` markers of a README; returns the files written.

    ``card_section``: instead, add the summary to the card under that heading, after its main results,
    replacing an earlier section of the same title in its place: for a second result set such as a goal check.
    With two budgets or more and 5 items a task or more it brings :func:`gap_plot` (``results-<title>.png`` in
    the card folder). ``replaces``: the title of an earlier section the new one takes the place of (a result set
    renamed as it grows, e.g. "... 126 items" -> "... 138 items"); the card keeps its order of sections.
    ``pairs``: the paired gaps of :func:`pair_table` go in too. ``methods``: only these labels
    (:func:`shown_rows`), e.g. a sweep's own methods where its output folder holds another config's rows too."""
    import shutil

    from retention.io import atomic_write_bytes

    check_publish_targets(card, readme, card_section=card_section, replaces=replaces)
    rows = shown_rows(read_results(results), methods)
    if card is not None:
        check_rows_scored_by_card(rows, card)
    if not rows:
        raise ValueError(f"{results} holds no results")
    src = Path(results)
    # the main results draw the quality-vs-budget plot; a --card-section (never with --readme) draws the gaps to
    # the full cache with their intervals where it has enough items for them (gap_plot), else nothing
    plot_path = summary_plot(rows, src.parent / "summary.png") if card_section is None else None
    gaps = gap_plot(rows, src.parent / "gaps.png") if card_section is not None and card is not None else None
    text = summary_text(rows, src, pairs)
    written = []
    if card is not None:
        card = Path(card)
        # the metadata file holds no results: they live in the card itself (an older config.json held them too)
        config = read_metadata(card)
        main, shown = card_results(card)
        if card_section is None:
            main = text + "\n\n![quality vs KV budget](results.png)"
        else:
            new, sections, placed, dropped = {"title": card_section, "markdown": text}, [], False, []
            if gaps is not None:
                new["figure"] = ("results-" + (re.sub(r"[^a-z0-9]+", "-", card_section.lower()).strip("-")[:60]
                                               or "section") + ".png")
                new["markdown"] += f"\n\n![gap to the full cache, with paired intervals]({new['figure']})"
            for x in shown:  # in the place of what it replaces, else after the others
                if x["title"] not in (card_section, replaces):
                    sections.append(x)
                    continue
                if x.get("figure") and x["figure"] != new.get("figure"):
                    dropped.append(card / x["figure"])  # the replaced section's plot goes with it
                if not placed:
                    sections.append(new)
                    placed = True
            shown = sections if placed else sections + [new]
            if gaps is not None:
                shutil.copyfile(gaps, card / new["figure"])
                written.append(card / new["figure"])
        cfg_file = write_metadata(card, config)  # retention.json (an older checkpoint's config.json goes)
        atomic_write_bytes(card / "README.md", model_card(config, main, shown).encode())
        written += [cfg_file, card / "README.md"]
        for f in dropped if card_section is not None else []:
            f.unlink(missing_ok=True)  # after the card stops showing it
        if card_section is None:
            shutil.copyfile(plot_path, card / "results.png")
            written.append(card / "results.png")
    if readme is not None:
        readme = Path(readme)
        body = readme.read_text()
        import os

        # relative to the README's own folder, so the image shows wherever the file sits (docs/results.md too)
        image = Path(card, "results.png") if card is not None else plot_path
        rel = Path(os.path.relpath(image.resolve(), readme.resolve().parent)).as_posix()
        new = (body[: body.index(README_START) + len(README_START)] + "\n" + summary_text(rows, src, headline=True)
               + f"\n\n![quality vs KV budget]({rel})\n" + body[body.index(README_END):])
        atomic_write_bytes(readme, new.encode())
        written.append(readme)
    return written
