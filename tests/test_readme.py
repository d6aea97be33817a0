"""The README and the pages under docs/: their Python examples run as written, from a folder outside the checkout (as
an installed user runs them), on the embedded model (only ``max_new_tokens`` is lowered, to keep the run short); every
relative link points at a file (and heading) that exists; the README stays a ten-minute read with its two commands."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = ("training.md", "inference.md", "evaluation.md", "kernels.md", "results.md")


def python_blocks(page: Path = README) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M)


def run_example(code: str, cwd: Path) -> str:
    code = re.sub(r"max_new_tokens=\d+", "max_new_tokens=4", code)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(README.parent)}
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"README example failed:\n{code}\n--- stderr ---\n{done.stderr[-3000:]}"
    return done.stdout


def test_the_readme_has_the_examples_this_file_runs():
    blocks = python_blocks()
    assert len(blocks) == 4, "a Python example was added to or removed from the README: update tests/test_readme.py"
    assert "model, tok" in blocks[1] and "GraphDecoder(model, cache)" in blocks[2]  # the later examples reuse the model
    assert "RetentionChat(model, tok" in blocks[3]
    (policy,) = python_blocks(DOCS / "inference.md")
    assert "class LowKeyNorm(EvictionPolicy)" in policy


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
    # a 39-token prompt outgrows 16 entries per head and the slack
    out = run_example(python_blocks(DOCS / "inference.md")[0], tmp_path)
    kept, full = (int(n.replace(",", "")) for n in re.search(r"KV cache: ([\d,]+) of ([\d,]+) entries", out).groups())
    assert kept < full and int(re.search(r"eviction rounds: (\d+)", out).group(1)) >= 1


def links(page: Path) -> list[tuple[str, str]]:
    """(target, anchor) of every relative Markdown link and image of a page, outside code blocks."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    found = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        found.append((path, anchor))
    return found


def anchors(page: Path) -> set[str]:
    """GitHub's ids of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", text, flags=re.M)}


def test_every_relative_link_of_the_readme_and_docs_resolves():
    pages = [README, *sorted(DOCS.glob("*.md"))]
    checked = 0
    for page in pages:
        for path, anchor in links(page):
            target = (page.parent / path).resolve() if path else page
            assert target.exists(), f"{page.relative_to(ROOT)} links to {path}, which does not exist"
            if anchor and target.suffix == ".md":
                assert anchor in anchors(target), f"{page.relative_to(ROOT)} links to {path}#{anchor}: no such heading"
            checked += 1
    assert checked >= 30  # the README and the docs link each other, the model card and the result pages


def test_the_readme_is_short_links_its_pages_and_keeps_the_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 300, "README.md is over 300 lines: move the detail into docs/"
    linked = {path for path, _ in links(README)}
    assert {f"docs/{p}" for p in PAGES} <= linked, "the README links every page of docs/"
    assert "checkpoints/smollm2-135m-global/README.md" in linked  # the model card
    assert all((DOCS / p).is_file() for p in PAGES)
    commands = re.search(r"## The two commands\n\n```bash\n(.*?)```", text, flags=re.S).group(1)
    assert re.search(r"^make demo\b", commands, flags=re.M) and re.search(r"^make test\b", commands, flags=re.M)
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, flags=re.M) and re.search(r"^test:", makefile, flags=re.M)
    demo_config = re.search(r"train\.py --config (\S+)", makefile).group(1)
    assert (ROOT / demo_config).is_file() and f"--config {demo_config}" in text  # the README runs what make demo runs
    results = text[text.index("## Results"):]
    table = [line for line in results[:results.index("\n## ")].splitlines() if line.startswith("|")]
    assert 3 <= len(table) <= 15, "the README's results table: at most 15 lines, the full tables in docs/results.md"


def test_the_published_sweep_has_its_place_in_docs():
    """`retention.eval run ... --readme docs/results.md` writes the sweep's table between these markers."""
    from retention.eval.publish import README_END, README_START

    text = (DOCS / "results.md").read_text()
    assert text.index(README_START) < text.index(README_END)
    assert "--readme docs/results.md" in text
