"""Retention maps (issue 76): the entries a global top-B keeps over a prompt, drawn per layer and KV head.
`retention_map` keeps what the cache keeps: the top-B of the default policy's scores (`(t - i + 1) log beta_i`, the
first 4 tokens held), checked against a brute-force top-B and against a RetentionCache prefilled at that budget."""

from __future__ import annotations

import pytest
import torch

from retention import attach_gates
from retention.cache import RetentionCache
from retention.compat import cache_kwargs
from retention.policies import GlobalGatesPolicy, get_policy
from retention.retention_map import plot_retention_map, retention_map
from tiny_models import tiny_llama, tiny_qwen3_vl, vl_inputs


def _spread_gates(attachment, seed=0):
    """Gates whose betas differ visibly between entries (fresh gates start at beta ~ 1 everywhere)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in attachment.gates.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def test_the_map_keeps_the_brute_force_top_b_of_the_policys_scores_and_what_the_cache_keeps():
    model = tiny_llama()
    attachment = attach_gates(model, mode="score")
    _spread_gates(attachment)
    ids = torch.randint(0, 100, (1, 90), generator=torch.Generator().manual_seed(1))
    budget = RetentionCache.budget_for(model, tokens=12)
    rmap = retention_map(model, {"input_ids": ids}, budget)
    L, H, T = rmap.keep.shape
    assert (L, H, T) == (3, 2, 90) and int(rmap.keep.sum()) == budget
    # the gates' scores: layer 0 reads the embeddings, as in any forward (later layers read full attention's output)
    with attachment.student(), torch.no_grad():
        model(input_ids=ids)
    assert torch.allclose(attachment.log_betas()[0][0].float(), rmap.log_beta[0], atol=1e-6)
    # brute force: (T - i) * log_beta, the first 4 tokens held, the global top-B
    age = (T - torch.arange(T)).float()
    score = rmap.log_beta * age
    score[..., :4] = float("inf")
    top = torch.zeros(L * H * T, dtype=torch.bool)
    top[score.flatten().topk(budget).indices] = True
    assert torch.equal(rmap.keep.flatten(), top)
    assert rmap.keep[..., :4].all()  # the sinks of every head
    # a cache prefilled and compressed to that budget keeps as many entries in each head
    cache = RetentionCache(model, budget=budget, policy=GlobalGatesPolicy())
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **cache_kwargs(cache))
    cache.compress()  # down to the budget at the prompt's end, as the query-agnostic protocol does
    assert torch.equal(cache.memory_report()["entries_per_head"][0].cpu(), rmap.kept_per_head())
    assert attachment.mode == "score"


def test_image_tokens_are_marked_and_drawn(tmp_path):
    model = tiny_qwen3_vl()
    attachment = attach_gates(model, mode="student")
    _spread_gates(attachment)
    inputs = vl_inputs(n_images=1)
    rmap = retention_map(model, inputs, budget=60)
    assert int(rmap.image.sum()) == int((inputs["input_ids"] == model.config.image_token_id).sum()) > 0
    assert attachment.mode == "student"  # restored
    out = plot_retention_map(rmap, tmp_path / "m.png", title="tiny")
    from PIL import Image

    with Image.open(out) as im:
        assert im.size[0] > 800 and im.size[1] > 300
    with pytest.raises(ValueError, match="not scored by the gates"):
        retention_map(model, inputs, 60, policy=get_policy("snapkv"))


def test_retention_inspect_draws_a_png_for_a_tiny_model(tmp_path, capsys):
    from retention.cli import main

    model_dir = tmp_path / "model"
    assert main(["tiny-model", str(model_dir)]) == 0
    from retention import load_model

    model, _ = load_model(str(model_dir))
    attachment = attach_gates(model)
    _spread_gates(attachment)
    attachment.gates.save_pretrained(tmp_path / "gates")
    (tmp_path / "prompt.txt").write_text("The library opens at nine. The red bicycle belongs to Maria. " * 8)
    out = tmp_path / "map.png"
    code = main(["inspect", "--model", str(model_dir), "--gates", str(tmp_path / "gates"), "--text",
                 str(tmp_path / "prompt.txt"), "--budget-tokens", "16", "--out", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert out.is_file() and out.stat().st_size > 10_000
    assert "budget 96 entries (16 per KV head" in printed.out and str(out) in printed.out
    assert main(["inspect", "--model", str(model_dir), "--text", str(tmp_path / "nope.txt")]) == 2
    assert "no such file" in capsys.readouterr().err
