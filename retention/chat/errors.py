"""The errors and the warning a chat raises: each message names the problem and the fix."""

from __future__ import annotations


class ChatInputError(ValueError):
    """A turn cannot be processed as given; the message names the problem and the fix."""


class ChatSetupError(ValueError):
    """Model, gates and options do not fit together; the message names the fix."""


class PastPositionsWarning(UserWarning):
    """A conversation may run past the model's ``max_position_embeddings`` (said once per conversation)."""
