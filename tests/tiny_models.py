"""Tiny random models built from configs (no downloads), shared by the tests."""

from __future__ import annotations

import torch


def _seeded(build):
    def wrapper(seed: int = 0, attn_implementation: str = "sdpa", **overrides):
        torch.manual_seed(seed)
        model = build(attn_implementation=attn_implementation, **overrides)
        return model.eval()

    wrapper.__name__ = build.__name__
    return wrapper


TEXT = dict(
    vocab_size=128,
    hidden_size=96,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)


@_seeded
def tiny_llama(attn_implementation="sdpa", **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{**TEXT, **overrides})
    cfg._attn_implementation = attn_implementation
    return LlamaForCausalLM(cfg)


@_seeded
def tiny_mistral(attn_implementation="sdpa", **overrides):
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(**{**TEXT, "sliding_window": None, **overrides})  # Mistral v0.2+: no window
    cfg._attn_implementation = attn_implementation
    return MistralForCausalLM(cfg)


@_seeded
def tiny_qwen2(attn_implementation="sdpa", **overrides):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**{**TEXT, **overrides})
    cfg._attn_implementation = attn_implementation
    return Qwen2ForCausalLM(cfg)


@_seeded
def tiny_qwen3(attn_implementation="sdpa", **overrides):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**{**TEXT, **overrides})
    cfg._attn_implementation = attn_implementation
    return Qwen3ForCausalLM(cfg)


# Qwen3-VL special tokens inside the tiny vocabulary
VL_TOKENS = dict(image_token_id=120, video_token_id=121, vision_start_token_id=122, vision_end_token_id=123)


@_seeded
def tiny_qwen3_vl(attn_implementation="sdpa", tokens=None, **overrides):
    """``tokens``: special token ids (image/video/vision_start/vision_end) when a real tokenizer is used."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    text = {**TEXT, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                        "mrope_interleaved": True}, **overrides}
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=TEXT["hidden_size"],
        num_position_embeddings=256,
        deepstack_visual_indexes=[1],
    )
    cfg = Qwen3VLConfig(text_config=text, vision_config=vision, **(tokens or VL_TOKENS))
    cfg._attn_implementation = attn_implementation
    cfg.text_config._attn_implementation = attn_implementation
    cfg.vision_config._attn_implementation = attn_implementation
    return Qwen3VLForConditionalGeneration(cfg)


BUILDERS = {"llama": tiny_llama, "mistral": tiny_mistral, "qwen2": tiny_qwen2, "qwen3": tiny_qwen3,
            "qwen3_vl": tiny_qwen3_vl}


def vl_inputs(n_images: int = 1, text_before: int = 5, text_after: int = 6, grid=(1, 4, 4), seed: int = 0):
    """Token ids with image placeholders plus random patches, as the Qwen3-VL processor would produce.

    ``grid`` is (t, h, w) in patches; the merger turns h*w/4 patches into one token each.
    Returns a dict for ``model(**inputs)``.
    """
    g = torch.Generator().manual_seed(seed)
    t, h, w = grid
    n_tok = t * h * w // 4
    ids = []
    for _ in range(n_images):
        ids += torch.randint(0, 100, (text_before,), generator=g).tolist()
        ids += ([VL_TOKENS["vision_start_token_id"]] + [VL_TOKENS["image_token_id"]] * n_tok
                + [VL_TOKENS["vision_end_token_id"]])
    ids += torch.randint(0, 100, (text_after,), generator=g).tolist()
    patch_dim = 3 * 2 * 14 * 14
    pixel_values = torch.randn(n_images * t * h * w, patch_dim, generator=g)
    grid_thw = torch.tensor([list(grid)] * n_images)
    input_ids = torch.tensor([ids])
    mm_token_type_ids = (input_ids == VL_TOKENS["image_token_id"]).int()  # 1 marks image tokens
    return dict(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        pixel_values=pixel_values,
        image_grid_thw=grid_thw,
        mm_token_type_ids=mm_token_type_ids,
    )
