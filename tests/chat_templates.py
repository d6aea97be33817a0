"""Chat templates for tests that need a template's behaviour without its model."""

# Qwen3's way (reduced): an answered assistant turn loses its empty <think> block once a user turn follows it, so the
# conversation does not render as the turns fed so far plus the new one
QWEN3_LIKE_TEMPLATE = (
    "{% set ns = namespace(q=-1) %}{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.q = loop.index0 %}"
    "{% endif %}{% endfor %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and loop.index0 > ns.q %}<think>\n\n</think>\n\n{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}"
)

# Qwen3's thinking switch (reduced): ``enable_thinking=False`` opens each reply with an empty <think> block, which the
# template leaves out of an answered turn
THINKING_SWITCH_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'].split('</think>')[-1].lstrip('\n') }}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
