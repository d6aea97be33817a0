"""The fidelity oracle (retention/eval/oracle.py): its scores are the continuation's attention, computed here by
brute force from the model's eager attention maps; it keeps each head's top entries by them; with the
whole budget it matches the full cache; configs that cannot run it fail before any model loads."""

import pytest
import torch

from retention.eval.budgets import parse_budget
from retention.eval.config import EvalConfigError, load_eval_config
from retention.eval.method_specs import make_method
from retention.eval.models import load_eval_model
from retention.eval.protocol import reference_logits, run_item_budgets
from retention.tasks import generate
from retention.compat import cache_kwargs


@pytest.fixture(scope="module")
def tiny():
    from retention import attach_gates

    model, tok = load_eval_model("tiny-llama-random")
    attach_gates(model, None, mode="score")
    item = generate("fidelity", tok, 160, 1, seed=4)[0]
    return model, tok, item


def _eager_attention(model, ids):
    """``[(Hq, T, T)]`` per layer: softmax attention maps of the model with no cache and no gates."""
    attached, model.config._attn_implementation = model.config._attn_implementation, "eager"
    try:
        with model.retention.use_mode("teacher"), torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), output_attentions=True, use_cache=False)
    finally:
        model.config._attn_implementation = attached  # the gates' attention, registered by attach_gates
    return [a[0].float() for a in out.attentions]


def _continuation_attention(model, ctx, cont):
    """``(L, H, T)``: the attention the continuation's queries pay each context entry, summed over them and
    averaged over each KV head's query heads (what the oracle records), from the eager maps."""
    maps = _eager_attention(model, ctx + cont)
    H = model.config.num_key_value_heads
    G = maps[0].shape[0] // H
    return torch.stack([m[:, -len(cont):, : len(ctx)].sum(1).reshape(H, G, -1).mean(1) for m in maps])


@pytest.mark.parametrize("scope", ["head", "global"])
def test_oracle_scores_are_the_continuations_attention_and_it_keeps_their_top(tiny, scope):
    model, tok, item = tiny
    ctx, cont = item.meta["context_ids"], item.meta["continuation_ids"]
    oracle = make_method({"name": "oracle", "params": {"scope": scope}})
    with oracle.active(model):
        oracle.prepare(model, item)
    expect = _continuation_attention(model, ctx, cont)
    L, H = expect.shape[:2]
    got = torch.stack([oracle.policy(False).stats.tables[layer][0, :, : len(ctx)] for layer in range(L)])
    torch.testing.assert_close(got, expect, atol=1e-5, rtol=1e-4)

    # compress the context to 25%: the entries kept are the brute-force top by that attention
    from retention.cache import RetentionCache

    total = parse_budget(0.25).entries(len(ctx), L * H)
    with oracle.active(model):
        cache = oracle.new_cache(model, None, streaming=False)
        model(input_ids=torch.tensor([ctx]), **cache_kwargs(cache), use_cache=True)
        cache.set_budget(total)
        oracle.compress(cache)
    assert isinstance(cache, RetentionCache)
    kept = _kept(cache, L, H, len(ctx))
    if scope == "head":
        for layer in range(L):
            for h in range(H):
                k = int(kept[layer, h].sum())
                assert k == total // (L * H)
                assert (set(expect[layer, h].topk(k).indices.tolist())
                        == set(kept[layer, h].nonzero().flatten().tolist()))
    else:
        assert int(kept.sum()) == total
        assert set(expect.flatten().topk(total).indices.tolist()) == set(kept.flatten().nonzero().flatten().tolist())


def _kept(cache, L, H, T):
    """``(L, H, T)`` bool: which context positions each KV head of ``cache`` holds."""
    kept = torch.zeros(L, H, T, dtype=torch.bool)
    for layer in range(L):
        view = cache.store.gather_layer(layer)
        for h in range(H):
            kept[layer, h, view.pos[0, h][view.valid[0, h]]] = True
    return kept


def _top_per_head(score, counts):
    """``(L, H, T)`` bool: each head's ``counts[l, h]`` entries of highest ``score``."""
    keep = torch.zeros_like(score, dtype=torch.bool)
    for layer in range(score.shape[0]):
        for h in range(score.shape[1]):
            keep[layer, h, score[layer, h].topk(int(counts[layer, h])).indices] = True
    return keep


def _global_counts(score, total):
    """``(L, H)``: how many of the global top-``total`` entries of ``score`` ``(L, H, T)`` each head holds."""
    L, H, T = score.shape
    top = score.flatten().topk(total).indices // T
    return torch.bincount(top, minlength=L * H).reshape(L, H)


@pytest.mark.parametrize("rank", ["oracle", "gates"])
def test_oracle_and_gates_crossed_keep_one_rankings_order_at_the_others_split(rank):
    """``scope: gates``: the oracle's top entries in each head, as many as the gates' global top-B keeps
    there; ``rank: gates, scope: oracle``: the other way round. Brute force from the attention maps and
    the gates' stored scores (``age * log beta``, the first 4 tokens always kept)."""
    from retention import attach_gates

    model, tok = load_eval_model("tiny-llama-random")
    gates = attach_gates(model, None, mode="score").gates
    torch.manual_seed(0)
    with torch.no_grad():  # untrained gates score every token alike: spread them so ranks have no ties
        for p in gates.parameters():
            p.normal_(0.0, 0.5)
    item = generate("fidelity", tok, 160, 1, seed=4)[0]
    ctx, cont = item.meta["context_ids"], item.meta["continuation_ids"]
    attention = _continuation_attention(model, ctx, cont)
    (L, H), T = attention.shape[:2], len(ctx)
    total = parse_budget(0.25).entries(T, L * H)

    method = make_method({"name": "oracle",
                          "params": {"rank": rank, "scope": "gates" if rank == "oracle" else "oracle"}})
    with method.active(model), torch.no_grad():
        method.prepare(model, item)
        cache = method.new_cache(model, None, streaming=False)
        model(input_ids=torch.tensor([ctx]), **cache_kwargs(cache), use_cache=True)
        log_beta = torch.stack([cache.store.gather_layer(layer).log_beta[0, :, :T] for layer in range(L)])  # (L, H, T)
        cache.set_budget(total)
        method.compress(cache)
    age = torch.arange(T, 0, -1, dtype=torch.float32)  # t - i + 1 at the last context token
    gate_score = (age * log_beta).clone()
    gate_score[..., :4] = float("inf")  # attention sinks
    split_by, order_by = (gate_score, attention) if rank == "oracle" else (attention, gate_score)
    counts = _global_counts(split_by, total)
    kept = _kept(cache, L, H, T)
    assert torch.equal(kept.sum(2), counts)
    assert int(counts.sum()) == total and counts.min() < counts.max()  # an uneven split, not the even one
    assert torch.equal(kept, _top_per_head(order_by, counts))
    assert method.gates_id(model) == gates.fingerprint()


def test_oracle_with_the_whole_budget_matches_the_full_cache(tiny):
    model, tok, item = tiny
    ref = reference_logits(model, item)
    oracle = make_method({"name": "oracle"})
    row = run_item_budgets(model, tok, item, oracle, [parse_budget(1.0)], reference=ref)[0]
    assert row["score"] == 100.0 and row["kl"] < 1e-4
    squeezed = run_item_budgets(model, tok, item, oracle, [parse_budget(0.05)], reference=ref)[0]
    assert squeezed["kept_entries"] < row["kept_entries"] // 10


def test_oracle_needs_fidelity_items_and_a_one_shot_prefill(tmp_path, tiny):
    model, tok, item = tiny
    p = tmp_path / "o.yaml"
    p.write_text("model: tiny-llama-random\ntasks: [niah_single, fidelity]\nmethods: [{name: oracle}]\n")
    with pytest.raises(EvalConfigError, match=r"tasks: \[fidelity\].*niah_single"):
        load_eval_config(p)
    p.write_text("model: tiny-llama-random\ntasks: [fidelity]\nprefill: streaming\nmethods: [{name: oracle}]\n")
    with pytest.raises(EvalConfigError, match="one_shot"):
        load_eval_config(p)
    p.write_text("model: tiny-llama-random\ntasks: [fidelity]\nmethods: [{name: oracle, params: {scope: layer}}]\n")
    with pytest.raises(EvalConfigError, match="scope must be one of"):
        load_eval_config(p)
    needle = generate("niah_single", tok, 160, 1, seed=4)[0]
    with pytest.raises(ValueError, match="fidelity items only"):
        make_method({"name": "oracle"}).prepare(model, needle)
