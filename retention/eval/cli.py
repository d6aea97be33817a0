"""``python -m retention.eval run --config ...`` / ``report RESULTS`` / ``pool A B ... --out P`` /
``rescore RESULTS --config ...`` / ``list`` (also ``retention eval ...``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _names(text: str | None) -> list[str] | None:
    """A comma-separated option (``--tasks``, ``--budgets``, ``--methods``) as its names; ``None`` when not given. An
    empty value is an empty list (no name), not "no filter": each command refuses it, naming what it holds."""
    return None if text is None else [x.strip() for x in text.split(",") if x.strip()]


def _run(args: argparse.Namespace) -> int:
    from .config import EvalConfigError, load_eval_config, restrict
    from .report import overview, write_report
    from .runner import read_results, run_sweep

    overrides = {k: v for k, v in (("output", args.output), ("seed", args.seed), ("protocol", args.protocol))
                 if v is not None}
    try:
        whole = load_eval_config(args.config, **overrides)  # its methods are the ones published
        cfg = restrict(whole, *(_names(v) for v in (args.tasks, args.budgets, args.methods)))
    except EvalConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    from .publish import check_publish_targets, check_sweep_scores_card
    from .report import check_pairs, parse_pairs

    try:  # before the sweep: a typo here should not cost an hour of evaluation
        check_publish_targets(args.card, args.readme, args.summary, args.card_section, args.replaces)
        check_pairs(parse_pairs(args.pair), {m.label for m in cfg.method_list()})
        if args.card:
            check_sweep_scores_card(cfg, args.card)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        results = run_sweep(cfg, progress=not args.quiet)
    except KeyboardInterrupt:  # every finished row is on disk: the same command resumes after them
        done = len(read_results(Path(cfg.output) / "results.jsonl"))
        print(f"\ninterrupted: {done} rows are in {Path(cfg.output) / 'results.jsonl'}; run the same command to go on "
              "from there", file=sys.stderr)
        return 130
    from .publish import shown_rows

    # the config's methods only: its output folder may hold rows of another config that shares it
    rows = read_results(results)
    held = {r["method"] for r in rows}  # a staged run (--methods) has rows of some methods only
    own = [m.label for m in whole.method_list() if m.label in held]
    print(overview(shown_rows(rows, own)))
    print(f"\nresults: {results}\nreport (per task, length, method and budget; plots): {write_report(results)}")
    return _publish(args, results, own)


def _publish(args: argparse.Namespace, results, methods: list[str] | None = None) -> int:
    """``--pair``: print the paired gaps; ``--card`` / ``--readme`` / ``--summary``: the summary (with
    those gaps) into a checkpoint's model card, a README and a stand-alone results page."""
    from .publish import check_publish_targets, publish, shown_rows, write_summary
    from .report import family_pair_tables, parse_pairs
    from .runner import read_results

    try:
        check_publish_targets(args.card, args.readme, args.summary, args.card_section, args.replaces)
        pairs = parse_pairs(args.pair)
        if pairs:
            print("\n" + family_pair_tables(shown_rows(read_results(results), methods), pairs))
        if not (args.card or args.readme or args.summary or args.card_section):
            return 0
        written = (publish(results, args.card, args.readme, args.card_section, pairs, args.replaces, methods)
                   if (args.card or args.readme or args.card_section) else [])
        if args.summary:
            written += write_summary(results, args.summary, args.title, pairs, methods)
        for path in written:
            print(f"published: {path}")
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _report(args: argparse.Namespace) -> int:
    from .publish import check_publish_targets, check_rows_scored_by_card, shown_rows
    from .report import check_pairs, overview, parse_pairs, write_report
    from .runner import load_result_file, results_file

    args.results = str(results_file(args.results))  # a sweep's output folder names its results.jsonl
    try:
        rows = load_result_file(args.results)
        if not rows:
            raise ValueError(f"{args.results} holds no results")
        # --methods "" is a list of no method, not "no filter"
        methods = _names(args.methods)
        if methods is not None and not methods:
            raise ValueError("--methods names no method: give labels (A,B) or leave it out to show every one")
        rows = shown_rows(rows, methods)
        # before report.md and the plots: a refused --card or --readme should leave nothing half done
        check_publish_targets(args.card, args.readme, args.summary, args.card_section, args.replaces)
        check_pairs(parse_pairs(args.pair), {r["method"] for r in rows})
        if args.card:
            check_rows_scored_by_card(rows, args.card)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    path = write_report(args.results, args.out)
    print(overview(rows))
    print(f"\nreport (per task, length, method and budget; plots): {path}")
    return _publish(args, args.results, methods)


def _pool(args: argparse.Namespace) -> int:
    from .pool import pool_results
    from .publish import check_publish_targets, check_rows_scored_by_card
    from .report import check_pairs, overview, parse_pairs
    from .runner import read_results, results_file

    args.results = [str(results_file(p)) for p in args.results]
    # --methods "" is a list of no method, not "no filter": pool_rows refuses it
    methods = _names(args.methods)
    try:
        check_publish_targets(args.card, args.readme, args.summary, args.card_section, args.replaces)
        inputs = {Path(p).resolve() for p in args.results}
        if args.summary and Path(args.summary).with_suffix(".jsonl").resolve() in inputs:
            raise ValueError(f"--summary {args.summary} copies the pooled rows to "
                             f"{Path(args.summary).with_suffix('.jsonl')}, one of the files to pool: name the page "
                             "otherwise")
        pairs = parse_pairs(args.pair)
        if methods:  # before pooling: a pair must be among the kept methods
            check_pairs(pairs, set(methods))
        # a --card whose gates scored none of the rows is refused before the pooled file is written
        card_check = (lambda rows: check_rows_scored_by_card(rows, args.card)) if args.card else None
        out, left_out = pool_results(args.results, args.out, methods, check=card_check)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if left_out:  # so a summary is never read as covering what some file lacked
        print("left out of the pool (a cell some file lacks would average other items than the cells beside it):"
              "\n  " + "\n  ".join(left_out), file=sys.stderr)
    print(overview(read_results(out)))
    print(f"\npooled: {out} (python -m retention.eval report {out}: the table per task, length, method and budget)")
    return _publish(args, out)


def _rescore(args: argparse.Namespace) -> int:
    """Score the stored replies of RESULTS again under the current metrics (:mod:`retention.eval.rescore`)."""
    from .config import EvalConfigError, load_eval_config
    from .models import eval_tokenizer
    from .rescore import rescore_results
    from .runner import results_file

    try:
        cfg = load_eval_config(args.config)
        path = results_file(args.results)
        changed, moved = rescore_results(path, cfg, eval_tokenizer(cfg.model), write=not args.dry_run)
    except (EvalConfigError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not changed:
        print(f"{path}: every stored reply scores as recorded")
        return 0
    print("\n".join(changed) + "\nmeans that moved (task, length, method, budget):\n  " + "\n  ".join(moved))
    print(f"\n{len(changed)} rows score otherwise: " + ("nothing written (--dry-run)" if args.dry_run else
                                                       f"{path} rewritten; remake its pages (report or pool with the "
                                                       "same --summary, --card, --readme)"))
    return 0


def _list(args: argparse.Namespace) -> int:
    """What a sweep config can name: tasks (generated and Hub sets), methods and budgets, with their params."""
    import inspect

    from .loaders import HUB_TASKS
    from .method_specs import available_methods
    from retention.tasks import TASKS

    def params(fn, skip=()) -> str:
        names = [n for n in inspect.signature(fn).parameters if n not in skip]
        return f" (params: {', '.join(names)})" if names else ""

    def first_line(fn) -> str:
        return (inspect.getdoc(fn) or "").split("\n\n")[0].replace("\n", " ").replace("``", "`")

    common = ("tokenizer", "length", "n", "seed", "split", "source", "params")
    print("tasks, generated (any length, any tokenizer; `seed:` picks the items):")
    for name, fn in TASKS.items():
        print(f"  {name:<18} {first_line(fn)}{params(fn, common)}")
    print("tasks from the Hub (`items` records; `data_files:` for a local copy):")
    for name, fn in HUB_TASKS.items():
        print(f"  {name:<18} {first_line(fn)}{params(fn, ('length', 'limit'))}")
    try:
        from retention.policies.registry import policy_params
    except ImportError:
        policy_params = None
    print("methods ({name, params?, label?, gates?}):")
    for name in available_methods():
        extra = ""
        if policy_params is not None and name not in ("full", "oracle"):
            extra = f" (params: {', '.join(policy_params(name))})"
        elif name == "oracle":
            extra = " (fidelity only; params: scope, rank)"
        print(f"  {name}{extra}")
    print("budgets: a fraction of the context (0.1 or \"10%\"), {tokens: N} per KV head on average, or {entries: N}")
    return 0


def _publish_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--card", default=None, metavar="DIR",
                   help="gate checkpoint folder whose model card gets the summary table and plot")
    p.add_argument("--readme", default=None, metavar="FILE",
                   help="README with <!-- results:start --> / <!-- results:end --> markers to fill")
    p.add_argument("--summary", default=None, metavar="FILE.md",
                   help="write a results page (summary, per-task table, full table) and copy the rows beside it "
                        "as FILE.jsonl")
    p.add_argument("--title", default=None, help="heading of the --summary page")
    p.add_argument("--pair", action="append", default=None, metavar="A,B",
                   help="also report the gap A minus B between two methods (labels; 'full' is the full cache), "
                        "with a paired-bootstrap interval over the items both scored; repeatable")
    p.add_argument("--card-section", default=None, metavar="TITLE",
                   help="with --card: add the summary to the model card as a further section under this heading "
                        "(e.g. a goal check), keeping the card's main results and plot; a section of the same "
                        "title is replaced in its place")
    p.add_argument("--replaces", default=None, metavar="TITLE",
                   help="with --card-section: the new section takes the place of the card's section of this title "
                        "(a result set renamed as it grows)")


def _seed(text: str) -> int:
    """``--seed``: an item set, a whole number >= 0 (argparse names the option and shows this message)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not an item set: give a whole number >= 0 (--seed 4)")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``eval`` and its commands to a parent parser's subcommands (``retention eval ...``)."""
    add_commands(subparsers.add_parser("eval", help="run an evaluation sweep or render its report"))


def add_commands(p: argparse.ArgumentParser) -> None:
    """Add ``run``, ``report``, ``pool``, ``rescore`` and ``list`` to ``p``."""
    from .protocol import PROTOCOLS

    # the metavar makes the error name them
    sub = p.add_subparsers(dest="eval_command", required=True, metavar="{run,report,pool,rescore,list}")
    run = sub.add_parser("run", help="run a sweep from a YAML config (resumes an interrupted one)")
    run.add_argument("--config", required=True, help="YAML file, or a name in eval/configs (tiny.yaml)")
    run.add_argument("--output", default=None, help="results folder (overrides the config's output)")
    run.add_argument("--protocol", default=None, choices=PROTOCOLS,
                     help="overrides the config's protocol: query_agnostic (the budget stays live while the question "
                          "and reply are fed), compress_once (the context compressed, then nothing evicted: as kvpress "
                          "measures) or query_aware (the question prefilled before the compression)")
    run.add_argument("--seed", type=_seed, default=None, metavar="N",
                     help="item set (overrides the config's seed): the same sweep on other items; fills {seed} in the "
                          "output folder (runs/eval/goal-set{seed}). Without {seed} the output stays: item ids carry "
                          "their seed, so a second seed into the same output adds to its rows, as a pool does")
    for flag, what in (("--tasks", "task names, or held_out / in_distribution"),
                       ("--budgets", "budgets as the config writes them (0.1 or 10%%)"),
                       ("--methods", "method labels")):
        run.add_argument(flag, default=None, metavar="A,B",
                         help=f"run only these of the config's {flag[2:]} ({what}): a staged sweep into the same "
                              "output; the whole config's run later keeps these rows and scores the rest")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    _publish_args(run)
    run.set_defaults(func=_run)
    rep = sub.add_parser("report", help="markdown table and PNG plots from a results.jsonl")
    rep.add_argument("results", help="a sweep's output folder or its results.jsonl (or a published copy of one)")
    rep.add_argument("--out", default=None, help="folder for report.md and the PNGs (default: beside RESULTS)")
    rep.add_argument("--methods", default=None, metavar="A,B",
                     help="print and publish only these method labels and the full cache (default: every one); "
                          "report.md keeps every row")
    _publish_args(rep)
    rep.set_defaults(func=_report)
    pool = sub.add_parser("pool", help="pool sweeps of the same tasks on different items (seeds) into one results file")
    pool.add_argument("results", nargs="+", help="results.jsonl files or sweep output folders (two or more)")
    pool.add_argument("--out", required=True,
                      help="the pooled results.jsonl to write (a folder, or a path ending in /: its results.jsonl)")
    pool.add_argument("--methods", default=None, help="comma-separated labels to keep (default: those in every file)")
    _publish_args(pool)
    pool.set_defaults(func=_pool)
    rescore = sub.add_parser("rescore", help="score a results file's stored replies again under the current metrics "
                                             "(no model run: the config's items are regenerated with its tokenizer)")
    rescore.add_argument("results", help="a sweep's output folder or its results.jsonl (or a published or pooled copy)")
    rescore.add_argument("--config", required=True, help="the eval config that produced the rows (its tasks, params "
                                                        "and source; the rows' own seeds and splits are used)")
    rescore.add_argument("--dry-run", action="store_true", help="print what would change, write nothing")
    rescore.set_defaults(func=_rescore)
    sub.add_parser(
        "list", help="the tasks, methods and budgets a sweep config can name, with their params"
    ).set_defaults(func=_list)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m retention.eval", description="evaluation sweeps and reports")
    add_commands(parser)
    args = parser.parse_args(argv)
    from retention.commands import user_errors

    from .config import EvalConfigError
    from .loaders import DatasetUnavailableError

    try:
        return args.func(args)
    # a model that cannot load, gates that do not fit, a Hub set not readable here: the message names the fix
    except (*user_errors(), DatasetUnavailableError, EvalConfigError) as e:
        print(f"python -m retention.eval {args.eval_command}: error: {e}", file=sys.stderr)
        return 2
