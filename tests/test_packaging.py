"""The wheel a user installs: every module of the source tree, and the default gates of each embedded model.

Before, the wheel held no gates: an installed `retention chat` and the eval harness fell back to untrained gates
with only a warning. The wheel is built offline (`--no-build-isolation`, setuptools from the virtualenv) from a copy
of the tree, so the checkout gets no `build/` folder.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("setuptools")  # `make setup` installs it; without it no wheel can be built offline
    src = tmp_path_factory.mktemp("src") / "retention"
    skip = shutil.ignore_patterns(".git", ".venv", "runs", "build", "dist", "*.egg-info", "__pycache__", "results")
    shutil.copytree(ROOT, src, ignore=skip)
    out = tmp_path_factory.mktemp("dist")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(src), "-w", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (whl,) = out.glob("retention-*.whl")
    return whl


def _sources(package_root: str) -> set[str]:
    return {p.relative_to(ROOT).as_posix() for p in (ROOT / package_root).rglob("*.py") if "__pycache__" not in p.parts}


def test_the_wheel_holds_every_module_and_the_shipped_gates(wheel):
    from retention.models import EMBEDDED_MODELS

    import retention

    assert wheel.name.startswith(f"retention-{retention.__version__}-")  # one version: retention.__version__
    names = set(zipfile.ZipFile(wheel).namelist())
    # pyproject.toml lists the packages by hand: a new subpackage missing from that list fails here
    missing = _sources("retention") - names
    assert not missing, f"modules left out of the wheel (add their package to pyproject.toml): {sorted(missing)}"
    # one top-level package: `train` or `eval` in site-packages would clash with other projects' and a user's own
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"retention"}, f"top-level names in the wheel besides retention: {sorted(tops - {'retention'})}"
    for spec in EMBEDDED_MODELS.values():
        shipped = ROOT / "checkpoints" / spec.gates
        files = {f"retention/checkpoints/{spec.gates}/{p.name}" for p in shipped.iterdir() if p.is_file()}
        assert {"gates.safetensors", "retention.json"} <= {p.name for p in shipped.iterdir()}
        assert files <= names, f"shipped gates left out of the wheel: {sorted(files - names)}"
    assert not any(n.startswith("checkpoints/") for n in names)  # no stray top-level folder in site-packages


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """The wheel installed into a folder of its own (put it on PYTHONPATH to import from it)."""
    target = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return target


def test_an_installed_wheel_finds_its_shipped_gates(installed, tmp_path):
    target = installed
    probe = (
        "import retention, retention.models as m\n"
        "from retention.hub import load_gates\n"
        "path = m.shipped_gates('smollm2-135m')\n"
        "print(retention.__file__); print(path); print(load_gates(path).fingerprint())\n"
        "assert load_gates('smollm2-135m-global').fingerprint() == load_gates(path).fingerprint()  # by name\n"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}  # ahead of the checkout's editable install
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    module, path, fingerprint = done.stdout.split()[-3:]
    assert Path(module).is_relative_to(target), "the probe imported the checkout, not the installed wheel"
    assert Path(path) == target / "retention" / "checkpoints" / "smollm2-135m-global"
    from retention.hub import load_gates

    assert fingerprint == load_gates(ROOT / "checkpoints" / "smollm2-135m-global").fingerprint()


def test_a_users_own_eval_and_train_modules_are_never_imported(installed, tmp_path):
    """Run from a project folder with its own ``eval.py`` and ``train/`` (common names in ML projects), the installed
    command must neither execute them nor lose its ``eval`` command: the harness lives in ``retention.eval``."""
    (tmp_path / "eval.py").write_text("raise SystemExit(\"the user's eval.py ran\")\n")
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "__init__.py").write_text("raise SystemExit(\"the user's train package ran\")\n")
    env = {**os.environ, "PYTHONPATH": str(installed)}
    outputs = []
    for args in (["retention", "--help"], ["retention", "eval", "list"], ["retention.train", "--help"]):
        done = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                              env=env)  # `-m` puts the working folder first on sys.path
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        outputs.append(done.stdout)
    assert "niah_single" in outputs[1]  # `retention eval list` ran the installed harness
    assert "--config" in outputs[2]  # `python -m retention.train` (accelerate launch -m retention.train) installed


def test_an_installed_copy_asks_for_a_configs_path_instead_of_a_bare_name(installed, tmp_path):
    """The recipes stay in the repository: a bare config name given to an installed copy stops with a message that
    asks for a path, not one naming a folder inside site-packages that never existed."""
    env = {**os.environ, "PYTHONPATH": str(installed)}
    for args, prog in ((["retention.train", "--config", "smollm2.yaml"], "python -m retention.train"),
                       (["retention", "eval", "run", "--config", "smollm2-goal.yaml"], None)):
        done = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                              env=env)
        assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-3000:]
        assert "this installed copy has none: pass the YAML file's path" in done.stderr, done.stderr[-3000:]
        assert "site-packages" not in done.stderr and str(installed) not in done.stderr
        if prog:
            usage = subprocess.run([sys.executable, "-m", *args[:1], "--help"], capture_output=True, text=True,
                                   timeout=300, cwd=tmp_path, env=env).stdout
            assert usage.startswith(f"usage: {prog} "), usage[:200]


def test_the_inference_path_imports_no_triton():
    """Importing the cache, the chat, the policies and the gates imports no Triton: the kernels' modules load on a
    CUDA tensor's first use, so a CPU process pays no Triton import and a process may still choose the interpreter
    (``TRITON_INTERPRET=1``, read when Triton loads) afterwards. ``torch.nn.attention.bias`` imports Triton, so
    the cache builds its lower-right causal mask itself."""
    probe = ("import sys\n"
             "from retention import RetentionCache, RetentionChat, GlobalGatesPolicy, attach_gates, load_gates\n"
             "import retention.cache.hf, retention.cache.attention, retention.chat, retention.policies\n"
             "assert 'triton' not in sys.modules, 'triton was imported'\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_inference_classes_import_from_the_top_level_without_slowing_import_retention():
    """``from retention import RetentionChat, RetentionCache, ...`` gives the classes the README imports from their
    modules; ``import retention`` alone still does not import transformers (they load on first use)."""
    probe = ("import sys, retention\n"
             "assert 'transformers' not in sys.modules and 'retention.chat' not in sys.modules\n"
             "from retention import GlobalGatesPolicy, GraphDecoder, RetentionCache, RetentionChat, get_policy\n"
             "from retention.cache import GraphDecoder as G, RetentionCache as C\n"
             "from retention.chat import RetentionChat as R\n"
             "from retention.policies import GlobalGatesPolicy as P, get_policy as g\n"
             "assert (GraphDecoder, RetentionCache, RetentionChat, GlobalGatesPolicy, get_policy) == (G, C, R, P, g)\n"
             "assert set(retention.__all__) <= set(dir(retention))\n"
             "try:\n    retention.no_such_name\nexcept AttributeError as e:\n    assert 'no_such_name' in str(e)\n"
             "else:\n    raise SystemExit('an unknown name did not raise')\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("prog,launch", [
    ("train.py", "accelerate launch train.py --config"),
    ("python -m retention.train", "accelerate launch -m retention.train --config"),
    # `accelerate launch retention train` ran `python retention train`: no such script (in a checkout, the package
    # folder run as a script failed on its relative import)
    ("retention train", "accelerate launch -m retention train --config"),
])
def test_the_training_help_names_an_accelerate_command_that_runs(prog, launch, capsys):
    from retention.train import main

    with pytest.raises(SystemExit) as stop:
        main(["--help"], prog=prog)
    assert stop.value.code == 0 and launch in " ".join(capsys.readouterr().out.split())


def test_a_training_check_that_names_the_fix_exits_2_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """``train.py --resume FOLDER`` with no checkpoint there: the loop's check raised SystemExit(message), which
    Python turns into exit status 1 with no ``train.py: error:``, unlike the command's other errors (status 2)."""
    import retention.models
    from retention.train import main

    monkeypatch.setattr(retention.models, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as stop:
        main(["--config", str(Path(__file__).parents[1] / "configs" / "smollm2.yaml"),
              "--set", f"train.output_dir={tmp_path / 'run'}", "--resume", str(tmp_path / "empty")])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("train.py: error: --resume") and "drop --resume" in err
