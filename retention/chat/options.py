"""Checks of a chat's arguments and of the ``generate`` options of its replies, before any model work."""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from ..attach import unwrap
from .errors import ChatInputError, ChatSetupError

# generate() options that turn on assisted decoding (a draft model or prompt lookup)
_ASSISTED = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit")


def _check_counts(**given: tuple[Any, int, str]) -> None:
    """ChatSetupError naming the argument unless each ``name=(value, least, meaning)`` is an integer >= least, as
    :func:`retention.cache.hf.is_count` reads one (a ``budget_tokens`` of None is allowed: no budget)."""
    from ..cache.hf import is_count

    for name, (value, least, meaning) in given.items():
        if name == "budget_tokens" and value is None:
            continue
        if not is_count(value) or value < least:
            raise ChatSetupError(f"{name} must be an integer >= {least} ({meaning}), got {value!r}")


def _check_text(what: str, text: Any, error: type[Exception] = ChatInputError) -> None:
    """``error`` unless ``text`` is a string (a None or a list rendered as a Jinja error or a TypeError deep in the
    template) of Unicode characters (:func:`not_unicode`)."""
    if not isinstance(text, str):
        raise error(f"{what} must be a str, got {type(text).__name__}: {text!r:.60}")
    bad = not_unicode(text)
    if bad:
        raise error(f"{what} holds {bad}, which is no character (a byte that is not UTF-8, as pasted from a file in "
                    "another encoding, or half a surrogate pair): type it again, or give UTF-8 text "
                    "(text.encode('utf-8', 'replace').decode() replaces such characters with ?)")


def not_unicode(text: str) -> str | None:
    """Where ``text`` holds a lone surrogate (``'\\udce9' at character 3``), or None: Python reads a byte that is not
    UTF-8 from a terminal or a pipe as one (``surrogateescape``), and the tokenizer refused it with a TypeError that
    ended ``retention chat``, conversation and all."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"{text[e.start:e.end]!r} at character {e.start}"
    return None


# the ranges generate's logits processors accept, checked before a turn starts (they raise only once it runs);
# the sampling ones matter only when sampling, as generate ignores them otherwise
GENERATION_RANGES: dict[str, tuple[str, Callable[[float], bool], bool]] = {
    "temperature": ("above 0 (for greedy replies leave out sampling)", lambda v: v > 0, True),
    "top_k": ("an integer >= 0 (0: every token)", lambda v: v >= 0 and float(v).is_integer(), True),
    "top_p": ("in (0, 1]", lambda v: 0 < v <= 1, True),
    "min_p": ("in [0, 1]", lambda v: 0 <= v <= 1, True),
    "repetition_penalty": ("above 0 (1 changes nothing, above 1 discourages repeats)", lambda v: v > 0, False),
}


def generation_value_problem(name: str, value: Any) -> str | None:
    """What is wrong with a sampling setting's ``value`` (``"must be ..., got ..."``), or ``None`` when generate
    takes it; :data:`GENERATION_RANGES` names the settings."""
    import math
    import numbers

    allowed, ok, _ = GENERATION_RANGES[name]
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or not ok(value):
        return f"must be {allowed}, got {value!r}"
    return None


def _check_generation_values(options: dict[str, Any], error: type[Exception]) -> None:
    """``error`` naming the first setting of ``options`` (a reply's merged generate options) out of its range."""
    for name, (_, _, sampling) in GENERATION_RANGES.items():
        if options.get(name) is not None and (options.get("do_sample") or not sampling):
            if problem := generation_value_problem(name, options[name]):
                raise error(f"{name} {problem}")


def _check_one_reply(options: dict[str, Any], error: type[Exception]) -> None:
    """``error`` when ``options`` ask generate for more than one reply's ids (beams, several sequences, an output
    object): a chat keeps one reply per turn in its cache."""
    for key in ("num_beams", "num_return_sequences"):
        if (options.get(key) or 1) > 1:
            raise error(f"{key}={options[key]}: a chat keeps one reply per turn in its cache; for beams or several "
                        "samples call model.generate with a RetentionCache directly (it supports both)")
    if options.get("return_dict_in_generate"):  # failed in the commit, after the reply, its entries left behind
        raise error("return_dict_in_generate: a chat returns the reply's text and keeps its tokens (chat.ids); for "
                    "scores or hidden states call model.generate with a RetentionCache directly")


# generate() keywords that are neither GenerationConfig fields nor in its signature
_GENERATE_EXTRAS = frozenset({"tokenizer", "assistant_tokenizer"})
# generate() arguments the chat passes itself (given again, generate raised a TypeError at every turn), and instead
_CHAT_PASSES = {"streamer": "stream() yields the reply as it is generated",
                "inputs": "send() takes the message; the chat feeds the conversation before it"}


def _check_generation_options(model: nn.Module, options: dict[str, Any], error: type[Exception]) -> None:
    """``error`` naming the keys of ``options`` that ``generate`` would refuse as unused model inputs (a typo, or a
    policy option): neither fields of the model's GenerationConfig nor ``generate``'s own arguments."""
    import inspect

    from transformers import GenerationConfig

    from ..policies.registry import POLICIES

    if passed := sorted(k for k in options if k in _CHAT_PASSES):
        raise error(f"{', '.join(passed)}: the chat passes {'it' if len(passed) == 1 else 'them'} to generate itself ("
                    + "; ".join(_CHAT_PASSES[k] for k in passed) + ")")
    config = getattr(unwrap(model), "generation_config", None) or GenerationConfig()
    own = set(inspect.signature(unwrap(model).generate).parameters) | _GENERATE_EXTRAS
    unknown = sorted(k for k in options if k not in own and not hasattr(config, k))
    if not unknown:
        return
    policy_options = sorted({k for k in unknown for cls in POLICIES.values()
                             if k in getattr(cls, "__dataclass_fields__", {})})
    hint = ((f"; {', '.join(policy_options)} {'is an option' if len(policy_options) == 1 else 'are options'} of "
             "the eviction policy: pass policy=GlobalGatesPolicy(...) (or the policy's own class) with it")
            if policy_options else "")
    raise error(f"unknown option(s) {', '.join(unknown)}: a chat's keyword arguments are generate()'s "
                f"(GenerationConfig fields such as temperature or repetition_penalty){hint}")
