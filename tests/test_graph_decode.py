"""GraphDecoder's planned decode step (retention.cache.graph_decode) against the cache's ordinary decode path, on the
CPU where it runs eagerly: the same logits, evictions and kept entries step for step. The recorded CUDA graph is
checked on a GPU in test_gpu_kernels.py."""

import pytest
import torch

from retention import attach_gates
from retention.cache import RetentionCache
from retention.cache import GraphDecoder
from retention.compat import cache_kwargs
from tiny_models import BUILDERS, tiny_llama


def _prefilled(model, ids, budget_tokens, policy=None):
    cache = RetentionCache(model, budget=RetentionCache.budget_for(model, budget_tokens), policy=policy)
    with torch.no_grad():
        first = model(input_ids=ids, **cache_kwargs(cache), use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
    return cache, first


def _kept(cache):
    """Every stream's kept positions, in order."""
    s = cache.store
    view = s.gather(torch.arange(s.num_streams), with_kv=False)
    return [view.pos[r][view.valid[r]].tolist() for r in range(s.num_streams)]


@pytest.mark.parametrize("arch,batch", [("llama", 1), ("llama", 2), ("mistral", 2), ("qwen2", 2), ("qwen3", 2)])
def test_the_planned_step_decodes_as_the_cache_does(arch, batch):
    """Fed the same tokens, the planned step gives the ordinary path's logits at every step, through evictions and
    new pages, and leaves the cache holding the same entries, counters and peak (every text architecture)."""
    torch.manual_seed(0)
    model = BUILDERS[arch]().eval()
    attach_gates(model, None, mode="score", bias_init=1.0)
    ids = torch.randint(0, 100, (batch, 40), generator=torch.Generator().manual_seed(1))
    plain, tok = _prefilled(model, ids, budget_tokens=12)
    planned, _ = _prefilled(model, ids, budget_tokens=12)
    decoder = GraphDecoder(model, planned, graph=False)
    assert not decoder.graph
    for _ in range(40):  # past several pages of 16 and evictions (budget 12 tokens per head, one page of slack)
        with torch.no_grad():
            want = model(input_ids=tok, **cache_kwargs(plain), use_cache=True).logits[:, -1]
        got = decoder.step(tok)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        tok = want.argmax(-1, keepdim=True)
    assert plain.evictions == planned.evictions >= 2
    assert plain._seen == planned._seen == [80] * model.config.num_hidden_layers
    assert plain.peak_entries == planned.peak_entries
    assert _kept(plain) == _kept(planned)
    planned.store.check()


def test_a_step_that_fails_midway_leaves_the_cache_as_it_was():
    """A step that raises after its first layers wrote their entries (Ctrl-C, out of memory) gives its slots and any
    page it opened back: no leak, the same lengths, and the next steps decode as the ordinary path does."""
    torch.manual_seed(0)
    model = tiny_llama().eval()
    attach_gates(model, None, mode="score", bias_init=1.0)
    ids = torch.randint(0, 100, (2, 40), generator=torch.Generator().manual_seed(1))
    plain, tok = _prefilled(model, ids, budget_tokens=12)
    planned, _ = _prefilled(model, ids, budget_tokens=12)
    decoder = GraphDecoder(model, planned, graph=False)

    def fail(*args):
        raise KeyboardInterrupt

    at_page_start = 0
    for _ in range(30):
        hook = model.model.layers[1].register_forward_hook(fail)  # layer 0 has written its entries
        lengths = []
        for _ in range(2):  # the first failure may evict first, as any step does; neither reserves for good
            with pytest.raises(KeyboardInterrupt):
                decoder.step(tok)
            lengths.append(planned.store.host_lengths.clone())
            assert torch.equal(planned.store.lengths, lengths[-1])
            planned.store.check()  # a page the step opened is free again
        hook.remove()
        assert torch.equal(lengths[0], lengths[1])
        at_page_start += int((lengths[0] % planned.page_size == 0).any())
        with torch.no_grad():
            want = model(input_ids=tok, **cache_kwargs(plain), use_cache=True).logits[:, -1]
        torch.testing.assert_close(decoder.step(tok), want, atol=1e-5, rtol=1e-5)
        tok = want.argmax(-1, keepdim=True)
    assert at_page_start >= 1 and plain.evictions == planned.evictions >= 1 and _kept(plain) == _kept(planned)


def test_what_the_planned_step_cannot_decode_is_refused():
    model = tiny_llama().eval()
    ids = torch.randint(0, 100, (1, 20), generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="score mode"):
        GraphDecoder(model, RetentionCache.__new__(RetentionCache))
    attach_gates(model, None, mode="score")
    with pytest.raises(ValueError, match="prefill the prompt first"):
        GraphDecoder(model, RetentionCache(model, budget=None))
    cache, _ = _prefilled(model, ids, budget_tokens=8, policy="snapkv")
    with pytest.raises(ValueError, match="reads the queries"):
        GraphDecoder(model, cache)
    cache, _ = _prefilled(model, ids, budget_tokens=8)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA model"):
        GraphDecoder(model, cache, graph=True)
    padded = RetentionCache(model, budget=None)
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    with torch.no_grad():
        model(input_ids=ids.expand(2, 20), attention_mask=mask, **cache_kwargs(padded), use_cache=True)
    with pytest.raises(ValueError, match="left padding"):
        GraphDecoder(model, padded)
    decoder = GraphDecoder(model, cache)
    with pytest.raises(ValueError, match=r"ids of shape \(1, 1\)"):
        decoder.step(torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(TypeError, match="token ids .an integer tensor., got torch.float32"):
        decoder.step(torch.zeros(1, 1))
    cache.reset()  # a step used to decode the lone token at position 0 over an empty cache
    with pytest.raises(RuntimeError, match="holds no tokens .it was reset.: prefill it again"):
        decoder.step(torch.zeros(1, 1, dtype=torch.long))
    with torch.no_grad():  # prefilled again, the same decoder goes on (RetentionChat keeps its decoder over resets)
        model(input_ids=ids, **cache_kwargs(cache), use_cache=True)
    assert decoder.step(torch.zeros(1, 1, dtype=torch.long)).shape == (1, model.config.vocab_size)
    with pytest.raises(TypeError, match="RetentionCache"):
        GraphDecoder(model, object())



def test_a_decoder_kept_over_a_reset_refuses_a_padded_refill():
    """The constructor refuses a left-padded cache, but a decoder kept over ``reset()`` (as RetentionChat keeps its
    own) stepped over a cache prefilled again with a padded batch and attended to the padding entries unmasked."""
    model = tiny_llama().eval()
    attach_gates(model, None, mode="score")
    ids = torch.randint(1, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    cache = RetentionCache(model)
    with torch.no_grad():
        model(input_ids=ids, **cache_kwargs(cache), use_cache=True)
    decoder = GraphDecoder(model, cache, graph=False)
    cache.reset()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # row 0 left-padded
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **cache_kwargs(cache), use_cache=True)
    lengths = cache.store.lengths.clone()
    with pytest.raises(ValueError, match="left padding"):
        decoder.step(torch.tensor([[5], [7]]))
    assert torch.equal(cache.store.lengths, lengths) and cache._seen[0] == 6  # refused before touching the cache


def _private_cache_reads(source: str) -> list[str]:
    """``name.attr`` of each private attribute the source reads off the cache (``c``, ``cache``, ``self.cache``)."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id in ("c", "cache")) or (
                    isinstance(owner, ast.Attribute) and owner.attr == "cache"):
                found.append(f"{ast.unparse(owner)}.{node.attr}")
    return found


def test_the_decoder_uses_only_the_cache_s_public_methods():
    """GraphDecoder reached into the cache's private state (cache._static, _seen, _pad_entries, _maybe_evict); it
    asks through public methods now (holds_padding, begin_planned_step, planned_slots, end_planned_step)."""
    from pathlib import Path

    import retention.cache.graph_decode as graph_decode

    checked = _private_cache_reads("c._seen[0]\nself.cache._static = None\ncache.store\n")
    assert sorted(checked) == ["c._seen", "self.cache._static"]
    assert _private_cache_reads(Path(graph_decode.__file__).read_text()) == []
