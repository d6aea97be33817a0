"""`retention tiny-model DIR --arch qwen3-vl|llama` (issue 76): a tiny random model saved with save_pretrained, with a
real tokenizer or processor, that `load_model(DIR)` loads and gates attach to. The Qwen3-VL processor without a
video processor could not `save_pretrained` before (its save walked a None video processor)."""

from __future__ import annotations

import pytest
import torch

from retention import attach_gates, load_model
from retention.cli import main
from tiny_vl import photos


@pytest.mark.parametrize("arch", ["llama", "qwen3-vl"])
def test_the_command_writes_a_model_that_loads_and_runs_a_student_forward(arch, tmp_path, capsys):
    dest = tmp_path / arch
    assert main(["tiny-model", str(dest), "--arch", arch]) == 0
    assert f"--model {dest}" in capsys.readouterr().out
    model, processor = load_model(str(dest))
    gates = attach_gates(model)
    messages = [{"role": "user", "content": "Name three rivers."}]
    if arch == "llama":
        inputs = processor.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)
    else:
        assert type(model).__name__ == "Qwen3VLForConditionalGeneration" and hasattr(processor, "image_processor")
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
        inputs = processor(text=[text], images=photos(1), return_tensors="pt")
        assert int((inputs["input_ids"] == model.config.image_token_id).sum()) > 0
    with gates.student():
        out = model(**inputs)
    assert out.logits.shape[:2] == inputs["input_ids"].shape and torch.isfinite(out.logits).all()


def test_the_processor_saves_and_loads_back(tmp_path):
    from retention.models import load_config, load_processor
    from retention.tiny_model import build_tiny_model

    model, processor = build_tiny_model("qwen3-vl")
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)  # AttributeError on the None video processor before
    back = load_processor(str(tmp_path), load_config(str(tmp_path))[0])
    assert back.chat_template == processor.chat_template
    assert back.tokenizer.convert_tokens_to_ids("<|image_pad|>") == model.config.image_token_id
    assert dict(back.image_processor.size) == dict(processor.image_processor.size) == {"longest_edge": 112 * 112,
                                                                                       "shortest_edge": 56 * 56}


def test_a_folder_of_other_files_is_refused(tmp_path, capsys):
    (tmp_path / "x.txt").write_text("mine")
    assert main(["tiny-model", str(tmp_path)]) == 2
    assert "not an empty folder" in capsys.readouterr().err
    assert (tmp_path / "x.txt").read_text() == "mine"
