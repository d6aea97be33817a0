"""Which new tokens of a forward are real and which are padding, read off the attention mask the model built.

Shared by the gated attention (which refuses padded batches) and the retention cache (which drops padding).
"""

from __future__ import annotations

from typing import Any

import torch


def new_token_valid(mask: Any, batch: int, T: int) -> torch.Tensor | None:
    """``(B, T)`` bool: which new tokens are real (not padding), read off the layer's attention mask.

    A padding token is a key no query may attend to: its column is masked in every row.
    """
    if mask is not None and hasattr(mask, "mask_mod") and hasattr(mask, "seq_lengths"):
        mask = _block_mask_columns(mask, batch, T)  # flex_attention: padding lives in the BlockMask's mask_mod
    if mask is None or not isinstance(mask, torch.Tensor):
        return None
    if mask.ndim == 2:  # flash-attention style 2D padding mask
        return mask[:, -T:].bool()
    cols = mask[:, 0, :, -T:]
    allowed = cols if cols.dtype == torch.bool else cols == 0
    return allowed.any(1).expand(batch, T)


def _block_mask_columns(mask: Any, batch: int, T: int) -> torch.Tensor:
    """``(B, 1, Q, T)`` bool: a flex_attention ``BlockMask`` evaluated for the new tokens' columns (the last ``T``
    keys) only, so a prompt costs ``Q * T`` evaluations, not ``Q * (seen + T)``."""
    from torch.nn.attention.flex_attention import create_mask

    Q, kv_len = mask.seq_lengths
    first, mod = kv_len - T, mask.mask_mod
    return create_mask(lambda b, h, q, kv: mod(b, h, q, kv + first), batch, 1, Q, T, mask.kv_num_blocks.device)
