"""Mixed precision as accelerate users write it (issue 76): `mixed_precision: no` in YAML (read as false) and in
`--set`, `auto` following `accelerate launch --mixed_precision`, a config's own precision winning over accelerate's
with a line that says so, and a CPU run saying the device and precision it uses before the model loads."""

from __future__ import annotations

import pytest

from retention.train.config import load_config
from retention.train.precision import resolve_mixed_precision, training_precision
from tiny_models import tiny_llama


def _yaml(tmp_path, train_extra: str = "", model_extra: str = "", name: str = "smollm2-135m"):
    text = tmp_path / "text"
    text.mkdir(exist_ok=True)
    (text / "a.txt").write_text("one two three four five six seven eight nine ten " * 40)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model: {{name: {name}{model_extra}}}\nbudget: {{tokens_per_head: 4}}\n"
                   f"data: {{seq_len: 32, sources: [{{kind: text, path: {text}}}]}}\n"
                   f"train: {{output_dir: {tmp_path / 'run'}, tracker: none{train_extra}}}\n")
    return cfg


def test_no_in_yaml_and_in_set_means_no_mixed_precision(tmp_path):
    assert load_config(_yaml(tmp_path, ", mixed_precision: no")).train.mixed_precision == "no"
    assert load_config(_yaml(tmp_path), ["train.mixed_precision=no"]).train.mixed_precision == "no"
    assert load_config(_yaml(tmp_path), ["train.mixed_precision=bf16"]).train.mixed_precision == "bf16"
    with pytest.raises(ValueError, match="train.mixed_precision"):  # true names no precision
        load_config(_yaml(tmp_path), ["train.mixed_precision=yes"])


def test_auto_follows_accelerate_launch_and_a_named_precision_wins_saying_so():
    env = {"ACCELERATE_MIXED_PRECISION": "fp16"}
    assert resolve_mixed_precision("auto", cuda=True, env=env)[0] == "fp16"
    assert resolve_mixed_precision("auto", cuda=True, env={})[0] == "bf16"
    assert resolve_mixed_precision("auto", cuda=False, env={})[0] == "no"
    mp, why = resolve_mixed_precision("bf16", cuda=True, env=env)
    assert mp == "bf16" and "bf16 from the config wins over accelerate launch's --mixed_precision fp16" in why
    assert "wins" not in resolve_mixed_precision("bf16", cuda=True, env={"ACCELERATE_MIXED_PRECISION": "bf16"})[1]


def test_a_cpu_run_says_its_device_and_precision_first_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """bf16 + gradient checkpointing on a machine without a GPU started silently."""
    from accelerate.state import AcceleratorState

    import retention.train.loop as loop

    AcceleratorState._reset_state(True)  # an earlier test's Accelerator (another precision) must not be reused
    model_dir = tmp_path / "model"
    tiny_llama().save_pretrained(model_dir)  # its config is read before the load
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    monkeypatch.setattr(loop.torch.cuda, "is_available", lambda: False)

    class Loaded(Exception):
        pass

    def load_model(*a, **k):
        raise Loaded

    monkeypatch.setattr(loop, "load_model", load_model)
    cfg = load_config(_yaml(tmp_path, ", mixed_precision: bf16", ", gradient_checkpointing: true", str(model_dir)))
    with pytest.raises(Loaded):
        loop.train(cfg)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[retention]")]
    assert lines, "the run printed nothing before the model loaded"
    first = lines[0]
    for part in ("training on CPU", "bf16 autocast", "gradient checkpointing on", "train.mixed_precision: no"):
        assert part in first, first


def test_only_the_main_process_prints_the_line(capsys):
    cfg = load_config(None, ["budget.tokens_per_head=4"])
    assert training_precision(cfg, cuda=False, env={"RANK": "1"}) == "no"
    assert capsys.readouterr().out == ""
    assert training_precision(cfg, cuda=False, env={"ACCELERATE_MIXED_PRECISION": "bf16"}) == "bf16"
    assert "follows accelerate launch's --mixed_precision bf16" in capsys.readouterr().out
