"""The README's Python examples run as written, from a folder outside the checkout (as an installed user runs
them), on the embedded model. Only ``max_new_tokens`` is lowered, to keep the run short."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path


README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def run_example(code: str, cwd: Path) -> str:
    code = re.sub(r"max_new_tokens=\d+", "max_new_tokens=4", code)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(README.parent)}
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"README example failed:\n{code}\n--- stderr ---\n{done.stderr[-3000:]}"
    return done.stdout


def test_the_readme_has_the_examples_this_file_runs():
    blocks = python_blocks()
    assert len(blocks) == 5, "a Python example was added to or removed from the README: update tests/test_readme.py"
    assert "model, tok" in blocks[1] and "GraphDecoder(model, cache)" in blocks[2]  # the later examples reuse the model
    assert "RetentionChat(model, tok" in blocks[3] and "class LowKeyNorm(EvictionPolicy)" in blocks[4]


def test_python_in_ten_lines(tmp_path):
    out = run_example(python_blocks()[0], tmp_path)
    assert out.count("<|im_start|>assistant") == 2  # teacher and student each generated


def test_inference_with_a_global_budget_then_a_chat(tmp_path):
    blocks = python_blocks()
    graph = blocks[2].replace("range(63)", "range(3)")  # 4 tokens, as max_new_tokens is lowered to for generate
    out = run_example(blocks[1] + "\n" + graph + "\n" + blocks[3], tmp_path)
    generated = out.splitlines()[0]  # generate's reply, then the cache's report, then GraphDecoder's reply
    assert generated.strip() and out.count(generated + "\n") == 2  # the planned steps decode generate's tokens
    assert out.count("KV cache:") == 2  # the cache's memory report, then the chat's


def test_writing_a_policy(tmp_path):
    """The custom policy example evicts through the cache: fewer entries kept than a full cache, at least one round."""
    out = run_example(python_blocks()[4], tmp_path)  # a 39-token prompt outgrows 16 entries per head and the slack
    kept, full = (int(n.replace(",", "")) for n in re.search(r"KV cache: ([\d,]+) of ([\d,]+) entries", out).groups())
    assert kept < full and int(re.search(r"eviction rounds: (\d+)", out).group(1)) >= 1
