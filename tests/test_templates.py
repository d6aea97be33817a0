"""Chat-template variables set through the template render as the same values passed to apply_chat_template."""

import pytest

import retention.models as models
from retention.templates import with_template_variables

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
