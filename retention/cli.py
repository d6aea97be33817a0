"""The ``retention`` command line: ``demo``, ``train``, ``chat``, ``push``, ``average`` and ``eval``
(``retention CMD --help``)."""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import nullcontext
from typing import Callable

from .commands import (add_placement_args, check_gates_source, checked_device, model_placement,  # noqa: F401
                       non_negative_int, positive_int)
from .commands import run_reporting_user_errors as _run_reporting
from .commands import user_errors as _base_user_errors


DEMO_PROMPT = (
    "Read the notes, then answer the question.\nNotes:\n"
    "The library opens at nine. The red bicycle belongs to Maria. The train to Lyon leaves from platform four. "
    "Tom bought apples and bread at the market. The meeting was moved to Thursday afternoon. "
    "The secret code for the office door is 4512. The cat sleeps on the blue sofa. "
    "Anna is learning to play the violin. The bakery closes early on Sundays. It rained all weekend in the city.\n"
    "Question: What is the secret code for the office door?"
)


def _demo(args: argparse.Namespace) -> int:
    """Generate with a full cache and with global top-B eviction; print answers and KV memory."""
    import torch

    from . import attach_gates, load_model
    from .attach import check_gates_match
    from .cache import RetentionCache
    from .compat import cache_kwargs
    from .gates import UNTRAINED_SEED
    from .hub import load_gates
    from .models import shipped_gates

    device, dtype = model_placement(args)
    gates = check_gates_source(args.gates, args.model)
    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model, device=device, dtype=dtype)
    print(f"loaded {args.model} in {time.perf_counter() - t0:.1f} s ({dtype} on {device})")
    if gates is not None:
        check_gates_match(model, gates.config)
        print(f"gates: {args.gates} ({gates.config.variant})")
    else:
        print("gates: untrained (beta = 1 everywhere); pass --gates DIR for trained ones")
    attachment = attach_gates(model, gates, mode="score", seed=None if gates is not None else UNTRAINED_SEED)
    messages = [{"role": "user", "content": args.prompt}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True).to(model.device)
    n_prompt = inputs["input_ids"].shape[1]
    print(f"prompt: {n_prompt} tokens")
    budget = RetentionCache.budget_for(model, args.budget_tokens)
    # beside the gates asked for, the checkpoint shipped for this model (if any): what training buys
    shipped = shipped_gates(model)
    shipped_set = None if shipped is None else load_gates(shipped, model=model)
    # the same gates however they were named (a path, the shipped name, a Hub copy): one row, not two
    same = shipped_set is not None and gates is not None and shipped_set.fingerprint() == gates.fingerprint()
    rows = [("full", None, None), (f"global top-B, B={budget}", budget, None)]
    if shipped_set is not None and not same:
        rows.append(("  with shipped gates", budget, shipped_set))
    print(f"{'cache':<22} {'KV entries kept':>16} {'KV MiB':>8}  answer")
    for name, b, other in rows:
        cache = RetentionCache(model, budget=b)
        attachment.reset()
        with attachment.use_gates(other) if other is not None else nullcontext(), torch.no_grad():
            out = model.generate(**inputs, **cache_kwargs(cache), max_new_tokens=args.max_new_tokens, do_sample=False)
        report = cache.memory_report()
        answer = tokenizer.decode(out[0, n_prompt:], skip_special_tokens=True).strip().replace("\n", " ")
        print(f"{name:<22} {report['kept_entries']:>16,} {report['kv_bytes'] / 2**20:>8.2f}  {answer!r}")
    # counted after the reply: a budgeted cache evicts in batches, so it may hold up to B + slack (a reader who sees
    # more than B kept should not take it for a broken budget)
    print(f"(entries kept after the reply: eviction cuts back to B once the cache holds more than B + {cache.slack:,}, "
          "one page per layer and KV head)")
    if shipped is not None and not same:
        print(f"(shipped gates: {shipped})")
    return 0


def build_demo_parser(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser("demo", help="generate with a full cache and with global top-B eviction")
    demo.add_argument("--model", default="smollm2-135m",
                      help="embedded name, Hub id or local folder (default: %(default)s)")
    demo.add_argument("--gates", default=None,
                      help="gate checkpoint folder, Hub repo or shipped name (smollm2-135m-global)")
    demo.add_argument("--budget", "--budget-tokens", dest="budget_tokens", type=positive_int, default=48,
                      help="KV budget in tokens per (layer, KV head), as retention chat's --budget")
    demo.add_argument("--prompt", default=DEMO_PROMPT,
                      help="the user turn (default: a secret code hidden in filler, asked for at the end)")
    add_placement_args(demo)
    demo.add_argument("--max-new-tokens", type=positive_int, default=24, help="reply length (default: %(default)s)")
    demo.set_defaults(func=_demo)


# Modules that add subcommands: each defines ``register(subparsers)`` and sets ``func`` on its parsers.
COMMAND_MODULES = ("retention.chat_cli", "retention.hub", "retention.average", "retention.eval.cli")
COMMAND_MODULES += ("retention.train.recipes", "retention.tiny_model", "retention.retention_map")  # issue 76


def _command_modules():
    import importlib

    for name in COMMAND_MODULES:
        yield importlib.import_module(name)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    # plain text in a terminal
    parser = argparse.ArgumentParser(prog="retention", description=__doc__.replace("``", ""))
    parser.add_argument("--version", action="version", version=f"retention {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    build_demo_parser(sub)
    # listed here for --help; main() hands `retention train ...` to retention.train.main whole (its own parser)
    sub.add_parser("train", add_help=False, help="train gates from a YAML config: the command of train.py "
                   "(retention train --help)")
    for module in _command_modules():
        module.register(sub)
    return parser


def user_errors() -> tuple[type[Exception], ...]:
    """The errors a ``retention`` command prints as a message, not a traceback: :func:`retention.commands.user_errors`
    and, for ``retention eval``, a Hub set (or its images) that cannot be read here, a config its model cannot run."""
    from .eval.config import EvalConfigError
    from .eval.loaders import DatasetUnavailableError

    return (*_base_user_errors(), DatasetUnavailableError, EvalConfigError)


def run_reporting_user_errors(parser: argparse.ArgumentParser, run: Callable[[], int]) -> int:
    """:func:`retention.commands.run_reporting_user_errors` with every ``retention`` command's :func:`user_errors`."""
    return _run_reporting(parser, run, user_errors())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train"]:  # also `accelerate launch -m retention train ...`
        from .train import main as train_main

        return train_main(argv[1:], prog="retention train")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except user_errors() as e:
        print(f"retention {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
