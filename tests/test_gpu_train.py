"""The README's GPU training recipe on a CUDA device: DeepSpeed ZeRO-2 and ZeRO-3 over NCCL in bf16
(``accelerate launch --config_file configs/accelerate/zero{2,3}.yaml``), training through the compiled Triton kernels
(``make test-gpu``; deselected with the ``gpu`` marker elsewhere). Their CPU twin, on DeepSpeed's CPU accelerator
over gloo and in fp32, is ``test_deepspeed_zero_trains_the_same_gates_and_resumes_exactly`` in test_train.py.

A process of its own, like test_gpu_kernels.py: the interpreter-mode test modules set ``TRITON_INTERPRET=1``.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

REPO = Path(__file__).resolve().parents[1]
# the embedded model's tokenizer, or RETENTION_GPU_MODEL's folder where the GGUF cannot travel (see test_gpu_kernels)
GPU_MODEL = os.environ.get("RETENTION_GPU_MODEL")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny Llama with the SmolLM2 tokenizer, a folder of real text (the standard library's module docs) and a
    run config of 128-token rows; returns the config's path."""
    import importlib

    from tiny_models import tiny_llama
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("gpu-train")
    if GPU_MODEL:
        tok = AutoTokenizer.from_pretrained(GPU_MODEL)
    else:
        from retention.models import embedded_model_dir

        tok = AutoTokenizer.from_pretrained(embedded_model_dir())
    tiny_llama(vocab_size=len(tok)).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    (root / "text").mkdir()
    for name in ("argparse", "collections", "email", "json", "logging", "pathlib", "subprocess", "typing"):
        doc = importlib.import_module(name).__doc__ or ""
        (root / "text" / f"{name}.txt").write_text(doc * 4)
    cfg = root / "run.yaml"
    cfg.write_text(
        f"model: {{name: {root / 'model'}}}\n"
        "gates: {variant: global, gate_hidden: 8, bias_init: 3.0}\n"
        "budget: {tokens_per_head: 8}\n"
        "loss: {kl_chunk: 64}\n"
        f"data: {{seq_len: 128, eval_fraction: 0.1, sources: [{{kind: text, path: {root / 'text'}}}]}}\n"
        "train: {steps: 4, batch_size: 2, lr: 0.05, warmup_steps: 1, log_every: 100, save_every: 2, tracker: none,\n"
        "        mixed_precision: bf16}\n"
    )
    return cfg


def _launch(cfg: Path, out: Path, launcher: list[str], *extra: str) -> str:
    """``accelerate launch`` one CUDA process of train.py as users launch it; its output."""
    from test_train import _free_port

    cmd = [sys.executable, "-m", "accelerate.commands.launch", *launcher, "--num_processes", "1", "--num_machines", "1",
           "--mixed_precision", "bf16", "--dynamo_backend", "no", "--main_process_port", str(_free_port()),
           str(REPO / "train.py"), "--config", str(cfg), "--set", f"train.output_dir={out}", *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=out.parent)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_in_bf16_trains_and_resumes_exactly_on_the_gpu(tiny_run, stage):
    """The shipped ZeRO-``stage`` config on one GPU (NCCL, DeepSpeed's bf16 engine: bf16 weights, fp32 master
    gates): the gates train (the loss falls, the weights move), a run stopped at step 2 and resumed ends on the
    uninterrupted run's losses and gates, and its first loss is one plain bf16-autocast process's (the same data and
    start; only the weights' precision differs)."""
    from test_train import tiny_gates_init

    from retention import load_gates

    zero = ["--use_deepspeed", "--deepspeed_config_file", str(REPO / "configs" / "deepspeed" / f"zero{stage}.json")]
    root = tiny_run.parent
    full, part, plain = (root / f"zero{stage}-{name}" for name in ("full", "part", "plain"))
    out_full = _launch(tiny_run, full, zero)
    assert "1 process (DEEPSPEED)" in out_full, out_full[-2000:]
    _launch(tiny_run, part, zero, "--set", "train.stop_after=2")
    out_resumed = _launch(tiny_run, part, zero, "--resume")
    assert "resumed from" in out_resumed and "Adam moments restart" not in out_resumed
    assert (part / "checkpoints" / "step-2" / "deepspeed").is_dir()
    _launch(tiny_run, plain, [])

    h_full, h_part, h_plain = (json.loads((d / "history.json").read_text()) for d in (full, part, plain))
    losses = [r["loss"] for r in h_full]
    print(f"ZeRO-{stage} losses {losses}, resumed {[r['loss'] for r in h_part]}, "
          f"plain bf16 autocast {[r['loss'] for r in h_plain]}")
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    assert [r["loss"] for r in h_part] == pytest.approx(losses, rel=2e-3)
    assert h_plain[0]["loss"] == pytest.approx(losses[0], rel=0.1)
    a, b = load_gates(full / "final"), load_gates(part / "final")
    assert (a.W1 - tiny_gates_init(a)).abs().max() > 1e-3  # trained away from their start
    assert a.state_dict().keys() == b.state_dict().keys()
    for k, v in a.state_dict().items():
        assert v.dtype == torch.float32, k  # exported as fp32, whatever the engine held
        torch.testing.assert_close(b.state_dict()[k], v, rtol=2e-3, atol=2e-4, msg=lambda m: f"{k}: {m}")
