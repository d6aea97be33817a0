"""The sweep around the tasks: config validation before any model loads, a resumable tiny sweep,
the report (table + plots) from a fixed results file, Hub loaders on local files, and the embedded
model solving easy needles with the full cache."""

import json
import re
from pathlib import Path

import pytest

from retention.eval.config import EvalConfigError, load_eval_config
from retention.eval.report import markdown_table, write_report
from retention.eval.runner import read_results, run_sweep


def test_config_errors_before_any_model_loads(tmp_path):
    p = tmp_path / "c.yaml"
    cases = [
        ("tasks: [niah_single]\nmethods: [{name: snapkvv}]\n", "unknown method 'snapkvv'"),
        ("taskz: [x]\n", r"unknown key\(s\) \['taskz'\]"),
        ("protocol: sometimes\n", r"choose one of \['query_agnostic', 'compress_once', 'query_aware'\]"),
        ("tasks: [niah_nope]\n", "unknown task 'niah_nope'"),
        ("budgets: [64]\nmethods: [{name: snapkv}]\n", "a bare number must be a fraction"),
        ("methods: [{name: snapkv}, {name: snapkv}]\n", "labels must be distinct"),
        ("lengths: [10]\n", "integers >= 64"),
        ("methods: [{name: snapkv, params: {windw: 8}}]\n", "snapkv"),
        ("dtype: bfloat17\n", r"dtype: 'bfloat17' is not allowed; choose one of \['float32', 'bfloat16', 'float16'\]"),
        ("device: gpu0\n", "device: 'gpu0' is not a device"),
        ("chat_template_kwargs: [enable_thinking]\n", "chat_template_kwargs: must be a mapping of template variable"),
        ("chat_template_kwargs: {enable-thinking: false}\n", "chat_template_kwargs: must be a mapping"),
        ("chat_template_kwargs: {add_generation_prompt: false}\n", "sets add_generation_prompt, which rendering"),
        # a traceback
        (f"output: {p}\n", "output: .*c.yaml is a file; the sweep writes results.jsonl .* into a folder"),
        ("output: 3\n", "output: must be a folder path"),
        ("seed: true\n", "seed: must be an integer >= 0 .*, got True"),  # a bool is an int to isinstance
        ("seed: -1\n", "seed: must be an integer >= 0"),
        ("output: runs/{sed}\n", r"output: 'runs/\{sed\}' names \['sed'\]; the one placeholder is \{seed\}"),
        ("output: runs/{}\n", r"the one placeholder is \{seed\}"),
        ("output: runs/{seed\n", r"output: 'runs/\{seed': .*the one placeholder is \{seed\}"),
    ]
    for text, match in cases:
        p.write_text(text)
        with pytest.raises(EvalConfigError, match=match):
            load_eval_config(p)
    with pytest.raises(EvalConfigError, match="not found"):
        load_eval_config(tmp_path / "missing.yaml")
    assert load_eval_config("tiny.yaml").tasks == ["niah_single", "fidelity"]
    p.write_text("output: ~/sweeps/a\n")  # was a folder named "~" in the working directory
    assert load_eval_config(p).output == str(Path.home() / "sweeps" / "a")
    import torch

    if not torch.cuda.is_available():  # on a CPU machine, asking for cuda fails here, not inside the sweep
        p.write_text("device: cuda\n")
        with pytest.raises(EvalConfigError, match="torch sees no CUDA GPU here"):
            load_eval_config(p)


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


def test_a_sweep_leaves_no_cache_for_the_cyclic_gc(tmp_path):
    """Every item's caches (shared prefill, one per method and budget, the query recorder) must be freed
    when dropped: left to Python's cyclic GC they piled up and a long sweep reached 24 GB RSS."""
    import gc

    from retention.eval.models import load_eval_model

    cfg = load_eval_config("tiny.yaml", output=str(tmp_path / "sweep"), prefill="one_shot")
    model_and_tokenizer = load_eval_model(cfg.model, seed=cfg.seed)  # loaded outside: its imports leave cycles
    gc.collect()
    gc.disable()
    try:
        run_sweep(cfg, model_and_tokenizer, progress=False)
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        left = sorted({type(o).__name__ for o in gc.garbage if "KV" in type(o).__name__ or "Cache" in type(o).__name__
                       or "Policy" in type(o).__name__})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert left == []


def test_report_from_a_fixed_results_file(tmp_path):
    base = {"task": "niah_single", "length": 1024, "full_cache_bytes": 2**20, "metric": "recall"}
    rows = [
        {**base, "item": "a", "method": "full", "budget": "full", "score": 100.0, "kept_entries": 1000,
         "kv_bytes": 2**20},
        {**base, "item": "a", "method": "snapkv", "budget": "fraction=0.1", "score": 50.0, "kept_entries": 100,
         "kv_bytes": 2**20 / 10},
        {**base, "item": "b", "method": "snapkv", "budget": "fraction=0.1", "score": 0.0, "kept_entries": 100,
         "kv_bytes": 2**20 / 10, "past_positions": True},  # a dialogue longer than the model's positions
        {**base, "item": "c", "method": "snapkv", "budget": "fraction=0.1", "score": None, "error": "too small"},
    ]
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = markdown_table(read_results(path))
    assert "| niah_single | 1024 | full | full | 100.0 |  | 1,000 | 1.00 | 100% | 1 |" in table
    assert ("| niah_single | 1024 | snapkv | 10% | 25.0 |  | 100 | 0.10 | 10% | 2 (1 failed, 1 past positions) |"
            in table)
    md = write_report(path)
    assert (tmp_path / "niah_single.png").stat().st_size > 1000 and "niah_single.png" in md.read_text()
    assert "gaps.png" not in md.read_text()  # 2 items and one budget: no intervals to draw
    # the summary (mean over tasks per method and budget) first, then the table per row group
    text = md.read_text()
    assert (text.index("## Summary") < text.index("| snapkv | 25.0 (10%, 102 KiB) |") < text.index("## Per task")
            < text.index("| niah_single | 1024 | snapkv | 10% |"))


def test_report_command_prints_the_summary_and_points_to_the_full_table(tmp_path, capsys):
    """A sweep's command prints the mean per method and budget (a few lines, whatever the number of tasks); the table
    per task, length, method and budget is in report.md. Rows of the full cache alone have no summary: their table."""
    from retention.eval.cli import main

    base = {"task": "niah_single", "length": 1024, "full_cache_bytes": 2**20, "metric": "recall", "item": "a"}
    full = {**base, "method": "full", "budget": "full", "score": 100.0, "kept_entries": 1000, "kv_bytes": 2**20}
    snap = {**base, "method": "snapkv", "budget": "fraction=0.1", "score": 0.0, "kept_entries": 100,
            "kv_bytes": 2**20 / 10}
    for name, rows in (("both", [full, snap]), ("full", [full])):
        path = tmp_path / name / "results.jsonl"
        path.parent.mkdir()
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        assert main(["report", str(path)]) == 0
        out = capsys.readouterr().out
        per_row = "| niah_single | 1024 | full | full | 100.0 |"
        if name == "both":
            assert "| full cache | 100.0 (100%, 1.0 MiB) |" in out and "| snapkv | 0.0 (10%, 102 KiB) |" in out
            assert per_row not in out and per_row in (path.parent / "report.md").read_text()
        else:
            assert per_row in out and "Mean score" not in out
        assert f"report (per task, length, method and budget; plots): {path.parent / 'report.md'}" in out


def test_hub_loaders_on_local_files(tmp_path, monkeypatch):
    from retention.eval.loaders import DatasetUnavailableError, load_longbench, load_longbench_v2, load_mmdu, load_ruler

    def write(name, rows):
        p = tmp_path / name
        p.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(p)

    ruler = load_ruler(data_files=write("r.jsonl", [{"context": "c", "question": "q", "answer": ["x"],
                                                     "task": "niah"}]))
    assert ruler[0].task == "ruler/niah" and ruler[0].answers == ["x"] and ruler[0].metric == "substring"
    lb = load_longbench("qasper", data_files=write("l.jsonl", [{"context": "c", "input": "q", "answers": ["a"],
                                                                "_id": "1"}]))
    assert lb[0].answers == ["a"] and "q" in lb[0].question
    v2 = load_longbench_v2(data_files=write("v.jsonl", [{"_id": "9", "context": "c", "question": "q", "choice_A": "a",
                                                         "choice_B": "b", "choice_C": "c", "choice_D": "d",
                                                         "answer": "C"}]))
    assert "C" in v2[0].answers[0] and "d" in v2[0].question
    mm = load_mmdu(data_files=write("m.jsonl", [{"id": 3, "image": ["x.jpg"], "conversations": [
        {"from": "human", "value": "<image> hi"}, {"from": "gpt", "value": "hello"},
        {"from": "human", "value": "what was it?"}, {"from": "gpt", "value": "a cat"}]}]))
    assert mm[0].messages[1]["role"] == "assistant" and mm[0].answers == ["a cat"] and mm[0].meta["images"] == ["x.jpg"]
    assert mm[0].meta["image_root"] == str(tmp_path)  # relative image paths: the data file's folder
    _offline(monkeypatch, tmp_path)
    with pytest.raises(DatasetUnavailableError, match="ruler"):
        load_ruler(length="nope")


def _offline(monkeypatch, tmp_path):
    """No Hub, nothing cached: datasets and huggingface_hub read their offline switches at import, so set both."""
    import datasets
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))


def _hub_copies(tmp_path):
    """Local copies of RULER, LongBench (hotpotqa) and LongBench v2 rows, 3 records each, with long contexts."""
    def write(name, rows):
        p = tmp_path / name
        p.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(p)

    text = lambda i: " ".join(f"Sentence {k} of document {i} says the river runs north." for k in range(60))
    return {
        "ruler": write("ruler.jsonl", [{"context": text(i)[:600], "question": "Which way?", "answer": ["north"],
                                         "task": task, "answer_prefix": "It runs", "max_new_tokens": 4}
                                        for task in ("niah_single_1", "vt") for i in range(3)]),  # task by task
        "longbench": write("hotpotqa.jsonl", [{"context": text(i), "input": "Which way?", "answers": ["north"],
                                               "_id": f"lb{i}"} for i in range(3)]),
        "longbench_v2": write("v2.jsonl", [{"_id": f"v{i}", "context": text(i), "question": "Which way?",
                                            "choice_A": "north", "choice_B": "south", "choice_C": "east",
                                            "choice_D": "west", "answer": "A"} for i in range(3)]),
    }


def test_hub_sets_run_as_sweep_tasks(tmp_path):
    """RULER and LongBench v1/v2 named in a config (`items` records; LongBench cut to each length by its middle),
    scored with their own metrics, one row per item, method and budget."""
    from retention.eval.config import load_eval_config
    from retention.eval.loaders import hub_task_items
    from retention.eval.models import load_eval_model
    from retention.eval.runner import read_results, run_sweep

    files = _hub_copies(tmp_path)
    cfg_file = tmp_path / "hub.yaml"
    cfg_file.write_text(
        "model: tiny-llama-random\n"
        f"output: {tmp_path / 'out'}\n"
        "tasks:\n"
        f"  - {{name: ruler, params: {{data_files: {files['ruler']}}}}}\n"
        f"  - {{name: longbench, params: {{subset: hotpotqa, data_files: {files['longbench']}}}}}\n"
        f"  - {{name: longbench_v2, params: {{data_files: {files['longbench_v2']}}}}}\n"
        "lengths: [96]\nbudgets: [0.5]\nitems: 2\nmax_new_tokens: 4\n"
        "methods: [{name: full}, {name: streamingllm}]\n"
    )
    model, tok = load_eval_model("tiny-llama-random")
    results = run_sweep(load_eval_config(cfg_file), (model, tok), progress=False)
    rows = read_results(results)
    report = write_report(results)  # one plot per subset: "ruler/vt" is no folder
    assert (report.parent / "ruler-vt.png").is_file() and "](ruler-vt.png)" in report.read_text()
    by_task = {}
    for r in rows:
        by_task.setdefault(r["task"], []).append(r)
    assert sorted(by_task) == ["longbench/hotpotqa", "longbench_v2", "ruler/niah_single_1", "ruler/vt"]
    assert {t: {r["metric"] for r in rs} for t, rs in by_task.items()} == {
        "longbench/hotpotqa": {"f1"}, "longbench_v2": {"choice"}, "ruler/niah_single_1": {"substring"},
        "ruler/vt": {"substring"}}
    assert all(len(rs) == 4 for rs in by_task.values())  # 2 items (of each RULER task) x (full + one budget)
    assert {r["item"] for r in by_task["longbench/hotpotqa"]} == {"lb0@96", "lb1@96"}
    # LongBench's truncation: at most `length` tokens, the beginning and the end of the context kept
    (item,) = hub_task_items("longbench", tok, 96, 1, subset="hotpotqa", data_files=files["longbench"])
    full = hub_task_items("longbench", None, 96, 1, subset="hotpotqa", data_files=files["longbench"])[0].context
    n = len(tok(item.context, add_special_tokens=False)["input_ids"])
    assert 90 <= n <= 96 and full.startswith(item.context[:40]) and full.endswith(item.context[-40:])
    assert item.id != hub_task_items("longbench", tok, 64, 1, subset="hotpotqa", data_files=files["longbench"])[0].id


def test_items_of_one_id_in_two_hub_sets_are_each_prefilled(tmp_path):
    """RULER listed twice (one task each) gives items of one id (ruler-96-0): the sweep kept its shared prefill by
    item id, so policies scored the second set's item from the first one's context (the full cache, never shared,
    did not)."""
    from retention.eval.models import load_eval_model

    text = lambda i, way: " ".join(f"Sentence {k} of document {i} says the river runs {way}." for k in range(60))
    data = tmp_path / "r.jsonl"
    data.write_text("".join(json.dumps({"context": text(i, way)[:600], "question": q, "answer": [way], "task": t,
                                        "answer_prefix": "It runs", "max_new_tokens": 4}) + "\n"
                            for i, (t, way, q) in enumerate([("niah_single_1", "south", "Which way?"),
                                                             ("vt", "north", "Where does the river run to?")])))
    model, tok = load_eval_model("tiny-llama-random")

    def sweep(out, tasks):
        listed = "".join(f"  - {{name: ruler, params: {{tasks: [{t}], data_files: {data}}}}}\n" for t in tasks)
        (tmp_path / "c.yaml").write_text(
            f"model: tiny-llama-random\noutput: {tmp_path / out}\ntasks:\n{listed}lengths: [96]\nbudgets: [0.5]\n"
            "items: 1\nmax_new_tokens: 4\nmethods: [{name: full}, {name: streamingllm}]\n")
        return read_results(run_sweep(load_eval_config(tmp_path / "c.yaml"), (model, tok), progress=False))

    both, alone = sweep("both", ["niah_single_1", "vt"]), sweep("alone", ["vt"])
    assert {r["item"] for r in both} == {"ruler-96-0"} and len(both) == 4
    keep = ("method", "context_tokens", "kept_entries", "reply")
    vt = [{k: r[k] for k in keep} for r in both if r["task"] == "ruler/vt"]
    assert vt == [{k: r[k] for k in keep} for r in alone]
    assert len({r["reply"] for r in both if r["method"] == "full"}) == 2  # the two items' replies do differ


@pytest.mark.parametrize("task, message", [
    ("{name: longbench, params: {subset: nosuch}}", "unknown subset 'nosuch'"),
    ("{name: ruler, params: {limit: 3}}", "come from the sweep's items / lengths"),
    ("{name: longbench_v2, params: {difficulty: hard, colour: red}}", "colour"),
    ("{name: mmdu, params: {turns: every}}", "turns"),
    ("ruller", "from the Hub: ['longbench', 'longbench_v2', 'mmdu', 'ruler']"),
    # a generated task's options are checked here too, not when its items are drawn after the model loads
    ("{name: niah_multikey, params: {key: 8}}", "niah_multikey takes no option 'key'"),
    ("{name: dialogue_memory, params: {facts: 5}}", "facts must be a whole number from 1 to 4"),
    ("{name: niah_single, params: [keys]}", "niah_single: params must be a mapping"),
])
def test_hub_task_config_errors(tmp_path, task, message):
    from retention.eval.config import EvalConfigError, load_eval_config

    p = tmp_path / "c.yaml"
    p.write_text(f"model: tiny-llama-random\ntasks: [{task}]\nmethods: [full]\n")
    with pytest.raises(EvalConfigError, match=re.escape(message)):
        load_eval_config(p)


def test_an_unreachable_hub_set_fails_before_the_model_loads(tmp_path, capsys, monkeypatch):
    import retention.eval.models
    from retention.eval.cli import main

    monkeypatch.setattr(retention.eval.models, "load_eval_model", lambda *a, **k: pytest.fail("loaded the model first"))
    _offline(monkeypatch, tmp_path)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: tiny-llama-random\noutput: {tmp_path / 'out'}\ntasks: [ruler]\nmethods: [full]\n")
    assert main(["run", "--config", str(cfg), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert (err.startswith("python -m retention.eval run: error: cannot load 'simonjegou/ruler' from the Hub")
            and "data_files=" in err)


@pytest.mark.smollm2
def test_smollm2_full_cache_solves_easy_needles():
    from retention.eval.methods import FullCache
    from retention.eval.models import load_eval_model
    from retention.eval.protocol import run_item
    from retention.tasks import generate

    model, tok = load_eval_model("smollm2-135m")
    items = generate("niah_single", tok, 1024, 5, seed=0)
    scores = [run_item(model, tok, it, FullCache("full"), None, max_new_tokens=16)["score"] for it in items]
    assert sum(s == 100.0 for s in scores) >= 3, scores


def test_a_method_scores_with_its_own_gates(tmp_path):
    """``{name: trimkv, gates: DIR}``: that method's forwards use DIR's gates; the others the sweep's."""
    import torch

    from retention.eval.config import load_eval_config
    from retention.eval.models import load_eval_model
    from retention.eval.runner import prepare_model
    from retention import GateConfig, RetentionGates
    from retention.hub import export_gates

    model, tok = load_eval_model("tiny-llama-random")
    own = RetentionGates(GateConfig.for_model(model, variant="trimkv", bias_init=-2.0))
    export_gates(own, tmp_path / "own", base_model="tiny")
    p = tmp_path / "c.yaml"
    p.write_text(f"model: tiny-llama-random\ngates: untrained\nmethods: [{{name: global_gates}}, "
                 f"{{name: trimkv, gates: {tmp_path / 'own'}, label: mine}}]\n")
    cfg = load_eval_config(p)
    prepare_model(cfg, model, tok)
    sweep_gates = model.retention.gates
    plain, mine = cfg.method_list()
    preloaded = mine._loaded  # loaded once by prepare_model, then kept: not loaded again in the sweep
    assert preloaded is not None and cfg.method_list()[1] is mine
    with plain.active(model):
        assert model.retention.gates is sweep_gates
    with mine.active(model):
        loaded = model.retention.gates
        assert loaded is preloaded and loaded is not sweep_gates and loaded.config.variant == "trimkv"
        assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), own.state_dict().values()))
    assert model.retention.gates is sweep_gates
    p.write_text(f"model: tiny-llama-random\nmethods: [{{name: trimkv, gates: {tmp_path / 'missing'}, label: x}}]\n")
    with pytest.raises(RuntimeError, match="method x: cannot load its gates"):
        prepare_model(load_eval_config(p), model, tok)


def test_untrained_gates_are_the_same_in_every_run():
    """``gates: untrained``: the gates are drawn with one seed, so a resumed sweep (a new process, another global RNG
    state) keeps its gated rows; they were set aside as scored by other gates and run again."""
    import torch

    from retention.eval.config import EvalConfig
    from retention.eval.models import load_eval_model
    from retention.eval.runner import prepare_model
    from retention.gates import UNTRAINED_SEED, RetentionGates

    cfg = EvalConfig(model="tiny-llama-random", gates="untrained", methods=[{"name": "global_gates"}])
    ids = []
    for seed in (1, 2):
        model, tok = load_eval_model("tiny-llama-random")
        torch.manual_seed(seed)  # what another process would start from
        prepare_model(cfg, model, tok)
        ids.append(cfg.method_list()[0].gates_id(model))
    assert ids[0] == ids[1] == RetentionGates(model.retention.gates.config, seed=UNTRAINED_SEED).fingerprint()


def test_the_embedded_model_defaults_to_its_shipped_gates():
    from retention.models import CHECKPOINT_DIRS, EMBEDDED_MODELS, shipped_gates

    want = CHECKPOINT_DIRS[-1] / "smollm2-135m-global"  # the checkout's (an editable install has no package copy)
    assert ((want / "gates.safetensors").is_file() and (want / "retention.json").is_file()
            and (want / "README.md").is_file())
    assert shipped_gates("smollm2-135m") == want == shipped_gates(EMBEDDED_MODELS["smollm2-135m"].hub_id)
    assert shipped_gates("some/other-model") is None
    cfg = json.loads((want / "retention.json").read_text())
    assert cfg["gate_config"]["variant"] == "global" and cfg["gate_config"]["num_layers"] == 30


@pytest.mark.parametrize("policy", ["global_gates", "snapkv", "h2o", "pyramidkv", "cake", "streamingllm", "trimkv"])
def test_one_shared_prefill_equals_one_prefill_per_budget(policy):
    """Several budgets compress copies of one prefilled cache: the same rows as separate runs."""
    from retention.eval.budgets import parse_budget
    from retention.eval.method_specs import make_method
    from retention.eval.models import load_eval_model
    from retention.eval.protocol import run_item, run_item_budgets
    from retention.tasks import generate
    from retention import GateConfig, RetentionGates, attach_gates

    model, tok = load_eval_model("tiny-llama-random")
    gates = RetentionGates(GateConfig.for_model(model, bias_init=2.0))
    torch_gen = __import__("torch").Generator().manual_seed(0)
    for p in gates.parameters():  # random gates: scores that differ from token to token
        p.data = __import__("torch").randn(p.shape, generator=torch_gen) * 0.5
    attach_gates(model, gates, mode="score")
    method = make_method({"name": policy})
    budgets = [parse_budget(b) for b in (0.4, 0.1, {"tokens": 12}, 0.25)]
    for item in generate("niah_single", tok, 192, 1, seed=1) + generate("fidelity", tok, 192, 1, seed=1):
        shared = run_item_budgets(model, tok, item, method, budgets, max_new_tokens=6)
        alone = [run_item(model, tok, item, method, b, max_new_tokens=6) for b in budgets]
        for a, b in zip(shared, alone):
            assert a == pytest.approx(b), (policy, item.task)
        assert len({r["kept_entries"] for r in shared}) == len(budgets)  # the budgets really differ


@pytest.mark.parametrize("policy", ["global_gates", "snapkv", "h2o", "tova", "pyramidkv", "adakv", "cake", "lava",
                                    "restkv", "defensivekv", "streamingllm", "trimkv", "random"])
def test_one_prefill_shared_by_all_methods_equals_their_own_prefills(policy):
    """SharedPrefill replays the recorded queries into each policy: the same rows as prefilling anew."""
    import torch

    from retention.eval.budgets import parse_budget
    from retention.eval.method_specs import make_method
    from retention.eval.models import load_eval_model
    from retention.eval.protocol import SharedPrefill, context_and_prompt, run_item_budgets
    from retention.tasks import generate
    from retention import GateConfig, RetentionGates, attach_gates

    model, tok = load_eval_model("tiny-llama-random")
    gates = RetentionGates(GateConfig.for_model(model))
    g = torch.Generator().manual_seed(0)
    for p in gates.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.5
    attach_gates(model, gates, mode="score")
    method = make_method({"name": policy})
    budgets = [parse_budget(b) for b in (0.3, 0.1)]
    for item in generate("niah_multikey", tok, 200, 1, seed=2) + generate("fidelity", tok, 200, 1, seed=2):
        shared = SharedPrefill(model, context_and_prompt(tok, item)[0])
        got = run_item_budgets(model, tok, item, method, budgets, max_new_tokens=6, shared=shared)
        want = run_item_budgets(model, tok, item, method, budgets, max_new_tokens=6)
        for a, b in zip(got, want):
            assert a == pytest.approx(b), (policy, item.task)


def test_publish_summary_into_a_model_card_and_the_readme(tmp_path):
    from retention.eval.publish import publish
    from retention.eval.report import summary_table
    from retention import GateConfig, RetentionGates
    from retention.hub import export_gates

    def row(task, method, budget, score, item="a", kv=0.1):
        return {"task": task, "length": 4096, "item": item, "method": method, "budget": budget, "score": score,
                "kept_entries": 10, "kv_bytes": kv * 2**22, "full_cache_bytes": 2**22, "metric": "recall", "model": "m"}

    rows = [row(t, "full", "full", 90.0, kv=1.0) for t in ("a", "b")]
    rows += [row("a", "global_gates", "fraction=0.1", 80.0), row("b", "global_gates", "fraction=0.1", 100.0),
             row("a", "snapkv", "fraction=0.1", 60.0), row("b", "snapkv", "fraction=0.1", 40.0),
             row("a", "snapkv", "fraction=0.1", 80.0, item="b"),  # task a: snapkv mean 70
             row("a", "streamingllm", "fraction=0.1", 10.0), row("b", "streamingllm", "fraction=0.1", 20.0),
             row("a", "global_gates", "fraction=0.2", 90.0, kv=0.2),
             row("b", "global_gates", "fraction=0.2", 90.0, kv=0.2)]
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = summary_table(rows)
    assert "| full cache | 90.0 (100%, 4.0 MiB) | 90.0 (100%, 4.0 MiB) |" in table
    assert "| global_gates | 90.0 (10%, 410 KiB) | 90.0 (20%, 819 KiB) |" in table
    assert "| snapkv | 55.0 (10%, 410 KiB) | - |" in table  # (70 + 40) / 2
    assert "| global_gates | 10% | 90.0 | +0.0 | +35.0 (snapkv) |" in table

    card = tmp_path / "card"
    export_gates(RetentionGates(GateConfig(num_layers=1, num_kv_heads=1, hidden_size=8)), card, base_model="m")
    readme = tmp_path / "README.md"
    readme.write_text("# x\n<!-- results:start -->\nold\n<!-- results:end -->\nafter\n")
    publish(results, card, readme)
    card_text = (card / "README.md").read_text()
    assert "| snapkv | 55.0 (10%, 410 KiB) | - |" in card_text
    assert "| method | a | b |" in card_text and "| snapkv | 70.0 | 40.0 |" in card_text  # the per-task view at 10%
    assert (card / "results.png").stat().st_size > 1000
    body = readme.read_text()
    assert ("old" not in body and "| snapkv | 55.0 (10%, 410 KiB) | - |" in body
            and body.endswith("<!-- results:end -->\nafter\n"))
    readme.write_text("no markers")
    with pytest.raises(ValueError, match="markers"):
        publish(results, None, readme)


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[1] / "eval" / "configs").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_every_shipped_eval_config_loads(path):
    """Each published command's config is valid, and every method's policy parameters are accepted
    (checked when the config loads, before a model does)."""
    cfg = load_eval_config(path)
    methods = cfg.method_list()
    assert methods and len({m.label for m in methods}) == len(methods), "labels must be unique: rows are keyed by them"


def test_cli_usage_names_the_command_users_type(capsys):
    from retention.eval.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["run", "--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python -m retention.eval run ")


@pytest.mark.parametrize("where", ["sweep", "method"])
@pytest.mark.parametrize("gates", ["missing", "other shapes"])
def test_bad_gates_fail_before_the_model_loads(tmp_path, capsys, monkeypatch, where, gates):
    """A missing checkpoint, or gates of another model's shapes (refused only once the model had loaded: minutes for a
    large one; its config says enough), as the sweep's gates or a method's."""
    import retention.eval.models
    from retention.eval.cli import main
    from retention.gates import GateConfig, RetentionGates
    from retention.hub import export_gates

    monkeypatch.setattr(retention.eval.models, "load_eval_model", lambda *a, **k: pytest.fail("loaded the model first"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if gates == "missing":
        path = tmp_path / "no-such-gates"
        said = f"gate checkpoint '{path}': there is no such folder"
    else:
        path = export_gates(RetentionGates(GateConfig(num_layers=3, num_kv_heads=2, hidden_size=64)), tmp_path / "g",
                            base_model="another")
        said = "gates do not match this model: gates have (layers, kv_heads, hidden) = (3, 2, 64)"
    sweep_gates, method = ((f"gates: {path}\n", "global_gates") if where == "sweep"
                           else ("", f"{{name: trimkv, gates: {path}}}"))
    cfg = tmp_path / "sweep.yaml"
    cfg.write_text(f"model: tiny-llama-random\n{sweep_gates}output: {tmp_path / 'out'}\ntasks: [niah_single]\n"
                   f"methods: [full, {method}]\n")
    assert main(["run", "--config", str(cfg), "--quiet"]) == 2
    assert said in capsys.readouterr().err


def test_a_card_of_other_gates_is_refused_before_the_sweep(tmp_path, capsys, monkeypatch):
    import retention.eval.models
    from retention.eval.cli import main
    from retention.eval.config import load_eval_config
    from retention.eval.publish import check_sweep_scores_card
    from retention import GateConfig, RetentionGates
    from retention.hub import export_gates

    from tiny_models import tiny_llama

    model = tiny_llama()
    for name, bias in (("a", 1.0), ("b", 2.0)):
        export_gates(RetentionGates(GateConfig.for_model(model, bias_init=bias)), tmp_path / name, base_model="m")
    cfg = tmp_path / "sweep.yaml"
    cfg.write_text(f"model: tiny-llama-random\ngates: {tmp_path / 'a'}\noutput: {tmp_path / 'out'}\n"
                   "tasks: [niah_single]\nmethods: [full, global_gates]\n")
    check_sweep_scores_card(load_eval_config(cfg), tmp_path / "a")  # its own gates: fine
    monkeypatch.setattr(retention.eval.models, "load_eval_model", lambda *a, **k: pytest.fail("loaded the model first"))
    assert main(["run", "--config", str(cfg), "--card", str(tmp_path / "b"), "--quiet"]) == 2
    assert "this sweep scores with other gates" in capsys.readouterr().err


def test_a_second_sweep_into_the_same_output_is_refused(tmp_path, capsys, monkeypatch):
    import retention.eval.models
    from retention.eval.cli import main
    from retention.io import exclusive_use

    monkeypatch.setattr(retention.eval.models, "load_eval_model", lambda *a, **k: pytest.fail("loaded the model first"))
    cfg = tmp_path / "sweep.yaml"
    cfg.write_text(f"model: tiny-llama-random\noutput: {tmp_path / 'out'}\ntasks: [niah_single]\nmethods: [full]\n")
    with exclusive_use(tmp_path / "out", "a sweep"):
        assert main(["run", "--config", str(cfg), "--quiet"]) == 2
    assert "is writing a sweep in" in capsys.readouterr().err


def test_a_model_that_cannot_load_is_an_error_not_a_traceback(tmp_path, capsys):
    from retention.eval.cli import main

    cfg = tmp_path / "sweep.yaml"
    cfg.write_text(f"model: {tmp_path}\ntasks: [niah_single]\nmethods: [full]\nbudgets: [0.1]\nlengths: [256]\n"
                   "items: 1\n")
    assert main(["run", "--config", str(cfg), "--output", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m retention.eval run: error: cannot load model") and "no config.json" in err


def test_budgets_must_be_a_list_as_lengths_and_tasks_are(tmp_path):
    """A scalar was iterated (TypeError: 'float' object is not iterable) and budgets: null reached the sweep."""
    p = tmp_path / "c.yaml"
    for text, fix in (("budgets: 0.2\nmethods: [full, snapkv]\n", "[0.2]"), ("budgets: 10%\n", "[10%]"),
                      ("budgets: {tokens: 64}\n", None), ("budgets: null\nmethods: [full]\n", "[]")):
        p.write_text("model: tiny-llama-random\n" + text)
        with pytest.raises(EvalConfigError, match=r"^budgets: must be a list of budgets") as e:
            load_eval_config(p)
        assert fix is None or str(e.value).endswith(f"write budgets: {fix}")


def test_a_config_that_is_not_yaml_is_a_config_error(tmp_path):
    """It was a yaml.ScannerError traceback."""
    p = tmp_path / "c.yaml"
    p.write_text("model: [tiny-llama-random\nbudgets: 0.1\n")
    with pytest.raises(EvalConfigError, match=r"^config: .*c.yaml is not valid YAML"):
        load_eval_config(p)


def test_gates_that_are_no_path_are_config_errors(tmp_path):
    """`gates: 3` reached the checkpoint lookup as a number (TypeError in retention.hub); a method's own gates too."""
    p = tmp_path / "c.yaml"
    for text, match in (
        ("gates: 3\n", r"^gates: must be a gate checkpoint folder, a Hub repo id or 'untrained', got 3 \(quote"),
        ("gates: ''\n", r"^gates: must be .* got ''; or leave it out"),
        ("gates: [a]\n", r"^gates: must be .* got \['a'\]; or leave it out"),
        ("methods: [full, {name: trimkv, gates: 3}]\n", r"^methods: trimkv: gates must be .* got 3"),
        ("methods: [full, {name: trimkv, gates: ''}]\n", r"^methods: trimkv: gates must be .* got ''"),
    ):
        p.write_text("model: tiny-llama-random\n" + text)
        with pytest.raises(EvalConfigError, match=match):
            load_eval_config(p)


def _sweep_config(tmp_path, **keys) -> Path:
    """A one-item sweep of the tiny model into tmp_path/out, ``keys`` replacing its own."""
    import yaml

    cfg = tmp_path / "sweep.yaml"
    cfg.write_text(yaml.safe_dump({"model": "tiny-llama-random", "output": str(tmp_path / "out"),
                                   "tasks": ["niah_single"], "lengths": [128], "items": 1, "max_new_tokens": 4,
                                   "methods": ["full"], **keys}))
    return cfg


@pytest.mark.parametrize("task, length, fix", [("niah_single", 16384, "under 16380, leaving room for the question"),
                                               ("niah_single", 100000, "under 16380"),
                                               ("fidelity", 16360, "at most 16352")])
def test_a_length_past_the_models_positions_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch, task,
                                                                              length, fix):
    """Read from the model's config (tiny-llama-random: 16384 positions), counting the tokens fed after the context
    (max_new_tokens: 4, a fidelity continuation: 32): such rows scored positions the model never trained on, with only
    transformers' warning, and a length far past them ran until killed."""
    import retention.eval.models
    from retention.eval.cli import main

    monkeypatch.setattr(retention.eval.models, "load_eval_model", lambda *a, **k: pytest.fail("loaded the model first"))
    cfg = _sweep_config(tmp_path, tasks=[task], lengths=[256, length])
    assert main(["run", "--config", str(cfg), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert (f"error: lengths: {length} context tokens of {task}" in err and "tiny-llama-random's 16384 positions "
            f"(max_position_embeddings): lower lengths to {fix}" in err)


def test_an_item_past_the_models_positions_is_refused_before_any_row(tmp_path, monkeypatch):
    """A length just under the limit passes the check from the config, but the item's chat template, question and
    reply take it past: the items are measured before any is scored, and the length the error names runs."""
    import retention.eval.runner
    from retention.eval.models import load_eval_model

    model, tok = load_eval_model("tiny-llama-random")
    monkeypatch.setattr(model.config, "max_position_embeddings", 160)
    scored = []
    run = retention.eval.runner.run_item_budgets
    monkeypatch.setattr(retention.eval.runner, "run_item_budgets", lambda *a, **k: scored.append(1) or run(*a, **k))
    cfg = load_eval_config(_sweep_config(tmp_path, lengths=[128, 150]))
    with pytest.raises(EvalConfigError, match=r"lengths: 150: item niah_single-eval-150-0-0 of niah_single runs to "
                                              r"\d+ tokens, past tiny-llama-random's 160 positions") as e:
        run_sweep(cfg, (model, tok), progress=False)
    assert not scored and not (tmp_path / "out").exists()
    fits = int(re.search(r"lower lengths to (\d+) or less", str(e.value)).group(1))
    assert 64 <= fits < 128
    rows = read_results(run_sweep(load_eval_config(_sweep_config(tmp_path, lengths=[fits])), (model, tok),
                                  progress=False))
    assert len(rows) == 1 and scored


@pytest.mark.parametrize("problem", ["gates", "model", "lengths"])
def test_a_run_refused_before_it_starts_leaves_no_output_folder(tmp_path, capsys, problem):
    """The output folder used to be made first, so a typo left an empty folder behind."""
    from retention.eval.cli import main

    keys = {"gates": {"gates": str(tmp_path / "no-such-gates"), "methods": ["full", "global_gates"]},
            "model": {"model": str(tmp_path)}, "lengths": {"lengths": [100000]}}[problem]
    assert main(["run", "--config", str(_sweep_config(tmp_path, **keys)), "--quiet"]) == 2
    assert "error: " in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_summary_page_names_its_rows_and_holds_every_table(tmp_path):
    from retention.eval.cli import main

    def row(task, method, budget, score, kv=0.1):
        return {"task": task, "length": 4096, "item": "a", "method": method, "budget": budget, "score": score,
                "kept_entries": 10, "kv_bytes": kv * 2**22, "full_cache_bytes": 2**22, "metric": "recall", "model": "m"}

    rows = [row("a", "full", "full", 90.0, kv=1.0), row("a", "global_gates", "fraction=0.1", 80.0),
            row("a", "snapkv", "fraction=0.1", 30.0)]
    results = tmp_path / "run" / "results.jsonl"
    results.parent.mkdir()
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    page = tmp_path / "published" / "goal.md"
    assert main(["report", str(results), "--summary", str(page), "--title", "Goal check"]) == 0
    text = page.read_text()
    assert text.startswith("# Goal check\n") and "`goal.jsonl` (3 rows" in text
    assert "| global_gates | 10% | 80.0 | -10.0 | +50.0 (snapkv) |" in text  # the summary
    assert "| method | a |" in text and "| snapkv | 30.0 |" in text  # the per-task view
    assert "| a | 4096 | snapkv | 10% | 30.0 |" in text  # the full table
    assert page.with_suffix(".jsonl").read_text() == results.read_text()


def test_report_methods_publishes_only_those_labels_and_run_only_its_configs(tmp_path, capsys, monkeypatch):
    """``report --methods`` shows the labels named (and the full cache); ``run`` publishes the methods of its config,
    not every row of an output folder another config shares."""
    import retention.eval.cli as cli
    import retention.eval.runner

    def row(method, budget, score):
        return {"task": "niah_single", "length": 128, "item": "a", "method": method, "budget": budget,
                "score": score, "kept_entries": 10, "kv_bytes": 2**20, "full_cache_bytes": 2**22, "metric": "recall",
                "model": "m"}

    rows = [row("full", "full", 90.0), row("snapkv_window8", "fraction=0.25", 30.0),
            row("streamingllm", "fraction=0.25", 20.0), row("other_configs_gates", "fraction=0.25", 70.0)]
    results = tmp_path / "run" / "results.jsonl"
    results.parent.mkdir()
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    page = tmp_path / "page.md"
    assert cli.main(["report", str(results), "--methods", "snapkv_window8", "--summary", str(page)]) == 0
    text = page.read_text()
    assert "| snapkv_window8 | 30.0" in text and "streamingllm" not in text and "other_configs" not in text
    kept = [json.loads(x)["method"] for x in page.with_suffix(".jsonl").read_text().splitlines()]
    assert kept == ["full", "snapkv_window8"]
    for flag, words in (("nope", "methods ['nope'] have no rows here; the rows hold ['full', 'other_configs_gates'"),
                        (",", "--methods names no method")):
        assert cli.main(["report", str(results), "--methods", flag, "--summary", str(page)]) == 2
        assert words in capsys.readouterr().err

    monkeypatch.setattr(retention.eval.runner, "run_sweep", lambda *a, **k: results)
    monkeypatch.setattr(retention.eval.report, "write_report", lambda r, *a: tmp_path / "report.md")
    cfg = Path(__file__).parents[1] / "eval" / "configs" / "tiny.yaml"
    assert cli.main(["run", "--config", str(cfg), "--summary", str(page)]) == 0
    text = page.read_text()
    assert "| snapkv_window8 | 30.0" in text and "| streamingllm | 20.0" in text and "other_configs" not in text
    assert "other_configs" not in capsys.readouterr().out


def test_run_refuses_a_bad_publish_target_before_the_sweep(tmp_path, capsys, monkeypatch):
    import retention.eval.cli as cli
    import retention.eval.runner

    monkeypatch.setattr(retention.eval.runner, "run_sweep", lambda *a, **k: pytest.fail("the sweep ran"))
    cfg = sorted((Path(__file__).parents[1] / "eval" / "configs").glob("tiny*.yaml"))[0]
    readme = tmp_path / "README.md"
    readme.write_text("no markers")
    for flags, words in ((["--summary", str(tmp_path / "x.txt")], "give a .md file"),
                         (["--card", str(tmp_path)], "not a gate checkpoint"),
                         (["--readme", str(readme)], "markers")):
        assert cli.main(["run", "--config", str(cfg), *flags]) == 2
        assert words in capsys.readouterr().err


def test_a_damaged_row_is_moved_aside_and_its_item_scored_again(tmp_path, capsys):
    """Issue 77: a resumed sweep skipped a garbled middle line and scored its item again, but left the garbage in
    place, so report and pool refused the file. The line goes to results.jsonl.bad, the file is rewritten whole."""
    from retention.eval.runner import load_result_file

    cfg = load_eval_config(_sweep_config(tmp_path, items=3, methods=["full", "streamingllm"], budgets=[0.5]))
    results = run_sweep(cfg, progress=False)
    lines = results.read_bytes().splitlines(keepends=True)
    assert len(lines) == 6
    garbled = lines[2][:20] + b"\x00\xff garbage"
    results.write_bytes(b"".join(lines[:2] + [garbled + b"\n", b"[1, 2]\n"] + lines[4:]))  # a line no row too
    with pytest.raises(ValueError, match=r"line 3: not UTF-8 text; .*\(resuming its sweep moves such lines to results"):
        load_result_file(results)
    capsys.readouterr()
    run_sweep(cfg, progress=False)
    err = capsys.readouterr().out
    assert f"warning: {results}, lines 3, 4: not a row (damaged or edited); moved to {results}.bad" in err
    assert (tmp_path / "out" / "results.jsonl.bad").read_bytes() == garbled + b"\n[1, 2]\n"
    rows = load_result_file(results)  # report and pool read it again
    key = lambda r: (r["item"], r["method"], r["budget"])  # noqa: E731
    assert sorted(map(key, rows)) == sorted(key(json.loads(line)) for line in lines)
    assert results.read_bytes().startswith(b"".join(lines[:2] + lines[4:]))  # the good rows kept as they were
    run_sweep(cfg, progress=False)  # nothing left to move or score
    assert "warning" not in capsys.readouterr().out and load_result_file(results) == rows


def test_a_resumed_sweep_rescores_rows_of_gates_that_changed(tmp_path, capsys):
    """Rows carry the fingerprint of the gates that scored them; when a method's gates change (a new
    shipped checkpoint), its rows move to results.replaced.jsonl and are scored again, the others stay."""
    import torch

    from retention import GateConfig, RetentionGates
    from retention.hub import export_gates

    def gates(seed):
        g = RetentionGates(GateConfig.for_model(model, bias_init=2.0))
        gen = torch.Generator().manual_seed(seed)
        for p in g.parameters():
            p.data = torch.randn(p.shape, generator=gen)
        return g

    from retention.eval.models import load_eval_model

    model, tok = load_eval_model("tiny-llama-random")
    first, second = gates(0), gates(1)
    assert first.fingerprint() == gates(0).fingerprint() != second.fingerprint()
    export_gates(first, tmp_path / "g", base_model="tiny")
    assert RetentionGates.from_pretrained(tmp_path / "g").fingerprint() == first.fingerprint()
    p = tmp_path / "c.yaml"
    p.write_text(f"model: tiny-llama-random\noutput: {tmp_path / 'out'}\ntasks: [niah_single]\nlengths: [128]\n"
                 f"budgets: [0.25]\nitems: 2\nmax_new_tokens: 2\nmethods: [{{name: snapkv}}, "
                 f"{{name: global_gates, gates: {tmp_path / 'g'}, label: mine}}]\n")
    results = run_sweep(load_eval_config(p), progress=False)
    rows = read_results(results)
    assert {r["method"]: r.get("gates_id") for r in rows} == {"snapkv": None, "mine": first.fingerprint()}
    run_sweep(load_eval_config(p), progress=False)  # same gates: nothing to do
    assert read_results(results) == rows and not (results.parent / "results.replaced.jsonl").exists()

    export_gates(second, tmp_path / "g", base_model="tiny")
    capsys.readouterr()
    run_sweep(load_eval_config(p), progress=False)
    assert f"mine gates ({first.fingerprint()} -> {second.fingerprint()})" in capsys.readouterr().out
    again, aside = read_results(results), read_results(results.parent / "results.replaced.jsonl")
    assert aside == [r for r in rows if r["method"] == "mine"] and len(aside) == 2
    assert [r for r in again if r["method"] == "snapkv"] == [r for r in rows if r["method"] == "snapkv"]
    assert (sorted(r["item"] for r in again if r.get("gates_id") == second.fingerprint())
            == sorted(r["item"] for r in aside))
    assert len(again) == len(rows)


def test_a_resumed_sweep_rescores_rows_of_another_setup(tmp_path, capsys):
    """Rows were keyed by task, item id, method and budget alone: after editing max_new_tokens, the model or a
    task's params, re-running the command kept every old row and reported it as the new setup's. Now rows record
    the setup (sweep_settings, item_sha) and those of another move aside and are scored again."""
    import json

    def config(max_new_tokens=2, keys=2):
        p = tmp_path / "c.yaml"
        p.write_text(f"model: tiny-llama-random\noutput: {tmp_path / 'out'}\n"
                     f"tasks: [{{name: niah_multikey, params: {{keys: {keys}}}}}, fidelity]\nlengths: [128]\n"
                     f"budgets: [0.25]\nitems: 2\nmax_new_tokens: {max_new_tokens}\n"
                     "methods: [{name: streamingllm}]\n")
        return load_eval_config(p)

    results = run_sweep(config(), progress=False)
    rows = read_results(results)
    assert ({(r["max_new_tokens"], r["chunk"], r["model"], r["dtype"]) for r in rows}
            == {(2, 512, "tiny-llama-random", "float32")})
    run_sweep(config(), progress=False)  # the same setup: nothing to do
    assert read_results(results) == rows
    aside = results.parent / "results.replaced.jsonl"
    assert not aside.exists()

    capsys.readouterr()
    run_sweep(config(max_new_tokens=3), progress=False)
    assert ("4 rows were scored with another setup than this config's: max_new_tokens (2 -> 3)"
            in capsys.readouterr().out)
    assert read_results(aside) == rows
    assert {r["max_new_tokens"] for r in read_results(results)} == {3} and len(read_results(results)) == 4

    run_sweep(config(max_new_tokens=3, keys=3), progress=False)  # other needles under the same item ids
    out = capsys.readouterr().out
    assert ("2 rows were scored with another setup" in out
            and "niah_multikey items (other text under the same ids" in out)
    now = read_results(results)
    assert len(now) == 4 and len({r["item_sha"] for r in now if r["task"] == "niah_multikey"}) == 2

    # rows written before rows recorded their setup are kept as they are
    results.write_text("".join(json.dumps({k: v for k, v in r.items() if k not in ("max_new_tokens", "item_sha")})
                               + "\n" for r in now))
    run_sweep(config(max_new_tokens=5, keys=3), progress=False)
    assert "rows were scored with another setup" not in capsys.readouterr().out and len(read_results(results)) == 4


def test_a_resumed_sweep_rescores_rows_of_a_label_given_another_method(tmp_path, capsys):
    """Rows were kept under their label alone: a config that gave the label another policy or other parameters
    re-ran into the same output kept the old method's rows and reported them as the new one's."""
    def config(method):
        p = tmp_path / "c.yaml"
        p.write_text(f"model: tiny-llama-random\noutput: {tmp_path / 'out'}\ntasks: [niah_single]\nlengths: [128]\n"
                     f"budgets: [0.25]\nitems: 2\nmax_new_tokens: 2\nmethods: [{{name: full}}, {method}]\n")
        return load_eval_config(p)

    results = run_sweep(config("{name: snapkv, params: {window: 8}, label: mine}"), progress=False)
    rows = read_results(results)
    assert {(r["policy"], str(r["params"])) for r in rows if r["method"] == "mine"} == {("snapkv", "{'window': 8}")}
    run_sweep(config("{name: snapkv, params: {window: 8}, label: mine}"), progress=False)  # the same: nothing to do
    assert read_results(results) == rows
    capsys.readouterr()
    run_sweep(config("{name: snapkv, params: {window: 16}, label: mine}"), progress=False)
    assert "2 rows were scored with another setup than this config's: mine params" in capsys.readouterr().out
    now = read_results(results)
    assert len(now) == 4 and {r["params"]["window"] for r in now if r["method"] == "mine"} == {16}
    run_sweep(config("{name: streamingllm, label: mine}"), progress=False)
    assert "mine policy ('snapkv' -> 'streamingllm')" in capsys.readouterr().out
    now = read_results(results)
    assert len(now) == 4 and {r["policy"] for r in now if r["method"] == "mine"} == {"streamingllm"}
    assert [r for r in now if r["method"] == "full"] == [r for r in rows if r["method"] == "full"]


def test_chat_template_kwargs_reach_every_prompt_of_a_sweep(tmp_path, monkeypatch, capsys):
    """`chat_template_kwargs: {enable_thinking: false}` renders every prompt as apply_chat_template(...,
    enable_thinking=False) does (Qwen3's empty reasoning block); rows record it, so a resumed sweep with other
    variables scores them again, and the tokenizer handed to the sweep stays as it was."""
    from chat_templates import THINKING_SWITCH_TEMPLATE

    import retention.tasks.prompt
    from retention.eval.models import load_eval_model
    from retention.templates import with_template_variables

    model, tok = load_eval_model("tiny-llama-random")
    tok.chat_template = THINKING_SWITCH_TEMPLATE
    messages = [{"role": "user", "content": "Hi."}]
    switched = with_template_variables(tok, {"enable_thinking": False, "extra": [1, None, {"k": "v\"w"}]})
    assert (switched.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
            != tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    assert tok.chat_template == THINKING_SWITCH_TEMPLATE

    prompts = []
    render = retention.tasks.prompt.render_chat
    monkeypatch.setattr(retention.tasks.prompt, "render_chat",
                        lambda *a, **k: prompts.append(render(*a, **k)) or prompts[-1])

    def sweep(extra: str) -> list[dict]:
        p = tmp_path / "c.yaml"
        p.write_text(f"model: tiny-llama-random\noutput: {tmp_path / 'out'}\ntasks: [niah_single]\nlengths: [128]\n"
                     f"budgets: [0.25]\nitems: 2\nmax_new_tokens: 2\nmethods: [{{name: streamingllm}}]\n{extra}")
        prompts.clear()
        return read_results(run_sweep(load_eval_config(p), (model, tok), progress=False))

    plain = sweep("")
    assert prompts and not any("<think>" in t for t in prompts) and plain[0]["chat_template_kwargs"] == {}
    off = sweep("chat_template_kwargs: {enable_thinking: false}\n")
    assert "chat_template_kwargs ({} -> {'enable_thinking': False})" in capsys.readouterr().out
    generation = [t for t in prompts if t.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")]
    assert len(generation) >= 2 and len(off) == 2 and off[0]["chat_template_kwargs"] == {"enable_thinking": False}
    assert tok.chat_template == THINKING_SWITCH_TEMPLATE


def test_a_generated_task_listed_twice_is_refused(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model: tiny-llama-random\ntasks: [{name: niah_multikey, params: {keys: 2}}, "
                 "{name: niah_multikey, params: {keys: 4}}]\nmethods: [{name: full}]\n")
    with pytest.raises(EvalConfigError, match="lists niah_multikey twice.*sweep the other into a second output"):
        load_eval_config(p)


def test_run_seed_flag_scores_another_item_set_into_the_same_rows(tmp_path, capsys):
    from retention.eval.cli import main

    p = tmp_path / "c.yaml"
    p.write_text(f"model: tiny-llama-random\noutput: {tmp_path / 'out'}\ntasks: [fidelity]\nlengths: [96]\n"
                 "items: 1\nseed: 0\nmethods: [{name: full}]\n")
    for seed in (3, 4):
        assert main(["run", "--config", str(p), "--seed", str(seed), "--quiet"]) == 0
    rows = read_results(tmp_path / "out" / "results.jsonl")
    assert [(r["seed"], r["item"]) for r in rows] == [(3, "fidelity-eval-96-3-0"), (4, "fidelity-eval-96-4-0")]


def test_seed_fills_the_output_folder(tmp_path):
    """``{seed}`` in ``output`` is filled with the item seed: the config's, or the one given instead (``--seed``)."""
    p = tmp_path / "c.yaml"
    p.write_text(f"output: {tmp_path}/set{{seed}}\nseed: 2\n")
    assert load_eval_config(p).output == f"{tmp_path}/set2"
    cfg = load_eval_config(p, seed=7)
    assert (cfg.seed, cfg.output) == (7, f"{tmp_path}/set7")
    assert load_eval_config(p, seed=7, output=f"{tmp_path}/{{seed}}/x").output == f"{tmp_path}/7/x"
    p.write_text(f"output: {tmp_path}/fixed\nseed: 2\n")  # no placeholder: the folder stays
    assert load_eval_config(p, seed=7).output == f"{tmp_path}/fixed"


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4, 17, 24])
def test_goal_sets_config_keeps_each_published_sets_folder(seed):
    """One config serves every goal set: ``--seed N`` gives the folder and the items that set's own config gave
    (``runs/eval/goal-setN``; seeds 1 and 3 keep theirs by ``--output``), so a published set's rows resume there."""
    cfg = load_eval_config("smollm2-goal-sets.yaml", seed=seed)
    assert (cfg.seed, cfg.output, cfg.items) == (seed, f"runs/eval/goal-set{seed}", 12)
    assert [m.label for m in cfg.method_list()] == ["full", "global_gates_sink4", "streamingllm"]


def test_run_seed_flag_fills_the_output_and_refuses_a_bad_seed(tmp_path, capsys, monkeypatch):
    import retention.eval.runner
    from retention.eval.cli import main

    p = tmp_path / "c.yaml"
    p.write_text(f"model: tiny-llama-random\noutput: {tmp_path}/set{{seed}}\ntasks: [fidelity]\nlengths: [96]\n"
                 "items: 1\nseed: 0\nmethods: [{name: full}]\n")
    assert main(["run", "--config", str(p), "--seed", "5", "--quiet"]) == 0
    rows = read_results(tmp_path / "set5" / "results.jsonl")
    assert [(r["seed"], r["item"]) for r in rows] == [(5, "fidelity-eval-96-5-0")]
    assert not (tmp_path / "set0").exists()
    monkeypatch.setattr(retention.eval.runner, "run_sweep", lambda *a, **k: pytest.fail("the sweep ran"))
    for bad in ("four", "-1", "2.5"):
        with pytest.raises(SystemExit) as exit_:
            main(["run", "--config", str(p), "--seed", bad])
        assert exit_.value.code == 2
        assert f"argument --seed: '{bad}' is not an item set: give a whole number >= 0" in capsys.readouterr().err


def test_eval_list_names_everything_a_config_can_use(capsys):
    from retention.eval.cli import main
    from retention.eval.loaders import HUB_TASKS
    from retention.eval.method_specs import available_methods
    from retention.tasks import TASKS

    assert main(["list"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert set(TASKS) | set(HUB_TASKS) | set(available_methods()) == set(lines)
    assert "(params: keys)" in lines["niah_multikey"] and "window" in lines["snapkv"] and "subset" in lines["longbench"]
    assert all("``" not in line for line in lines.values())
    for name in TASKS:  # every generator says what it asks
        assert len(lines[name].split(None, 1)) == 2 and not lines[name].split(None, 1)[1].startswith("(params"), name


def test_an_interrupted_sweep_says_how_to_go_on(tmp_path, capsys, monkeypatch):
    import retention.eval.runner
    from retention.eval.cli import main

    def interrupted(cfg, *a, **k):
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "results.jsonl").write_text('{"task": "t"}\n{"task": "u"}\n')
        raise KeyboardInterrupt

    monkeypatch.setattr(retention.eval.runner, "run_sweep", interrupted)
    cfg = tmp_path / "sweep.yaml"
    cfg.write_text(f"model: tiny-llama-random\noutput: {tmp_path / 'out'}\ntasks: [niah_single]\nmethods: [full]\n")
    assert main(["run", "--config", str(cfg), "--quiet"]) == 130
    assert "interrupted: 2 rows are in" in capsys.readouterr().err


def test_rescore_scores_stored_replies_again_under_the_current_metrics(tmp_path, capsys):
    """A metric fix changes rows already on disk: ``rescore`` regenerates the items from the config and the rows' own
    seeds (tokenizer only), scores each stored reply again and rewrites only what changed; rows of other items than
    the config makes are refused, and --dry-run writes nothing."""
    from retention.eval.cli import main

    p = tmp_path / "c.yaml"
    p.write_text(f"model: tiny-llama-random\noutput: {tmp_path / 'out'}\ntasks: [niah_single, fidelity]\n"
                 "lengths: [96]\nitems: 2\nmax_new_tokens: 2\nmethods: [{name: full}]\n")
    for seed in (3, 4):
        assert main(["run", "--config", str(p), "--seed", str(seed), "--quiet"]) == 0
    results = tmp_path / "out" / "results.jsonl"
    before = results.read_bytes()
    assert main(["rescore", str(results), "--config", str(p)]) == 0
    assert "every stored reply scores as recorded" in capsys.readouterr().out and results.read_bytes() == before

    rows = read_results(results)
    i = next(i for i, r in enumerate(rows) if r["task"] == "niah_single" and r["seed"] == 4)
    j = next(j for j, r in enumerate(rows) if r["task"] == "niah_single" and r["seed"] == 3)
    from retention.eval.models import tiny_tokenizer
    from retention.tasks import generate

    tok = tiny_tokenizer()
    needle = {it.id: it.answers[0] for seed in (3, 4) for it in generate("niah_single", tok, 96, 2, seed=seed)}
    # what a plain substring test scored 100: the needle inside a longer number; and a reply that does hold it
    rows[i] = {**rows[i], "reply": f" {needle[rows[i]['item']]}7.", "score": 100.0}
    rows[j] = {**rows[j], "reply": f" It is {needle[rows[j]['item']]}.", "score": 0.0}
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tampered = results.read_bytes()
    assert main(["rescore", str(results), "--config", str(p), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "2 rows score otherwise: nothing written" in out and results.read_bytes() == tampered
    assert main(["rescore", str(results), "--config", str(p)]) == 0
    after = read_results(results)
    assert after[i]["score"] == 0.0 and after[j]["score"] == 100.0
    assert [r for k, r in enumerate(after) if k not in (i, j)] == [r for k, r in enumerate(rows) if k not in (i, j)]

    other = tmp_path / "other.yaml"  # other haystack text under the same ids: the rows' item_sha says so
    other.write_text(p.read_text().replace("items: 2", "items: 2\nsource: pydoc"))
    capsys.readouterr()
    assert main(["rescore", str(results), "--config", str(other)]) == 2
    assert "scored on other text under the same ids" in capsys.readouterr().err
    few = tmp_path / "few.yaml"
    few.write_text(p.read_text().replace("[niah_single, fidelity]", "[niah_multikey, fidelity]"))
    assert main(["rescore", str(results), "--config", str(few)]) == 2
    assert "rows name items the config does not generate" in capsys.readouterr().err
    assert read_results(results) == after


@pytest.mark.parametrize("policy", ["global_gates", "snapkv"])
def test_compress_once_evicts_nothing_after_the_context(policy, tmp_path):
    """Issue 74: the harness kept the budget live after the compression, so the question's tokens evicted context
    entries (and SnapKV scored again with the question's queries); compress_once freezes the compressed context."""
    from retention.eval.budgets import parse_budget
    from retention.eval.config import EvalConfigError, load_eval_config
    from retention.eval.method_specs import make_method
    from retention.eval.methods import kv_streams
    from retention.eval.models import load_eval_model
    from retention.eval.protocol import context_and_prompt, run_item
    from retention.eval.runner import run_sweep
    from retention.tasks import generate

    from retention import GateConfig, RetentionGates, attach_gates

    model, tok = load_eval_model("tiny-llama-random")
    attach_gates(model, RetentionGates(GateConfig.for_model(model, bias_init=2.0), seed=0), mode="score")
    method = make_method({"name": policy})
    caches, new_cache = {}, method.new_cache

    def spy(*a, **k):
        caches[protocol] = cache = new_cache(*a, **k)
        return cache

    method.new_cache = spy
    item = generate("niah_single", tok, 192, 1, seed=1)[0]
    rows = {}
    for protocol in ("query_agnostic", "compress_once"):
        rows[protocol] = run_item(model, tok, item, method, parse_budget(0.25), protocol=protocol, max_new_tokens=4)
    L, H, _ = kv_streams(model)
    head, prompt = context_and_prompt(tok, item, "compress_once")  # generate feeds the prompt past the context
    compressed = rows["compress_once"]["kept_entries"]
    assert compressed == rows["query_agnostic"]["kept_entries"]  # the same compression of the context
    frozen = caches["compress_once"].memory_report()["kept_entries"]
    live = caches["query_agnostic"].memory_report()["kept_entries"]
    fed = len(prompt) - len(head)  # the question, generation prompt and answer prefix
    assert frozen >= compressed + L * H * fed > live  # nothing evicted vs evicted back to the budget

    # one output holds one protocol: a second protocol into it is refused before the model loads
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(f"model: tiny-llama-random\noutput: {tmp_path / 'out'}\ntasks: [niah_single]\nlengths: [128]\n"
                        "budgets: [0.25]\nitems: 1\nmax_new_tokens: 2\nmethods: [{name: streamingllm}]\n")
    run_sweep(load_eval_config(cfg_file), progress=False)
    with pytest.raises(EvalConfigError, match="holds rows of protocol query_agnostic and this sweep is compress_once"):
        run_sweep(load_eval_config(cfg_file, protocol="compress_once"), progress=False)


def test_a_staged_run_scores_part_of_the_config_and_the_whole_run_fills_in_around_it(tmp_path, capsys, monkeypatch):
    """``--tasks/--budgets/--methods`` run part of a config into its output; the whole config's run keeps those rows
    (scored once) and adds the rest. A name the config lacks fails before any model loads, naming what it holds."""
    import retention.eval.runner
    from retention.eval.cli import main

    p = tmp_path / "c.yaml"
    p.write_text(f"model: tiny-llama-random\noutput: {tmp_path / 'out'}\ntasks: [fidelity, niah_single]\n"
                 "lengths: [96]\nitems: 1\nbudgets: [0.25, 0.5]\nmethods: [{name: full}, {name: streamingllm}]\n")
    assert main(["run", "--config", str(p), "--tasks", "fidelity", "--budgets", "50%", "--methods", "streamingllm",
                 "--quiet"]) == 0
    staged = read_results(tmp_path / "out" / "results.jsonl")
    assert [(r["task"], r["method"], r["budget"]) for r in staged] == [("fidelity", "streamingllm", "fraction=0.5")]
    assert main(["run", "--config", str(p), "--tasks", "in_distribution", "--quiet"]) == 0
    rows = read_results(tmp_path / "out" / "results.jsonl")
    assert rows[0] == staged[0]  # kept, not scored again
    assert sorted((r["task"], r["method"], r["budget"]) for r in rows) == sorted(
        [("fidelity", "streamingllm", "fraction=0.5")]
        + [(t, m, b) for t in ("fidelity", "niah_single") for m, b in
           [("full", "full"), ("streamingllm", "fraction=0.25"), ("streamingllm", "fraction=0.5")]
           if (t, m, b) != ("fidelity", "streamingllm", "fraction=0.5")])
    monkeypatch.setattr(retention.eval.runner, "run_sweep", lambda *a, **k: pytest.fail("the sweep ran"))
    for flag, value, says in (("--tasks", "prose_facts", r"\['prose_facts'\] not in this config's tasks"),
                              ("--tasks", "held_out", r"\['held_out'\] not in this config's tasks"),  # none held out
                              ("--budgets", "0.1", r"not all in this config's budgets \['25%', '50%'\]"),
                              ("--budgets", "lots", "budget 'lots' is not allowed"),
                              ("--methods", "h2o",
                               r"\['h2o'\] not in this config's methods \['full', 'streamingllm'\]")):
        assert main(["run", "--config", str(p), flag, value, "--quiet"]) == 2
        assert re.search(says, capsys.readouterr().err)
