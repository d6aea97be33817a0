"""The ``retention`` command line: ``retention demo`` (and more subcommands as features land)."""

from __future__ import annotations

import argparse
import sys
import time


def _demo(args: argparse.Namespace) -> int:
    import torch

    from . import attach_gates, load_model

    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model)
    print(f"loaded {args.model} in {time.perf_counter() - t0:.1f} s")
    attachment = attach_gates(model)
    n_gate = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"attached {attachment.gates.config.variant} retention gates: {n_gate:,} trainable parameters")
    messages = [{"role": "user", "content": args.prompt}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    n_prompt = inputs["input_ids"].shape[1]
    for mode in ("teacher", "student"):
        attachment.reset()
        with attachment.use_mode(mode), torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
        print(f"[{mode}] {tokenizer.decode(out[0, n_prompt:], skip_special_tokens=True)!r}")
    return 0


# Modules that add subcommands: each defines ``register(subparsers)`` and sets ``func`` on its parsers.
COMMAND_MODULES = ("retention.chat", "retention.hub", "eval.cli")


def _command_modules():
    import importlib
    import importlib.util

    for name in COMMAND_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # parent package absent
            found = False
        if found:
            yield importlib.import_module(name)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="retention", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for module in _command_modules():
        module.register(sub)
    demo = sub.add_parser("demo", help="load the embedded model, attach gates, generate in both modes")
    demo.add_argument("--model", default="smollm2-135m")
    demo.add_argument("--prompt", default="What is the capital of France?")
    demo.add_argument("--max-new-tokens", type=int, default=24)
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
