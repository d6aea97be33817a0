"""``benchmarks/decode.py`` end to end on the embedded model with tiny settings: the table has every
setting, the budget keeps fewer bytes than the full cache, and ``--profile`` writes an op table per
setting (what the next GPU session reads to find where the plain rows' time goes)."""

import pytest


@pytest.mark.slow  # about 30 s: nine prefills and profiled decodes of the embedded model
@pytest.mark.smollm2
def test_bench_decode_table_and_profile(tmp_path, capsys):
    from benchmarks import decode as bench_decode

    out = tmp_path / "profile.txt"
    assert bench_decode.main(["--contexts", "64", "--budget", "8", "--new", "3", "--chunk", "32",
                              "--profile", str(out)]) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| 64 ") or line.startswith("| 8 ")]
    names = [r[1] for r in rows]
    assert names == ["full@B", "budget", "full", "plain", "bare"]
    mib = {r[1]: float(r[3]) for r in rows}
    assert mib["budget"] < mib["full"] == mib["plain"] == mib["bare"]
    text = out.read_text()
    sections = text.split("## N = ")[1:]
    assert [s.split("\n")[0] for s in sections] == ["8, full@B", "64, budget", "64, full", "64, plain", "64, bare"]
    for s in sections:
        assert "host time per step" in s and "aten::" in s and "Self CPU time total" in s


def test_warm_up_rounds_are_reported_as_cold_and_left_out_of_the_timed_medians(monkeypatch, capsys):
    """Every setting runs an untimed warm-up round first: per-shape setup (cuDNN attention plans per key length on
    an H100) is then not charged to whichever setting meets a shape first. Timed rounds feed the medians; the first
    warm-up round is the 'cold' column."""
    import itertools

    from benchmarks import decode as bench_decode
    from tiny_models import tiny_llama

    import retention

    monkeypatch.setattr(retention, "load_model", lambda *a, **k: (tiny_llama(), None))  # a fresh model per run
    monkeypatch.setattr(bench_decode, "real_text_ids", lambda tok, n: list(range(n)))
    clock = itertools.count(1)  # each call's "ms/token" is its call number: rounds are told apart
    calls = []

    def fake_run(model, ids, budget, new, chunk, plain=False, profile=False):
        calls.append(profile)
        return float(next(clock)), {"kv_bytes": 2**20}, None, None

    monkeypatch.setattr(bench_decode, "run_one", fake_run)
    assert bench_decode.main(["--contexts", "32", "--budget", "8", "--repeats", "2", "--device", "cpu"]) == 0
    assert len(calls) == 5 * 2 and "warm-up" not in capsys.readouterr().out  # the CPU's default: no warm-up round
    calls.clear()
    clock = itertools.count(1)
    assert bench_decode.main(["--contexts", "32", "--budget", "8", "--repeats", "2", "--warmup", "1",
                              "--device", "cpu"]) == 0
    # below the header
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    assert len(calls) == 5 * 3  # 5 settings x (1 warm-up + 2 timed rounds)
    for i, row in enumerate(rows):  # setting i ran as call i+1 (warm-up), i+6 and i+11 (timed)
        assert row[1] == ["full@B", "budget", "full", "plain", "bare"][i]
        assert row[2] == f"{(i + 6 + i + 11) / 2:.1f} [{i + 6:.1f}-{i + 11:.1f}]"
        assert row[-1].strip(" |") == f"{i + 1:.1f}"


@pytest.mark.parametrize("script,args,words", [
    ("decode", ["--warmup", "-1"], "--warmup: must be at least 0, got -1"),
    ("decode", ["--contexts", "0"], "--contexts: must be at least 1, got 0"),
    ("decode", ["--new", "0"], "--new: must be at least 1"),  # was a StatisticsError after every prefill
    ("decode", ["--budget", "-1"], "--budget: must be at least 1"),
    ("decode", ["--device", "cuda:0"], "torch sees no CUDA GPU here"),
    ("decode", ["--dtype", "fp8"], "invalid choice: 'fp8'"),
    # full@B printed B tokens of context it never held
    ("decode", ["--contexts", "64", "128", "--budget", "64"], "--budget 64 must be below the smallest context"),
    ("graph_ceiling", ["--repeats", "1"], "--repeats: must be at least 2"),  # the one round was the warm-up
    ("graph_ceiling", ["--device", "cuda"], "torch sees no CUDA GPU here"),  # was a ValueError traceback
    ("train_step", ["--seq-len", "0"], "--seq-len: must be at least 1"),
    ("train_step", ["--device", "cuda"], "torch sees no CUDA GPU here"),
    ("kernels", ["--seq", "64", "0"], "--seq: must be at least 1"),
])
def test_benchmark_arguments_are_checked_before_anything_loads(script, args, words, capsys, monkeypatch):
    import importlib

    import retention

    if "cuda" in " ".join(args) and __import__("torch").cuda.is_available():
        pytest.skip("this machine has the GPU the argument names")
    monkeypatch.setattr(retention, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    main = importlib.import_module(f"benchmarks.{script}").main
    with pytest.raises(SystemExit) as stop:
        main(args)
    assert stop.value.code == 2 and words in capsys.readouterr().err


def test_the_graph_ceiling_bench_decodes_the_same_tokens_from_a_static_cache():
    """benchmarks/graph_ceiling.py's eager rows on the CPU (the graphed row needs a GPU): the static cache,
    fed with explicit cache positions, decodes the eager DynamicCache's greedy tokens, and every setting is timed."""
    import torch

    from benchmarks import graph_ceiling as bench_graph_ceiling
    from retention import attach_gates
    from tiny_models import tiny_llama

    model = tiny_llama().eval()
    attach_gates(model, None, mode="score")
    ids = torch.randint(0, 100, (90,), generator=torch.Generator().manual_seed(0)).tolist()
    ms, tokens = bench_graph_ceiling.run_round(model, ids, budget_tokens=8, new_tokens=6, chunk=32)
    assert set(ms) == {"budget", "bare", "static"} and all(v > 0 for v in ms.values())
    assert len(tokens["bare"]) == 6 and tokens["static"] == tokens["bare"]


def test_the_graph_ceiling_bench_runs_as_its_command(monkeypatch, capsys):
    """``python -m benchmarks.graph_ceiling`` end to end on the CPU with a tiny model: it imports its
    helpers from the package (it once imported ``bench_decode`` as a top-level module, which fails outside
    ``retention/eval/``) and prints a row per setting against the bare model."""
    from benchmarks import decode as bench_decode, graph_ceiling as bench_graph_ceiling
    from tiny_models import tiny_llama

    import retention

    monkeypatch.setattr(retention, "load_model", lambda *a, **k: (tiny_llama(), None))
    monkeypatch.setattr(bench_decode, "real_text_ids", lambda tok, n: [i % 100 for i in range(n)])
    assert bench_graph_ceiling.main(["--context", "40", "--budget", "8", "--new", "3", "--chunk", "16",
                                     "--repeats", "2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "greedy tokens equal to the eager DynamicCache's: {'bare': True, 'static': True}" in out
    rows = {line.split(" | ")[0].strip("| "): line for line in out.splitlines() if line.startswith("| ")}
    assert {"bare", "static", "budget"} <= set(rows) and "| 1.00x |" in rows["bare"]


def test_the_profile_path_is_checked_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """``--profile`` was written only after every measurement: a folder or a path under a file failed then."""
    from benchmarks import decode as bench_decode

    import retention

    monkeypatch.setattr(retention, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    (tmp_path / "file").write_text("x")
    for bad, words in ((tmp_path, "is a folder"), (tmp_path / "file" / "p.txt", "is a file, not a folder")):
        with pytest.raises(SystemExit) as stop:
            bench_decode.main(["--contexts", "64", "--budget", "8", "--device", "cpu", "--profile", str(bad)])
        assert stop.value.code == 2 and words in capsys.readouterr().err
    assert bench_decode.profile_problem(tmp_path / "new" / "p.txt") is None  # missing folders are made


@pytest.mark.parametrize("script,args,words", [
    ("decode", ["--contexts", "64", "--budget", "8", "--gates", "MISSING"], "gate checkpoint"),
    ("decode", ["--contexts", "64", "--budget", "8", "--model", "MISSING"], "cannot load model"),
    ("prefill", ["--contexts", "64", "--model", "MISSING"], "cannot load model"),
    ("train_step", ["--no-memory", "--model", "MISSING"], "cannot load model"),
    ("graph_ceiling", ["--model", "MISSING"], "cannot load model"),
])
def test_benchmark_user_errors_are_messages_not_tracebacks(script, args, words, tmp_path, monkeypatch, capsys):
    """A missing checkpoint or model: ``error: ...`` and exit status 2 (was a traceback, the gates' only after the
    model had loaded)."""
    import importlib

    import retention

    missing = str(tmp_path / "nosuch")  # a path: refused at once, with no Hub round trip
    if "--gates" in args:
        monkeypatch.setattr(retention, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    main = importlib.import_module(f"benchmarks.{script}").main
    assert main([missing if a == "MISSING" else a for a in args] + ["--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "error: " in err and words in err and "Traceback" not in err


def test_the_memory_ratio_is_not_printed_against_a_floor_the_sampling_cannot_see():
    """``--seq-len 1`` on the CPU: the floor's step added no page the samples saw, and the ratio read 4754x."""
    from benchmarks.train_step import memory_ratio

    assert memory_ratio(0.05, 0.0) == memory_ratio(3.0, 1e-6) == "n/a (floor below what the sampling sees)"
    assert memory_ratio(3.0, float("nan")).startswith("n/a") and memory_ratio(300.0, 200.0) == "1.50x"


def test_gates_of_another_model_are_a_message_not_a_traceback(tmp_path, capsys):
    """check_gates_match raised a plain ValueError, which no command printed as an error."""
    from benchmarks.decode import main
    from retention.gates import GateConfig, RetentionGates

    RetentionGates(GateConfig(num_layers=2, num_kv_heads=2, hidden_size=64)).save_pretrained(tmp_path / "other")
    assert main(["--contexts", "64", "--budget", "8", "--new", "1", "--gates", str(tmp_path / "other"),
                 "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "error: gates do not match this model" in err and "Traceback" not in err


def test_a_repeated_context_is_timed_and_printed_once(monkeypatch, capsys):
    """``--contexts 32 32`` ran every setting of N = 32 twice a round, printed its rows twice, and gave one round a
    range in brackets (two runs under one key), as if it were the median of two rounds."""
    from benchmarks import decode as bench_decode
    from tiny_models import tiny_llama

    import retention

    monkeypatch.setattr(retention, "load_model", lambda *a, **k: (tiny_llama(), None))
    monkeypatch.setattr(bench_decode, "real_text_ids", lambda tok, n: list(range(n)))
    calls = []

    def fake_run(model, ids, budget, new, chunk, plain=False, profile=False):
        calls.append(len(ids))
        return float(len(calls)), {"kv_bytes": 2**20}, None, None

    monkeypatch.setattr(bench_decode, "run_one", fake_run)
    assert bench_decode.main(["--contexts", "32", "32", "--budget", "8", "--device", "cpu"]) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    assert calls == [8, 32, 32, 32, 32]
    assert [r[1] for r in rows] == ["full@B", "budget", "full", "plain", "bare"] and all("[" not in r[2] for r in rows)


@pytest.mark.parametrize("module,args", [
    ("retention.cli", ["demo", "--device", "cpu"]),
    ("retention.cli", ["chat", "--device", "cpu"]),
    ("benchmarks.decode", ["--contexts", "64", "--budget", "8", "--device", "cpu"]),
])
def test_gates_of_another_model_are_refused_before_the_model_loads(module, args, tmp_path, monkeypatch, capsys):
    """The gates' shapes were checked against the loaded model only: the weights (minutes for a large model) loaded
    first, for nothing. The model's config says its shapes before them."""
    import importlib

    import retention
    import retention.models
    from retention.gates import GateConfig, RetentionGates

    for owner in (retention, retention.models):
        monkeypatch.setattr(owner, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    RetentionGates(GateConfig(num_layers=2, num_kv_heads=2, hidden_size=64)).save_pretrained(tmp_path / "other")
    assert importlib.import_module(module).main(args + ["--gates", str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err
    assert "error: gates do not match this model" in err and "(30, 3, 576)" in err and "Traceback" not in err
