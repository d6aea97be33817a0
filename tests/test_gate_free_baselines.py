"""Training-free baselines (SnapKV, H2O, StreamingLLM, ...) run without the gate MLP: their policies never read the
gates' scores, so a score-mode forward into their cache skips the gates (retention.attach.gates_needed), and what
they keep and generate is what it was when the gates ran for nothing."""

from __future__ import annotations

import pytest
import torch

import retention.attach
from retention import GateConfig, RetentionGates, attach_gates
from retention.cache import RetentionCache
from retention.compat import cache_kwargs
from retention.policies import POLICIES, get_policy

TRAINING_FREE = sorted(n for n in POLICIES if not get_policy(n).uses_gates)
GATED = sorted(n for n in POLICIES if get_policy(n).uses_gates)


def _model_with_random_gates():
    """The tiny eval model with gates whose scores differ from token to token (0 would hide a mix-up)."""
    from retention.eval.models import load_eval_model

    model, tok = load_eval_model("tiny-llama-random")
    gates = RetentionGates(GateConfig.for_model(model))
    g = torch.Generator().manual_seed(0)
    for p in gates.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.5
    attach_gates(model, gates, mode="score")
    calls = []
    gates.register_forward_hook(lambda module, args, out: calls.append(args[0]))
    return model, calls


@pytest.fixture(scope="module")
def model_and_calls():
    return _model_with_random_gates()


def _generate(model, policy_name: str) -> tuple[torch.Tensor, list[list[int]]]:
    """Greedy tokens of a 70-token prompt under a budget of 12 tokens per head (evicting), and each stream's kept
    positions."""
    ids = torch.randint(1, 1000, (1, 70), generator=torch.Generator().manual_seed(1))
    cache = RetentionCache(model, budget=RetentionCache.budget_for(model, 12), policy=get_policy(policy_name),
                           slack=0)
    model.retention.reset()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **cache_kwargs(cache),
                             max_new_tokens=5, do_sample=False, pad_token_id=0)
    view = cache.store.gather(torch.arange(cache.store.num_streams), with_kv=False)
    kept = [view.pos[r][view.valid[r]].tolist() for r in range(view.pos.shape[0])]
    return out, kept


def test_the_lists_cover_every_policy():
    assert "snapkv" in TRAINING_FREE and "streamingllm" in TRAINING_FREE and "h2o" in TRAINING_FREE
    assert GATED == ["global_gates", "trimkv"]


@pytest.mark.parametrize("name", TRAINING_FREE)
def test_a_training_free_policy_runs_no_gate_mlp_and_keeps_and_says_the_same(name, model_and_calls, monkeypatch):
    model, calls = model_and_calls
    calls.clear()
    out, kept = _generate(model, name)
    assert calls == [], f"{name} ran the gate MLP {len(calls)} times"
    assert sum(map(len, kept)) < 70 * len(kept) or name == "full"  # the budget evicted (the full cache keeps all)
    monkeypatch.setattr(retention.attach, "gates_needed", lambda cache: True)  # as before: the gates always ran
    ref_out, ref_kept = _generate(model, name)
    assert calls, "the reference run did not run the gates"
    assert torch.equal(out, ref_out) and kept == ref_kept


@pytest.mark.parametrize("name", GATED)
def test_a_gated_policy_still_runs_the_gates(name, model_and_calls):
    model, calls = model_and_calls
    calls.clear()
    _generate(model, name)
    assert len(calls) == model.config.num_hidden_layers * 5  # every layer: the prompt, 4 steps (the 5th is not fed)


def test_gates_are_needed_without_a_retention_cache_and_for_a_policy_that_keeps_their_scores():
    from retention.eval.oracle import FutureAttention
    from retention.policies.recorder import QueryRecorder

    assert retention.attach.gates_needed(None)  # a plain cache in score mode: as before
    for policy, needed in ((get_policy("snapkv"), False), (get_policy("global_gates"), True),
                           (QueryRecorder(), True), (FutureAttention(window=4), True)):
        assert retention.attach.gates_needed(type("C", (), {"policy": policy})()) is needed, policy


def test_the_eval_harness_runs_a_baseline_without_the_gates_and_the_shared_prefill_with_them(model_and_calls):
    """The sweep attaches the gates once for every method: a baseline's rows run no gate forward; the prefill shared
    by all methods (gated ones among them) still records the gates' scores."""
    from retention.eval.budgets import parse_budget
    from retention.eval.method_specs import make_method
    from retention.eval.models import load_eval_model
    from retention.eval.protocol import SharedPrefill, context_and_prompt, run_item_budgets
    from retention.tasks import generate

    model, calls = model_and_calls
    _, tok = load_eval_model("tiny-llama-random")
    item = generate("niah_single", tok, 160, 1, seed=3)[0]
    calls.clear()
    rows = run_item_budgets(model, tok, item, make_method({"name": "snapkv"}), [parse_budget(0.2)], max_new_tokens=4)
    assert calls == [] and rows[0]["score"] is not None
    shared = SharedPrefill(model, context_and_prompt(tok, item)[0])
    assert len(calls) == model.config.num_hidden_layers
    calls.clear()
    gated = run_item_budgets(model, tok, item, make_method({"name": "global_gates"}), [parse_budget(0.2)],
                             max_new_tokens=4, shared=shared)
    alone = run_item_budgets(model, tok, item, make_method({"name": "global_gates"}), [parse_budget(0.2)],
                             max_new_tokens=4)
    assert gated[0] == pytest.approx(alone[0])  # the shared prefill held the gates' scores
