"""``python -m eval run --config ...`` / ``python -m eval report RESULTS`` (also ``retention eval ...``)."""

from __future__ import annotations

import argparse
import sys


def _run(args) -> int:
    from .report import write_report
    from .runner import EvalConfigError, load_eval_config, run_sweep

    try:
        cfg = load_eval_config(args.config)
    except (EvalConfigError, ValueError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    results = run_sweep(cfg)
    print(f"results: {results}")
    print(f"report: {write_report(results)}")
    return 0


def _report(args) -> int:
    from .report import markdown_table, write_report
    from .runner import read_results

    path = write_report(args.results, args.out)
    print(markdown_table(read_results(args.results)))
    print(f"\nreport: {path}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("eval", help="run an evaluation sweep or render its report")
    sub = p.add_subparsers(dest="eval_command", required=True)
    run = sub.add_parser("run", help="run a sweep from a YAML config (resumes an interrupted one)")
    run.add_argument("--config", required=True)
    run.set_defaults(func=_run)
    rep = sub.add_parser("report", help="markdown table and PNG plots from a results.jsonl")
    rep.add_argument("results")
    rep.add_argument("--out", default=None)
    rep.set_defaults(func=_report)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(["eval", *(argv if argv is not None else sys.argv[1:])])
    return args.func(args)
