"""A random-weight copy of a model (its config and tokenizer, fresh weights) for cost benchmarks and path tests
on a machine the real weights cannot reach: speed, memory and device placement do not depend on the weights.

    python -m benchmarks.random_copy smollm2-135m runs/smol-shape --no-weights  # here: config + tokenizer, 3 MB
    python -m benchmarks.random_copy runs/smol-shape /tmp/smol-random  # there: adds seeded random weights
    MODEL=/tmp/smol-random benchmarks/gpu_check.sh                               # every GPU check on the copy

What it writes loads with ``load_model(OUT)`` like any model folder. Answers from it are noise: never score one.
OUT is written whole and replaced whole: it must be new, empty, or a copy this command wrote before.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# written into every copy: what tells a folder this command may replace from one it must not touch
MARKER = "random_copy.json"


def is_random_copy(path: str | Path) -> bool:
    """Whether ``path`` is a folder this command wrote (it holds :data:`MARKER`)."""
    return (Path(path) / MARKER).is_file()


def check_out(out: str | Path) -> None:
    """FileExistsError naming the fix unless ``out`` may be written: absent, an empty folder, or an earlier copy
    (replaced whole). A file, or a folder of anything else (a gate checkpoint, a model), is refused: the copy's
    config.json and tokenizer would overwrite its own."""
    from retention.io import check_replaceable

    check_replaceable(out, is_random_copy, "a random copy")


def random_copy(source: str, out: Path, weights: bool = True, seed: int = 0) -> Path:
    """Write ``source``'s config and tokenizer (and, with ``weights``, weights drawn with ``seed``) to ``out``.

    ``source``: a model name that :func:`retention.load_model` takes (``smollm2-135m``, a Hub id) or a folder.
    Only causal language models: a multimodal model's processor is not copied. ``out`` is checked before anything
    loads (:func:`check_out`) and written whole in one rename."""
    import json

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from retention.io import atomic_directory
    from retention.models import load_config, resolve_model_path

    out = Path(out)
    check_out(out)
    folder = resolve_model_path(source)  # an embedded name: its converted folder
    config, _ = load_config(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    with atomic_directory(out) as tmp:  # a crash leaves no half-written copy, and an earlier copy is replaced whole
        if weights:
            torch.manual_seed(seed)
            AutoModelForCausalLM.from_config(config).save_pretrained(tmp)
        else:
            config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps({"source": str(source), "weights": weights, "seed": seed}) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="model name or folder (its config and tokenizer are copied)")
    p.add_argument("out", type=Path, help="folder to write")
    p.add_argument("--no-weights", action="store_true", help="config and tokenizer only (small enough to carry)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = p.parse_args(argv)
    from retention.cli import user_errors

    try:
        out = random_copy(args.source, args.out, weights=not args.no_weights, seed=args.seed)
    except (FileExistsError, *user_errors()) as e:  # a refused OUT, an unknown source: the message names the fix
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({'config and tokenizer' if args.no_weights else 'random weights, config and tokenizer'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
