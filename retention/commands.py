"""What the commands share (``retention demo / chat / eval``, ``train.py``, ``benchmarks/``): argparse types,
``--device`` / ``--dtype``, ``--gates`` read and checked before the model loads, and the errors a command prints as
a message instead of a traceback.

Below training and evaluation, which both use it; :mod:`retention.cli` builds the ``retention`` command on top.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from .gates import RetentionGates


def add_placement_args(parser: argparse.ArgumentParser) -> None:
    """``--device`` / ``--dtype`` of a command that loads a model (resolved by :func:`model_placement`)."""
    parser.add_argument("--device", default=None,
                        help="cpu, cuda or cuda:N; default: cuda when there is a GPU, else cpu")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 or float16; default: bfloat16 on a GPU, "
                        "float32 on the CPU")


def model_placement(args: argparse.Namespace) -> tuple[str, str]:
    """``(device, dtype)`` for ``load_model`` from ``--device`` / ``--dtype``; ModelNotAvailableError naming the fix
    for a device this machine lacks or an unknown dtype (before anything loads)."""
    import torch

    from .models import MODEL_DTYPES, ModelNotAvailableError, device_problem

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    problem = device_problem(device)
    if problem:
        raise ModelNotAvailableError(f"--device {problem}; or leave --device out (cuda when there is one, else cpu)")
    dtype = args.dtype or ("bfloat16" if torch.device(device).type == "cuda" else "float32")
    if dtype not in MODEL_DTYPES:
        raise ModelNotAvailableError(f"--dtype {dtype!r}: choose one of {', '.join(MODEL_DTYPES)}")
    return device, dtype


def _int_at_least(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a budget, a chunk, a token count), refused before anything loads."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0 (a number of warm-up rounds)."""
    return _int_at_least(text, 0)


def user_errors() -> tuple[type[Exception], ...]:
    """The errors whose message names the problem and the fix: a command prints them, not a traceback. The eval's own
    (a config, a data set) are added by :func:`retention.cli.user_errors` and ``retention eval``."""
    from .attach import GatesMismatchError, UnsupportedModelError
    from .cache.hf import CacheBudgetError
    from .chat import ChatInputError, ChatSetupError
    from .gates import GateCheckpointError
    from .hub import HubError
    from .io import FolderBusyError
    from .models import ModelNotAvailableError

    return (CacheBudgetError, ChatInputError, ChatSetupError, FolderBusyError, GateCheckpointError,
            GatesMismatchError, HubError, ModelNotAvailableError, UnsupportedModelError)


def checked_device(parser: argparse.ArgumentParser, device: str | None) -> str:
    """A command's ``--device``: the one given, else cuda when torch sees a GPU, else cpu; a usage error (status 2)
    for one this machine cannot use, before anything loads."""
    import torch

    from .models import device_problem

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if problem := device_problem(device):
        parser.error(f"--device {problem}")
    return device


def run_reporting_user_errors(parser: argparse.ArgumentParser, run: Callable[[], int],
                              errors: tuple[type[Exception], ...] | None = None) -> int:
    """``run()``, with a :func:`user_errors` (an unknown model, a missing or damaged checkpoint: the message names
    the fix; ``errors``, default :func:`user_errors`) printed as ``PROG: error: ...`` and status 2 instead of a
    traceback."""
    try:
        return run()
    except (errors or user_errors()) as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2


def check_gates_source(gates: str | None, model: str | None = None) -> RetentionGates | None:
    """Find and read a ``--gates`` folder or Hub repo before the model loads (seconds to minutes): a typo or a
    damaged checkpoint fails at once, and so, given the ``model`` to load, do gates of another model's shapes (from
    its config). Returns the gates read (``None`` for none or ``"untrained"``), for the caller to use once the model
    is there rather than read them again."""
    if gates and gates != "untrained":
        from .gates import RetentionGates
        from .hub import checkpoint_folder

        found = RetentionGates.from_pretrained(checkpoint_folder(gates))  # a few MB: a damaged file fails now too
        if model is not None:  # the config alone: the weights would load for nothing
            from .attach import check_gates_shape, text_config
            from .models import load_config

            check_gates_shape(text_config(load_config(model, check_support=False)[0]), found.config)
        return found
    return None
