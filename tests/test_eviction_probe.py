"""retention/eval/eviction_probe.py, the probe behind the folded-eviction and consensus experiments."""

import pytest
import torch

from retention.cache.attention import padded_attention
from retention.eval import eviction_probe as ep

LENGTH = 200  # context tokens per item: 10% keeps 20 entries per head


def naive_folded(query, keys, values, key_pos, valid, query_pos, scale, fk, fv, fb):
    """One (batch, query head, query) at a time: softmax over the visible keys plus the folded entry."""
    B, Hq, Q, D = query.shape
    H = keys.shape[1]
    out = torch.zeros(B, Q, Hq, D, dtype=torch.float64)
    for b in range(B):
        for hq in range(Hq):
            h = hq // (Hq // H)
            for q in range(Q):
                seen = valid[b, h] & (key_pos[b, h] >= 0) & (key_pos[b, h] <= query_pos[b, q])
                logits = [float(query[b, hq, q] @ keys[b, h, j]) * scale for j in range(keys.shape[2]) if seen[j]]
                vals = [values[b, h, j] for j in range(keys.shape[2]) if seen[j]]
                logits.append(float(query[b, hq, q] @ fk[b, h]) * scale + float(fb[b, h]))
                vals.append(fv[b, h])
                p = torch.softmax(torch.tensor(logits, dtype=torch.float64), 0)
                out[b, q, hq] = sum(pi * v.double() for pi, v in zip(p, vals))
    return out


def random_layout(seed=0, B=2, H=2, G=2, Q=3, L=7, D=4):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(B, H * G, Q, D, generator=g)
    keys, values = torch.randn(B, H, L, D, generator=g), torch.randn(B, H, L, D, generator=g)
    key_pos = torch.arange(L).expand(B, H, L).clone()
    valid = torch.rand(B, H, L, generator=g) > 0.3
    valid[..., 0] = True  # every query sees at least one key
    query_pos = torch.tensor([[L - 3, L - 2, L - 1]] * B)
    fk, fv = torch.randn(B, H, D, generator=g), torch.randn(B, H, D, generator=g)
    return query, keys, values, key_pos, valid, query_pos, fk, fv


def test_folded_attention_matches_a_naive_softmax_with_the_extra_entry():
    query, keys, values, key_pos, valid, query_pos, fk, fv = random_layout()
    fb = torch.tensor([[0.0, 1.5], [2.0, -1.0]])
    got = ep.folded_attention(query, keys, values, key_pos, valid, query_pos, 0.5, fk, fv, fb)
    want = naive_folded(query, keys, values, key_pos, valid, query_pos, 0.5, fk, fv, fb)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_an_empty_fold_is_plain_padded_attention():
    query, keys, values, key_pos, valid, query_pos, fk, fv = random_layout(seed=1)
    none = torch.full((2, 2), -float("inf"))
    got = ep.folded_attention(query, keys, values, key_pos, valid, query_pos, 0.5, fk, fv, none)
    want = padded_attention(query, keys, values, key_pos, valid, query_pos, 0.5)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    folded = ep.folded_attention(query, keys, values, key_pos, valid, query_pos, 0.5, fk, fv, torch.zeros(2, 2))
    assert not torch.allclose(folded, want, atol=1e-3)  # a finite bias does change the output


def test_variants_parse_and_bad_ones_name_the_forms():
    assert ep.parse_variant("base") == ("base", 0.0)
    assert ep.parse_variant("fold:0.5") == ("fold", 0.5)
    assert ep.parse_variant("consensus:2") == ("consensus", 2.0)
    for bad in ("fold", "fold:x", "fold:-1", "base:1", "snapkv"):
        with pytest.raises(ValueError, match="use base, fold:A"):
            ep.parse_variant(bad)


@pytest.fixture(scope="module")
def tiny():
    from retention import attach_gates
    from retention.eval.models import load_eval_model

    model, tok = load_eval_model("tiny-llama-random")
    attach_gates(model, None, mode="score", seed=0)
    return model, tok


@pytest.fixture(scope="module")
def shared(tiny):
    from retention.eval.protocol import SharedPrefill
    from retention.eval.tasks.fidelity import fidelity

    model, tok = tiny
    item = fidelity(tok, LENGTH, 1, seed=5)[0]
    with model.retention.use_mode("score"):
        return SharedPrefill(model, item.meta["context_ids"]), item


def test_the_fold_holds_the_mean_key_and_value_of_exactly_what_was_evicted(tiny, shared):
    model, _ = tiny
    prefilled, _ = shared
    L, H = model.config.num_hidden_layers, model.config.num_key_value_heads
    R = L * H
    full = prefilled.cache.store.gather(torch.arange(R))
    budget = 20 * R
    with model.retention.use_mode("score"):
        folded = ep.variant_cache(model, prefilled, "fold", 1.0, budget)
        plain = ep.variant_cache(model, prefilled, "base", 0.0, budget - R)
    kept = folded.store.gather(torch.arange(R))
    assert int(folded.store.host_lengths.sum()) == budget - R  # one entry per stream left for the fold
    # the fold keeps what the plain policy keeps at the same (lowered) budget
    torch.testing.assert_close(kept.pos, plain.store.gather(torch.arange(R)).pos)
    ks, vs, cnt = folded._fold
    for r in range(R):
        held = set(kept.pos[r][kept.valid[r]].tolist())
        gone = [j for j in range(int(full.valid[r].sum())) if int(full.pos[r, j]) not in held]
        assert int(cnt[r]) == len(gone) > 0
        torch.testing.assert_close(ks[r] / cnt[r], full.keys[r, gone].float().mean(0))
        torch.testing.assert_close(vs[r] / cnt[r], full.values[r, gone].float().mean(0))


def test_consensus_keeps_the_gates_split_and_reorders_within_it(tiny, shared):
    model, _ = tiny
    prefilled, _ = shared
    R = model.config.num_hidden_layers * model.config.num_key_value_heads
    with model.retention.use_mode("score"):
        base = ep.variant_cache(model, prefilled, "base", 0.0, 20 * R)
        zero = ep.variant_cache(model, prefilled, "consensus", 0.0, 20 * R)
        heavy = ep.variant_cache(model, prefilled, "consensus", 4.0, 20 * R)
    b, z, h = (c.store.gather(torch.arange(R)) for c in (base, zero, heavy))
    torch.testing.assert_close(z.pos, b.pos)  # weight 0: the gates' own choice
    assert torch.equal(h.valid.sum(1), b.valid.sum(1))  # the same number kept in every stream
    assert not torch.equal(h.pos, b.pos)  # but not the same entries
    assert bool((h.pos[:, :ep.SINKS] == torch.arange(ep.SINKS)).all())  # the sinks stay


def test_the_probe_scores_every_variant_on_every_item_and_reports_paired_gaps(tiny):
    model, tok = tiny
    rows = ep.probe(model, tok, 2, ["base", "fold:0.5", "consensus:1"], length=LENGTH, seed=5)
    assert [r["variant"] for r in rows] == ["base", "fold:0.5", "consensus:1"] * 2
    assert all(0 <= r["top1"] <= 100 and r["kl"] >= 0 for r in rows)
    table = ep.report(rows).splitlines()
    assert table[0].startswith("| variant | items | top-1 % | KL |") and len(table) == 5
    assert table[2].startswith("| base | 2 |") and table[2].endswith("|  |  |")  # no gap to itself
    assert "[" in table[3] and " / " in table[3]


def test_paired_interval_brackets_the_mean():
    lo, hi = ep.paired_interval([1.0, 2.0, 3.0, 4.0, 10.0])
    assert lo < 4.0 < hi and lo >= 1.0 and hi <= 10.0
    assert ep.paired_interval([2.0] * 6) == (2.0, 2.0)


def test_the_command_refuses_bad_variants_and_a_missing_base_before_loading(monkeypatch, capsys):
    monkeypatch.setattr("retention.eval.models.load_eval_model", lambda *a, **k: pytest.fail("loaded the model first"))
    with pytest.raises(SystemExit):
        ep.main(["1", "--variants", "base,fold:x"])
    assert "--variants: variant 'fold:x': use base, fold:A" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ep.main(["1", "--variants", "fold:1"])
    assert "include base" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ep.main(["1", "--model", "tiny-llama-random"])
    assert "no gates are shipped for 'tiny-llama-random'; pass --gates" in capsys.readouterr().err


def test_the_probe_runs_as_its_command(tmp_path, capsys):
    from retention.eval.models import load_eval_model
    from retention.gates import GateConfig, RetentionGates

    model, _ = load_eval_model("tiny-llama-random")
    RetentionGates(GateConfig.for_model(model)).save_pretrained(tmp_path / "gates")
    assert ep.main(["2", "--model", "tiny-llama-random", "--gates", str(tmp_path / "gates"), "--length", str(LENGTH),
                    "--variants", "base,fold:1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"2 fidelity items of seed 33, {LENGTH}-token contexts, 10% kept"
    assert out[3].startswith("| base | 2 |") and out[4].startswith("| fold:1 | 2 |")
