"""Losses: chunked KL equals the unchunked one; capacity sums and the capacity loss equal brute force."""

import pytest
import torch
import torch.nn.functional as F

import retention.ops.capacity.reference as capref
from retention.losses import capacity_loss, distillation_kl, positions_in_document
from retention.ops.capacity import capacity_sum, capacity_sum_naive


def brute_kl(head, hs, ht, temperature=1.0):
    """``KL(p_teacher || p_student)`` at every position ``(B, T)`` from full logits at once."""
    lt = F.log_softmax(head(ht) / temperature, -1)
    ls = F.log_softmax(head(hs) / temperature, -1)
    return (lt.exp() * (lt - ls)).sum(-1)


def test_chunked_kl_equals_full_logits_kl_with_gradients():
    torch.manual_seed(0)
    B, T, D, V = 2, 11, 8, 50
    head = torch.nn.Linear(D, V, bias=False)
    hs = torch.randn(B, T, D, requires_grad=True)
    ht = torch.randn(B, T, D)
    mask = torch.rand(B, T) > 0.3
    got = distillation_kl(hs, ht, head, mask, temperature=2.0, chunk_size=3)
    (g_got,) = torch.autograd.grad(got, hs)
    want = brute_kl(head, hs, ht, 2.0)[mask].mean() * 4.0
    (g_want,) = torch.autograd.grad(want, hs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_got, g_want, rtol=1e-5, atol=1e-6)
    one_chunk = distillation_kl(hs, ht, head, mask, temperature=2.0, chunk_size=10_000)
    torch.testing.assert_close(got, one_chunk, rtol=1e-6, atol=1e-7)


def test_weighted_kl_is_the_weighted_mean_over_marked_positions():
    """Source weights (train data.sources.weight): each marked position's KL counts ``weight`` times."""
    torch.manual_seed(1)
    B, T, D, V = 2, 9, 6, 40
    head = torch.nn.Linear(D, V, bias=False)
    hs = torch.randn(B, T, D, requires_grad=True)
    ht = torch.randn(B, T, D)
    mask = torch.rand(B, T) > 0.3
    w = torch.where(torch.rand(B, T) > 0.5, 10.0, 0.5)
    got = distillation_kl(hs, ht, head, mask, chunk_size=4, weights=w)
    (g_got,) = torch.autograd.grad(got, hs)
    want = (brute_kl(head, hs, ht) * w)[mask].sum() / w[mask].sum()
    (g_want,) = torch.autograd.grad(want, hs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_got, g_want, rtol=1e-5, atol=1e-6)
    total, count = distillation_kl(hs, ht, head, mask, weights=w, reduction="sum")
    assert count == pytest.approx(float(w[mask].sum()))
    torch.testing.assert_close(total / count, want, rtol=1e-5, atol=1e-6)
    # equal weights are the plain mean, and differ from the weighted one
    plain = distillation_kl(hs, ht, head, mask)
    torch.testing.assert_close(distillation_kl(hs, ht, head, mask, weights=torch.full((B, T), 3.0)), plain,
                               rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got, plain)


def test_kl_is_zero_for_identical_states():
    head = torch.nn.Linear(4, 9)
    h = torch.randn(1, 5, 4)
    assert distillation_kl(h, h, head).abs() < 1e-6


@pytest.mark.parametrize("cu", [None, [0, 5, 30, 41, 80]])
@pytest.mark.parametrize("reduce", [True, False])
def test_capacity_sum_reference_matches_brute_force(cu, reduce, monkeypatch):
    monkeypatch.setattr(capref, "_BLOCK_ELEMENTS", 500)  # several position blocks
    cu = None if cu is None else torch.tensor(cu)
    lb = (-torch.rand(2, 3, 40, dtype=torch.float64) * 0.3).requires_grad_()
    got, want = capacity_sum(lb, cu, reduce), capacity_sum_naive(lb, cu, reduce)
    # the reference computes in fp32: relative error ~1e-6 on sums of up to 40 terms
    assert got.dtype == torch.float32  # sums are always fp32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(got)
    (ga,) = torch.autograd.grad((got * g).sum(), lb)
    (gb,) = torch.autograd.grad((want * g).sum(), lb)
    torch.testing.assert_close(ga, gb, rtol=1e-4, atol=1e-4)


def test_capacity_sum_of_beta_one_counts_tokens_in_the_document():
    lb = torch.zeros(1, 2, 10)
    S = capacity_sum(lb, torch.tensor([0, 4, 10]), reduce=False)
    assert S[0, 0].tolist() == [1, 2, 3, 4, 1, 2, 3, 4, 5, 6]


def test_positions_in_document():
    pos = positions_in_document(torch.tensor([0, 3, 5, 8, 12]), 2, 6, "cpu")
    assert pos.tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 0, 1, 2, 3]]


@pytest.mark.parametrize("fractional", [False, True])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("form", ["global", "per_head"])
def test_capacity_loss_equals_brute_force(form, masked, fractional):
    """The loss against its definition; ``mask`` (a packed row's padding, here the second row's last document)
    leaves its positions out of the mean. A fractional budget (a share of a context) puts a full cache under one
    entry past it, and the term still divides by that distance."""
    torch.manual_seed(0)
    L, B, H, T = 3, 2, 2, 12
    lbs = [-torch.rand(B, H, T) * 0.5 for _ in range(L)]
    cu = torch.tensor([0, 5, 12, 20, 24])
    M = (20.0 if form == "global" else 3.0) - (0.5 if fractional else 0.0)
    doc = [[0] * 5 + [1] * 7, [2] * 8 + [3] * 4]
    mask = torch.tensor([[d != 3 for d in row] for row in doc]) if masked else None
    got, stats = capacity_loss(lbs, M, form, cu, mask=mask)
    terms, considered, peaks = [], 0, [0.0] * B
    for b in range(B):
        for t in range(T):
            if masked and doc[b][t] == 3:
                continue
            same = [i for i in range(t + 1) if doc[b][i] == doc[b][t]]
            n_t = len(same)  # tokens of the document so far
            per_head = [sum(float(torch.exp((t - i) * lbs[l][b, h, i])) for i in same)
                        for l in range(L) for h in range(H)]
            peaks[b] = max(peaks[b], sum(per_head))
            if form == "global":
                considered += 1
                full = n_t * L * H
                if full > M:
                    terms.append(max(0.0, sum(per_head) - M) / (full - M))
            else:
                considered += len(per_head)
                for s in per_head:
                    if n_t > M:
                        terms.append(max(0.0, s - M) / (n_t - M))
    want = sum(terms) / len(terms)
    assert abs(float(got) - want) < 1e-5
    # the logged stats leave the masked positions out too: the share of terms past the budget, the soft cache's peak
    assert stats["capacity_terms"] == len(terms)
    assert stats["capacity_active_frac"] == pytest.approx(len(terms) / considered)
    assert stats["soft_cache_entries"] == pytest.approx(sum(peaks) / B, rel=1e-5)


def test_capacity_loss_rejects_unknown_form():
    with pytest.raises(ValueError, match="capacity form must be"):
        capacity_loss([torch.zeros(1, 1, 3)], 1.0, "local")


def test_kl_over_positions_whose_weights_are_all_zero_is_zero_not_nan():
    """As with no marked position: a weighted mean over positions that all weigh 0 (a batch of one ``weight: 0``
    source) was 0 / 0 = NaN, and its gradient NaN too."""
    torch.manual_seed(2)
    head = torch.nn.Linear(4, 9)
    hs, ht = torch.randn(2, 5, 4, requires_grad=True), torch.randn(2, 5, 4)
    mask = torch.rand(2, 5) > 0.3
    got = distillation_kl(hs, ht, head, mask, weights=torch.zeros(2, 5))
    assert float(got.detach()) == 0.0
    (g,) = torch.autograd.grad(got, hs)
    assert torch.equal(g, torch.zeros_like(g))
    total, count = distillation_kl(hs, ht, head, mask, weights=torch.zeros(2, 5), reduction="sum")
    assert float(total.detach()) == 0.0 and count == 0


def test_losses_refuse_an_unknown_reduction():
    """reduction="none" (or a typo) silently gave the mean."""
    head = torch.nn.Linear(4, 9)
    h = torch.randn(1, 5, 4)
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum'"):
        distillation_kl(h, h, head, reduction="none")
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum'"):
        capacity_loss([torch.zeros(1, 2, 3)], 1.0, reduction="none")


@pytest.mark.parametrize("form", ["global", "per_head"])
def test_capacity_loss_of_an_empty_sequence_is_zero(form):
    """No positions: no terms, loss 0 (was an IndexError from the soft cache statistic)."""
    lb = torch.zeros(1, 2, 0, requires_grad=True)
    loss, stats = capacity_loss([lb], 1.0, form)
    assert float(loss.detach()) == 0.0 and stats["capacity_terms"] == 0 and stats["soft_cache_entries"] == 0.0
    loss.backward()


def test_kl_refuses_a_mask_or_weights_of_another_shape():
    """A mask one position short (``loss_mask[:, 1:]``) was flattened and read against the flattened states: the
    KL of other positions than those marked, with no error."""
    head = torch.nn.Linear(4, 9)
    hs, ht = torch.randn(2, 5, 4), torch.randn(2, 5, 4)
    mask = torch.ones(2, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"mask \(2, 4\) does not match the hidden states' positions \(2, 5\)"):
        distillation_kl(hs, ht, head, mask[:, 1:])
    with pytest.raises(ValueError, match=r"weights \(10,\) does not match the hidden states' positions \(2, 5\)"):
        distillation_kl(hs, ht, head, mask, weights=torch.ones(10))
    distillation_kl(hs, ht, head, mask, weights=torch.ones(2, 5))


@pytest.mark.parametrize("half", ["autocast", "bf16 model"])
def test_kl_logits_are_float32_with_bf16(half):
    """Mixed precision distils float32 logits: rounding logits near 10 to bf16 steps of 1/16 made a KL of ~2e-4 come
    out far off. Under bf16 autocast, and with a bf16 model's states and head, the KL and its gradient are float32's
    from the same values (the backward outside autocast, as training runs it)."""
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(64, 8192, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(8192, 64, generator=g) * 1.5)  # logits of a few units to ~20
    ht = torch.randn(2, 16, 64, generator=g)
    hs = ht + 0.003 * torch.randn(2, 16, 64, generator=g)
    if half == "bf16 model":
        head, ht, hs = head.to(torch.bfloat16), ht.bfloat16(), hs.bfloat16()
    hs = hs.requires_grad_()
    ref = brute_kl(head.float(), hs.float(), ht.float()).mean()
    (ref_grad,) = torch.autograd.grad(ref, hs)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=half == "autocast"):
        got = distillation_kl(hs, ht, head, chunk_size=8)
    (grad,) = torch.autograd.grad(got, hs)
    assert 1e-4 < ref.item() < 1e-2  # the regime where the rounding mattered
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=0)
    torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=1e-3, atol=1e-7)
