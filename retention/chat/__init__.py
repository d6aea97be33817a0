"""Long multimodal dialogue with one retention cache across turns.

``RetentionChat`` keeps the model, its tokenizer or processor, the gates and a single
:class:`~retention.cache.RetentionCache` for the whole conversation. Each :meth:`~RetentionChat.send`
feeds only the new part of the conversation (the chat template's closing of the last reply and the
new user turn); the cache evicts down to its budget during prefill (chunked) and decoding, so memory
stays bounded however long the dialogue gets. The ``retention chat`` command is :mod:`retention.chat_cli`.

Modules: :mod:`~retention.chat.session` (the class: setup, state, turns), :mod:`~retention.chat.template` (turn
encoding), :mod:`~retention.chat.multimodal` (images, M-RoPE), :mod:`~retention.chat.graphs` (CUDA-graph decoding),
:mod:`~retention.chat.transcript` (save, resume, conversation logs), :mod:`~retention.chat.options` (argument
checks), :mod:`~retention.chat.errors`.
"""

from .errors import ChatInputError, ChatSetupError, PastPositionsWarning
from .options import GENERATION_RANGES, generation_value_problem, not_unicode
from .session import RetentionChat
from .template import shown_reply, text_after_reply
from .transcript import TRANSCRIPT_FORMAT, TRANSCRIPT_VERSION, read_history, read_transcript

__all__ = [
    "GENERATION_RANGES",
    "TRANSCRIPT_FORMAT",
    "TRANSCRIPT_VERSION",
    "ChatInputError",
    "ChatSetupError",
    "PastPositionsWarning",
    "RetentionChat",
    "generation_value_problem",
    "not_unicode",
    "read_history",
    "read_transcript",
    "shown_reply",
    "text_after_reply",
]
