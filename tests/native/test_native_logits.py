"""logits.c (common/engine/native/csrc) through bindings.py: the int8 head's top-k refinement and greedy's argmax.

Against plain references (a sort by the documented order, float64 dot products, torch's max), for what
invariant 4 (same inputs, same tokens) needs of them (a row's result never depends on the other
rows), and alike in the host's build, the image's portable AVX2 build and the plain C one.
"""
from __future__ import annotations


import numpy as np
import pytest
import torch

from tests.support.native import native_kernels, other_build

VOCAB, DIM, K = 4099, 64, 64  # an odd vocabulary: the 8-wide scan's tail


def _case(rows: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, VOCAB, generator=gen) * 3
    logits[0].clamp_(max=2.0)
    logits[0, 1000:1030] = 5.0 + torch.arange(30)  # 30 clear winners,
    logits[0, 500:600] = 2.5  # then 100 ties across the 64th place: the lower ids win
    logits[1, 4000:4010] = float("nan")  # NaN ranks above everything, as in torch.topk
    logits[1, 17] = float("inf")
    logits[2, :] = 0.0
    logits[2, 3::2] = -0.0  # -0 ranks as +0
    if rows > 3:
        logits[3] = -logits[3].abs() - 1  # all negative: the 64 nearest zero
    hidden = torch.randn(rows, DIM, generator=gen)
    head = torch.randn(VOCAB, DIM, generator=gen)
    return logits, hidden, head


def _expected_ids(row: torch.Tensor, k: int) -> set[int]:
    """The k best of a row by the documented order: NaN first, then by value (-0 as +0), ties to the lower id."""
    v = row.double().numpy()
    rank = sorted(range(len(v)), key=lambda i: (0 if np.isnan(v[i]) else 1, -(0.0 if np.isnan(v[i]) else v[i]), i))
    return set(rank[:k])


def test_refine_top_recomputes_the_k_best_exactly_and_nothing_else():
    k = native_kernels()
    logits, hidden, head = _case(5, 0)
    out = k.refine_top(logits.clone(), hidden, head, K)
    exact = hidden.double() @ head.double().T  # [rows, vocab]
    for r in range(5):
        changed = set(torch.nonzero(out[r].ne(logits[r]) & ~(out[r].isnan() & logits[r].isnan())).flatten().tolist())
        chosen = _expected_ids(logits[r], K)
        assert changed <= chosen, f"row {r}: refined ids outside its {K} best"
        ids = sorted(chosen)
        err = (out[r, ids].double() - exact[r, ids]).abs()
        scale = hidden[r].double().abs() @ head[ids].double().abs().T
        assert (err <= 1e-6 * scale + 1e-30).all(), f"row {r}: worst error {err.max():.3g}"
        rest = sorted(set(range(VOCAB)) - chosen)
        assert torch.equal(out[r, rest], logits[r, rest]), f"row {r}: an unchosen logit moved"
    # Row 0: its 30 clear winners, then the first 34 of the 100 ties.
    assert _expected_ids(logits[0], K) == set(range(1000, 1030)) | set(range(500, 534))


def test_a_row_is_the_same_bits_alone_and_in_any_batch():
    k = native_kernels()
    logits, hidden, head = _case(13, 1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone_refined = [k.refine_top(logits[i:i + 1].clone(), hidden[i:i + 1].contiguous(), head, K)[0]
                         for i in range(13)]
        alone_argmax = [k.argmax(logits[i:i + 1].contiguous())[0] for i in range(13)]
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            refined = k.refine_top(logits.clone(), hidden, head, K)
            top = k.argmax(logits)
            for i in range(13):
                assert torch.equal(refined[i], alone_refined[i]), (i, n_threads)
                assert top[i] == alone_argmax[i], (i, n_threads)
    finally:
        torch.set_num_threads(threads)


def test_argmax_is_torchs_first_largest():
    k = native_kernels()
    logits, _, _ = _case(6, 2)
    logits[3, :] = float("-inf")
    logits[4, 9], logits[4, 3000] = 1e9, 1e9  # a tie: the first
    logits[5, 0] = float("nan")
    assert torch.equal(k.argmax(logits), logits.max(dim=-1).indices)
    assert k.argmax(torch.tensor([[-0.0, 0.0, -1.0]])).item() == 0


def test_bad_arguments_are_refused_with_a_reason():
    k = native_kernels()
    logits, hidden, head = _case(3, 3)
    with pytest.raises(RuntimeError, match="refused its arguments"):
        k.refine_top(logits.clone(), hidden, head, VOCAB + 1)  # k above the vocabulary
    with pytest.raises(RuntimeError, match="refused its arguments"):
        k.refine_top(logits[:, :VOCAB - 1].contiguous(), hidden[:, :60].contiguous(), head[:VOCAB - 1, :60].contiguous(),
                     K)  # dim not a multiple of 8
    with pytest.raises(ValueError, match="fp32 contiguous"):
        k.refine_top(logits.to(torch.bfloat16), hidden, head, K)
    with pytest.raises(ValueError, match="fp32 and contiguous"):
        k.argmax(logits.t())


@pytest.mark.parametrize("march", ["x86-64", "x86-64-v3"], ids=["plain-c", "portable-avx2"])
def test_other_builds_compute_the_same_bits(tmp_path, march):
    k = native_kernels()
    other = other_build(tmp_path, march)
    logits, hidden, head = _case(7, 4)
    assert torch.equal(other.refine_top(logits.clone(), hidden, head, K), k.refine_top(logits.clone(), hidden, head, K))
    assert torch.equal(other.argmax(logits), k.argmax(logits))
