"""Chat-template variables set through the template render as the same values passed to apply_chat_template."""

import datetime
import re

import pytest

import retention.models as models
from retention.templates import template_variables_problem, with_template_variables

TEMPLATE = ("[{{ note }}|{{ tags | join(',') }}|{{ meta | tojson }}]"
            "{% for m in messages %}{{ m['content'] }}{% endfor %}")


@pytest.mark.parametrize("note", ["plain", "café", "emoji 😀 and 𝔘 and 𠀋",
                                  "quote \" backslash \\ newline \n tab \t"])
def test_template_variables_render_as_passed(note):
    """A character outside the Basic Multilingual Plane (an emoji) was written as a JSON surrogate pair, which Jinja
    reads as two lone surrogates: the prompt held no emoji and could not even be encoded as UTF-8."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models.embedded_model_dir())
    tok.chat_template = TEMPLATE
    variables = {"note": note, "tags": [note, "b"], "meta": {note: [1, None, True, 2.5]}}
    messages = [{"role": "user", "content": "Hi."}]
    got = with_template_variables(tok, variables).apply_chat_template(messages, tokenize=False)
    want = tok.apply_chat_template(messages, tokenize=False, **variables)
    assert got == want
    got.encode("utf-8")


@pytest.mark.parametrize("value, words", [
    (datetime.date(2024, 6, 1), r"sets date_string to a date \(2024-06-01\), which is no JSON value: give it as a "
                                "string"),
    ({"when": datetime.datetime(2024, 6, 1, 12)}, "sets date_string.when to a datetime"),
    ([1, {2, 3}], r"sets date_string\[1\] to a set"),
    (float("nan"), "sets date_string to nan: give a finite number"),
    ({1: "a"}, "sets date_string with the key 1: keys must be strings"),
])
def test_template_variables_must_be_json_values(value, words):
    """YAML reads an unquoted ``2024-06-01`` as a date: the config passed, and the run failed with json's
    TypeError once the model had loaded (NaN rendered as an undefined name)."""
    assert re.search(words, template_variables_problem({"date_string": value}))
    assert template_variables_problem({"ok": [None, True, 1, 2.5, "s", {"k": []}]}) is None


def test_a_training_config_with_a_date_is_refused_at_load(tmp_path):
    from retention.train.config import ConfigError, load_config

    path = tmp_path / "c.yaml"
    path.write_text("budget: {tokens_per_head: 64}\ndata:\n  chat_template_kwargs: {date_string: 2024-06-01}\n")
    with pytest.raises(ConfigError, match=r"data.chat_template_kwargs.* sets date_string to a date \(2024-06-01\)"):
        load_config(path)
