"""A multimodal source's first records' images are opened and decoded before the model loads (issue 76): a missing
image gave a raw FileNotFoundError from the data pipeline after a Qwen3-VL had loaded."""

from __future__ import annotations

import json

import pytest

from retention.train.config import load_config
from retention.train.sources import DataError, check_local_source
from tiny_vl import photo_paths


def _config(tmp_path, records, image_root=None):
    data = tmp_path / "mm.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    root = f", image_root: {image_root}" if image_root else ""
    cfg = tmp_path / "vl.yaml"
    cfg.write_text(f"model: {{name: {tmp_path / 'model'}}}\nbudget: {{tokens_per_head: 4}}\n"
                   f"data: {{seq_len: 512, sources: [{{kind: multimodal, path: {data}{root}}}]}}\n"
                   f"train: {{output_dir: {tmp_path / 'run'}, tracker: none, batch_size: 1}}\n")
    return load_config(cfg)


def _record(image: str) -> dict:
    return {"conversations": [{"from": "human", "value": "<image>\nWhat is shown?"},
                              {"from": "gpt", "value": "A person."}], "image": image}


def test_a_missing_image_stops_the_run_before_the_model_loads_naming_record_path_and_root(tmp_path, monkeypatch):
    import retention.train.loop as loop

    images = tmp_path / "images"
    images.mkdir()
    photo = photo_paths()[0]
    (images / "a.jpg").write_bytes(photo.read_bytes())
    cfg = _config(tmp_path, [_record("a.jpg"), _record("b/missing.jpg")], image_root=images)
    monkeypatch.setattr(loop, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    monkeypatch.setattr("retention.models.load_config", lambda *a, **k: pytest.fail("read the model's config first"))
    with pytest.raises(DataError) as err:
        loop.train(cfg)
    msg = str(err.value)
    assert "mm.jsonl, line 2" in msg and "'b/missing.jpg'" in msg and str(images / "b" / "missing.jpg") in msg
    assert f"image_root {str(images)!r}" in msg


def test_an_image_that_does_not_decode_is_named_and_good_records_pass(tmp_path):
    (tmp_path / "bad.jpg").write_bytes(b"not an image at all")
    photo = photo_paths()[0]
    check_local_source(_config(tmp_path, [_record(str(photo))]).data.sources[0])  # an absolute path: no root needed
    with pytest.raises(DataError, match=r"mm.jsonl, line 1: image 'bad.jpg' .* does not decode .*no image_root set"):
        check_local_source(_config(tmp_path, [_record("bad.jpg")]).data.sources[0])
