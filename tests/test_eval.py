"""Evaluation harness: generated items are answerable and hit their length, metrics on hand-made
cases, a tiny resumable sweep, report rendering, Hub-set loaders on local files."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from eval.loaders import load_longbench, load_longbench_v2, load_mmdu, load_ruler
from eval.metrics import answer_recall, kl_and_top1
from eval.report import markdown_table, write_report
from eval.runner import EvalConfig, EvalConfigError, load_eval_config, read_results, run_sweep
from eval.tasks import TASKS
from retention.models import embedded_model_dir


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(embedded_model_dir())


@pytest.mark.parametrize("task", sorted(TASKS))
def test_items_are_answerable_and_hit_the_length(task, tok):
    for length in (256, 1024):
        items = TASKS[task](tok, length, 3, seed=1, split="eval")
        assert len(items) == 3 and len({i.id for i in items}) == 3
        for it in items:
            text = it.context if it.messages is None else tok.apply_chat_template(it.messages, tokenize=False)
            n = len(tok(text, add_special_tokens=False)["input_ids"])
            assert 0.8 * length <= n <= 1.25 * length, (task, length, n)
            if task == "fidelity":
                assert it.continuation and not it.answers
            else:
                assert it.answers and all(a.lower() in text.lower() for a in it.answers)
    again = TASKS[task](tok, 256, 3, seed=1, split="eval")
    assert [i.context for i in again] == [i.context for i in TASKS[task](tok, 256, 3, seed=1, split="eval")]


def test_train_and_eval_haystacks_are_disjoint():
    from eval.haystack import addresses

    assert not {t for t, _ in addresses("eval")} & {t for t, _ in addresses("train")}


def test_metrics_on_hand_made_cases():
    assert answer_recall("The number is 4512.", ["4512"]) == 100.0
    assert answer_recall("It is 12 and  MEADOW", ["meadow", "12", "99"]) == pytest.approx(200 / 3)
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
    kl, top1 = kl_and_top1(logits, logits)
    assert kl == pytest.approx(0.0, abs=1e-7) and top1 == 100.0
    kl, top1 = kl_and_top1(logits, torch.tensor([[0.0, 2.0], [0.0, 1.0]]))
    p = torch.softmax(torch.tensor([2.0, 0.0]), 0)
    want = float((p * (p.log() - torch.log_softmax(torch.tensor([0.0, 2.0]), 0))).sum()) / 2
    assert kl == pytest.approx(want, rel=1e-5) and top1 == 50.0


def test_config_errors_before_any_model_loads(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("tasks: [niah_single]\nmethods: [{name: snapkvv}]\n")
    with pytest.raises(EvalConfigError, match="unknown policy 'snapkvv'"):
        load_eval_config(p)
    p.write_text("taskz: [x]\n")
    with pytest.raises(EvalConfigError, match="unknown key\\(s\\) \\['taskz'\\]"):
        load_eval_config(p)
    p.write_text("protocol: sometimes\n")
    with pytest.raises(EvalConfigError, match="choose one of \\['query_agnostic', 'query_aware'\\]"):
        load_eval_config(p)
    assert load_eval_config("tiny.yaml").tasks == ["niah_single", "fidelity"]


def test_tiny_sweep_resumes_without_duplicates(tmp_path, tok):
    from tiny_models import tiny_llama

    model = tiny_llama(vocab_size=len(tok))
    cfg = load_eval_config("tiny.yaml")
    cfg.output = str(tmp_path / "sweep")
    results = run_sweep(cfg, (model, tok))
    rows = read_results(results)
    # 2 tasks x 2 items x (full + 2 policies x 2 budgets)
    assert len(rows) == 2 * 2 * 5
    assert all(r["kept_entries"] <= r["budget_entries"] for r in rows if r["budget_entries"])
    full = [r for r in rows if r["method"] == "full" and r["task"] == "fidelity"]
    assert all(r["score"] == 100.0 and r["kl"] == pytest.approx(0, abs=1e-5) for r in full)
    lines = Path(results).read_text().splitlines()
    Path(results).write_text("\n".join(lines[:7]) + "\n" + lines[7][: len(lines[7]) // 2])  # interrupted mid-write
    run_sweep(cfg, (model, tok))
    again = read_results(results)
    keys = [(r["task"], r["item"], r["method"], r["budget"]) for r in again]
    assert len(keys) == len(set(keys)) == 20
    for a in rows:  # deterministic: resumed rows equal the first run's
        b = next(r for r in again if (r["task"], r["item"], r["method"], r["budget"]) == (a["task"], a["item"], a["method"], a["budget"]))
        assert a["score"] == b["score"] and a["kept_entries"] == b["kept_entries"]


def test_report_from_a_fixed_results_file(tmp_path):
    rows = [
        {"task": "niah_single", "item": "a", "length": 1024, "method": "full", "budget": None, "score": 100.0,
         "kept_entries": 1000, "kv_bytes": 2**20, "full_cache_bytes": 2**20},
        {"task": "niah_single", "item": "a", "length": 1024, "method": "snapkv", "budget": 0.1, "score": 50.0,
         "kept_entries": 100, "kv_bytes": 2**20 / 10, "full_cache_bytes": 2**20},
        {"task": "niah_single", "item": "b", "length": 1024, "method": "snapkv", "budget": 0.1, "score": 0.0,
         "kept_entries": 100, "kv_bytes": 2**20 / 10, "full_cache_bytes": 2**20},
    ]
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = markdown_table(read_results(path))
    assert "| niah_single | full | full | 100.0 | 1,000 | 1.00 | 100% |  | 1 |" in table
    assert "| niah_single | snapkv | 10% | 25.0 | 100 | 0.10 | 10% |  | 2 |" in table
    md = write_report(path)
    assert (tmp_path / "niah_single.png").stat().st_size > 1000 and "niah_single.png" in md.read_text()


def test_hub_loaders_on_local_files(tmp_path):
    def write(name, rows):
        p = tmp_path / name
        p.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(p)

    ruler = load_ruler(data_files=write("r.jsonl", [{"context": "c", "question": "q", "answer": ["x"], "task": "niah"}]))
    assert ruler[0].task == "ruler/niah" and ruler[0].answers == ["x"]
    lb = load_longbench("qasper", data_files=write("l.jsonl", [{"context": "c", "input": "q", "answers": ["a"], "_id": "1"}]))
    assert lb[0].question == "q" and lb[0].answers == ["a"]
    v2 = load_longbench_v2(data_files=write("v.jsonl", [{"_id": "9", "context": "c", "question": "q", "choice_A": "a",
                                                        "choice_B": "b", "choice_C": "c", "choice_D": "d", "answer": "C"}]))
    assert v2[0].answers == ["(C)"] and "(D) d" in v2[0].question
    mm = load_mmdu(data_files=write("m.jsonl", [{"id": 3, "image": ["x.jpg"], "conversations": [
        {"from": "human", "value": "<image> hi"}, {"from": "gpt", "value": "hello"},
        {"from": "human", "value": "what was it?"}, {"from": "gpt", "value": "a cat"}]}]))
    assert mm[0].messages[1]["role"] == "assistant" and mm[0].answers == ["a cat"] and mm[0].meta["images"] == ["x.jpg"]
    with pytest.raises(RuntimeError, match="cannot load"):
        import os

        os.environ["HF_DATASETS_OFFLINE"] = "1"
        try:
            load_ruler(subset="nope")
        finally:
            del os.environ["HF_DATASETS_OFFLINE"]


@pytest.mark.smollm2
def test_smollm2_full_cache_solves_easy_needles(tok):
    from eval.methods import Method, run_item
    from retention import attach_gates, load_model

    model, tok = load_model("smollm2-135m")
    attach_gates(model, mode="score")
    items = TASKS["niah_single"](tok, 1024, 5, seed=0)
    scores = [run_item(model, tok, it, Method("full", {}, "full"), None, max_new_tokens=16)["score"] for it in items]
    model.retention.detach()
    assert sum(s == 100.0 for s in scores) >= 3, scores
