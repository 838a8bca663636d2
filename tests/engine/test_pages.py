"""common/engine/pages.py: the packed decode weights and the KV pool in huge-page mappings.

The kernel's own account (/proc/self/smaps) says whether a mapping may get huge pages (`THPeligible`):
that is what the advice decides, deterministic where THP is `madvise`. Whether the kernel then finds free
2 MiB pages depends on the host's memory, so no test asserts `AnonHugePages`; the benchmark prints it.
"""
from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from common.engine import pages
from common.engine.native.packing import pack_q4, pack_q8
from tests.support.native import q4_weight


def _eligible(t: torch.Tensor) -> bool:
    fields = pages.smaps_fields(t.data_ptr())
    assert fields, f"no mapping holds {t.data_ptr():#x}"
    return fields.get("THPeligible") == "1"


needs_madvise_mode = pytest.mark.skipif(pages.thp_mode() != "madvise",
                                        reason=f"THP is {pages.thp_mode()!r} here, not 'madvise'")


def test_zeros_is_torch_zeros_in_its_own_aligned_mapping():
    t = pages.zeros((3, 1000, 2, 3, 64), torch.bfloat16)
    assert t.shape == (3, 1000, 2, 3, 64) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert not t.any() and t.data_ptr() % pages.HUGE_PAGE == 0
    t[2, 999] = 1.5  # writable to its last element
    assert t.sum().item() == 1.5 * 2 * 3 * 64


@needs_madvise_mode
def test_the_advice_makes_a_mapping_eligible_and_the_switch_turns_it_off(monkeypatch):
    assert _eligible(pages.zeros((4 << 20,), torch.uint8))
    monkeypatch.setenv(pages.ENV_HUGE_PAGES, "0")
    off = pages.zeros((8 << 20,), torch.uint8)  # every page touched
    assert not _eligible(off) and pages.huge_page_bytes([off]) == 0
    assert int(pages.smaps_fields(off.data_ptr())["Rss"].split()[0]) >= 8 << 10  # kB: smaps is read right
    arena = pages.WeightArena()
    assert not arena.huge and not _eligible(arena.take(1000))


def test_the_arena_hands_out_aligned_disjoint_ranges_that_outlive_it():
    arena = pages.WeightArena()
    sizes = [1000, 80, pages.ARENA_CHUNK - 5000, 3 * pages.ARENA_CHUNK, 64]  # the third and fourth need new chunks
    parts = [arena.take(n) for n in sizes]
    assert [p.numel() for p in parts] == sizes and all(p.data_ptr() % 64 == 0 for p in parts)
    spans = sorted((p.data_ptr(), p.data_ptr() + p.numel()) for p in parts)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])), "two ranges overlap"
    assert len(arena.chunks) == 3
    for i, p in enumerate(parts):
        p.fill_(i + 1)
    del arena
    gc.collect()
    assert all(bool((p == i + 1).all()) for i, p in enumerate(parts))


def test_packing_into_an_arena_gives_the_same_bytes():
    codes, d, m, _ = q4_weight(102, 576)
    arena = pages.WeightArena()
    assert torch.equal(pack_q4(codes, d, m, arena), pack_q4(codes, d, m))
    digits = pack_q4(codes, d, m, arena, layout="digits")
    assert torch.equal(digits, pack_q4(codes, d, m, layout="digits"))
    rng = np.random.default_rng(3)
    q8 = torch.from_numpy(rng.integers(-127, 128, (102, 576), dtype=np.int8))
    scales = torch.rand(102)
    (a, sa), (b, sb) = pack_q8(q8, scales, arena), pack_q8(q8, scales)
    assert torch.equal(a, b) and torch.equal(sa, sb) and a.dtype == torch.int8


def test_the_digit_layout_unpacks_to_the_files_codes_and_scales():
    """pack_q4's layout for the int8 digit kernels, read back as matmul_q4_digits.c reads it: per group of 16
    outputs and block, chunk k's low nibbles are inputs 4k..4k+3 and its high ones 16+4k.., byte 4n + t of
    output n; then 16 fp16 d, 16 fp16 m. 102 outputs: 7 groups, the last 10 outputs zero."""
    codes, d, m, _ = q4_weight(102, 576)
    rec = pack_q4(codes, d, m, layout="digits").numpy()
    assert rec.shape == (7, 18, 320)
    chunks = rec[:, :, :256].reshape(7, 18, 4, 16, 4)  # [group, block, k, n, t]
    inputs = np.concatenate([chunks & 15, chunks >> 4], axis=2)  # [group, block, 4 k + t / 4, n, t]
    back = inputs.transpose(0, 3, 1, 2, 4).reshape(112, 576)  # [output, input]
    assert (back[:102] == codes).all() and not back[102:].any()
    for at, want in ((256, d), (288, m)):
        got = rec[:, :, at:at + 32].copy().view(np.float16).transpose(0, 2, 1).reshape(112, 18).astype(np.float32)
        assert (got[:102] == want).all() and not got[102:].any()
    with pytest.raises(ValueError, match="layout 'rows' is not one of"):
        pack_q4(codes, d, m, layout="rows")


@needs_madvise_mode
def test_a_models_packed_weights_and_kv_pool_are_in_eligible_mappings(make_runner):
    runner = make_runner(num_blocks=64, dtype=torch.bfloat16, packed_decode=True)
    model = runner.model
    if model.weight_arena is None:
        pytest.skip("no native matmuls here: the packed weights are torch's")
    head = ([model.lm_head_int8.codes] if model.lm_head_int8 is not None
            else [p for _, p, _ in model.head_packed.segments])  # a quantized file's head stays in its rows
    packed = head + [layer[n].packed for layer in model.layers
                     for n in ("wqkv_packed", "wo_packed", "w13_packed", "w2_packed")]
    chunks = [(c.data_ptr(), c.data_ptr() + c.numel()) for c in model.weight_arena.chunks]
    assert all(any(lo <= t.data_ptr() and t.data_ptr() + t.numel() <= hi for lo, hi in chunks) for t in packed)
    assert all(_eligible(c) for c in model.weight_arena.chunks)
    assert _eligible(runner.cache.kv)


def test_a_kv_pool_larger_than_the_address_space_says_what_to_lower():
    import dataclasses

    from common.engine.kv_cache import KVCache
    from tests.support.checkpoints import TINY

    wide = dataclasses.replace(TINY, num_layers=1000, num_heads=64, num_kv_heads=64, head_dim=256)  # 1 GiB a block
    with pytest.raises(MemoryError, match=r"KV pool \(200000 blocks of 16 tokens, [\d.]+ GiB\).*--kv-memory-gib"):
        KVCache(wide, 200_000, 16, torch.bfloat16)  # 195 TiB: past any address space


def test_a_files_pages_leave_the_resident_set_once_read_and_come_back_the_same(tmp_path):
    """drop_file_pages: what a loader read from a memory-mapped file leaves this process's resident set (a
    decode worker's memory is its packed copy, not that and the file too), a later read gets the same bytes,
    and memory that is not a file mapping is left alone (the advice would zero it)."""
    path = tmp_path / "weights.bin"
    data = np.random.default_rng(0).integers(0, 256, 16 << 20, dtype=np.uint8)
    data.tofile(path)
    mapped = np.memmap(path, mode="r")
    view = np.asarray(mapped[1000:(12 << 20) + 1000])  # as the GGUF reader's tensors are: views of the map
    digest = int(view.astype(np.uint64).sum())  # touches every page

    def resident_kib() -> int:
        return int(pages.smaps_fields(view.__array_interface__["data"][0])["Rss"].split()[0])

    assert resident_kib() >= 12 << 10
    dropped = pages.drop_file_pages(view)
    assert dropped >= (12 << 20) - 2 * 4096 and dropped % 4096 == 0  # whole pages inside the view only
    assert resident_kib() <= 4 << 10  # at most the huge pages the view's two ends share with the rest (tmpfs)
    assert int(view.astype(np.uint64).sum()) == digest and (view == data[1000:(12 << 20) + 1000]).all()

    anonymous = data.copy()
    assert pages.drop_file_pages(anonymous) == 0 and (anonymous == data).all()
