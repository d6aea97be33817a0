"""The goal summary's gap intervals: a paired bootstrap over items, checked against exact small cases
and against the normal approximation on many items."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from retention.eval.report import paired_gap_interval, summary_table


def _rows(method: str, budget: str, task: str, scores, length: int = 4096) -> list[dict]:
    return [{"task": task, "length": length, "item": f"{task}-{i}", "method": method, "budget": budget, "score": s,
             "kept_entries": 10, "kv_bytes": (1.0 if budget == "full" else 0.1) * 2**22, "full_cache_bytes": 2**22,
             "metric": "recall", "model": "m"} for i, s in enumerate(scores)]


A, FULL = ("global_gates", "fraction=0.1"), ("full", "full")


def _write_rows(path, rows: list[dict]):
    """A results.jsonl of these rows at ``path``."""
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _blank_card(folder):
    """A one-layer gate checkpoint whose model card the results can be published into."""
    from retention import GateConfig, RetentionGates
    from retention.hub import export_gates

    export_gates(RetentionGates(GateConfig(num_layers=1, num_kv_heads=1, hidden_size=8)), folder, base_model="m")
    return folder


def test_two_items_span_their_two_gaps():
    # with 2 items a resample's mean is d1, d2 (a quarter each) or their mean: the 2.5% / 97.5% points are the two gaps
    rows = _rows(*A, "t", [50.0, 100.0]) + _rows(*FULL, "t", [100.0, 60.0])
    assert paired_gap_interval(rows, A, FULL, ["t"], min_items=2) == pytest.approx((-50.0, 40.0))
    assert paired_gap_interval(rows, A, FULL, ["t"]) is None  # by default 5 items or no interval


def test_interval_matches_the_exact_bootstrap_distribution():
    # 3 items in each of 2 tasks: all 27 x 27 resamples enumerated give the exact percentiles the draws estimate
    d = {"t": [-30.0, 0.0, 10.0], "u": [5.0, 20.0, -40.0]}
    rows = []
    for task, gaps in d.items():
        rows += _rows(*A, task, [50.0 + g for g in gaps]) + _rows(*FULL, task, [50.0] * 3)
    exact = sorted((np.mean(a) + np.mean(b)) / 2 for a in itertools.product(d["t"], repeat=3)
                   for b in itertools.product(d["u"], repeat=3))
    lo, hi = paired_gap_interval(rows, A, FULL, ["t", "u"], draws=200_000, min_items=3)
    assert lo == pytest.approx(np.quantile(exact, 0.025), abs=1.0)
    assert hi == pytest.approx(np.quantile(exact, 0.975), abs=1.0)


def test_many_items_agree_with_the_normal_interval_and_pair_by_item():
    rng = np.random.default_rng(3)
    base = rng.uniform(0, 100, 200)
    gaps = rng.normal(-4.0, 10.0, 200)
    rows = _rows(*A, "t", list(base + gaps)) + _rows(*FULL, "t", list(base))
    lo, hi = paired_gap_interval(rows, A, FULL, ["t"])
    half = 1.96 * gaps.std(ddof=1) / np.sqrt(len(gaps))
    assert lo == pytest.approx(gaps.mean() - half, abs=0.15 * half)
    assert hi == pytest.approx(gaps.mean() + half, abs=0.15 * half)
    # unpaired, the item-to-item spread of the scores (sd ~29) would make it about three times wider
    assert hi - lo < 2.6 * half
    assert paired_gap_interval(rows, A, FULL, ["t"]) == (lo, hi)  # seeded


def test_no_interval_without_enough_paired_items_in_every_task():
    rows = _rows(*A, "t", [50.0, 60.0]) + _rows(*FULL, "t", [70.0, 80.0])
    rows += _rows(*A, "u", [50.0]) + _rows(*FULL, "u", [70.0])
    assert paired_gap_interval(rows, A, FULL, ["t", "u"], min_items=2) is None
    assert paired_gap_interval(rows, A, FULL, ["t"], min_items=2) is not None
    failed = _rows(*A, "t", [50.0, None]) + _rows(*FULL, "t", [70.0, 80.0])  # an errored item is not a pair
    assert paired_gap_interval(failed, A, FULL, ["t"], min_items=2) is None
    assert paired_gap_interval(failed, A, FULL, ["t"], min_items=1) is None  # one pair has no spread


def test_summary_table_shows_the_intervals_and_says_what_they_are():
    rows = _rows(*FULL, "t", [100.0] * 5) + _rows(*A, "t", [100.0, 0.0, 100.0, 100.0, 100.0])
    rows += _rows("streamingllm", "fraction=0.1", "t", [0.0] * 5)
    table = summary_table(rows)
    assert paired_gap_interval(rows, A, FULL, ["t"]) == (-60.0, 0.0)  # 0 to 3 of 5 resampled items are the miss
    assert "| global_gates | 10% | 80.0 | -20.0 [-60.0, +0.0] | +80.0 [+40.0, +100.0] (streamingllm) |" in table
    assert "paired bootstrap over items" in table
    few = _rows(*FULL, "t", [100.0] * 4) + _rows(*A, "t", [100.0, 0.0, 0.0, 0.0])
    assert "[" not in summary_table(few) and "paired bootstrap" not in summary_table(few)


def test_a_card_section_adds_a_result_set_and_keeps_the_main_one(tmp_path):
    from retention.eval.cli import main
    from retention.eval.publish import publish

    sweep = _write_rows(tmp_path / "sweep.jsonl", _rows(*FULL, "t", [90.0]) + _rows(*A, "t", [70.0])
                        + _rows("global_gates", "fraction=0.2", "t", [80.0]))
    goal = _write_rows(tmp_path / "goal.jsonl",
                       _rows(*FULL, "t", [100.0] * 5) + _rows(*A, "t", [100.0, 0.0, 100.0, 100.0, 100.0])
                       + _rows("global_gates", "fraction=0.2", "t", [100.0] * 5))
    card = _blank_card(tmp_path / "card")
    publish(sweep, card)
    plot = (card / "results.png").read_bytes()
    publish(goal, card, card_section="Goal check")
    publish(goal, card, card_section="Goal check")  # published again: replaced, not repeated
    publish(sweep, card, card_section="Fresh items")
    text = (card / "README.md").read_text()
    assert text.count("## Results") == 1 and text.count("### Goal check") == 1
    main_at, goal_at, fresh_at = (text.index("| global_gates | 70.0 (10%"), text.index("### Goal check"),
                                  text.index("### Fresh items"))
    assert main_at < goal_at < fresh_at and "![quality vs KV budget](results.png)" in text[:goal_at]
    assert "| global_gates | 10% | 80.0 | -20.0 [-60.0, +0.0] |" in text[goal_at:fresh_at]
    assert (card / "results.png").read_bytes() == plot  # a section keeps the main plot as it was
    # 5 items a task: the section shows the gaps to the full cache with their intervals, from its own file
    assert ("results-goal-check.png" in text[goal_at:fresh_at]
            and (card / "results-goal-check.png").stat().st_size > 10_000)
    assert "results-fresh-items" not in text and not (card / "results-fresh-items.png").exists()  # 1 item: no plot
    publish(sweep, card, card_section="Renamed", replaces="Goal check")  # replaced by a set without intervals
    assert (not (card / "results-goal-check.png").exists()
            and "results-goal-check" not in (card / "README.md").read_text())
    with pytest.raises(ValueError, match="--card-section"):
        publish(goal, None, card_section="Goal check")
    assert main(["report", str(goal), "--card-section", "Goal check"]) == 2  # no --card: refused
    assert main(["report", str(goal), "--card", str(card), "--card-section", " "]) == 2


def test_a_renamed_card_section_takes_the_place_of_the_one_it_replaces(tmp_path):
    from retention.eval.cli import main
    from retention.eval.publish import publish
    from retention.hub import card_results

    rows = _write_rows(tmp_path / "goal.jsonl", _rows(*FULL, "t", [100.0] * 5) + _rows(*A, "t", [100.0] * 5))
    card = _blank_card(tmp_path / "card")
    for title in ("First", "Pooled over 10 items", "Last"):
        publish(rows, card, card_section=title)
    publish(rows, card, card_section="First")  # the same title again: replaced where it stood
    publish(rows, card, card_section="Pooled over 12 items", replaces="Pooled over 10 items")

    def titles() -> list[str]:
        return [x["title"] for x in card_results(card)[1]]  # as the card shows them

    assert titles() == ["First", "Pooled over 12 items", "Last"]
    text = (card / "README.md").read_text()
    assert ("Pooled over 10 items" not in text
            and text.index("### First") < text.index("### Pooled over 12") < text.index("### Last"))
    # a title the card does not have, or --replaces without a section, is refused before anything is written
    before = (card / "retention.json").read_bytes(), (card / "README.md").read_bytes()
    with pytest.raises(ValueError, match="no such section.*'First', 'Pooled over 12 items', 'Last'"):
        publish(rows, card, card_section="New", replaces="Pooled over 11 items")
    assert main(["report", str(rows), "--card", str(card), "--replaces", "First"]) == 2
    assert main(["report", str(rows), "--card", str(card), "--card-section", "New", "--replaces", "Nope"]) == 2
    assert ((card / "retention.json").read_bytes(), (card / "README.md").read_bytes()) == before


def test_learned_rows_are_known_by_their_policy_not_their_label():
    rows = _rows(*FULL, "t", [100.0] * 5) + _rows(*A, "t", [100.0, 0.0, 100.0, 100.0, 100.0])
    variant = _rows("stage2", "fraction=0.1", "t", [100.0] * 5)
    for r in variant:
        r["policy"] = "global_gates"
    rows += variant + _rows("streamingllm", "fraction=0.1", "t", [0.0] * 5)
    table = summary_table(rows)
    assert "| stage2 | 10% | 100.0 | +0.0 [+0.0, +0.0] | +100.0 [+100.0, +100.0] (streamingllm) |" in table
    assert "(stage2)" not in table  # never the "best training-free" baseline


def _seed_rows(seed: int, methods: dict[str, list[float]]) -> list[dict]:
    rows = []
    for m, scores in methods.items():
        budget = "full" if m == "full" else "fraction=0.1"
        for r in _rows(m, budget, "t", scores):
            rows.append({**r, "item": f"t-{seed}-{r['item']}", "protocol": "query_agnostic", "prefill": "one_shot"})
    return rows


def _two_seed_files(tmp_path):
    """Two results.jsonl files, one seed each: full 100 / gates 80 on seed 0, both 60 on seed 1."""
    return (_write_rows(tmp_path / "a.jsonl", _seed_rows(0, {"full": [100.0] * 5, "global_gates": [80.0] * 5})),
            _write_rows(tmp_path / "b.jsonl", _seed_rows(1, {"full": [60.0] * 5, "global_gates": [60.0] * 5})))


def test_pooled_sets_keep_the_methods_every_set_scored(tmp_path):
    from retention.eval.pool import pool_results, pool_rows

    s0 = _seed_rows(0, {"full": [100.0] * 5, "global_gates": [80.0] * 5, "snapkv": [10.0] * 5})
    s1 = _seed_rows(1, {"full": [60.0] * 5, "global_gates": [60.0] * 5})
    rows, dropped = pool_rows({"s0": s0, "s1": s1})
    assert dropped == ["snapkv: missing from s1"] and len(rows) == 20
    # each method's mean is over the same 10 items: 90 vs 70, and the interval is a real pooled one
    assert "| full cache | 80.0" in summary_table(rows) and "| global_gates | 70.0" in summary_table(rows)
    assert paired_gap_interval(rows, A, FULL, ["t"]) is not None
    assert paired_gap_interval(s0, A, FULL, ["t"]) == pytest.approx((-20.0, -20.0))
    with pytest.raises(ValueError, match="s1 has no rows of \\['snapkv'\\]"):
        pool_rows({"s0": s0, "s1": s1}, methods=["full", "snapkv"])
    with pytest.raises(ValueError, match="both hold t item 't-0-t-0'.*another `seed:`"):
        pool_rows({"s0": s0, "again": s0})
    with pytest.raises(ValueError, match="two or more"):
        pool_rows({"s0": s0})
    with pytest.raises(ValueError, match="nothing to pool"):
        pool_rows({"s0": _seed_rows(0, {"a": [1.0]}), "s1": _seed_rows(1, {"b": [1.0]})})
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for p, rs in ((a, s0), (b, s1)):
        p.write_text("".join(__import__("json").dumps(r) + "\n" for r in rs))
    out, dropped = pool_results([a, b], tmp_path / "pooled" / "results.jsonl", methods=["full", "global_gates"])
    assert dropped == ["snapkv: not in --methods"] and len(out.read_text().splitlines()) == 20
    with pytest.raises(FileNotFoundError, match="results.jsonl of a sweep"):
        pool_results([a, tmp_path / "nope.jsonl"], tmp_path / "x.jsonl")


def test_pool_keeps_only_the_cells_every_file_scored(tmp_path, capsys):
    """A budget (or task) one file lacked was pooled from the other's items alone, against a full cache over
    both: a gap of +10 whose paired interval, over the one file's items, was [-10, -10]."""
    import json

    from retention.eval.cli import main
    from retention.eval.pool import pool_rows
    from retention.eval.report import gap_points

    s0 = _seed_rows(0, {"full": [100.0] * 5, "global_gates": [80.0] * 5})
    s0 += [{**r, "budget": "fraction=0.2"} for r in _seed_rows(0, {"global_gates": [90.0] * 5})]
    s1 = _seed_rows(1, {"full": [60.0] * 5, "global_gates": [60.0] * 5})
    s1 += [{**r, "task": "u"} for r in _seed_rows(1, {"full": [50.0] * 5})]  # a task only s1 ran
    rows, left_out = pool_rows({"s0": s0, "s1": s1})
    assert {(r["method"], r["budget"], r["task"]) for r in rows} == {("full", "full", "t"), (*A, "t")}
    assert left_out == ["full at full on u (4096): missing from s0", "global_gates at 20%: missing from s1"]
    pts = gap_points(rows)["global_gates"]
    assert [(round(kv), gap) for kv, gap, _, _ in pts] == [(10, -10.0)]
    assert all(lo <= gap <= hi for _, gap, lo, hi in pts)  # the point and its interval are over the same items
    with pytest.raises(ValueError, match="no \\(method, budget, task, length\\) is scored in every results file"):
        pool_rows({"s0": [r for r in s0 if r["budget"] == "fraction=0.2"], "s1": s1})
    a, b = _write_rows(tmp_path / "a.jsonl", s0), _write_rows(tmp_path / "b.jsonl", s1)
    assert main(["pool", str(a), str(b), "--out", str(tmp_path / "p.jsonl")]) == 0
    err = capsys.readouterr().err
    assert "left out of the pool" in err and f"global_gates at 20%: missing from {b}" in err
    assert len(json.loads("[" + ",".join((tmp_path / "p.jsonl").read_text().splitlines()) + "]")) == 20


def test_pair_with_the_full_cache_first_is_the_mirror_of_full_second():
    """`--pair full,X` said "(no budget that both methods of a pair ran)": only A's budgets were tried."""
    from retention.eval.report import pair_table

    rows = _rows(*FULL, "t", [100.0] * 5) + _rows(*A, "t", [100.0, 0.0, 100.0, 100.0, 100.0])
    rows += _rows("global_gates", "fraction=0.2", "t", [100.0] * 5)
    table = pair_table(rows, [("full", "global_gates"), ("global_gates", "full")])
    assert "(no budget" not in table
    assert "| full - global_gates | 10% | +20.0 [+0.0, +60.0] | +20.0 |" in table
    assert "| full - global_gates | 20% | +0.0 [+0.0, +0.0] | +0.0 |" in table
    assert "| global_gates - full | 10% | -20.0 [-60.0, +0.0] | -20.0 |" in table


def test_report_refuses_its_publish_options_before_writing_anything(tmp_path, capsys):
    """`report` wrote report.md and the plots, then refused --card-section without --card and the like."""
    from retention.eval.cli import main

    rows = _write_rows(tmp_path / "goal.jsonl", _rows(*FULL, "t", [100.0] * 5) + _rows(*A, "t", [80.0] * 5))
    (tmp_path / "not-a-card").mkdir()
    readme = tmp_path / "README.md"
    readme.write_text("# no markers here\n")
    card = _blank_card(tmp_path / "card")
    other = _write_rows(tmp_path / "other.jsonl", [{**r, "gates_id": "0123abcd"} if r["method"] != "full" else r
                                                   for r in _rows(*FULL, "t", [1.0]) + _rows(*A, "t", [1.0])])
    out = tmp_path / "out"
    for argv, words in (([str(rows), "--card-section", "Goal"], "give it with --card"),
                        ([str(rows), "--replaces", "Goal"], "give --card-section too"),
                        ([str(rows), "--card", str(tmp_path / "not-a-card")], "is not a gate checkpoint"),
                        ([str(rows), "--readme", str(readme)], "has no <!-- results:start -->"),
                        ([str(other), "--card", str(card)], "no row was scored by its gates")):
        assert main(["report", *argv, "--out", str(out)]) == 2
        assert words in capsys.readouterr().err
        assert not out.exists() and not (tmp_path / "report.md").exists() and not list(tmp_path.glob("*.png"))
    s0, s1 = _write_rows(tmp_path / "s0.jsonl", _seed_rows(0, {"full": [1.0]})), tmp_path / "s1.jsonl"
    _write_rows(s1, _seed_rows(1, {"full": [1.0]}))
    assert main(["pool", str(s0), str(s1), "--out", str(out / "p.jsonl"), "--card-section", "Goal"]) == 2
    assert "give it with --card" in capsys.readouterr().err and not out.exists()


def test_pool_out_folder_empty_methods_and_empty_report(tmp_path, capsys):
    """`--out DIR/` wrote a file named DIR; `--methods ""` pooled every method; an empty file's report had no
    "error:"."""
    from retention.eval.cli import main

    a = _write_rows(tmp_path / "a.jsonl", _seed_rows(0, {"full": [100.0] * 5, "global_gates": [80.0] * 5}))
    b = _write_rows(tmp_path / "b.jsonl", _seed_rows(1, {"full": [60.0] * 5, "global_gates": [60.0] * 5}))
    assert main(["pool", str(a), str(b), "--out", str(tmp_path / "new") + "/"]) == 0
    assert (tmp_path / "new" / "results.jsonl").is_file() and f"pooled: {tmp_path / 'new' / 'results.jsonl'}" in (
        capsys.readouterr().out)
    (tmp_path / "there").mkdir()
    assert main(["pool", str(a), str(b), "--out", str(tmp_path / "there")]) == 0
    assert (tmp_path / "there" / "results.jsonl").is_file()
    assert main(["report", str(tmp_path / "there")]) == 0  # the folder reads back as a sweep's
    capsys.readouterr()
    for empty in ("", " , "):
        assert main(["pool", str(a), str(b), "--out", str(tmp_path / "m.jsonl"), "--methods", empty]) == 2
        assert "error: --methods names no method" in capsys.readouterr().err and not (tmp_path / "m.jsonl").exists()
    (tmp_path / "empty.jsonl").write_text("")
    assert main(["report", str(tmp_path / "empty.jsonl")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'empty.jsonl'} holds no results")


def test_pool_refuses_a_card_of_other_gates_before_writing_the_pool(tmp_path, capsys):
    """The card's gates were checked only by publish, after the pooled file had been written."""
    import shutil

    from retention.eval.cli import main
    from retention.models import shipped_checkpoint

    a = _write_rows(tmp_path / "a.jsonl", [{**r, "gates_id": "0123456789ab"} for r in
                                            _seed_rows(0, {"full": [100.0] * 5, "global_gates": [80.0] * 5})])
    b = _write_rows(tmp_path / "b.jsonl", [{**r, "gates_id": "0123456789ab"} for r in
                                            _seed_rows(1, {"full": [60.0] * 5, "global_gates": [60.0] * 5})])
    card = tmp_path / "card"
    shutil.copytree(shipped_checkpoint("smollm2-135m-trimkv"), card)
    assert main(["pool", str(a), str(b), "--out", str(tmp_path / "p.jsonl"), "--card", str(card)]) == 2
    assert "no row was scored by its gates" in capsys.readouterr().err and not (tmp_path / "p.jsonl").exists()


def test_pool_command_publishes_a_summary(tmp_path, capsys):
    from retention.eval.cli import main

    a, b = _two_seed_files(tmp_path)
    page = tmp_path / "pooled.md"
    assert main(["pool", str(a), str(b), "--out", str(tmp_path / "p.jsonl"), "--summary", str(page),
                 "--title", "All"]) == 0
    assert page.read_text().startswith("# All") and "| global_gates | 10% | 70.0 | -10.0 [" in page.read_text()
    # the page says it was pooled, and from which files (not "Produced by `python -m retention.eval run`")
    assert (f"Pooled by `python -m retention.eval pool` ({tmp_path / 'p.jsonl'}) "
            f"from the `python -m retention.eval run` results {a}, {b}." in page.read_text())
    assert "Produced by" not in page.read_text()
    assert main(["pool", str(a), str(a), "--out", str(tmp_path / "q.jsonl")]) == 2
    assert "another `seed:`" in capsys.readouterr().err and not (tmp_path / "q.jsonl").exists()
    # an input is never replaced by the pool, as --out or as the --summary page's copy of the rows
    before = a.read_text(), b.read_text()
    assert main(["pool", str(a), str(b), "--out", str(a)]) == 2
    assert "is one of the files to pool" in capsys.readouterr().err
    assert main(["pool", str(a), str(b), "--out", str(tmp_path / "r.jsonl"), "--summary", str(tmp_path / "b.md")]) == 2
    assert "one of the files to pool: name the page otherwise" in capsys.readouterr().err
    assert (a.read_text(), b.read_text()) == before and not (tmp_path / "r.jsonl").exists()
    # a sweep's output folder names its results.jsonl, for pool and report alike (was "not found")
    for name, src in (("sweep_a", a), ("sweep_b", b)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.jsonl").write_text(src.read_text())
    capsys.readouterr()
    assert main(["pool", str(tmp_path / "sweep_a"), str(tmp_path / "sweep_b"), "--out", str(tmp_path / "s.jsonl")]) == 0
    from retention.eval.runner import read_results

    scores = lambda f: [(r["item"], r["method"], r["score"]) for r in read_results(tmp_path / f)]
    assert scores("s.jsonl") == scores("p.jsonl")
    assert {r["pooled_from"] for r in read_results(tmp_path / "s.jsonl")} == {
        str(tmp_path / n / "results.jsonl") for n in ("sweep_a", "sweep_b")}
    assert main(["report", str(tmp_path / "sweep_a")]) == 0 and (tmp_path / "sweep_a" / "report.md").is_file()
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2
    assert "empty is a folder without a results.jsonl" in capsys.readouterr().err


def test_pair_table_gives_the_paired_gap_between_two_learned_methods():
    from retention.eval.report import pair_table, parse_pairs

    B = ("gates_old", "fraction=0.1")
    # per task: new - old = +10 on every item of t, 0 on u; the full cache is far above both
    rows = _rows(*A, "t", [60.0, 70.0, 80.0, 90.0, 100.0]) + _rows(*B, "t", [50.0, 60.0, 70.0, 80.0, 90.0])
    rows += _rows(*A, "u", [0.0, 100.0, 0.0, 100.0, 0.0]) + _rows(*B, "u", [0.0, 100.0, 0.0, 100.0, 0.0])
    rows += _rows(*FULL, "t", [100.0] * 5) + _rows(*FULL, "u", [100.0] * 5)
    table = pair_table(rows, parse_pairs(["global_gates,gates_old", "gates_old,full"]))
    assert "| A - B | budget | gap | t | u |" in table
    # every paired difference is +10 on t and 0 on u, so every resample gives +5: a zero-width interval
    assert paired_gap_interval(rows, A, B, ["t", "u"]) == pytest.approx((5.0, 5.0))
    assert "| global_gates - gates_old | 10% | +5.0 [+5.0, +5.0] | +10.0 | +0.0 |" in table
    lo, hi = paired_gap_interval(rows, B, FULL, ["t", "u"])
    assert f"| gates_old - full | 10% | -45.0 [{lo:+.1f}, {hi:+.1f}] | -30.0 | -60.0 |" in table
    with pytest.raises(ValueError, match="no method labelled 'nope'; the methods are full, gates_old, global_gates"):
        pair_table(rows, [("nope", "full")])
    for bad in ("a", "a,b,c", "a,a", ",b"):
        with pytest.raises(ValueError, match="two different method labels as A,B"):
            parse_pairs([bad])


def test_pair_option_checks_labels_before_the_work_and_puts_the_gaps_on_the_page(tmp_path, capsys):
    from retention.eval.cli import main

    a, b = _two_seed_files(tmp_path)
    page = tmp_path / "pooled.md"
    assert main(["pool", str(a), str(b), "--out", str(tmp_path / "p.jsonl"), "--summary", str(page),
                 "--pair", "global_gates,full"]) == 0
    assert "| global_gates - full | 10% | -10.0 [" in page.read_text()
    assert "| global_gates - full | 10% | -10.0 [" in capsys.readouterr().out
    # a label that is not there: refused before pooling (with --methods) or before the sweep runs
    assert main(["pool", str(a), str(b), "--out", str(tmp_path / "q.jsonl"), "--methods", "full,global_gates",
                 "--pair", "gates,full"]) == 2
    assert "no method labelled 'gates'" in capsys.readouterr().err and not (tmp_path / "q.jsonl").exists()
    assert main(["run", "--config", "tiny.yaml", "--output", str(tmp_path / "sweep"),
                 "--pair", "snapkv_window8,gates"]) == 2
    assert "no method labelled 'gates'; the methods are full, snapkv_window8, streamingllm" in capsys.readouterr().err
    assert not (tmp_path / "sweep").exists()
    assert main(["report", str(a), "--pair", "global_gates"]) == 2
    assert "two different method labels" in capsys.readouterr().err


def test_an_oracle_is_never_the_best_training_free_baseline():
    # the oracle reads the continuation: the learned method's "vs best training-free" must name the real baseline
    rows = _rows(*A, "t", [80.0] * 5) + _rows(*FULL, "t", [100.0] * 5)
    rows += _rows("snapkv", "fraction=0.1", "t", [60.0] * 5)
    rows += [{**r, "policy": "oracle"} for r in _rows("oracle_head", "fraction=0.1", "t", [95.0] * 5)]
    table = summary_table(rows)
    assert "| global_gates | 10% | 80.0 | -20.0 [-20.0, -20.0] | +20.0 [+20.0, +20.0] (snapkv) |" in table
    assert "| oracle_head | 95.0" in table and "oracle_head: references" in table


def test_a_run_seeded_with_pooled_rows_says_it_was_run_not_pooled(tmp_path):
    from retention.eval.publish import summary_text

    pooled = [{**r, "pooled_from": "runs/a/results.jsonl"} for r in _rows(*FULL, "t", [100.0] * 5)]
    text = summary_text(pooled + _rows(*A, "t", [80.0] * 5), tmp_path / "r.jsonl")
    assert "Pooled by" not in text
    assert (f"Produced by `python -m retention.eval run` ({tmp_path / 'r.jsonl'}); 5 of its 10 rows were copied in "
            "from runs pooled earlier (runs/a/results.jsonl)") in text


def test_gap_points_and_plot_pair_every_method_with_the_full_cache(tmp_path):
    from retention.eval.publish import write_summary
    from retention.eval.report import gap_plot, gap_points

    g = np.random.default_rng(3)
    full_t, full_u = g.integers(0, 101, 6).astype(float), g.integers(0, 101, 6).astype(float)
    rows = _rows(*FULL, "t", full_t) + _rows(*FULL, "u", full_u)
    for method, budget, shift in [("global_gates", "fraction=0.1", -4.0), ("global_gates", "fraction=0.2", -1.0),
                                  ("snapkv", "fraction=0.1", -30.0), ("oracle", "fraction=0.1", 0.0)]:
        rows += (_rows(method, budget, "t", full_t + shift + g.normal(0, 3, 6))
                 + _rows(method, budget, "u", full_u + shift))
    for r in rows:
        r["kv_bytes"] *= 2 if r["budget"] == "fraction=0.2" else 1
    pts = gap_points(rows)
    assert set(pts) == {"global_gates", "snapkv"}  # the full cache is the zero line; an oracle is no method
    assert [round(p[0]) for p in pts["global_gates"]] == [10, 20]  # the KV kept, in order
    for (m, b), (kv, gap, lo, hi) in zip([("global_gates", "fraction=0.1"), ("global_gates", "fraction=0.2")],
                                        pts["global_gates"]):
        mine = [r["score"] for r in rows if r["method"] == m and r["budget"] == b]
        want = (np.mean(mine[:6]) + np.mean(mine[6:])) / 2 - (full_t.mean() + full_u.mean()) / 2
        assert gap == pytest.approx(want)
        assert (lo, hi) == pytest.approx(paired_gap_interval(rows, (m, b), FULL, ["t", "u"])) and lo < gap < hi
    assert (gap_plot(rows, tmp_path / "gaps.png") == tmp_path / "gaps.png"
            and (tmp_path / "gaps.png").stat().st_size > 10_000)
    few = [r for r in rows if int(r["item"].split("-")[1]) < 2]  # 2 items a task: no intervals, no plot
    assert all(lo == gap == hi for p in gap_points(few).values() for _, gap, lo, hi in p)
    assert gap_plot(few, tmp_path / "few.png") is None and not (tmp_path / "few.png").exists()
    assert gap_points([r for r in rows if r["method"] != "full"]) == {}
    one_budget = [r for r in rows if r["budget"] != "fraction=0.2"]  # a curve needs two budgets
    assert gap_points(one_budget)["global_gates"] and gap_plot(one_budget, tmp_path / "one.png") is None
    page = tmp_path / "page.md"
    written = write_summary(_write_rows(tmp_path / "results.jsonl", rows), page)
    assert page.with_suffix(".png") in written and "](page.png)" in page.read_text()
    from retention.eval.report import write_report

    assert "](gaps.png)" in write_report(tmp_path / "results.jsonl", tmp_path / "report").read_text()
    assert (tmp_path / "report" / "gaps.png").is_file()


def test_a_card_only_takes_rows_its_own_gates_scored(tmp_path):
    """`--card DIR` put any sweep's numbers into DIR's model card; now some row must carry DIR's gates_id."""
    from retention.eval.publish import publish
    from retention import GateConfig, RetentionGates

    card = _blank_card(tmp_path / "card")
    own = RetentionGates.from_pretrained(card).fingerprint()
    other = RetentionGates(GateConfig(num_layers=1, num_kv_heads=1, hidden_size=8, bias_init=1.0)).fingerprint()
    assert own != other

    def rows_with(gates_id):
        rows = _rows(*A, "t", [60.0, 70.0]) + _rows(*FULL, "t", [100.0, 90.0])
        return [{**r, "gates_id": gates_id} if r["method"] != "full" and gates_id else r for r in rows]

    before = (card / "README.md").read_text()
    with pytest.raises(ValueError,
                       match=f"no row was scored by its gates \\(fingerprint {own}; the rows' gates are {other}\\)"):
        publish(_write_rows(tmp_path / "other.jsonl", rows_with(other)), card)
    assert (card / "README.md").read_text() == before
    publish(_write_rows(tmp_path / "own.jsonl", rows_with(own)), card)
    publish(_write_rows(tmp_path / "old.jsonl", rows_with(None)), card)  # rows from before gates_id: cannot be checked


def test_report_and_pool_name_a_file_that_is_not_a_sweeps_rows(tmp_path, capsys):
    """A stray JSON lines file was a KeyError traceback, and a missing one "no results"."""
    import json

    from retention.eval.cli import main

    good = tmp_path / "good.jsonl"
    row = {"task": "niah_single", "length": 128, "item": "i0", "method": "full", "budget": "full", "score": 1.0}
    good.write_text(json.dumps(row) + "\n" + json.dumps({**row, "item": "i1"}) + "\n" + '{"task": "niah_si')  # torn
    junk = tmp_path / "junk.jsonl"
    junk.write_text(json.dumps(row) + "\n" + json.dumps({"a": 1}) + "\n")
    # a file of one line that is not JSON read as "no results" (its line taken for a torn one)
    text = tmp_path / "notes.txt"
    text.write_text("these are my notes\n")
    cut = tmp_path / "cut.jsonl"  # complete lines end with a newline, so a whole last line that is not JSON is no tear
    cut.write_text(json.dumps(row) + "\n" + '{"task": "niah_si\n')
    for argv, words in ((["report", str(tmp_path / "missing.jsonl")], "missing.jsonl not found"),
                        (["report", str(junk)],
                         "junk.jsonl, line 2: a row without task, length, item, method, budget, score"),
                        (["report", str(text)], "notes.txt, line 1: not JSON"),
                        (["report", str(cut)], "cut.jsonl, line 2: not JSON"),
                        (["pool", str(junk), str(good), "--out", str(tmp_path / "p.jsonl")], "junk.jsonl, line 2"),
                        (["pool", str(tmp_path / "missing.jsonl"), str(good), "--out", str(tmp_path / "p.jsonl")],
                         "missing.jsonl not found")):
        assert main(argv) == 2
        assert words in capsys.readouterr().err
    assert not (tmp_path / "p.jsonl").exists()
    from retention.eval.runner import load_result_file

    assert [r["item"] for r in load_result_file(good)] == ["i0", "i1"]  # a torn last line is left out


def test_eval_without_a_subcommand_names_the_subcommands(capsys):
    """It said "the following arguments are required: eval_command", the parser's internal name."""
    from retention.eval.cli import main

    with pytest.raises(SystemExit) as stop:
        main([])
    assert stop.value.code == 2 and "arguments are required: {run,report,pool,rescore,list}" in capsys.readouterr().err


def test_gap_weighs_a_tasks_lengths_equally_and_pairs_items_whatever_the_row_order():
    """The interval averages as the summary does: items within a (task, length), then lengths, then tasks; an
    item-weighted mean (5 items gap 10 at 1024, 10 items gap 30 at 4096) would give 23.3, not 20. Items pair by
    id within their (task, length), not by row order: the full cache's rows are shuffled."""
    import random

    rows = []
    for length, n, gap in ((1024, 5, 10.0), (4096, 10, 30.0)):
        base = [float(7 * i % 60) for i in range(n)]  # items differ far more than the gap
        rows += _rows(A[0], A[1], "t", [b + gap for b in base], length) + _rows(*FULL, "t", base, length)
    full_rows = [r for r in rows if r["budget"] == "full"]
    random.Random(0).shuffle(full_rows)
    rows = [r for r in rows if r["budget"] != "full"] + full_rows
    assert paired_gap_interval(rows, A, FULL, ["t"]) == pytest.approx((20.0, 20.0))
    assert "+20.0 [+20.0, +20.0]" in summary_table(rows)


@pytest.mark.parametrize("field, values", [("protocol", ("query_agnostic", "query_aware")), ("model", ("m", "m2")),
                                           ("gates_id", ("0123456789ab", "ba9876543210")),
                                           ("max_new_tokens", (24, 64)), ("prefill", ("one_shot", "streaming")),
                                           ("params", ({"sink": 4}, {"sink": 0}))])
def test_pool_refuses_sets_scored_with_another_setup(field, values):
    """Sets of a method scored under another protocol, model, gates or decoding were pooled into one mean, while a
    resumed sweep sets such rows aside so that one table never mixes two setups. A value a set's rows do not record
    (rows from before it was) cannot be checked and passes."""
    from retention.eval.pool import pool_rows

    s0 = [{**r, field: values[0]} for r in _seed_rows(0, {"full": [100.0] * 5, "global_gates": [80.0] * 5})]
    s1 = [{**r, field: values[1]} if r["method"] == "global_gates" else {**r, field: values[0]}
          for r in _seed_rows(1, {"full": [60.0] * 5, "global_gates": [60.0] * 5})]
    with pytest.raises(ValueError, match=f"s1 scored global_gates with {field} {values[1]!r}, s0 with {values[0]!r}"):
        pool_rows({"s0": s0, "s1": s1})
    unrecorded = [{k: v for k, v in r.items() if k != field} for r in s1]
    rows, _ = pool_rows({"s0": s0, "s1": unrecorded})
    assert len(rows) == 20
    # a method the pool leaves out is not checked
    rows, left_out = pool_rows({"s0": s0, "s1": s1}, methods=["full"])
    assert len(rows) == 10 and left_out == ["global_gates: not in --methods"]


def test_the_pair_tables_task_columns_are_over_the_items_both_scored():
    """A run still going: B has scored 8 items of each task, A only the first 6. The gap was paired but its task
    columns were differences of each method's whole mean (+8.3 and -37.5 here, beside a paired gap of -16.7)."""
    from retention.eval.report import pair_table, paired_task_gaps

    b = ("other", "fraction=0.1")
    rows = (_rows(*A, "t1", [100.0] * 5 + [0.0]) + _rows(*b, "t1", [100.0] * 6 + [0.0, 0.0])
            + _rows(*A, "t2", [0.0] * 6) + _rows(*b, "t2", [0.0] * 5 + [100.0, 100.0, 100.0]))
    assert paired_task_gaps(rows, A, b, ["t1", "t2"]) == pytest.approx({"t1": -100 / 6, "t2": -100 / 6})
    row = next(line for line in pair_table(rows, [("global_gates", "other")]).splitlines()
               if line.startswith("| global_gates - other"))
    assert row.startswith("| global_gates - other | 10% | -16.7 [") and row.endswith("| -16.7 | -16.7 |"), row


def test_a_failed_row_leaves_the_gap_and_its_interval_over_the_same_items():
    """A failed row (score None) dropped out of its method's mean but not out of the other's, while the interval
    pairs items both scored: the page read +16.7 [+0.0, +0.0], a point outside its own interval. The point is now
    over the paired items too, in the summary, the pair table and the gap plot's points."""
    from retention.eval.report import gap_points, pair_table, paired_gap

    rows = _rows(*A, "t", [100.0, 100.0, 100.0, 100.0, None, 100.0]) + _rows(*FULL, "t", [100.0] * 4 + [0.0, 100.0])
    assert paired_gap(rows, A, FULL, ["t"]) == 0.0 and paired_gap_interval(rows, A, FULL, ["t"]) == (0.0, 0.0)
    assert "+0.0 [+0.0, +0.0]" in summary_table(rows) and "+16.7" not in summary_table(rows)
    assert "| global_gates - full | 10% | +0.0 [+0.0, +0.0] | +0.0 |" in pair_table(rows, [("global_gates", "full")])
    assert gap_points(rows)["global_gates"][0][1:] == (0.0, 0.0, 0.0)
    # with every item scored by both, the point is the difference of the means, as before
    whole = _rows(*A, "t", [90.0, 80.0, 100.0, 70.0, 60.0]) + _rows(*FULL, "t", [100.0, 100.0, 90.0, 100.0, 80.0])
    assert paired_gap(whole, A, FULL, ["t"]) == pytest.approx(-14.0) and "-14.0 [" in summary_table(whole)


def test_publishing_into_a_checkpoint_from_before_retention_json_keeps_its_results_and_converts_it(tmp_path):
    """A card whose metadata and results are still in config.json: a new section lands after its sections, and the
    checkpoint comes out with retention.json (metadata only) and every result in README.md."""
    import json

    from retention.eval.publish import publish
    from retention.hub import card_results, model_card

    rows = _write_rows(tmp_path / "goal.jsonl", _rows(*FULL, "t", [100.0] * 5) + _rows(*A, "t", [100.0] * 5))
    card = _blank_card(tmp_path / "card")
    meta = json.loads((card / "retention.json").read_text())
    (card / "retention.json").unlink()
    old = {**meta, "results_markdown": "| old | main |", "results_sections": [{"title": "Old", "markdown": "| o |"}]}
    (card / "config.json").write_text(json.dumps(old))
    (card / "README.md").write_text(model_card(old))
    publish(rows, card, card_section="New")
    assert sorted(p.name for p in card.iterdir() if p.suffix != ".png") == ["README.md", "gates.safetensors",
                                                                          "retention.json"]
    assert json.loads((card / "retention.json").read_text()) == meta  # no tables in it
    main, sections = card_results(card)
    assert main == "| old | main |" and [s["title"] for s in sections] == ["Old", "New"]
    text = (card / "README.md").read_text()
    assert text.index("| old | main |") < text.index("### Old") < text.index("### New")


def test_held_out_and_in_distribution_families_are_summarised_side_by_side_never_averaged(tmp_path):
    from retention.eval.publish import summary_text
    from retention.eval.report import families, family_summaries

    rows = _rows(*FULL, "prose_facts", [100.0] * 5) + _rows(*A, "prose_facts", [20.0] * 5)
    rows += _rows(*FULL, "niah_single", [100.0] * 5) + _rows(*A, "niah_single", [100.0] * 5)
    (held_title, held), (in_title, in_dist) = families(rows)
    assert held_title.startswith("Held-out") and {r["task"] for r in held} == {"prose_facts"}
    assert in_title.startswith("In-distribution") and {r["task"] for r in in_dist} == {"niah_single"}
    text = family_summaries(rows)
    assert text.index("Held-out") < text.index("In-distribution")
    assert "| global_gates | 10% | 20.0 |" in text and "| global_gates | 10% | 100.0 |" in text
    assert "60.0" not in text  # the mean over both families is nowhere
    assert families(held) == [(None, held)] and "Held-out" not in family_summaries(held)
    from retention.eval.report import family_pair_tables

    gaps = family_pair_tables(rows, [("global_gates", "full")])  # what `run --pair` and `report --pair` print
    assert gaps.index("Held-out") < gaps.index("-80.0") < gaps.index("In-distribution") < gaps.index("+0.0")
    assert "-40.0" not in gaps  # nor the gap averaged over both
    for r in rows:
        r["protocol"] = "compress_once"
    shown = summary_text(rows, tmp_path / "results.jsonl")
    assert "protocol compress_once (the context compressed once" in shown and "query_agnostic" not in shown


def test_the_readme_gets_both_families_in_one_table_with_each_familys_best_training_free(tmp_path):
    """headline_table: a row per method, held-out and in-distribution columns side by side at every budget, the
    baselines ordered by their held-out score; the gaps pair each family with its own best training-free method,
    which differs here (StreamingLLM held out, SnapKV in distribution). A README gets it; a card keeps its tables."""
    from retention.eval.publish import publish
    from retention.eval.report import headline_table

    quarter = "fraction=0.25"
    rows = _rows(*FULL, "prose_facts", [100.0] * 5) + _rows(*FULL, "niah_single", [80.0] * 5)
    for budget, held, in_dist in ((A[1], 60.0, 80.0), (quarter, 90.0, 80.0)):
        rows += _rows("global_gates", budget, "prose_facts", [held] * 5)
        rows += _rows("global_gates", budget, "niah_single", [in_dist] * 5)
    rows += _rows("snapkv", A[1], "prose_facts", [0.0] * 5) + _rows("snapkv", A[1], "niah_single", [40.0] * 5)
    rows += _rows("streamingllm", A[1], "prose_facts", [20.0] * 5) + _rows("streamingllm", A[1], "niah_single",
                                                                           [0.0] * 5)
    for r in rows:
        r["policy"] = r["method"]
    table = headline_table(rows)
    assert "| method | held-out 10% | held-out 25% | in-distribution 10% | in-distribution 25% |" in table
    assert "| full cache (4.0 MiB) | 100.0 | 100.0 | 80.0 | 80.0 |" in table
    assert "| **global_gates** | 60.0 | 90.0 | 80.0 | 80.0 |" in table
    assert table.index("| streamingllm | 20.0 | - | 0.0 | - |") < table.index("| snapkv | 0.0 | - | 40.0 | - |")
    assert "| KV kept | 410 KiB | 410 KiB | 410 KiB | 410 KiB |" in table
    assert ("| global_gates | 10% | -40.0 [-40.0, -40.0] | +40.0 [+40.0, +40.0] (streamingllm) | +0.0 [+0.0, +0.0] "
            "| +40.0 [+40.0, +40.0] (snapkv) |") in table
    assert "| global_gates | 25% | -10.0 [-10.0, -10.0] |  | +0.0 [+0.0, +0.0] |  |" in table
    assert "50.0" not in table  # no mean over both families

    results = _write_rows(tmp_path / "results.jsonl", rows)
    readme = tmp_path / "README.md"
    readme.write_text("# x\n<!-- results:start -->\nold\n<!-- results:end -->\n")
    card = _blank_card(tmp_path / "card")
    publish(results, card, readme)
    body, card_text = readme.read_text(), (card / "README.md").read_text()
    assert "| **global_gates** | 60.0 | 90.0 | 80.0 | 80.0 |" in body and "Held-out families (" not in body
    assert "![quality vs KV budget](card/results.png)" in body  # relative to the README's folder
    assert "**Held-out families (" in card_text and "| global_gates | 10% | 60.0 |" in card_text


def test_a_cell_scored_on_some_tasks_only_is_left_out_not_shrinking_the_table():
    """A staged sweep's 25% cell with one of two tasks: left out with a note (no column while no cell of it is
    whole); the 10% means stay over both tasks."""
    rows = _rows(*FULL, "a", [100.0] * 5) + _rows(*FULL, "b", [50.0] * 5)
    rows += _rows("snapkv", "fraction=0.1", "a", [40.0] * 5) + _rows("snapkv", "fraction=0.1", "b", [20.0] * 5)
    rows += _rows("snapkv", "fraction=0.25", "a", [90.0] * 5)
    table = summary_table(rows)
    assert "Mean score over 2 tasks (a, b)" in table and "| full cache | 75.0" in table
    assert "| method | 10% |" in table and "| snapkv | 30.0 (10%, 410 KiB) |" in table
    assert "Not yet scored on every task, so shown as -: 1 cell (snapkv 25%)" in table
    assert "Not yet scored" not in summary_table(rows[:-5])
