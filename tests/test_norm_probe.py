"""retention/eval/norm_probe.py, the probe behind the key- and value-norm experiments, on a tiny random model."""

import random

import pytest
import torch

from retention.eval import norm_probe

LENGTH = 200  # context tokens per item: 10% keeps 20 entries per head past the 4 sinks


def textbook_spearman(a: list[float], b: list[float]) -> float:
    """1 - 6 sum d^2 / (n (n^2 - 1)), valid without ties."""
    rank = lambda x: {i: r for r, i in enumerate(sorted(range(len(x)), key=x.__getitem__))}  # noqa: E731
    ra, rb = rank(a), rank(b)
    n = len(a)
    return 1 - 6 * sum((ra[i] - rb[i]) ** 2 for i in range(n)) / (n * (n * n - 1))


def test_spearman_matches_the_textbook_formula_row_by_row():
    rng = random.Random(0)
    rows_a = [[rng.random() for _ in range(30)] for _ in range(5)]
    rows_b = [[x + rng.gauss(0, 0.3) for x in row] for row in rows_a]
    expected = sum(textbook_spearman(a, b) for a, b in zip(rows_a, rows_b)) / 5
    a, b = torch.tensor(rows_a), torch.tensor(rows_b)
    assert norm_probe.spearman(a, b) == pytest.approx(expected, abs=1e-5)
    assert 0.3 < expected < 1  # the rows are related but not identical: the check is not trivial
    assert norm_probe.spearman(a, a) == pytest.approx(1.0)
    assert norm_probe.spearman(a, -a) == pytest.approx(-1.0)


@pytest.fixture(scope="module")
def tiny():
    from retention import attach_gates
    from retention.eval.models import load_eval_model

    model, tok = load_eval_model("tiny-llama-random")
    attach_gates(model, None, mode="score", seed=0)
    return model, tok


def test_the_probe_reports_bounded_correlations_and_shares(tiny):
    model, tok = tiny
    result = norm_probe.probe(model, tok, n_items=2, length=LENGTH, seed=5)
    assert result["items"] == 2 and result["heads"] == 4  # 2 layers x 2 KV heads
    for rho in result["rho"]:
        assert len(rho) == len(norm_probe.RHO_NAMES) and all(-1 <= r <= 1 for r in rho)
    for shares in result["quartiles"]:  # every top entry falls in exactly one quartile
        assert sum(shares) == pytest.approx(1.0) and all(0 <= s <= 1 for s in shares)
    assert set(result["kept"]) == set(norm_probe.KEY_WEIGHTS)
    assert all(len(v) == 2 and all(0 <= x <= 1 for x in v) for v in result["kept"].values())


def test_an_oracle_that_ranks_as_the_gates_do_is_fully_kept(tiny, monkeypatch):
    """Wiring check: when the future attention is replaced by the gates' own order (sinks first), the gates
    correlate perfectly with it and, at key weight 0, keep every one of its per-head picks."""
    model, tok = tiny

    def gates_order(self, entries):
        score = (LENGTH - entries.pos) * entries.log_beta
        return torch.where(entries.pos < norm_probe.SINKS, torch.full_like(score, 1e30), score)

    monkeypatch.setattr(norm_probe.FutureAttention, "score", gates_order)
    result = norm_probe.probe(model, tok, n_items=1, length=LENGTH, seed=5)
    assert result["rho"][0][2] == pytest.approx(1.0)  # gates vs "future attention"
    assert result["kept"][0.0] == [pytest.approx(1.0)]
    assert min(result["kept"][8.0]) < 1.0  # a key-norm term reorders the picks: the share can fall below 1


def test_the_probe_runs_as_its_command(tmp_path, capsys):
    from retention.eval.models import load_eval_model
    from retention.gates import GateConfig, RetentionGates

    model, _ = load_eval_model("tiny-llama-random")
    RetentionGates(GateConfig.for_model(model)).save_pretrained(tmp_path / "gates")
    assert norm_probe.main(["1", "--model", "tiny-llama-random", "--gates", str(tmp_path / "gates"),
                            "--length", str(LENGTH)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"1 fidelity items of seed 31, {LENGTH}-token contexts, 4 KV heads"
    assert [line.split(":")[0] for line in out[1:6]] == [f"rho({n})" for n in norm_probe.RHO_NAMES]
    assert out[7].startswith("share of the per-head oracle's picks kept") and "8: " in out[7]


def test_the_command_refuses_a_model_without_gates_before_loading_it(capsys):
    with pytest.raises(SystemExit):
        norm_probe.main(["1", "--model", "tiny-llama-random"])
    assert "no gates are shipped for 'tiny-llama-random'; pass --gates" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        norm_probe.main(["1", "--length", "30"])
    assert "a context of at least 50 tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        norm_probe.main(["0"])
    assert "items" in capsys.readouterr().err


def test_the_command_reads_the_gates_before_the_model_and_names_an_unknown_model(tmp_path, monkeypatch, capsys):
    """A missing ``--gates`` failed with a HubError traceback after the model had loaded; an unknown ``--model``
    without ``--gates`` was told no gates are shipped for it."""
    monkeypatch.setattr("retention.eval.models.load_eval_model", lambda *a, **k: pytest.fail("loaded the model first"))
    assert norm_probe.main(["1", "--length", "50", "--gates", str(tmp_path / "nosuch")]) == 2
    err = capsys.readouterr().err
    assert "error: gate checkpoint" in err and "no such folder" in err and "Traceback" not in err
    assert norm_probe.main(["1", "--model", str(tmp_path / "nosuch")]) == 2
    err = capsys.readouterr().err
    assert "error: cannot load model" in err and "no gates are shipped" not in err
