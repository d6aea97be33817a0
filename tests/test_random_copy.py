"""``benchmarks/random_copy.py``: the random-weight copy that the GPU checks run on where the real weights cannot
travel. Config and tokenizer are the source's; the weights are fresh, seeded, and the copy loads like any model
folder."""

import torch
from safetensors.torch import load_file

from retention import load_model
from retention.models import embedded_model_dir


def test_a_random_copy_keeps_config_and_tokenizer_and_draws_seeded_weights(tmp_path):
    from tiny_models import tiny_llama
    from transformers import AutoTokenizer

    from benchmarks.random_copy import main

    src = tiny_llama(seed=7)  # not the copy's default seed (0), which would draw the same weights
    src.save_pretrained(tmp_path / "src")
    AutoTokenizer.from_pretrained(embedded_model_dir()).save_pretrained(tmp_path / "src")
    assert main([str(tmp_path / "src"), str(tmp_path / "shape"), "--no-weights"]) == 0
    assert not list((tmp_path / "shape").glob("*.safetensors"))  # small enough to carry: no weights
    for name in ("a", "b"):
        assert main([str(tmp_path / "shape"), str(tmp_path / name)]) == 0  # the default seed, twice
    assert main([str(tmp_path / "shape"), str(tmp_path / "c"), "--seed", "1"]) == 0

    model, tok = load_model(str(tmp_path / "a"))
    assert model.config.num_hidden_layers == src.config.num_hidden_layers
    assert model.config.hidden_size == src.config.hidden_size and tok("hello").input_ids
    weights = {n: load_file(tmp_path / n / "model.safetensors") for n in ("a", "b", "c")}
    key = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(weights["a"][key], weights["b"][key])  # seeded: the same copy twice
    assert not torch.equal(weights["a"][key], weights["c"][key])
    assert not torch.equal(weights["a"][key], src.state_dict()[key])  # fresh weights, not the source's


def test_a_random_copy_refuses_a_file_or_a_folder_it_did_not_write_before_loading_anything(tmp_path, monkeypatch,
                                                                                          capsys):
    """OUT is written whole: a folder of something else (a gate checkpoint) would lose its config.json, and a file
    gave a FileExistsError traceback. Both are refused before the source is read; a copy written earlier is
    replaced."""
    import pytest

    import retention.models
    from benchmarks.random_copy import MARKER, main

    gates = tmp_path / "gates"
    gates.mkdir()
    (gates / "config.json").write_text('{"gate_config": {}}')
    (tmp_path / "file").write_text("x")
    real = retention.models.load_config
    monkeypatch.setattr(retention.models, "load_config", lambda *a, **k: pytest.fail("read the source first"))
    for out, words in ((gates, "a folder that does not hold a random copy"), (tmp_path / "file", "is a file")):
        assert main(["smollm2-135m", str(out), "--no-weights"]) == 2
        assert "error: " in (err := capsys.readouterr().err) and words in err and "Traceback" not in err
    assert (gates / "config.json").read_text() == '{"gate_config": {}}'
    monkeypatch.setattr(retention.models, "load_config", real)
    assert main([str(tmp_path / "nonexistent"), str(tmp_path / "new")]) == 2  # an unknown source: no traceback
    assert "cannot load model" in capsys.readouterr().err and not (tmp_path / "new").exists()
    old = tmp_path / "old"
    old.mkdir()
    (old / MARKER).write_text("{}")
    (old / "stale.txt").write_text("x")
    assert main(["smollm2-135m", str(old), "--no-weights"]) == 0  # its own earlier copy: replaced whole
    assert (old / "config.json").is_file() and (old / MARKER).is_file() and not (old / "stale.txt").exists()


def test_a_copy_without_weights_is_refused_by_a_command_with_the_fix_not_a_traceback(tmp_path, capsys):
    """``--no-weights`` writes config and tokenizer only; ``retention demo --model`` on it (or any command that loads
    it) printed transformers' OSError traceback and exited with status 1."""
    from transformers import AutoTokenizer

    from retention.cli import main
    from benchmarks.random_copy import random_copy

    (tmp_path / "src").mkdir()
    __import__("tiny_models").tiny_llama().config.save_pretrained(tmp_path / "src")
    AutoTokenizer.from_pretrained(embedded_model_dir()).save_pretrained(tmp_path / "src")
    random_copy(str(tmp_path / "src"), tmp_path / "shape", weights=False)
    assert main(["demo", "--model", str(tmp_path / "shape"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "error: cannot load model" in err and "benchmarks.random_copy" in err and "Traceback" not in err
