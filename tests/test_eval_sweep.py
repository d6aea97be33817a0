"""The sweep around the tasks: config validation before any model loads, a resumable tiny sweep,
the report (table + plots) from a fixed results file, Hub loaders on local files, and the embedded
model solving easy needles with the full cache."""

import json
import os
from pathlib import Path

import pytest

from eval.config import EvalConfigError, load_eval_config
from eval.report import markdown_table, write_report
from eval.runner import read_results, run_sweep


def test_config_errors_before_any_model_loads(tmp_path):
    p = tmp_path / "c.yaml"
    cases = [
        ("tasks: [niah_single]\nmethods: [{name: snapkvv}]\n", "unknown method 'snapkvv'"),
        ("taskz: [x]\n", r"unknown key\(s\) \['taskz'\]"),
        ("protocol: sometimes\n", r"choose one of \['query_agnostic', 'query_aware'\]"),
        ("tasks: [niah_nope]\n", "unknown task 'niah_nope'"),
        ("budgets: [64]\nmethods: [{name: snapkv}]\n", "a bare number must be a fraction"),
        ("methods: [{name: snapkv}, {name: snapkv}]\n", "labels must be distinct"),
        ("lengths: [10]\n", "integers >= 64"),
        ("methods: [{name: snapkv, params: {windw: 8}}]\n", "snapkv"),
    ]
    for text, match in cases:
        p.write_text(text)
        with pytest.raises(EvalConfigError, match=match):
            load_eval_config(p)
    with pytest.raises(EvalConfigError, match="not found"):
        load_eval_config(tmp_path / "missing.yaml")
    assert load_eval_config("tiny.yaml").tasks == ["niah_single", "fidelity"]


def test_tiny_sweep_resumes_without_duplicates(tmp_path):
    cfg = load_eval_config("tiny.yaml", output=str(tmp_path / "sweep"))
    results = run_sweep(cfg, progress=False)
    rows = read_results(results)
    # 2 tasks x 2 items x (full + 2 policies x 2 budgets)
    assert len(rows) == 2 * 2 * 5
    assert all(r["kept_entries"] <= r["budget_entries"] for r in rows if r.get("budget_entries"))
    full = [r for r in rows if r["method"] == "full" and r["task"] == "fidelity"]
    assert full and all(r["score"] == 100.0 and r["kl"] == pytest.approx(0, abs=1e-5) for r in full)
    lines = Path(results).read_text().splitlines()
    Path(results).write_text("\n".join(lines[:7]) + "\n" + lines[7][: len(lines[7]) // 2])  # interrupted mid-write
    run_sweep(cfg, progress=False)
    again = read_results(results)
    key = lambda r: (r["task"], r["item"], r["method"], r["budget"])  # noqa: E731
    assert len(again) == len({key(r) for r in again}) == 20
    for a in rows:  # deterministic: resumed rows equal the first run's
        b = next(r for r in again if key(r) == key(a))
        assert a["score"] == b["score"] and a["kept_entries"] == b["kept_entries"]


def test_report_from_a_fixed_results_file(tmp_path):
    base = {"task": "niah_single", "length": 1024, "full_cache_bytes": 2**20, "metric": "recall"}
    rows = [
        {**base, "item": "a", "method": "full", "budget": "full", "score": 100.0, "kept_entries": 1000, "kv_bytes": 2**20},
        {**base, "item": "a", "method": "snapkv", "budget": "fraction=0.1", "score": 50.0, "kept_entries": 100,
         "kv_bytes": 2**20 / 10},
        {**base, "item": "b", "method": "snapkv", "budget": "fraction=0.1", "score": 0.0, "kept_entries": 100,
         "kv_bytes": 2**20 / 10},
        {**base, "item": "c", "method": "snapkv", "budget": "fraction=0.1", "score": None, "error": "too small"},
    ]
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = markdown_table(read_results(path))
    assert "| niah_single | 1024 | full | full | 100.0 |  | 1,000 | 1.00 | 100% | 1 |" in table
    assert "| niah_single | 1024 | snapkv | 10% | 25.0 |  | 100 | 0.10 | 10% | 2 (1 failed) |" in table
    md = write_report(path)
    assert (tmp_path / "niah_single.png").stat().st_size > 1000 and "niah_single.png" in md.read_text()


def test_hub_loaders_on_local_files(tmp_path):
    from eval.loaders import DatasetUnavailableError, load_longbench, load_longbench_v2, load_mmdu, load_ruler

    def write(name, rows):
        p = tmp_path / name
        p.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(p)

    ruler = load_ruler(data_files=write("r.jsonl", [{"context": "c", "question": "q", "answer": ["x"], "task": "niah"}]))
    assert ruler[0].task == "ruler/niah" and ruler[0].answers == ["x"]
    lb = load_longbench("qasper", data_files=write("l.jsonl", [{"context": "c", "input": "q", "answers": ["a"], "_id": "1"}]))
    assert lb[0].answers == ["a"] and "q" in lb[0].question
    v2 = load_longbench_v2(data_files=write("v.jsonl", [{"_id": "9", "context": "c", "question": "q", "choice_A": "a",
                                                        "choice_B": "b", "choice_C": "c", "choice_D": "d", "answer": "C"}]))
    assert "C" in v2[0].answers[0] and "d" in v2[0].question
    mm = load_mmdu(data_files=write("m.jsonl", [{"id": 3, "image": ["x.jpg"], "conversations": [
        {"from": "human", "value": "<image> hi"}, {"from": "gpt", "value": "hello"},
        {"from": "human", "value": "what was it?"}, {"from": "gpt", "value": "a cat"}]}]))
    assert mm[0].messages[1]["role"] == "assistant" and mm[0].answers == ["a cat"] and mm[0].meta["images"] == ["x.jpg"]
    os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        with pytest.raises(DatasetUnavailableError, match="ruler"):
            load_ruler(length="nope")
    finally:
        del os.environ["HF_DATASETS_OFFLINE"], os.environ["HF_HUB_OFFLINE"]


@pytest.mark.smollm2
def test_smollm2_full_cache_solves_easy_needles():
    from eval.methods import FullCache
    from eval.models import load_eval_model
    from eval.protocol import run_item
    from eval.tasks import generate

    model, tok = load_eval_model("smollm2-135m")
    items = generate("niah_single", tok, 1024, 5, seed=0)
    scores = [run_item(model, tok, it, FullCache("full"), None, max_new_tokens=16)["score"] for it in items]
    assert sum(s == 100.0 for s in scores) >= 3, scores
