"""The fidelity oracle (eval/oracle.py): its scores are the continuation's attention, computed here by
brute force from the model's eager attention maps; it keeps each head's top entries by them; with the
whole budget it matches the full cache; configs that cannot run it fail before any model loads."""

import pytest
import torch

from eval.budgets import parse_budget
from eval.config import EvalConfigError, load_eval_config
from eval.methods import make_method
from eval.models import load_eval_model
from eval.protocol import reference_logits, run_item_budgets
from eval.tasks import generate
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


@pytest.mark.parametrize("scope", ["head", "global"])
def test_oracle_scores_are_the_continuations_attention_and_it_keeps_their_top(tiny, scope):
    model, tok, item = tiny
    ctx, cont = item.meta["context_ids"], item.meta["continuation_ids"]
    oracle = make_method({"name": "oracle", "params": {"scope": scope}})
    with oracle.active(model):
        oracle.prepare(model, item)
    maps = _eager_attention(model, ctx + cont)
    L, H = len(maps), model.config.num_key_value_heads
    G = maps[0].shape[0] // H
    expect = torch.stack([m[:, -len(cont):, : len(ctx)].sum(1).reshape(H, G, -1).mean(1) for m in maps])  # (L, H, Tc)
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
    kept = torch.zeros(L, H, len(ctx), dtype=torch.bool)
    for layer in range(L):
        view = cache.store.gather_layer(layer)
        for h in range(H):
            kept[layer, h, view.pos[0, h][view.valid[0, h]]] = True
    if scope == "head":
        for layer in range(L):
            for h in range(H):
                k = int(kept[layer, h].sum())
                assert k == total // (L * H)
                assert set(expect[layer, h].topk(k).indices.tolist()) == set(kept[layer, h].nonzero().flatten().tolist())
    else:
        assert int(kept.sum()) == total
        assert set(expect.flatten().topk(total).indices.tolist()) == set(kept.flatten().nonzero().flatten().tolist())


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
