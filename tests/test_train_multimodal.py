"""A tiny random Qwen3-VL trains on multimodal conversations with real photos, processor built offline."""

import json

import torch

from retention.hub import load_gates
from tiny_vl import photo_paths, tiny_qwen3_vl_for, tiny_qwen3_vl_processor
from retention.train.config import load_config
from retention.train.multimodal_data import encode_multimodal
from retention.train.loop import train

QUESTIONS = ["What is in this picture?", "Describe the colours you see.", "Is this indoors or outdoors?"]
ANSWERS = ["A person in a uniform, photographed in a studio.", "Mostly dark blue and grey tones.",
           "It looks like an indoor portrait."]


def conversations(path, n=10):
    photos = photo_paths()
    with open(path, "w") as f:
        for i in range(n):
            msgs = [
                {"role": "user", "content": [{"type": "image", "image": str(photos[i % len(photos)])},
                                             {"type": "text", "text": QUESTIONS[i % 3]}]},
                {"role": "assistant", "content": [{"type": "text", "text": ANSWERS[i % 3]}]},
                {"role": "user", "content": [{"type": "text", "text": "And anything else?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": ANSWERS[(i + 1) % 3]}]},
            ]
            f.write(json.dumps({"messages": msgs}) + "\n")


def test_vision_tokens_are_encoded_and_masked():
    proc = tiny_qwen3_vl_processor()
    msgs = [{"role": "user", "content": [{"type": "image", "image": str(photo_paths()[0])},
                                         {"type": "text", "text": "Hi"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Hello there"}]}]
    enc = encode_multimodal(proc, msgs, seq_len=512)
    ids = enc["input_ids"][0]
    n_image = int((ids == proc.image_token_id).sum())
    assert n_image == int(enc["image_grid_thw"].prod(-1).sum()) // 4 > 0  # merged 2x2 patches
    predicted = proc.tokenizer.decode(ids[1:][enc["loss_mask"][0, :-1]])
    assert "Hello there" in predicted and "Hi" not in predicted


def _conv(i, image=True):
    content = [{"type": "text", "text": QUESTIONS[i % 3]}]
    if image:
        content = [{"type": "image", "image": str(photo_paths()[i % len(photo_paths())])}] + content
    return [{"role": "user", "content": content},
            {"role": "assistant", "content": [{"type": "text", "text": ANSWERS[i % 3]}]}]


def test_packed_conversations_equal_separate_ones():
    """Conversations packed into one row (text positions restarting, M-RoPE rows from the model) give the
    same teacher and student hidden states as each conversation alone; lengths are estimated exactly."""
    from retention import attach_gates
    from retention.attach import unwrap
    from retention.train.multimodal_data import concat_encoded, conversation_length, pack_lengths
    from retention.train.distill import mrope_positions

    proc = tiny_qwen3_vl_processor()
    model = tiny_qwen3_vl_for(proc)
    convs = [_conv(0), _conv(1, image=False), _conv(2)]
    encs = [encode_multimodal(proc, m, 4096) for m in convs]
    assert [conversation_length(proc, m) for m in convs] == [e["input_ids"].shape[1] for e in encs]
    att = attach_gates(model, bias_init=2.0, gate_hidden=8)

    def run(b, mode, restart=True):
        text_pos = b["position_ids"] if restart else torch.arange(b["input_ids"].shape[1])[None]
        pos = torch.cat([text_pos[None], mrope_positions(model, b)])
        kw = {k: b[k] for k in ("pixel_values", "image_grid_thw", "mm_token_type_ids") if k in b}
        with torch.no_grad(), att.use_mode(mode):
            return unwrap(model).model(input_ids=b["input_ids"], position_ids=pos, use_cache=False,
                                       **kw).last_hidden_state

    packed = concat_encoded(encs)
    lengths = [e["input_ids"].shape[1] for e in encs]
    assert (packed["cu_seqlens"].tolist() == [0, lengths[0], sum(lengths[:2]), sum(lengths)]
            and packed["pixel_values"].shape[0] == sum(e["pixel_values"].shape[0] for e in encs if "pixel_values" in e))
    for mode in ("teacher", "student"):
        alone = torch.cat([run(concat_encoded([e]), mode) for e in encs], dim=1)
        torch.testing.assert_close(run(packed, mode), alone, rtol=1e-4, atol=1e-4)
        assert (run(packed, mode, restart=False) - alone).abs().max() > 1e-2  # control: unpacked rows do mix
    assert pack_lengths([5, 9, 3, 20, 4], 10, seed=0) == pack_lengths([5, 9, 3, 20, 4], 10, seed=0)
    rows = pack_lengths([5, 9, 3, 20, 4], 10, seed=0)
    assert (sorted(i for r in rows for i in r) == [0, 1, 2, 4]
            and all(sum([5, 9, 3, 20, 4][i] for i in r) <= 10 for r in rows))


def test_tiny_qwen3_vl_trains_with_gated_vision_tokens(tmp_path):
    proc = tiny_qwen3_vl_processor()
    model = tiny_qwen3_vl_for(proc)
    conversations(tmp_path / "convs.jsonl")
    cfg_file = tmp_path / "vl.yaml"
    cfg_file.write_text(f"""
model: {{name: tiny-qwen3-vl}}
gates: {{variant: global, gate_hidden: 8, bias_init: 3.0}}
budget: {{tokens_per_head: 8}}
data:
  seq_len: 256
  eval_fraction: 0.2
  sources: [{{kind: multimodal, path: {tmp_path / 'convs.jsonl'}}}]
train: {{output_dir: {tmp_path / 'run'}, steps: 6, lr: 0.05, warmup_steps: 1, log_every: 100, save_every: 100, \
tracker: none}}
""")
    seen = {}
    import retention.train.distill as distill

    real_capacity = distill.capacity_loss

    def spy(log_betas, budget, form, cu_seqlens, **k):
        seen["T"] = log_betas[0].shape[-1]
        seen["docs"] = len(cu_seqlens) - 1
        return real_capacity(log_betas, budget, form, cu_seqlens, **k)

    distill.capacity_loss, old = spy, distill.capacity_loss
    try:
        summary = train(load_config(cfg_file), model_and_processor=(model, proc))
    finally:
        distill.capacity_loss = old
    h = summary["history"]
    assert len(h) == 6 and h[-1]["capacity"] < h[0]["capacity"]
    assert seen["T"] > 100, "gate scores cover the whole packed row, image tokens included"
    assert seen["docs"] > 1, "several conversations share a row"
    gates = load_gates(summary["export_dir"], model=model)
    assert gates.config.num_layers == 3


def test_cached_lengths_follow_the_row_length(tmp_path, monkeypatch):
    """An image task's items fill the row less its photos, so their lengths depend on data.seq_len; the lengths cache
    was keyed without it, so a run at a longer seq_len packed its items by the shorter items' lengths and silently
    left out every conversation that then overflowed its row (one of the two here)."""
    from retention.train.config import DataConfig, SourceConfig
    from retention.train.multimodal_data import build_multimodal

    proc = tiny_qwen3_vl_processor()
    monkeypatch.setenv("RETENTION_CACHE", str(tmp_path / "cache"))
    source = SourceConfig(kind="synthetic", path="image_memory", max_docs=2, params={"images": 2, "size": 112})
    for seq_len in (512, 1024):
        rows, _ = build_multimodal(DataConfig(sources=[source], seq_len=seq_len, eval_fraction=0.0), proc,
                                   cache=tmp_path / "lengths")
        assert sum(len(rows[i]["cu_seqlens"]) - 1 for i in range(len(rows))) == 2  # every conversation, whole


def test_llava_and_mmdu_layout_becomes_messages():
    from retention.train.multimodal_data import to_messages
    from retention.train.sources import DataError

    rec = {"image": ["a.jpg", "b.jpg"], "conversations": [
        {"from": "human", "value": "<image>\nWhat is here? And <image> here?"},
        {"from": "gpt", "value": "A cat, then a dog."}]}
    msgs = to_messages(rec)
    assert msgs[0]["role"] == "user" and [c["type"] for c in msgs[0]["content"]] == ["image", "text", "image", "text"]
    assert (msgs[0]["content"][2]["image"] == "b.jpg"
            and msgs[1]["content"] == [{"type": "text", "text": "A cat, then a dog."}])
    import pytest

    with pytest.raises(DataError, match="more <image> markers than images"):
        to_messages({"image": [], "conversations": [{"from": "human", "value": "<image>"}]})



def test_mmdu_image_markers_place_its_images():
    """MMDU marks its images <ImageHere> (as the eval loader reads them): split on <image> only, every image of an
    MMDU record was dropped and the marker trained as text. An image no marker places is an error, not dropped."""
    import pytest

    from retention.train.multimodal_data import to_messages
    from retention.train.sources import DataError

    rec = {"id": "7", "image": ["a.jpg", "b.jpg"], "conversations": [
        {"from": "user", "value": "Image1: <ImageHere>; Image2: <ImageHere>. Compare them."},
        {"from": "assistant", "value": "The first is brighter."}]}
    msgs = to_messages(rec)
    assert [c["type"] for c in msgs[0]["content"]] == ["text", "image", "text", "image", "text"]
    assert [c["image"] for c in msgs[0]["content"] if c["type"] == "image"] == ["a.jpg", "b.jpg"]
    assert not any("ImageHere" in c.get("text", "") for m in msgs for c in m["content"])
    with pytest.raises(DataError, match="1 more image\\(s\\) than <image> markers"):
        to_messages({"image": ["a.jpg", "b.jpg"], "conversations": [{"from": "human", "value": "<image> what?"}]})

def test_image_memory_trains_as_multimodal_conversations(tmp_path, monkeypatch):
    """A synthetic image_memory source (training haystacks, its own seed) becomes multimodal conversations: each
    opening turn's photo in the row's vision inputs, the text around them, and the answer (the number on a photo)
    among the distilled positions; a text run, or the eviction objective, refuses the task before any model loads."""
    import pytest

    from retention.train.config import ConfigError, DataConfig, SourceConfig
    from retention.train.multimodal_data import build_multimodal

    proc = tiny_qwen3_vl_processor()  # before the cache moves: its tokenizer is the embedded model's, cached
    monkeypatch.setenv("RETENTION_CACHE", str(tmp_path / "cache"))
    source = SourceConfig(kind="synthetic", path="image_memory", max_docs=3, params={"images": 2, "size": 112})
    train_rows, held = build_multimodal(DataConfig(sources=[source], seq_len=512, eval_fraction=0.0), proc)
    assert len(train_rows) >= 1 and len(held) == 0
    rows = [train_rows[i] for i in range(len(train_rows))]
    docs = sum(len(r["cu_seqlens"]) - 1 for r in rows)
    assert docs == 3 and all(int(r["input_ids"].shape[1]) <= 512 for r in rows)
    images = sum(int(r["image_grid_thw"].shape[0]) for r in rows)
    assert images == 2 * 3  # two photos in each of the three conversations
    tokens = sum(int((r["input_ids"] == proc.image_token_id).sum()) for r in rows)
    assert tokens == sum(int(r["image_grid_thw"].prod(-1).sum()) // 4 for r in rows) > 0
    predicted = " ".join(proc.tokenizer.decode(r["input_ids"][0, 1:][r["loss_mask"][0, :-1]]) for r in rows)
    from retention.tasks import generate

    answers = [it.answers[0] for it in generate("image_memory", proc.tokenizer, 512 - 128 - 2 * 16, 3, seed=1000,
                                                 split="train", images=2, size=112)]
    assert all(a in predicted for a in answers)  # the answers are distilled

    import retention.train.distill as distill

    built = {}
    real_build = distill.build_multimodal

    def spy(cfg, processor, cache=None):
        built["rows"] = real_build(cfg, processor, cache=cache)
        return built["rows"]

    monkeypatch.setattr(distill, "build_multimodal", spy)  # the training loop takes the multimodal path for this source
    (tmp_path / "im.yaml").write_text(f"""
model: {{name: tiny-qwen3-vl}}
gates: {{variant: global, gate_hidden: 8, bias_init: 3.0}}
budget: {{tokens_per_head: 8}}
data: {{seq_len: 512, eval_fraction: 0.3, sources: [{{kind: synthetic, path: image_memory, max_docs: 4, \
params: {{images: 2, size: 112}}}}]}}
train: {{output_dir: {tmp_path / 'run'}, steps: 2, lr: 0.05, warmup_steps: 1, log_every: 100, save_every: 100, \
tracker: none}}
""")
    summary = train(load_config(tmp_path / "im.yaml"), model_and_processor=(tiny_qwen3_vl_for(proc), proc))
    assert len(summary["history"]) == 2 and "pixel_values" in built["rows"][0][0]

    base = (f"model: {{name: tiny-qwen3-vl}}\nbudget: {{tokens_per_head: 8}}\n"
            f"train: {{output_dir: {tmp_path / 'run'}}}\n"
            "data:\n  seq_len: 512\n  sources:\n    - {kind: synthetic, path: image_memory, max_docs: 2}\n")
    for extra, words in (("    - {kind: text, path: sotu}\n", "beside kind: multimodal sources only"),
                         ("loss: {objective: evict}\n", "loss.objective: distill")):
        cfg = tmp_path / "c.yaml"
        cfg.write_text(base + extra if extra.startswith("    ") else base + extra)
        with pytest.raises(ConfigError, match=words):
            load_config(cfg)
