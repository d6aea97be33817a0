"""RetentionCache inside ``model.generate``: unlimited budget == DynamicCache, batching == alone (every policy), VL,
crop."""

from __future__ import annotations

import pytest
import torch

from transformers import DynamicCache

from retention.attach import attach_gates
from retention.compat import cache_kwargs
from retention.policies import get_policy
from retention.policies.registry import POLICIES
from retention.cache import RetentionCache
from tiny_models import BUILDERS, vl_inputs


def _with_gates(name: str):
    model = BUILDERS[name]()
    attach_gates(model, mode="score")
    return model


def _generate(model, cache, **kw):
    with torch.no_grad():
        return model.generate(**cache_kwargs(cache), pad_token_id=0, **kw)


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "qwen3"])
def test_unlimited_budget_matches_dynamic_cache(name):
    model = _with_gates(name)
    ids = torch.randint(0, 100, (1, 23), generator=torch.Generator().manual_seed(0))
    kw = dict(input_ids=ids, max_new_tokens=24, do_sample=False)
    ref = _generate(model, DynamicCache(config=model.config), **kw)
    got = _generate(model, RetentionCache(model), **kw)
    assert torch.equal(got, ref)
    chunked = _generate(model, RetentionCache(model), prefill_chunk_size=5, **kw)
    assert torch.equal(chunked, ref)


def test_sampling_and_stopping_behave_as_dynamic_cache():
    model = _with_gates("llama")
    ids = torch.randint(0, 100, (1, 9), generator=torch.Generator().manual_seed(1))
    kw = dict(input_ids=ids, max_new_tokens=30, do_sample=True, top_k=20, temperature=1.3)
    torch.manual_seed(5)
    ref = _generate(model, DynamicCache(config=model.config), **kw)
    torch.manual_seed(5)
    got = _generate(model, RetentionCache(model), **kw)
    assert torch.equal(got, ref)
    stop = int(ref[0, 12])  # stop at a token that is known to be generated
    torch.manual_seed(5)
    ref_stop = _generate(model, DynamicCache(config=model.config), eos_token_id=stop, **kw)
    torch.manual_seed(5)
    got_stop = _generate(model, RetentionCache(model), eos_token_id=stop, **kw)
    assert torch.equal(got_stop, ref_stop) and ref_stop.shape[1] <= 13


def test_qwen3_vl_unlimited_budget_matches_dynamic_cache():
    model = _with_gates("qwen3_vl")
    inputs = vl_inputs(n_images=2)
    ref = _generate(model, DynamicCache(config=model.config), **inputs, max_new_tokens=12, do_sample=False)
    got = _generate(model, RetentionCache(model), **inputs, max_new_tokens=12, do_sample=False)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("budget_tokens,policy", [(None, "global_gates"), (6, "global_gates"), (6, "streamingllm")])
def test_batch_of_different_lengths_equals_each_alone(budget_tokens, policy):
    """Left padding changes nothing, attention sinks included (they are each sequence's first real tokens)."""
    model = _with_gates("qwen3")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 100, (n,), generator=g) for n in (5, 13, 9)]
    budget = None if budget_tokens is None else RetentionCache.budget_for(model, budget_tokens)
    alone = []
    for p in prompts:
        out = _generate(model, RetentionCache(model, budget=budget, policy=get_policy(policy), slack=0),
                        input_ids=p[None], max_new_tokens=10, do_sample=False)
        alone.append(out[0, len(p) :])
    T = max(len(p) for p in prompts)
    cache = RetentionCache(model, budget=budget, policy=get_policy(policy), slack=0)
    out = _generate(model, cache, **_pad_left(prompts), max_new_tokens=10, do_sample=False)
    for i in range(len(prompts)):
        assert torch.equal(out[i, T:], alone[i])
    if budget is not None:
        assert bool((cache.store.lengths.view(3, -1).sum(1) <= budget + 6).all())


def _pad_left(prompts: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` ``(len(prompts), longest)`` of 1-D prompts, left-padded with 0."""
    T = max(len(p) for p in prompts)
    ids, mask = torch.zeros(len(prompts), T, dtype=torch.long), torch.zeros(len(prompts), T, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, T - len(p) :], mask[i, T - len(p) :] = p, 1
    return dict(input_ids=ids, attention_mask=mask)


def _kept(cache: RetentionCache, row: int, shift: int) -> list[list[int]]:
    """Positions kept per (layer, head) for batch row ``row``, less ``shift`` (its left padding)."""
    out = []
    for layer in range(cache.store.num_layers):
        view = cache.store.gather_layer(layer)
        for h in range(view.pos.shape[1]):
            pos = view.pos[row, h][view.valid[row, h] & (view.pos[row, h] >= 0)]
            out.append(sorted((pos - shift).tolist()))
    return out


@pytest.mark.parametrize("name", sorted(set(POLICIES) - {"full", "random"}))
def test_every_policy_keeps_for_a_padded_batch_what_it_keeps_for_each_sequence_alone(name):
    """A sequence's evictions do not depend on what it is batched with: LAVa's layer entropies, CAKE's layer
    preferences and PyramidKV's context length are each sequence's own (they were pooled over the batch)."""
    model = _with_gates("qwen3")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 100, (n,), generator=g) for n in (70, 140, 90, 110)]
    budget = RetentionCache.budget_for(model, 60)

    def prefill(input_ids, attention_mask=None):
        cache = RetentionCache(model, budget=budget, policy=get_policy(name), slack=0)
        with torch.no_grad():
            model(input_ids=input_ids, attention_mask=attention_mask, **cache_kwargs(cache))
        cache.compress()
        return cache

    T = max(len(p) for p in prompts)
    batch = prefill(**_pad_left(prompts))
    for i, p in enumerate(prompts):
        alone = prefill(p[None])
        assert _kept(batch, i, T - len(p)) == _kept(alone, 0, 0), i
    assert int(batch.store.lengths.sum()) <= len(prompts) * budget


ONE_SHOT = sorted(n for n in set(POLICIES) - {"full", "random"} if get_policy(n).mode == "one_shot")


@pytest.mark.parametrize("name", ONE_SHOT)
def test_one_shot_policies_observe_the_same_window_however_the_prompt_is_chunked(name):
    """The observation window is the prompt's last ``window`` tokens whatever the chunking: a last chunk shorter than
    the window once observed only its own queries, so a prompt of 101 tokens in chunks of 32 (last chunk 5) or 7
    (last chunk 3) kept other entries than in one forward, and a left-padded batch (chunked at other offsets) other
    entries than each sequence alone."""
    model = _with_gates("qwen3")
    g = torch.Generator().manual_seed(4)
    budget = RetentionCache.budget_for(model, 40)

    def run(input_ids, attention_mask=None, chunk=None):
        cache = RetentionCache(model, budget=budget, policy=get_policy(name), slack=0)
        kw = {} if chunk is None else {"prefill_chunk_size": chunk}
        out = _generate(model, cache, input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=8,
                        do_sample=False, **kw)
        return out[:, input_ids.shape[1] :], cache

    ids = torch.randint(1, 100, (1, 101), generator=g)
    ref, cache = run(ids)
    for chunk in (7, 32):
        got, chunked = run(ids, chunk=chunk)
        assert torch.equal(got, ref) and _kept(chunked, 0, 0) == _kept(cache, 0, 0), chunk
    prompts = [torch.randint(1, 100, (n,), generator=g) for n in (70, 101)]
    T = max(len(p) for p in prompts)
    out, batch = run(**_pad_left(prompts), chunk=32)  # the short prompt's chunks start 31 tokens off its own
    for i, p in enumerate(prompts):
        alone, cache = run(p[None], chunk=32)
        assert torch.equal(out[i], alone[0]) and _kept(batch, i, T - len(p)) == _kept(cache, 0, 0), i


def test_window_queries_carry_over_forwards_and_follow_the_batch():
    """A chunk shorter than the window observes the earlier forwards' last queries too; a decoding step its own;
    ``select_batch`` and ``reset`` move and drop what is carried."""
    policy = get_policy("snapkv", window=4)
    q = torch.arange(2 * 1 * 6 * 1, dtype=torch.float32).view(2, 1, 6, 1)
    pos = torch.arange(6).repeat(2, 1)
    wq, wp = policy.window_queries(0, q, pos)
    assert torch.equal(wq, q[:, :, 2:]) and torch.equal(wp, pos[:, 2:])
    wq, wp = policy.window_queries(0, q[:, :, :2] + 100, pos[:, :2] + 6)  # a 2-token chunk: 2 carried, 2 new
    assert wp[0].tolist() == [4, 5, 6, 7] and torch.equal(wq[:, :, :2], q[:, :, 4:]) and (wq[:, :, 2:] >= 100).all()
    step, step_pos = policy.window_queries(0, q[:, :, :1], pos[:, :1] + 8)  # a decoding step: its own query
    assert step.shape[2] == 1 and step_pos.tolist() == [[8], [8]]
    policy.select_batch(torch.tensor([1]))
    wq, wp = policy.window_queries(0, q[1:, :, :2], pos[1:, :2] + 9)
    assert wp.tolist() == [[7, 8, 9, 10]] and float(wq[0, 0, 0, 0]) == float(q[1, 0, 1, 0] + 100)
    policy.reset()
    assert policy.window_queries(0, q[:1, :, :2], pos[:1, :2])[1].tolist() == [[0, 1]]


def test_per_sequence_allocations_follow_the_batch_reorder():
    """``select_batch`` (beam search) moves each sequence's layer statistics with its row."""
    policy = get_policy("lava")
    policy.entropy.put(0, torch.tensor([1.0, 3.0]))
    policy.entropy.put(1, torch.tensor([3.0, 1.0]))
    first = policy.layer_budget_table(100, 2, seq=0).tolist()
    assert first == [25, 75] and policy.layer_budget_table(100, 2, seq=1).tolist() == [75, 25]
    policy.select_batch(torch.tensor([1, 1, 0]))
    assert [policy.layer_budget_table(100, 2, seq=s).tolist() for s in range(3)] == [[75, 25], [75, 25], first]
    policy.reset()
    assert policy.layer_budget_table(100, 2) is None


@pytest.mark.smollm2
def test_smollm2_unlimited_budget_matches_dynamic_cache():
    from retention.models import load_model

    model, tok = load_model("smollm2-135m")
    attach_gates(model, mode="score")
    msgs = [{"role": "user", "content": "Name three colors of the rainbow and explain why the sky is blue."}]
    inputs = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    kw = dict(**inputs, max_new_tokens=32, do_sample=False)
    ref = _generate(model, DynamicCache(config=model.config), **kw)
    got = _generate(model, RetentionCache(model), prefill_chunk_size=16, **kw)
    assert torch.equal(got, ref)
    # and with a budget the cache really holds fewer entries than the full one
    cache = RetentionCache(model, budget=RetentionCache.budget_for(model, 32))
    _generate(model, cache, **kw)
    report = cache.memory_report()
    assert report["kv_bytes"] < report["full_cache_bytes"]
    # print(report) is a summary (was a dict with a layers x heads tensor); its numbers are the dict's
    text = str(report).splitlines()
    per_layer = report["entries_per_head"][0].sum(dim=1).tolist()
    assert text[0].startswith(f"KV cache: {report['kept_entries']:,} of {report['full_cache_entries']:,} entries kept")
    assert text[1].endswith(" ".join(map(str, per_layer))) and sum(per_layer) == report["kept_entries"]
    assert "tensor(" not in str(report) and len(text) == 5
    assert text[4] == (f"  memory: {report['held_bytes'] / 2**20:.2f} MiB held, {report['used_bytes'] / 2**20:.2f} MiB "
                       "used (cache.shrink() gives free pages back)")
    assert str(RetentionCache(model).memory_report()) == "KV cache: empty (nothing prefilled yet)"


def test_beam_search_with_unlimited_budget_matches_dynamic_cache():
    model = _with_gates("llama")
    ids = torch.randint(1, 100, (2, 11), generator=torch.Generator().manual_seed(3))
    kw = dict(input_ids=ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, num_beams=3, num_return_sequences=2)
    ref = _generate(model, DynamicCache(config=model.config), **kw)
    got = _generate(model, RetentionCache(model), **kw)
    assert torch.equal(got, ref)


def _replay_logprob(model, cache, prompt: torch.Tensor, new: torch.Tensor) -> float:
    """Sum of log p(new tokens) decoding ``prompt`` then ``new`` one token at a time in a one-row cache."""
    total = 0.0
    with torch.no_grad():
        logits = model(input_ids=prompt[None], **cache_kwargs(cache), use_cache=True).logits[0, -1]
        for tok in new.tolist():
            total += float(torch.log_softmax(logits.float(), -1)[tok])
            logits = model(input_ids=torch.tensor([[tok]]), **cache_kwargs(cache), use_cache=True).logits[0, -1]
    return total


@pytest.mark.parametrize("policy", sorted(set(POLICIES) - {"full", "random"}))
def test_beam_search_under_eviction_equals_replaying_each_beam_alone(policy):
    """With a budget, every beam's score is the log-probability of its tokens decoded alone with the same
    budget: reordering copies pages, padding state and the policy's statistics (per-position scores, per-sequence
    layer allocations, the carried window queries) to the right rows. Every policy evicts at every step here."""
    model = _with_gates("qwen3")
    prompt = torch.randint(1, 100, (17,), generator=torch.Generator().manual_seed(4))
    budget = RetentionCache.budget_for(model, 8)
    cache = RetentionCache(model, budget=budget, policy=get_policy(policy, mode="streaming"), slack=0)
    with torch.no_grad():
        out = model.generate(input_ids=prompt[None], **cache_kwargs(cache), pad_token_id=0, max_new_tokens=10,
                             min_new_tokens=10, do_sample=False, num_beams=3, num_return_sequences=3,
                             length_penalty=0.0, return_dict_in_generate=True, output_scores=True)
    assert cache.evictions > 0 and cache.store.batch == 3
    cache.store.check()
    assert len({tuple(s.tolist()) for s in out.sequences}) == 3  # three different beams
    for seq, score in zip(out.sequences, out.sequences_scores):
        alone = RetentionCache(model, budget=budget, policy=get_policy(policy, mode="streaming"), slack=0)
        assert _replay_logprob(model, alone, prompt, seq[len(prompt):]) == pytest.approx(float(score), abs=1e-4)


def test_several_continuations_of_a_filled_cache():
    """One prefill, several continuations: batch_repeat_interleave copies the filled cache, and each copy
    continues exactly as the single cache would (transformers does not repeat a cache it was handed)."""
    model = _with_gates("llama")
    prompt = torch.randint(1, 100, (1, 15), generator=torch.Generator().manual_seed(6))
    budget = RetentionCache.budget_for(model, 6)
    cache = RetentionCache(model, budget=budget, policy=get_policy("h2o"), slack=0)
    with torch.no_grad():
        model(input_ids=prompt, **cache_kwargs(cache), use_cache=True)
    cache.compress()
    twin = RetentionCache(model, budget=budget, policy=get_policy("h2o"), slack=0)
    twin.copy_from(cache)  # the same policy with the same options: its statistics are copied with the entries
    assert twin.policy.stats.tables.keys() == cache.policy.stats.tables.keys()
    ids = torch.cat([prompt, torch.randint(1, 100, (1, 3), generator=torch.Generator().manual_seed(7))], 1)
    with pytest.raises(RuntimeError, match=r"call cache.batch_repeat_interleave\(2\) first"):
        _generate(model, cache, input_ids=ids.repeat(2, 1), max_new_tokens=2, do_sample=False)
    cache.batch_repeat_interleave(2)
    cache.store.check()
    assert cache.store.batch == 2 and all(t.shape[0] == 2 for t in cache.policy.stats.tables.values())
    got = _generate(model, cache, input_ids=ids.repeat(2, 1), max_new_tokens=8, do_sample=False)
    one = _generate(model, twin, input_ids=ids, max_new_tokens=8, do_sample=False)
    assert cache.evictions > 1 and torch.equal(got[0], one[0]) and torch.equal(got[1], one[0])


def test_reset_starts_the_counters_again_and_odd_arguments_are_named():
    """reset() kept the eviction rounds and peak of the earlier sequence; a fresh cache's report lacked most keys;
    batch_repeat_interleave(0) emptied the batch; budget=[] failed only at the first forward."""
    from retention.cache.hf import CacheBudgetError

    model = _with_gates("llama")
    prompt = torch.randint(1, 100, (1, 15), generator=torch.Generator().manual_seed(6))
    cache = RetentionCache(model, budget=RetentionCache.budget_for(model, 4), slack=0)
    fresh = cache.memory_report()
    first = _generate(model, cache, input_ids=prompt, max_new_tokens=6, do_sample=False)
    used = cache.memory_report()
    assert set(fresh) == set(used) and fresh["kv_fraction"] == 1.0 and used["evictions"] > 0
    cache.reset()
    assert cache.memory_report()["evictions"] == 0 and cache.memory_report()["peak_entries"] == 0
    again = _generate(model, cache, input_ids=prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(again, first) and cache.memory_report()["evictions"] == used["evictions"]
    assert cache.get_seq_length(99) == 0  # a layer the model lacks holds nothing, as transformers' caches say
    for bad in (0, 2.5, -1):
        with pytest.raises(ValueError, match="whole number of copies >= 1"):
            cache.batch_repeat_interleave(bad)
    with pytest.raises(CacheBudgetError, match="budget is an empty list"):
        RetentionCache(model, budget=[])


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_cache_continues_on_its_own(how):
    """transformers' prompt-reuse recipe: prefill once, ``copy.deepcopy`` the cache per continuation (or save it
    with pickle / torch.save). The copy's layers must write to the copy (they hold their cache weakly), and the
    copy must continue as the original."""
    import copy
    import pickle

    model = _with_gates("llama")
    prompt = torch.randint(1, 100, (1, 15), generator=torch.Generator().manual_seed(8))
    cache = RetentionCache(model, budget=RetentionCache.budget_for(model, 6), policy=get_policy("h2o"), slack=0)
    with torch.no_grad():
        model(input_ids=prompt, **cache_kwargs(cache), use_cache=True)
    twin = copy.deepcopy(cache) if how == "deepcopy" else pickle.loads(pickle.dumps(cache))
    assert all(layer.cache is twin for layer in twin.layers) and all(layer.cache is cache for layer in cache.layers)
    ids = torch.cat([prompt, torch.randint(1, 100, (1, 3), generator=torch.Generator().manual_seed(9))], 1)
    got = _generate(model, twin, input_ids=ids, max_new_tokens=8, do_sample=False)
    assert twin.evictions > 0 and int(cache.store.lengths.sum()) == 15 * 3 * 2  # the original is untouched
    one = _generate(model, cache, input_ids=ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, one)
    orphan = RetentionCache(model).layers[0]  # the cache itself is dropped at once
    with pytest.raises(RuntimeError, match="outlived its RetentionCache"):
        orphan.cache


def _stream_contents(cache):
    """Per stream: (positions, keys, values) of the kept entries, in order."""
    store = cache.store
    view = store.gather(torch.arange(store.lengths.numel()))
    return [(view.pos[r][view.valid[r]], view.keys[r][view.valid[r]], view.values[r][view.valid[r]])
            for r in range(view.pos.shape[0])]


@pytest.mark.parametrize("slack", [0, None])
@pytest.mark.parametrize("policy", ["global_gates", "streamingllm"])
def test_crop_equals_never_feeding_the_removed_tokens(policy, slack):
    """Feeding accepted + rejected tokens then cropping the rejected ones leaves exactly the cache that
    feeding the accepted ones alone gives (eviction included: slack 0 evicts at every forward)."""
    model = _with_gates("llama")
    g = torch.Generator().manual_seed(8)
    prompt, accepted, rejected, nxt = (torch.randint(1, 100, (1, n), generator=g) for n in (17, 3, 4, 1))
    budget = RetentionCache.budget_for(model, 6)
    caches = [RetentionCache(model, budget=budget, policy=get_policy(policy), slack=slack) for _ in range(2)]
    with torch.no_grad():
        for cache, chunk in zip(caches, (torch.cat([accepted, rejected], 1), accepted)):
            model(input_ids=prompt, **cache_kwargs(cache), use_cache=True)
            model(input_ids=torch.tensor([[7]]), **cache_kwargs(cache), use_cache=True)
            model(input_ids=chunk, **cache_kwargs(cache), use_cache=True)
        spec, plain = caches
        assert spec.is_croppable and spec.get_seq_length() == plain.get_seq_length() + rejected.shape[1]
        spec.crop(-rejected.shape[1])
        spec.store.check()
        assert spec.get_seq_length() == plain.get_seq_length()
        for (p1, k1, v1), (p2, k2, v2) in zip(_stream_contents(spec), _stream_contents(plain)):
            assert torch.equal(p1, p2) and torch.allclose(k1, k2, atol=1e-6) and torch.allclose(v1, v2, atol=1e-6)
        a = model(input_ids=nxt, **cache_kwargs(spec), use_cache=True).logits
        b = model(input_ids=nxt, **cache_kwargs(plain), use_cache=True).logits
    assert torch.allclose(a, b, atol=1e-5)
    assert (spec.evictions > 0) == (slack == 0)


def test_crop_refuses_what_it_cannot_restore():
    model = _with_gates("llama")
    prompt = torch.randint(1, 100, (1, 17), generator=torch.Generator().manual_seed(9))
    cache = RetentionCache(model, budget=RetentionCache.budget_for(model, 6), slack=0)
    with torch.no_grad():
        model(input_ids=prompt, **cache_kwargs(cache), use_cache=True)
        cache.crop(-2)  # nothing evicted yet: the prompt's last 2 tokens can go
        assert cache.get_seq_length() == 15
        model(input_ids=torch.tensor([[3, 4]]), **cache_kwargs(cache), use_cache=True)  # evicts first
    assert cache.evictions == 1
    with pytest.raises(ValueError, match="cannot be restored"):
        cache.crop(-3)  # the third token back was in the cache when eviction ran
    with pytest.raises(ValueError, match="cannot remove 30 tokens"):
        cache.crop(-30)
    cache.crop(-2)
    assert cache.get_seq_length() == 15
    cache.crop(15)  # the older API's length to keep: nothing to do
    h2o = RetentionCache(model, budget=RetentionCache.budget_for(model, 6), policy=get_policy("h2o"))
    with torch.no_grad():
        model(input_ids=prompt, **cache_kwargs(h2o), use_cache=True)
    assert not h2o.is_croppable
    with pytest.raises(NotImplementedError, match="streaming policy that reads no queries"):
        h2o.crop(-1)


def _generate_logging_chunks(model, cache, **kw):
    """Generate, logging ``[tokens fed, tokens cropped]`` per forward of ``model`` over ``cache``."""
    log, crop = [], cache.crop

    def logged(n):
        log[-1][1] += -n
        crop(n)

    cache.crop = logged
    hook = model.register_forward_pre_hook(lambda m, a, k: log.append([k["input_ids"].shape[1], 0]), with_kwargs=True)
    try:
        return _generate(model, cache, **kw), log
    finally:
        hook.remove()
        del cache.crop


@pytest.mark.parametrize("budget_tokens", [None, 8])
def test_prompt_lookup_decoding_under_a_budget_equals_greedy_replay(budget_tokens):
    """Assisted (prompt-lookup) decoding over a RetentionCache: unlimited, it is greedy decoding; under a
    budget, every token is the greedy choice of a cache fed the accepted tokens in the same chunks."""
    model = _with_gates("qwen3")
    prompt = torch.tensor([[5, 6, 7, 8, 9] * 5])
    kw = dict(input_ids=prompt, max_new_tokens=24, min_new_tokens=24, do_sample=False, prompt_lookup_num_tokens=3)
    budget = None if budget_tokens is None else RetentionCache.budget_for(model, budget_tokens)
    cache = RetentionCache(model, budget=budget, slack=0)
    out, log = _generate_logging_chunks(model, cache, **kw)
    assert sum(c for _, c in log) > 0 and any(t - c > 1 for t, c in log[1:])  # drafts were rejected and accepted
    if budget_tokens is None:
        ref = _generate(model, DynamicCache(config=model.config), **{**kw, "prompt_lookup_num_tokens": None})
        assert torch.equal(out, ref)
        return
    assert cache.evictions > 0
    replay, at = RetentionCache(model, budget=budget, slack=0), 0
    with torch.no_grad():
        for fed, cropped in log:
            chunk = out[:, at : at + fed - cropped]
            at += chunk.shape[1]
            logits = model(input_ids=chunk, **cache_kwargs(replay), use_cache=True).logits
            assert int(logits[0, -1].argmax()) == int(out[0, at])
    assert at == out.shape[1] - 1 and replay.evictions == cache.evictions


def _left_padded(lens, seed):
    g = torch.Generator().manual_seed(seed)
    return _pad_left([torch.randint(1, 100, (n,), generator=g) for n in lens])


@pytest.mark.parametrize("chunk", [None, 4])
def test_a_budget_that_holds_the_whole_generation_equals_dynamic_cache_for_a_padded_batch(chunk):
    """A finite budget of exactly the generation's entries (padding not counted) never evicts: token for token the
    DynamicCache generation of a left-padded batch, prefilled whole or in chunks."""
    model = _with_gates("qwen3")
    inputs, new = _left_padded([5, 13, 9], 0), 12
    kw = dict(**inputs, max_new_tokens=new, min_new_tokens=new, do_sample=False,
              **({"prefill_chunk_size": chunk} if chunk else {}))
    ref = _generate(model, DynamicCache(config=model.config), **kw)
    cache = RetentionCache(model, budget=RetentionCache.budget_for(model, 13 + new - 1), slack=0, page_size=3)
    assert torch.equal(_generate(model, cache, **kw), ref) and cache.evictions == 0


def test_a_reset_cache_generates_and_reports_as_a_new_one():
    """After a left-padded batch under eviction, ``reset()`` leaves nothing behind: the next batch (padded otherwise, or
    not at all, of the same size or another) generates the same tokens and the same memory report as a new cache."""
    model = _with_gates("llama")
    opts = dict(budget=30, page_size=3, policy=get_policy("global_gates"), slack=2)
    used = RetentionCache(model, **opts)
    _generate(model, used, **_left_padded([5, 13], 1), max_new_tokens=8, do_sample=False)
    assert used.evictions > 0
    for lens in ([9, 9], [12, 3], [7, 11, 4], [6]):  # a reset cache once refused a batch of another size
        used.reset()
        new = RetentionCache(model, **{**opts, "policy": get_policy("global_gates")})
        inputs = _left_padded(lens, 2)
        got = _generate(model, used, **inputs, max_new_tokens=8, do_sample=False)
        assert torch.equal(got, _generate(model, new, **inputs, max_new_tokens=8, do_sample=False))
        a, b = used.memory_report(), new.memory_report()
        assert a.keys() == b.keys() and torch.equal(a.pop("entries_per_head"), b.pop("entries_per_head"))
        for key in ("pool_capacity_bytes", "held_bytes"):  # the pool keeps its size over a reset
            a.pop(key), b.pop(key)
        assert a == b and a["evictions"] > 0
    with pytest.raises(RuntimeError, match=r"holds 1 sequence but got a batch of 2.*cache.reset\(\)"):
        _generate(model, used, **_left_padded([5, 8], 0), max_new_tokens=2)  # still holding a sequence: refused


def test_kept_where_counts_neither_padding_nor_positions_past_the_marks():
    """``kept_where`` (a chat's kept image entries) indexed the marks by position: a padding entry (position -1) of
    sequence 0 counted as the last token, and a position past the marks as the last mark."""
    from retention.cache.hf import kept_where

    model = _with_gates("llama")
    cache = RetentionCache(model)
    with torch.no_grad():
        model(**_left_padded([5, 13], 0), **cache_kwargs(cache), use_cache=True)
    marked = torch.zeros(13, dtype=torch.bool)
    marked[-1] = True  # the last token of sequence 0 (8 padding tokens, then 5 real ones)
    streams = model.config.num_hidden_layers * model.config.num_key_value_heads
    assert kept_where(cache, marked) == streams
    assert kept_where(cache, marked[:-1]) == 0  # the marks end before the last token: it is not marked


def test_flex_attention_left_padding_is_padding():
    """With ``attn_implementation="flex_attention"`` the layers' mask is a ``BlockMask``, not a tensor: the cache
    read no padding off it, so left-padding tokens were stored and attended as real tokens at positions 0..p-1 and a
    padded row generated something else than alone."""
    model = BUILDERS["llama"](attn_implementation="flex_attention")
    attach_gates(model, mode="score")
    prompts = [torch.randint(1, 100, (n,), generator=torch.Generator().manual_seed(n)) for n in (4, 11)]
    budget = RetentionCache.budget_for(model, 6)
    alone = [_generate(model, RetentionCache(model, budget=budget, slack=0), input_ids=p[None], max_new_tokens=6,
                       do_sample=False)[0, len(p):] for p in prompts]
    cache = RetentionCache(model, budget=budget, slack=0)
    out = _generate(model, cache, **_pad_left(prompts), max_new_tokens=6, do_sample=False)
    assert torch.equal(out[0, 11:], alone[0]) and torch.equal(out[1, 11:], alone[1]) and cache.evictions > 0
    view = cache.store.gather_layer(0)
    assert int(view.pos[0][view.valid[0] & (view.pos[0] >= 0)].min()) >= 7  # row 0's 7 padding tokens hold no position
