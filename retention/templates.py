"""Chat-template variables (``chat_template_kwargs``, e.g. ``{"enable_thinking": False}`` for Qwen3): one rule for
the chat, an eval sweep's config and a training config's ``data``, so a model renders its prompts the same in all
three."""

from __future__ import annotations

import copy
import json
import math
from typing import Any

# what every rendering of a chat template sets itself: template variables of these names are refused
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "conversation", "add_generation_prompt", "tokenize", "return_dict",
                                         "return_tensors", "continue_final_message"})


def _not_json(value: Any, where: str) -> str | None:
    """What in ``value`` (named ``where``) is no JSON value, as :func:`template_variables_problem` words it."""
    if value is None or isinstance(value, (bool, int, str)):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else f"sets {where} to {value!r}: give a finite number"
    if isinstance(value, (list, tuple)):
        return next((p for i, v in enumerate(value) if (p := _not_json(v, f"{where}[{i}]"))), None)
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                return f"sets {where} with the key {k!r}: keys must be strings"
            if problem := _not_json(v, f"{where}.{k}"):
                return problem
        return None
    # YAML reads an unquoted 2024-06-01 as a date, which the template text cannot hold
    return (f"sets {where} to a {type(value).__name__} ({value}), which is no JSON value: give it as a string "
            "(in YAML, quote it)")


def template_variables_problem(variables: Any) -> str | None:
    """What is wrong with ``variables`` as chat-template variables (a mapping of identifier names to JSON values
    that rendering does not set itself), as the end of a sentence naming the fix; None when they are fine."""
    if not isinstance(variables, dict) or any(not isinstance(k, str) or not k.isidentifier() for k in variables):
        return (f"must be a mapping of template variable names to values, e.g. {{'enable_thinking': False}}; "
                f"got {variables!r}")
    taken = sorted(set(variables) & RESERVED_TEMPLATE_VARIABLES)
    if taken:
        return f"sets {', '.join(taken)}, which rendering sets itself: leave them out"
    return next((p for k, v in variables.items() if (p := _not_json(v, k))), None)


def _jinja_literal(value: Any) -> str:
    """``value`` (JSON: None, bool, number, string, list, dict) as a Jinja literal."""
    if value is None or isinstance(value, bool):
        return {None: "none", True: "true", False: "false"}[value]
    if isinstance(value, list):
        return "[" + ", ".join(_jinja_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_jinja_literal(str(k))}: {_jinja_literal(v)}" for k, v in value.items()) + "}"
    # not ensure_ascii: Jinja reads a JSON surrogate pair (an emoji's \ud83d\ude00) as two lone surrogates
    return json.dumps(value, ensure_ascii=False)


def with_template_variables(processor: Any, variables: dict[str, Any]) -> Any:
    """A shallow copy of ``processor`` (a tokenizer, or a processor and its tokenizer) whose chat template sets
    ``variables`` first, so every rendering through it (task generators, training data, a multimodal chat) sees
    them without passing them to each call. ``processor`` itself is left as it was."""
    if not variables:
        return processor
    prefix = "".join(f"{{% set {k} = {_jinja_literal(v)} %}}" for k, v in variables.items())
    out = copy.copy(processor)
    holders = [out]
    if getattr(out, "tokenizer", None) is not None:
        out.tokenizer = copy.copy(out.tokenizer)
        holders.append(out.tokenizer)
    for holder in holders:
        template = getattr(holder, "chat_template", None)
        if isinstance(template, str):
            holder.chat_template = prefix + template
        elif template is not None:
            raise ValueError("chat_template_kwargs: this model's tokenizer holds several named chat templates; "
                             "leave chat_template_kwargs out")
    return out
