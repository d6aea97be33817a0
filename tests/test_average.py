"""Averaging gate checkpoints: the weighted mean of every parameter, written as an ordinary checkpoint."""

import json

import pytest
import torch

from retention.average import average_checkpoints, average_gates
from retention.cli import main
from retention.gates import GateConfig, RetentionGates
from retention.hub import export_gates, load_gates
from tiny_models import tiny_llama


def _gates(seed: int, **options) -> RetentionGates:
    config = GateConfig.for_model(tiny_llama(), base_model="tiny-llama", **options)
    torch.manual_seed(seed)  # after building the model, which seeds its own weights
    return RetentionGates(config)


def test_average_is_the_weighted_mean_of_every_parameter():
    a, b, c = _gates(0), _gates(1), _gates(2)
    mean = average_gates([a, b, c], [1, 2, 1])
    for name, t in mean.state_dict().items():
        want = 0.25 * a.state_dict()[name] + 0.5 * b.state_dict()[name] + 0.25 * c.state_dict()[name]
        torch.testing.assert_close(t, want)
        assert not torch.equal(t, a.state_dict()[name]) or name in ("b1", "b")  # biases start equal
    # a weight of zero leaves the other set exactly; the inputs are not modified
    only_a = average_gates([a, b], [3.0, 0.0])
    for name, t in only_a.state_dict().items():
        assert torch.equal(t, a.state_dict()[name])
    assert not torch.equal(a.W1, b.W1)


def test_average_refuses_other_layouts_and_bad_weights():
    a = _gates(0)
    with pytest.raises(ValueError, match="gate_hidden"):
        average_gates([a, _gates(1, gate_hidden=8)])
    with pytest.raises(ValueError, match="variant"):
        average_gates([a, _gates(1, variant="trimkv")])
    with pytest.raises(ValueError, match="one weight per checkpoint"):
        average_gates([a, _gates(1)], [1.0])
    with pytest.raises(ValueError, match="positive sum"):
        average_gates([a, _gates(1)], [0.0, 0.0])
    with pytest.raises(ValueError, match=">= 0"):
        average_gates([a, _gates(1)], [1.0, -0.5])
    with pytest.raises(ValueError, match="at least two"):
        average_gates([a])


def test_average_command_writes_a_checkpoint_that_records_its_sources(tmp_path, capsys):
    a, b = _gates(0), _gates(1)
    pa = export_gates(a, tmp_path / "a", base_model="tiny-llama", budget="10%", training={"config": "configs/a.yaml"})
    pb = export_gates(b, tmp_path / "b", base_model="tiny-llama", budget="10%", training={"config": "configs/b.yaml"})
    assert main(["average", str(pa), str(pb), "--weights", "0.75", "0.25", "--out", str(tmp_path / "soup")]) == 0
    out = tmp_path / "soup"
    assert capsys.readouterr().out.strip() == str(out)
    loaded = load_gates(out, model=tiny_llama())
    torch.testing.assert_close(loaded.W1, 0.75 * a.W1 + 0.25 * b.W1)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["training"]["averaged_from"] == f"0.75 x {pa} + 0.25 x {pb}"
    assert cfg["training"]["source 1"] == "configs/b.yaml" and cfg["budget"] == "10%"
    assert "| averaged_from | 0.75 x" in (out / "README.md").read_text()


def test_average_refuses_an_out_folder_of_other_files_before_reading(tmp_path, capsys, monkeypatch):
    import retention.average

    monkeypatch.setattr(retention.average, "checkpoint_folder", lambda p: pytest.fail("read a checkpoint first"))
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "notes.txt").write_text("keep me")
    assert main(["average", "a", "b", "--out", str(tmp_path / "work")]) == 2
    assert "does not hold a gate checkpoint" in capsys.readouterr().err
    assert (tmp_path / "work" / "notes.txt").read_text() == "keep me"


def test_average_refuses_to_write_over_one_of_its_sources(tmp_path, capsys):
    """`retention average A B --out A` used to replace A's gates, card and plots with the mean: refused, A kept."""
    pa = export_gates(_gates(0), tmp_path / "a", base_model="tiny-llama")
    pb = export_gates(_gates(1), tmp_path / "b", base_model="tiny-llama")
    (pa / "results.png").write_bytes(b"a plot")
    before = (pa / "gates.safetensors").read_bytes()
    assert main(["average", str(pa), str(pb), "--out", str(tmp_path / "x" / ".." / "a")]) == 2
    assert "is one of the checkpoints averaged" in capsys.readouterr().err
    # named by its gates file, the source was not recognised as --out and was replaced
    assert main(["average", str(pa / "gates.safetensors"), str(pb), "--out", str(pa)]) == 2
    assert "is one of the checkpoints averaged" in capsys.readouterr().err
    assert (pa / "gates.safetensors").read_bytes() == before and (pa / "results.png").read_bytes() == b"a plot"


def test_average_refuses_checkpoints_of_different_base_models(tmp_path):
    pa = export_gates(_gates(0), tmp_path / "a", base_model="tiny-llama")
    pb = export_gates(_gates(1), tmp_path / "b", base_model="other-model")
    with pytest.raises(ValueError, match="different base models"):
        average_checkpoints([pa, pb], tmp_path / "soup")
    assert not (tmp_path / "soup").exists()


def test_average_command_reports_bad_input_without_a_traceback(tmp_path, capsys):
    pa = export_gates(_gates(0), tmp_path / "a", base_model="tiny-llama")
    pb = export_gates(_gates(1, gate_hidden=8), tmp_path / "b", base_model="tiny-llama")
    assert main(["average", str(pa), str(pb), "--out", str(tmp_path / "soup")]) == 2
    assert "gate_hidden" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["average", str(pa), str(tmp_path / "empty"), "--out", str(tmp_path / "soup")]) == 2
    assert "config.json not found: a gate checkpoint needs config.json and gates.safetensors" in capsys.readouterr().err
    assert not (tmp_path / "soup").exists()


def test_bad_weights_are_refused_before_any_checkpoint_is_read(tmp_path):
    # the paths do not exist (nor are they Hub repos): the weights are named first, nothing is downloaded
    with pytest.raises(ValueError, match="3 weights for 2 gate sets"):
        average_checkpoints([tmp_path / "a", tmp_path / "b"], tmp_path / "soup", weights=[1, 1, 1])
    assert not (tmp_path / "soup").exists()


def test_a_single_checkpoint_is_refused_before_it_is_read(tmp_path):
    # the path does not exist: the count is named first, not a missing file
    with pytest.raises(ValueError, match="at least two gate sets, got 1"):
        average_checkpoints([tmp_path / "a"], tmp_path / "soup")
    assert not (tmp_path / "soup").exists()
