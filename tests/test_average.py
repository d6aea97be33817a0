"""Averaging gate checkpoints: the weighted mean of every parameter, written as an ordinary checkpoint."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from retention.average import average_checkpoints, average_gates, normalised_weights
from retention.cli import main
from retention.gates import GateConfig, RetentionGates
from retention.hub import export_gates, load_gates
from retention.models import shipped_checkpoint
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


def test_weights_that_are_infinite_or_whose_sum_overflows_are_refused_or_kept_exact():
    """inf was taken as a weight (inf / inf: NaN gates, returned without a word) and 1e308 twice summed to inf, so
    every normalised weight was 0 and the "mean" was all-zero gates; the CLI then blamed weights it had made."""
    a, b = _gates(0), _gates(1)
    for bad in ([math.inf, 1.0], [1.0, -math.inf], [math.nan, 1.0]):
        with pytest.raises(ValueError, match=r"finite and >= 0.*got \[(inf|nan|1.0)"):
            average_gates([a, b], bad)
    assert normalised_weights([1e308, 1e308], 2) == [0.5, 0.5]
    assert normalised_weights([1e308, 3e307], 2) == pytest.approx([1 / 1.3, 0.3 / 1.3])
    mean = average_gates([a, b], [1e308, 1e308])
    for name, t in mean.state_dict().items():
        torch.testing.assert_close(t, 0.5 * a.state_dict()[name] + 0.5 * b.state_dict()[name])


def test_average_command_writes_a_checkpoint_that_records_its_sources(tmp_path, capsys):
    a, b = _gates(0), _gates(1)
    pa = export_gates(a, tmp_path / "a", base_model="tiny-llama", budget="10%", training={"config": "configs/a.yaml"})
    pb = export_gates(b, tmp_path / "b", base_model="tiny-llama", budget="10%", training={"config": "configs/b.yaml"})
    assert main(["average", str(pa), str(pb), "--weights", "0.75", "0.25", "--out", str(tmp_path / "soup")]) == 0
    out = tmp_path / "soup"
    assert capsys.readouterr().out.strip() == str(out)
    loaded = load_gates(out, model=tiny_llama())
    torch.testing.assert_close(loaded.W1, 0.75 * a.W1 + 0.25 * b.W1)
    cfg = json.loads((out / "retention.json").read_text())
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
    assert ("retention.json not found: a gate checkpoint needs retention.json (config.json before it) and "
            "gates.safetensors") in capsys.readouterr().err
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


def _nan_copy(src: Path, dest: Path) -> Path:
    """A copy of the checkpoint ``src`` at ``dest`` with its ``w`` tensor all NaN, as a diverged run exported it
    before the hash of the tensors was recorded (no ``gates_sha256``: a changed tensor is damage)."""
    shutil.copytree(src, dest)
    state = load_file(dest / "gates.safetensors")
    state["w"] = torch.full_like(state["w"], float("nan"))
    save_file(state, dest / "gates.safetensors", metadata={"format": "pt"})
    meta = json.loads((dest / "retention.json").read_text())
    meta.pop("gates_sha256", None)
    (dest / "retention.json").write_text(json.dumps(meta))
    return dest


def test_average_refuses_a_source_with_nan_weights_before_writing(tmp_path, capsys):
    """A diverged run's NaN gates were averaged into a NaN checkpoint, exit 0."""
    shipped = shipped_checkpoint("smollm2-135m-trimkv")
    nan = _nan_copy(shipped, tmp_path / "nan-gates")
    assert main(["average", str(shipped), str(nan), "--out", str(tmp_path / "soup")]) == 2
    err = capsys.readouterr().err
    assert str(nan) in err and "w (2880 of 2880 values)" in err and "diverged" in err and "train.lr" in err
    assert not (tmp_path / "soup").exists()


def test_average_refuses_a_non_finite_mean(tmp_path, monkeypatch):
    import retention.average

    pa = export_gates(_gates(0), tmp_path / "a", base_model="tiny-llama")
    pb = export_gates(_gates(1), tmp_path / "b", base_model="tiny-llama")

    def overflowing(gate_sets, weights=None):  # finite sources, a mean that is not (e.g. an overflow)
        out = average_gates(gate_sets, weights)
        with torch.no_grad():
            out.W1.fill_(float("inf"))
        return out

    monkeypatch.setattr(retention.average, "average_gates", overflowing)
    with pytest.raises(ValueError, match=r"holds NaN or inf in W1 \("):
        average_checkpoints([pa, pb], tmp_path / "soup")
    assert not (tmp_path / "soup").exists()


def test_average_of_sources_at_different_budgets_states_each_budget(tmp_path):
    """The card and config said the first source's budget ("96 entries per KV head") for a mean with a 384 one."""
    pa = export_gates(_gates(0), tmp_path / "a", base_model="tiny-llama", budget="96 entries", base_revision="r1")
    pb = export_gates(_gates(1), tmp_path / "b", base_model="tiny-llama", budget="384 entries", base_revision="r2")
    out = average_checkpoints([pa, pb], tmp_path / "soup")
    cfg = json.loads((out / "retention.json").read_text())
    want = "differs by source: source 0: 96 entries; source 1: 384 entries"
    assert cfg["budget"] == want and f"| training budget | {want} |" in (out / "README.md").read_text()
    # no one base revision is the mean's: none claimed, each recorded
    assert cfg["base_revision"] is None
    assert cfg["training"]["base_revision"] == "differs by source: source 0: r1; source 1: r2"
    # shared facts are stated once, as before
    pc = export_gates(_gates(2), tmp_path / "c", base_model="tiny-llama", budget="96 entries", base_revision="r1")
    cfg = json.loads((average_checkpoints([pa, pc], tmp_path / "soup2") / "retention.json").read_text())
    assert cfg["budget"] == "96 entries" and cfg["base_revision"] == "r1" and "base_revision" not in cfg["training"]


def test_average_refuses_one_checkpoint_named_twice(tmp_path, capsys, monkeypatch):
    """`retention average A A` wrote A's gates back as a "soup" of two sources; refused before anything is read."""
    import retention.average

    pa = export_gates(_gates(0), tmp_path / "a", base_model="tiny-llama")
    pb = export_gates(_gates(1), tmp_path / "b", base_model="tiny-llama")
    monkeypatch.setattr(retention.average, "checkpoint_folder", lambda p: pytest.fail("read a checkpoint first"))
    for same in (str(pa), str(pa / "gates.safetensors"), str(tmp_path / "b" / ".." / "a")):
        assert main(["average", str(pa), str(pb), same, "--out", str(tmp_path / "soup")]) == 2
        err = capsys.readouterr().err
        assert f"and {same} are the same checkpoint ({pa.resolve()})" in err and "--weights" in err
    assert not (tmp_path / "soup").exists()


def test_average_refuses_copies_of_one_checkpoint_in_two_folders(tmp_path, capsys):
    """A copy of a checkpoint in another folder passed the by-path check and was written as a two-source soup."""
    pa = export_gates(_gates(0), tmp_path / "a", base_model="tiny-llama")
    pb = export_gates(_gates(1), tmp_path / "b", base_model="tiny-llama")
    copy = shutil.copytree(pa, tmp_path / "copy")
    assert main(["average", str(pb), str(pa), str(copy), "--out", str(tmp_path / "soup")]) == 2
    err = capsys.readouterr().err
    assert f"{pa} and {copy} hold the same gate weights" in err and "--weights" in err
    assert not (tmp_path / "soup").exists()
    assert main(["average", str(pa), str(pb), "--out", str(tmp_path / "soup")]) == 0  # distinct sets still average


def test_average_reads_a_checkpoint_from_before_retention_json(tmp_path):
    """A source whose metadata is still in config.json (with the card's results) averages as any other; the mean is
    written with retention.json."""
    pa = export_gates(_gates(0), tmp_path / "a", base_model="tiny-llama", budget="10%", training={"config": "a.yaml"})
    pb = export_gates(_gates(1), tmp_path / "b", base_model="tiny-llama", budget="10%", training={"config": "b.yaml"})
    meta = json.loads((pb / "retention.json").read_text())
    (pb / "retention.json").unlink()
    (pb / "config.json").write_text(json.dumps({**meta, "results_markdown": "| a table |"}))
    out = average_checkpoints([pa, pb], tmp_path / "soup")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "gates.safetensors", "retention.json"]
    cfg = json.loads((out / "retention.json").read_text())
    assert cfg["training"]["source 1"] == "b.yaml" and cfg["budget"] == "10%" and "results_markdown" not in cfg


def test_gates_from_before_the_base_architecture_was_recorded_average_with_newer_ones():
    """A checkpoint without base_architecture (the shipped ones) and a newer one of that model were "of another
    layout"; the mean keeps the architecture the newer set records, and two different architectures are refused."""
    new = _gates(0)
    old = RetentionGates(GateConfig(**{**new.config.to_dict(), "base_model_type": None, "base_architecture": None}))
    for sets in ([old, new], [new, old], [old, old, new]):
        mean = average_gates(sets)
        assert mean.config.base_architecture == new.config.base_architecture
        assert mean.config.base_model_type == "llama"
    other = RetentionGates(GateConfig(**{**new.config.to_dict(), "base_architecture": "0" * 12}))
    with pytest.raises(ValueError, match=r"base_architecture \('000000000000' vs"):
        average_gates([old, new, other])
