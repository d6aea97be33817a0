"""An offline Qwen3-VL processor (PIL image processor + the SmolLM2 tokenizer with Qwen's vision tokens),
a tiny random Qwen3-VL model that matches it, and real photos shipped inside installed packages."""

from __future__ import annotations

from pathlib import Path

from retention.tiny_model import CHAT_TEMPLATE, VISION_TOKENS  # noqa: F401  (shared with `retention tiny-model`)


def tiny_qwen3_vl_processor(tokenizer_dir: str | Path | None = None):
    """Qwen3VLProcessor built locally (:func:`retention.tiny_model.tiny_qwen3_vl_processor`); images at most 112x112
    pixels (16 merged tokens). The tokenizer is the embedded model's unless ``tokenizer_dir`` names a folder holding
    another (a machine without the package)."""
    from retention.tiny_model import tiny_qwen3_vl_processor as build

    return build(tokenizer_dir)


def tiny_qwen3_vl_for(processor, seed: int = 0):
    """A tiny random Qwen3-VL whose vocabulary and vision token ids match ``processor``."""
    from tiny_models import tiny_qwen3_vl

    tok = processor.tokenizer
    ids = tok.convert_tokens_to_ids(VISION_TOKENS)
    tokens = dict(vision_start_token_id=ids[0], vision_end_token_id=ids[1], image_token_id=ids[2],
                  video_token_id=ids[3])
    return tiny_qwen3_vl(seed=seed, tokens=tokens, vocab_size=len(tok))


def photo_paths() -> list[Path]:
    """Photos that ship inside installed packages (matplotlib's sample data; scikit-image if present)."""
    import matplotlib

    root = Path(matplotlib.get_data_path()) / "sample_data"
    paths = [root / "grace_hopper.jpg"]
    try:
        import skimage

        data = Path(skimage.__file__).parent / "data"
        paths += sorted(p for p in data.glob("*.png") if p.name in ("astronaut.png", "coffee.png", "chelsea.png"))
    except ImportError:
        pass
    return [p for p in paths if p.is_file()]


def photos(n: int):
    from PIL import Image

    paths = photo_paths()
    return [Image.open(paths[i % len(paths)]).convert("RGB") for i in range(n)]


def vl_chat_on(device: str, tokenizer_dir: str | Path | None = None) -> dict:
    """Two turns of RetentionChat with a tiny random Qwen3-VL on ``device`` (a photo, then text only), no budget:
    the chat's ``ids``, its cache length and the devices they ended on. Shared by the CPU test and the GPU one, so
    the GPU test runs what the CPU one checks."""
    import warnings

    from retention.chat import RetentionChat

    proc = tiny_qwen3_vl_processor(tokenizer_dir)
    model = tiny_qwen3_vl_for(proc).to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # untrained gates, on purpose
        chat = RetentionChat(model, proc, budget_tokens=None, max_new_tokens=4, min_new_tokens=4)
    for text, images in (("What is this?", photos(1)), ("Say more.", None)):
        chat.send(text, images=images)
    return {"ids": chat.ids, "cache_length": chat.cache.get_seq_length(), "device": chat.ids.device.type,
            "model_device": next(model.parameters()).device.type}


def mmdu_benchmark(tmp_path: Path, dialogues: int = 2) -> Path:
    """An MMDU-format file (``{id: record}``, ``<ImageHere>`` markers, image paths relative to its folder) of
    three-turn dialogues over two photos: the first turn shows one, the second the other (the second photo a shipped
    one's mirror image when only one ships here)."""
    from PIL import Image, ImageOps

    shipped = photo_paths()
    first = Image.open(shipped[0]).convert("RGB")
    second = Image.open(shipped[1]).convert("RGB") if len(shipped) > 1 else ImageOps.mirror(first)
    paths = [tmp_path / "first.png", tmp_path / "second.png"]
    for im, p in zip((first, second), paths):
        im.save(p)
    import json

    records = {}
    for d in range(dialogues):
        records[str(d)] = {"id": d, "image": [p.name for p in paths], "conversations": [
            {"from": "user", "value": f"<ImageHere>Describe this photo, please ({d})."},
            {"from": "assistant", "value": "It shows a person in a uniform."},
            {"from": "user", "value": "<ImageHere>And this one?"},
            {"from": "assistant", "value": "A different scene, with more colour."},
            {"from": "user", "value": "Which of the two photos came first?"},
            {"from": "assistant", "value": "The photo of the person in a uniform."},
        ]}
    path = tmp_path / "benchmark.json"
    path.write_text(json.dumps(records))
    return path


def vl_dialogue_rows_on(device: str, folder: Path, tokenizer_dir: str | Path | None = None) -> list[dict]:
    """One MMDU-format dialogue (two photos) scored by the sweep's multimodal protocol on ``device`` with a tiny
    random Qwen3-VL: the full cache and the learned-gates policy at a 25% budget. Shared by the CPU tests and the
    GPU one."""
    from retention.eval.budgets import parse_budget
    from retention.eval.loaders import load_mmdu
    from retention.eval.method_specs import make_method
    from retention.eval.multimodal import run_chat_item_budgets, shared_history
    from retention import attach_gates

    proc = tiny_qwen3_vl_processor(tokenizer_dir)
    model = tiny_qwen3_vl_for(proc).to(device).eval()
    attach_gates(model, None, mode="score")
    item = load_mmdu(mmdu_benchmark(folder), limit=1, max_new_tokens=4)[0]
    history = shared_history(model, proc, item, chunk=512)
    rows = run_chat_item_budgets(model, proc, item, make_method({"name": "full"}), [None], history=history)
    rows += run_chat_item_budgets(model, proc, item, make_method({"name": "global_gates"}), [parse_budget(0.25)],
                                  history=history)
    return [{**r, "device": next(model.parameters()).device.type} for r in rows]
