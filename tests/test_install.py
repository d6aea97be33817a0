"""`pip install retention` where triton has no wheels (macOS, Windows) and without deepspeed (issue 76): the core
dependencies are what inference and loading gates need, the rest are extras, and the CPU paths run without them."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# modules that import triton at their top, imported only behind a CUDA / triton_available() check
TRITON_KERNEL_MODULES = {"retention/ops/retention_attention/triton_kernel.py",
                         "retention/ops/capacity/triton_kernel.py", "retention/cache/triton_decode.py"}
IMPORT_NAMES = {"PIL": "pillow", "yaml": "pyyaml"}  # import name -> distribution name where they differ


def _project() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].strip().lower().replace("_", "-")


def test_core_dependencies_install_everywhere_and_the_rest_are_extras():
    project = _project()
    core = {_name(r) for r in project["dependencies"]}
    for heavy in ("triton", "deepspeed", "peft", "datasets", "gguf", "flash-attn", "tensorboard", "wandb"):
        assert heavy not in core, f"{heavy} is a core dependency: it belongs in an extra"
    assert {"torch", "transformers", "safetensors", "huggingface-hub", "numpy", "pyyaml", "tqdm"} <= core
    extras = project["optional-dependencies"]
    names = {k: {_name(r) for r in v} for k, v in extras.items()}
    assert {"accelerate", "deepspeed", "peft", "datasets"} <= names["train"]
    assert {"gguf", "accelerate"} <= names["embedded"]
    assert {"tensorboard", "wandb"} <= names["tracking"]
    assert {"triton", "flash-attn"} <= names["gpu"]
    for extra in ("gpu", "dev"):  # triton has Linux wheels only
        (triton,) = [r for r in extras[extra] if _name(r) == "triton"]
        assert re.search(r";\s*platform_system\s*==\s*['\"]Linux['\"]", triton), triton


def test_every_module_imports_only_core_dependencies_at_its_top():
    """A third-party import at a module's top runs on ``import retention.x``: it must be a core dependency (or the
    standard library, or a Triton kernel module imported only where Triton is)."""
    core = {_name(r) for r in _project()["dependencies"]}
    stray = []
    for path in sorted((ROOT / "retention").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in TRITON_KERNEL_MODULES:
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                tops = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                tops = [node.module.split(".")[0]]
            else:
                continue
            for top in tops:
                if top in sys.stdlib_module_names or top == "retention" or top == "__future__":
                    continue
                if IMPORT_NAMES.get(top, top).lower().replace("_", "-") not in core:
                    stray.append(f"{rel}: {top}")
    assert not stray, f"top-level imports of packages that are not core dependencies (import them lazily): {stray}"


PROBE = r"""
import sys
for name in ("triton", "deepspeed"):  # as on a machine where they are not installed
    sys.modules[name] = None
sys.path.insert(0, "tests")
import torch
import retention
from retention import RetentionCache, attach_gates
from retention.compat import cache_kwargs
from tiny_models import tiny_llama

model = tiny_llama()
gates = attach_gates(model)
ids = torch.randint(0, 100, (1, 120), generator=torch.Generator().manual_seed(0))
with gates.student():
    loss = model(input_ids=ids, labels=ids).loss
loss.backward()
assert all(p.grad is not None for p in gates.gates.parameters() if p.requires_grad)
gates.set_mode("score")
cache = RetentionCache(model, budget=RetentionCache.budget_for(model, tokens=8))
with torch.no_grad():
    out = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, **cache_kwargs(cache))
assert out.shape[1] == 124
import retention.chat, retention.cli, retention.hub, retention.train.config, retention.train.loop  # noqa: E401
import retention.retention_map, retention.tiny_model, retention.train.recipes  # noqa: E401
retention.cli.build_parser()  # every subcommand registers
print("ok", "evicted" if "eviction rounds: 0" not in str(cache.memory_report()) else "kept all")
"""


def test_the_cpu_paths_run_without_triton_and_deepspeed():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["ok", "evicted"], done.stdout


def test_make_setup_installs_the_extras_the_demo_and_the_tests_need():
    make = (ROOT / "Makefile").read_text()
    (line,) = [ln for ln in make.splitlines() if "pip install" in ln and " -e " in ln]
    extras = set(re.search(r'-e "\.\[([^\]]+)\]"', line).group(1).split(","))
    assert {"train", "embedded", "dev"} <= extras, line
    assert "--no-build-isolation" in make and "--no-deps" in make  # deepspeed against the torch above; the models
