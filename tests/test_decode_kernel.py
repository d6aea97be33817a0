"""Triton paged decode kernel (interpreter mode) against the PyTorch reference; the compiled kernel on a
GPU: ``test_gpu_kernels.py``."""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from kernel_checks import generate_under_budget, paged_inputs as setup
from retention.cache.attention import paged_decode_reference

kernel = pytest.importorskip("retention.cache.triton_decode")


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("G", [1, 3, 4])
@pytest.mark.parametrize("split", [1, 2, None])
def test_matches_reference(dtype, tol, G, split):
    q, kp, vp, table, lens = setup(5, G, 32, 8, [1, 7, 8, 23, 40], dtype)
    got = kernel.paged_decode_triton(q, kp, vp, table, lens, 32**-0.5, pages_per_split=split)
    want = paged_decode_reference(q, kp, vp, table, lens, 32**-0.5)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_rows_pick_streams_of_a_larger_table():
    """The cache passes its whole block table and lengths with the layer's rows: stream n reads row
    ``rows[n]`` in place (no gathered copy), in any order."""
    q, kp, vp, table, lens = setup(6, 3, 32, 8, [3, 0, 17, 9, 40, 8], torch.float32)
    rows = torch.tensor([4, 1, 2])
    got = kernel.paged_decode_triton(q[:3], kp, vp, table, lens, 0.2, rows=rows)
    want = paged_decode_reference(q[:3], kp, vp, table[rows], lens[rows], 0.2)
    assert torch.equal(got[1], torch.zeros_like(got[1]))  # row 1 is empty
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    other = kernel.paged_decode_triton(q[:3], kp, vp, table, lens, 0.2, rows=torch.tensor([0, 3, 5]))
    assert not torch.allclose(other, got)


def test_splits_cover_the_pages_in_use_not_the_table_width():
    """The cache's block table grows by doubling and keeps its width after evictions; with ``longest``
    the splits share the pages in use (8 here, 2 per split) instead of the table's 32 columns (4 per split,
    half the splits idle), and the result is unchanged."""
    q, kp, vp, table, lens = setup(4, 2, 32, 8, [64, 3, 40, 17], torch.float32)
    wide = torch.cat([table, torch.full((4, 24), -1)], dim=1)
    assert kernel.split_plan(wide.shape[1]) == (4, 8) and kernel.split_plan(8) == (1, 8)
    want = paged_decode_reference(q, kp, vp, table, lens, 0.3)
    for longest in (None, 64, 100):
        got = kernel.paged_decode_triton(q, kp, vp, wide, lens, 0.3, longest=longest)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    short = kernel.paged_decode_triton(q, kp, vp, wide, lens, 0.3, longest=40)  # below stream 0: its tail is dropped
    assert not torch.allclose(short[0], want[0]) and torch.allclose(short[1:], want[1:], rtol=1e-5, atol=1e-5)


def test_empty_streams_give_zeros_and_head_dim_64():
    q, kp, vp, table, lens = setup(3, 3, 64, 16, [0, 5, 33], torch.float32)
    got = kernel.paged_decode_triton(q, kp, vp, table, lens, 0.125)
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    torch.testing.assert_close(got, paged_decode_reference(q, kp, vp, table, lens, 0.125), rtol=1e-5, atol=1e-5)


def test_page_size_must_be_a_power_of_two():
    q, kp, vp, table, lens = setup(1, 1, 16, 6, [4], torch.float32)
    with pytest.raises(ValueError, match="power of two"):
        kernel.paged_decode_triton(q, kp, vp, table, lens, 0.25)


def test_generate_through_the_paged_kernel_equals_the_padded_path(monkeypatch):
    """RetentionCache decoding with the Triton kernel (forced on CPU) gives the same tokens."""
    from retention import attach_gates
    from tiny_models import tiny_llama

    model = tiny_llama()
    attach_gates(model, bias_init=0.0, mode="score")
    ids = torch.randint(0, 100, (2, 30), generator=torch.Generator().manual_seed(0))
    padded, ev = generate_under_budget(model, ids, 12, page_size=4, new_tokens=8)
    calls = []
    real = kernel.paged_decode_triton
    monkeypatch.setattr(kernel, "paged_decode_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv("RETENTION_FORCE_TRITON", "1")
    paged, ev2 = generate_under_budget(model, ids, 12, page_size=4, new_tokens=8)
    assert calls and ev > 0 and ev2 == ev
    assert torch.equal(paged, padded)


def test_flash_attn_path_maps_streams_to_sequences(monkeypatch):
    """With flash-attn present (faked here by a reference of its documented semantics), paged streams
    are passed as one-KV-head sequences with their own block tables and lengths."""
    import retention.cache.flash as flash

    calls = []

    def fake_flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, causal):
        calls.append((q.shape, k_cache.shape, block_table.dtype, cache_seqlens.dtype, causal))
        out = paged_decode_reference(q[:, 0], k_cache[:, :, 0], v_cache[:, :, 0], block_table, cache_seqlens,
                                     softmax_scale)
        return out[:, None]

    monkeypatch.setattr(flash, "_flash_attn_with_kvcache", lambda: fake_flash_attn_with_kvcache)
    q, kp, vp, table, lens = setup(4, 3, 32, 256, [1, 300, 513, 0], torch.float16)
    assert flash.flash_paged_decode(q, kp, vp, table, lens, 0.2) is None  # CPU tensors: not for flash-attn
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    got = flash.flash_paged_decode(q, kp, vp, table, lens, 0.2)
    assert calls == [((4, 1, 3, 32), (kp.shape[0], 256, 1, 32), torch.int32, torch.int32, False)]
    torch.testing.assert_close(got, paged_decode_reference(q, kp, vp, table, lens, 0.2))
    rows = torch.tensor([2, 0])  # the cache passes its whole table with the layer's rows
    got = flash.flash_paged_decode(q[:2], kp, vp, table, lens, 0.2, rows=rows)
    torch.testing.assert_close(got, paged_decode_reference(q[:2], kp, vp, table[rows], lens[rows], 0.2))
    small = setup(2, 1, 16, 16, [3, 5], torch.float16)
    assert flash.flash_paged_decode(*small, 0.25) is None  # pages must be multiples of 256 entries


def test_bad_inputs_are_clear_errors(monkeypatch):
    q, kp, vp, table, lens = setup(3, 3, 32, 8, [5, 9, 17], torch.float32)
    # a query head_dim other than the pools' read the wrong entries and returned garbage
    with pytest.raises(ValueError, match="pools must both be"):
        kernel.paged_decode_triton(q[..., :16].contiguous(), kp, vp, table, lens, 0.25)
    with pytest.raises(ValueError, match="pools must both be"):
        kernel.paged_decode_triton(q, kp, vp[..., :16], table, lens, 0.25)
    with pytest.raises(ValueError, match="integer tensors"):
        kernel.paged_decode_triton(q, kp, vp, table, lens.float(), 0.25)
    with pytest.raises(ValueError, match="one block-table row per query stream"):
        kernel.paged_decode_triton(q, kp, vp, table, lens, 0.25, rows=torch.tensor([0, 1]))
    # a table or lengths with fewer rows than the streams read past them (garbage such as 1e32), not fail
    with pytest.raises(ValueError, match="block-table rows"):
        kernel.paged_decode_triton(q, kp, vp, table[:2], lens[:2], 0.25)
    with pytest.raises(ValueError, match=r"lengths \(streams,\)"):
        kernel.paged_decode_triton(q, kp, vp, table, lens[:2], 0.25)
    with pytest.raises(ValueError, match=r"lengths \(streams,\)"):
        kernel.paged_decode_triton(q, kp, vp, table.flatten(), lens, 0.25)
    # CPU tensors without the interpreter (RETENTION_FORCE_TRITON=1 alone) failed inside Triton ("0 active drivers")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        kernel.paged_decode_triton(q, kp, vp, table, lens, 0.25)


def test_flash_attn_path_without_rows_passes_one_table_row_per_query(monkeypatch):
    """flash-attn checks ``block_table`` ``(batch, max_blocks)`` and ``cache_seqlens`` ``(batch,)`` against the
    queries; without ``rows`` the first N rows of a larger table are the streams (as the Triton kernel reads)."""
    import retention.cache.flash as flash

    def fake(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, causal):
        assert block_table.shape[0] == q.shape[0] and cache_seqlens.shape == (q.shape[0],)  # flash-attn's checks
        return paged_decode_reference(q[:, 0], k_cache[:, :, 0], v_cache[:, :, 0], block_table, cache_seqlens,
                                      softmax_scale)[:, None]

    monkeypatch.setattr(flash, "_flash_attn_with_kvcache", lambda: fake)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    q, kp, vp, table, lens = setup(4, 3, 32, 256, [1, 300, 513, 7], torch.float16)
    got = flash.flash_paged_decode(q[:2], kp, vp, table, lens, 0.2)
    torch.testing.assert_close(got, paged_decode_reference(q[:2], kp, vp, table[:2], lens[:2], 0.2))
