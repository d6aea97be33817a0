"""benchmarks/prefill.py on a tiny model: every setting runs, and ``masked`` really is the masked path."""

import pytest

from retention.cache import attention
from benchmarks import decode as bench_decode, prefill as bench_prefill


@pytest.fixture
def tiny(monkeypatch):
    from tiny_models import tiny_llama

    import retention

    monkeypatch.setattr(retention, "load_model", lambda *a, **k: (tiny_llama(), None))
    monkeypatch.setattr(bench_decode, "real_text_ids", lambda tok, n: [i % 100 for i in range(n)])


def test_the_prefill_bench_runs_as_its_command(tiny, capsys):
    assert bench_prefill.main(["--contexts", "24", "40", "--chunk", "16", "--repeats", "2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "prefill in 16-token chunks" in out and "median of 2 interleaved rounds" in out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [(r[0].strip("| "), r[1]) for r in rows] == [(n, s) for n in ("24", "40") for s in bench_prefill.SETTINGS]
    assert all(r[3] == "1.00x |" for r in rows if r[1] == "plain")


def test_masked_turns_the_mask_free_path_off_and_back_on(monkeypatch):
    from retention.cache import dispatch

    calls = []

    def spy(*args, held=None):
        calls.append(held)
        return attention.padded_attention(*args, held=held)

    monkeypatch.setattr(dispatch, "padded_attention", spy)
    with bench_prefill.masked_attention():
        dispatch.padded_attention(*_args(), held=5)  # what the cache asks for while nothing is evicted
    assert dispatch.padded_attention is spy and calls == [None]


def _args():
    import torch

    q, k = torch.randn(1, 2, 5, 4), torch.randn(1, 1, 5, 4)
    pos = torch.arange(5).expand(1, 1, 5)
    return q, k, k, pos, torch.ones(1, 1, 5, dtype=torch.bool), torch.arange(5)[None], 0.5


def test_the_first_timed_setting_is_not_charged_the_warm_up_and_repeated_contexts_run_once(tiny, monkeypatch,
                                                                                           capsys):
    """On the CPU the process's one-time setup landed on the first timed prefill (its row read 13x); an untimed
    prefill per setting now runs first there too. ``--contexts 16 16`` is one context, not two merged rows."""
    calls = []

    def fake(model, ids, setting, chunk):  # the first prefill of the process pays 100 ms of setup
        calls.append((len(ids), setting))
        return 100.0 if len(calls) == 1 else 1.0

    monkeypatch.setattr(bench_prefill, "prefill_ms", fake)
    assert bench_prefill.main(["--contexts", "16", "16", "--device", "cpu"]) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line[:3] == "| 1"]
    assert [r[1] for r in rows] == list(bench_prefill.SETTINGS)
    assert all(r[2] == "1" and r[3] == "1.00x |" for r in rows)
    assert len(calls) == 2 * len(bench_prefill.SETTINGS)  # the warm-up and one timed round
