"""The Triton kernels compiled for a CUDA GPU against their PyTorch references, and the gated model's
training and decoding paths through them (``make test-gpu``; deselected with the ``gpu`` marker elsewhere).

These need a process of their own: the interpreter-mode test modules set ``TRITON_INTERPRET=1`` when
imported, after which Triton interprets every kernel of the process, so ``make test-gpu`` runs this
file alone. Tolerances: ``kernel_checks.py``.
"""

import os

import pytest
import torch

from kernel_checks import (
    attention_compare,
    attention_inputs,
    capacity_check,
    capacity_inputs,
    generate_under_budget,
    paged_inputs,
    student_matches_oracle,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") == "1",
        reason="TRITON_INTERPRET=1 is set in this process (an interpreter-mode test module was imported): "
        "run `make test-gpu`, which runs this file alone",
    ),
]

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# the embedded model by default; RETENTION_GPU_MODEL names a folder instead (e.g. a random-weight copy of its config
# and tokenizer, where the GGUF cannot be brought to the GPU machine): the chat checks compare paths, not answers
GPU_MODEL = os.environ.get("RETENTION_GPU_MODEL")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("T", [300, 1000])
def test_attention_matches_reference(dtype, D, T):
    attention_compare(*attention_inputs(2, T, T, 8, 2, D, dtype, lb_lo=-0.2, device="cuda"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_packed_and_decode(dtype):
    cu = torch.tensor([0, 1, 200, 513, 700, 1024], device="cuda")
    attention_compare(*attention_inputs(2, 512, 512, 12, 4, 96, dtype, lb_lo=-2.0, device="cuda"), cu=cu)
    attention_compare(*attention_inputs(2, 7, 700, 12, 4, 64, dtype, lb_lo=-0.3, device="cuda"))


def test_attention_long_bf16_with_weak_decay():
    """4k tokens, decay near 0: many key blocks, every one of them weighted, as in training."""
    attention_compare(*attention_inputs(1, 4096, 4096, 4, 1, 64, torch.bfloat16, lb_lo=-1e-3, device="cuda"))


@pytest.mark.parametrize("reduce", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_capacity_matches_reference(reduce, dtype):
    capacity_check(capacity_inputs(2, 48, 700, -0.5, dtype=dtype, device="cuda"), [0, 3, 400, 700, 1400], reduce)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("G", [1, 3, 4])
@pytest.mark.parametrize("D", [64, 128])
def test_paged_decode_matches_reference(dtype, tol, G, D):
    from retention.cache.attention import paged_decode_reference
    from retention.cache.triton_decode import paged_decode_triton

    q, kp, vp, table, lens = paged_inputs(6, G, D, 16, [0, 1, 16, 31, 700, 2050], dtype, device="cuda")
    got = paged_decode_triton(q, kp, vp, table, lens, D**-0.5)
    want = paged_decode_reference(q.float(), kp.float(), vp.float(), table, lens, D**-0.5)
    assert got.dtype == dtype and torch.equal(got[0], torch.zeros_like(got[0]))
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_gated_model_forward_and_gate_gradients_match_the_oracle(monkeypatch):
    """A gated model on CUDA (attention through the Triton kernel) against the same model whose
    attention is the materialised fp32 oracle: logits and every gate gradient."""
    from retention import attach_gates
    from tiny_models import tiny_llama

    model = tiny_llama(head_dim=64, hidden_size=384, num_attention_heads=6).cuda()
    att = attach_gates(model, bias_init=2.0)
    ids = torch.randint(0, 100, (2, 300), generator=torch.Generator().manual_seed(0)).cuda()
    student_matches_oracle(model, att, dict(input_ids=ids), monkeypatch, rtol=(1e-4, 1e-3), atol=(1e-4, 1e-6))


def test_generate_through_the_paged_kernel_equals_the_padded_path(monkeypatch):
    """Decoding under a global budget on CUDA: the Triton paged kernel gives the padded path's tokens."""
    from retention import attach_gates
    from retention.cache import RetentionCache, flash, triton_decode
    from tiny_models import tiny_llama

    model = tiny_llama(head_dim=64, hidden_size=384, num_attention_heads=6).cuda()
    attach_gates(model, bias_init=0.0, mode="score")
    ids = torch.randint(0, 100, (2, 200), generator=torch.Generator().manual_seed(0)).cuda()
    monkeypatch.setattr(flash, "flash_paged_decode", lambda *a, **k: None)  # flash-attn's path when installed
    calls = []
    real = triton_decode.paged_decode_triton
    monkeypatch.setattr(triton_decode, "paged_decode_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    paged, ev = generate_under_budget(model, ids, 48, page_size=16, new_tokens=24)
    assert calls and ev > 0
    monkeypatch.setattr(RetentionCache, "_paged_decode", lambda self, key_states, T: False)
    padded, ev2 = generate_under_budget(model, ids, 48, page_size=16, new_tokens=24)
    assert ev2 == ev
    assert torch.equal(paged, padded)


def test_decode_step_adds_no_host_sync():
    """A decode step through RetentionCache (no eviction in it) waits for the GPU no more often than one
    through transformers' DynamicCache: page planning, padding and totals are read off host copies."""
    import warnings

    from transformers import DynamicCache

    from retention import attach_gates
    from retention.cache import RetentionCache
    from retention.compat import cache_kwargs
    from tiny_models import tiny_llama

    model = tiny_llama(head_dim=64, hidden_size=384, num_attention_heads=6).cuda()
    attach_gates(model, bias_init=0.0, mode="score")
    ids = torch.randint(0, 100, (1, 100), generator=torch.Generator().manual_seed(0)).cuda()

    def syncs(cache) -> tuple[int, int]:
        with torch.no_grad():
            model(input_ids=ids, **cache_kwargs(cache), use_cache=True)
            model(input_ids=ids[:, -1:], **cache_kwargs(cache), use_cache=True)  # first decode step: warm-up
            before = getattr(cache, "evictions", 0)
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    model(input_ids=ids[:, -1:], **cache_kwargs(cache), use_cache=True)
                finally:
                    torch.cuda.set_sync_debug_mode(0)
        n = sum("synchroniz" in str(w.message) for w in caught)
        return n, getattr(cache, "evictions", 0) - before

    plain, _ = syncs(DynamicCache())
    full, _ = syncs(RetentionCache(model, budget=None))
    budget = RetentionCache.budget_for(model, 64)
    kept, evicted = syncs(RetentionCache(model, budget=budget, slack=budget))  # big slack: no eviction this step
    assert evicted == 0
    assert full <= plain, (full, plain)
    assert kept <= plain, (kept, plain)


def test_a_decode_step_replayed_as_a_cuda_graph_decodes_as_the_cache_does():
    """GraphDecoder records a decode step (gates scoring, planned slots, the paged kernel) as a CUDA graph: its
    logits match the same planned step run eagerly (the same kernels) and the cache's ordinary decode path,
    through evictions and new pages, and a growing block table is recorded again."""
    from retention import attach_gates
    from retention.cache import RetentionCache
    from retention.cache.graph_decode import GraphDecoder
    from retention.compat import cache_kwargs
    from tiny_models import tiny_llama

    model = tiny_llama(head_dim=64, hidden_size=384, num_attention_heads=6).cuda().eval()
    attach_gates(model, None, mode="score", bias_init=1.0)
    ids = torch.randint(0, 100, (2, 40), generator=torch.Generator().manual_seed(1)).cuda()

    def prefilled():
        cache = RetentionCache(model, budget=RetentionCache.budget_for(model, 40), initial_pages=8)
        with torch.no_grad():
            tok = model(input_ids=ids, **cache_kwargs(cache), use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        return cache, tok

    (plain, tok), (eager, _), (graphed, _) = prefilled(), prefilled(), prefilled()
    by_eager, by_graph = GraphDecoder(model, eager, graph=False), GraphDecoder(model, graphed)
    assert by_graph.graph
    layouts = []  # the store's addresses and table width at each replay: a new one must be recorded again
    for _ in range(60):
        with torch.no_grad():
            want = model(input_ids=tok, **cache_kwargs(plain), use_cache=True).logits[:, -1]
        same = by_eager.step(tok)
        got = by_graph.step(tok)
        if not layouts or layouts[-1] != by_graph._addresses():
            layouts.append(by_graph._addresses())
        torch.testing.assert_close(got, same, atol=1e-5, rtol=1e-5)  # the same kernels, replayed
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        tok = want.argmax(-1, keepdim=True)
    assert plain.evictions == graphed.evictions >= 2 and plain._seen == graphed._seen
    assert by_graph.captures == len(layouts) >= 2  # once per layout (the table grew on the way), not per step
    graphed.store.check()


def _budgeted_chat_evicts_within_its_bound(model, tok) -> None:
    """Three turns under 48 tokens per KV head: the cache evicts and keeps at most budget + slack entries."""
    from retention.chat import RetentionChat

    chat = RetentionChat(model, tok, budget_tokens=48, max_new_tokens=12)
    for turn in ("My name is Ada.", "Tell me one fact about rivers.", "What is my name?"):
        assert isinstance(chat.send(turn), str)
    streams = model.config.num_hidden_layers * model.config.num_key_value_heads
    assert chat.cache.evictions > 0 and chat.memory()["kept_entries"] <= 48 * streams + chat.cache.slack


def test_retention_chat_on_the_gpu():
    """RetentionChat built its inputs on the CPU: on a CUDA model, generate failed on devices. The first reply
    equals plain generate on the GPU, and a budgeted conversation goes on with its cache and ids there."""
    from retention import load_model
    from retention.chat import RetentionChat

    model, tok = load_model(GPU_MODEL or "smollm2-135m", device="cuda", dtype="float32")
    chat = RetentionChat(model, tok, budget_tokens=None, max_new_tokens=8)
    reply = chat.send("What is the capital of France?")
    assert chat.ids.device.type == "cuda"
    chat.model.retention.detach()
    x = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                add_generation_prompt=True, return_tensors="pt", return_dict=True).to("cuda")
    with torch.no_grad():
        out = model.generate(**x, max_new_tokens=8, do_sample=False)
    assert reply == tok.decode(out[0, x["input_ids"].shape[1]:], skip_special_tokens=True)
    _budgeted_chat_evicts_within_its_bound(model, tok)


def test_retention_chat_in_bfloat16_on_the_gpu():
    """`retention chat`'s default on a GPU is bfloat16. The cache keeps bfloat16 entries, the first reply starts
    with plain generate's first token (the same prefill; later tokens may part on bf16 rounding, since the paged
    kernel and SDPA sum in different orders), and a budgeted conversation evicts within its bound."""
    from retention import load_model
    from retention.chat import RetentionChat

    model, tok = load_model(GPU_MODEL or "smollm2-135m", device="cuda", dtype="bfloat16")
    question = "What is the capital of France?"
    chat = RetentionChat(model, tok, budget_tokens=None, max_new_tokens=4)
    chat.send(question)
    assert chat.cache.store.pool.keys.dtype == torch.bfloat16 and chat.ids.device.type == "cuda"
    x = tok.apply_chat_template([{"role": "user", "content": question}],
                                add_generation_prompt=True, return_tensors="pt", return_dict=True).to("cuda")
    n = x["input_ids"].shape[1]
    chat.model.retention.detach()
    with torch.no_grad():
        out = model.generate(**x, max_new_tokens=1, do_sample=False)
    assert torch.equal(chat.ids[0, :n + 1], out[0, :n + 1])
    _budgeted_chat_evicts_within_its_bound(model, tok)


def test_retention_chat_with_cuda_graphs_on_the_gpu():
    """RetentionChat(cuda_graphs=True) decodes replies as replayed CUDA graphs (recorded in the chat's generation
    thread): over three budgeted greedy turns and a sampled one (the same seed for both) its replies and evictions are
    the generate path's."""
    import warnings

    from retention import load_model
    from retention.chat import RetentionChat

    model, tok = load_model(GPU_MODEL or "smollm2-135m", device="cuda", dtype="float32")
    plain = RetentionChat(model, tok, budget_tokens=48, max_new_tokens=16)
    graphed = RetentionChat(model, tok, budget_tokens=48, max_new_tokens=16, cuda_graphs=True)
    for turn in ("My name is Ada.", "Tell me one fact about rivers.", "What is my name?"):
        assert graphed.send(turn) == plain.send(turn)
    sampled = dict(do_sample=True, temperature=0.9, top_p=0.95, repetition_penalty=1.2)
    torch.manual_seed(0)
    reply = plain.send("Tell me a story.", **sampled)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # decoded through the graphs, not generate
        assert graphed.send("Tell me a story.", **sampled) == reply
    assert graphed._decoder is not None and graphed._decoder.graph and graphed._decoder.captures >= 1
    assert graphed.cache.evictions == plain.cache.evictions > 0 and torch.equal(graphed.ids, plain.ids)


def test_a_vl_dialogue_item_on_the_gpu(tmp_path):
    """The sweep's multimodal protocol (a shared history, add_turn with photos, compress, send) on a CUDA model; the
    CPU twin is in test_eval_multimodal.py."""
    from tiny_vl import vl_dialogue_rows_on

    full, gated = vl_dialogue_rows_on("cuda", tmp_path, tokenizer_dir=GPU_MODEL)
    assert full["device"] == gated["device"] == "cuda" and full["image_tokens"] == gated["image_tokens"] > 0
    assert gated["kept_entries"] <= gated["budget_entries"] < full["kept_entries"]


def test_a_vl_chat_on_the_gpu():
    """The multimodal turn (pixel values, M-RoPE positions) on a CUDA model; the CPU twin is in test_chat_vl.py."""
    from tiny_vl import vl_chat_on

    out = vl_chat_on("cuda", tokenizer_dir=GPU_MODEL)
    assert out["cache_length"] == out["ids"].shape[1] - 1 and out["device"] == out["model_device"] == "cuda"
