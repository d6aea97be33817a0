"""A random-weight copy of a model (its config and tokenizer, fresh weights) for cost benchmarks and path tests
on a machine the real weights cannot reach: speed, memory and device placement do not depend on the weights.

    python -m retention.eval.random_copy smollm2-135m runs/smol-shape --no-weights  # here: config + tokenizer, 3 MB
    python -m retention.eval.random_copy runs/smol-shape /tmp/smol-random  # there: adds seeded random weights
    MODEL=/tmp/smol-random eval/gpu_check.sh                               # every GPU check on the copy

What it writes loads with ``load_model(OUT)`` like any model folder. Answers from it are noise: never score one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def random_copy(source: str, out: Path, weights: bool = True, seed: int = 0) -> Path:
    """Write ``source``'s config and tokenizer (and, with ``weights``, weights drawn with ``seed``) to ``out``.

    ``source``: a model name that :func:`retention.load_model` takes (``smollm2-135m``, a Hub id) or a folder.
    Only causal language models: a multimodal model's processor is not copied."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from retention.models import load_config, resolve_model_path

    folder = resolve_model_path(source)  # an embedded name: its converted folder
    config, _ = load_config(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    out.mkdir(parents=True, exist_ok=True)
    if weights:
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(config).save_pretrained(out)
    else:
        config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="model name or folder (its config and tokenizer are copied)")
    p.add_argument("out", type=Path, help="folder to write")
    p.add_argument("--no-weights", action="store_true", help="config and tokenizer only (small enough to carry)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = p.parse_args(argv)
    out = random_copy(args.source, args.out, weights=not args.no_weights, seed=args.seed)
    print(f"wrote {out} ({'config and tokenizer' if args.no_weights else 'random weights, config and tokenizer'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
