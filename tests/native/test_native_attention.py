"""The native decode-attention kernel (common/engine/native/csrc/attention.c) on its own.

Against the eager path it replaces (gather, widen to fp32, SDPA with a mask), and for the property
invariant 4 (same inputs, same tokens) needs of it: a row's output is the same bits whatever the
other rows, wherever its blocks lie in the cache, and however the rows are split between threads.
"""
from __future__ import annotations

import logging
import shutil

import pytest
import torch
import torch.nn.functional as F

from common.engine.native import bindings, build
from common.engine.native.__main__ import main
from tests.support.native import native_kernels, other_build

BLOCK = 16
HEADS, KV_HEADS, DIM = 9, 3, 64  # SmolLM2's shape


def _case(dtype, lens: list[int], seed: int = 0):
    """A layer cache with every row's blocks scattered at random, and q as the view of a qkv row."""
    gen = torch.Generator().manual_seed(seed)
    width = -(-max(lens) // BLOCK)
    num_blocks = len(lens) * width + 3
    kv = torch.randn(num_blocks * BLOCK + 1, 2, KV_HEADS, DIM, generator=gen).to(dtype)
    kv[-1] = 0  # the null slot, as KVCache keeps it
    order = torch.randperm(num_blocks, generator=gen)[:len(lens) * width].view(len(lens), width)
    tables = order.contiguous()
    qkv = torch.randn(len(lens), (HEADS + 2 * KV_HEADS) * DIM, generator=gen).to(dtype)
    q = qkv[:, :HEADS * DIM].view(len(lens), HEADS, DIM)  # rows strided, as in the model
    return q, kv, tables, torch.tensor(lens)


def _eager(q, kv, tables, lens):
    """The model's eager decode attention (model.py _decode_attention) on the same inputs."""
    span = -(-int(lens.max()) // 64) * 64
    null = kv.shape[0] - 1
    slots = (tables[:, :, None] * BLOCK + torch.arange(BLOCK)).view(len(lens), -1)
    if slots.shape[1] < span:
        slots = torch.cat([slots, torch.full((len(lens), span - slots.shape[1]), null)], 1)
    slots = slots[:, :span]
    attend = torch.arange(span)[None, :] < lens[:, None]
    slots = slots.masked_fill(~attend, null)
    ctx = kv.index_select(0, slots.reshape(-1)).view(len(lens), span, 2, KV_HEADS, DIM)
    kb = ctx[:, :, 0].transpose(1, 2).float()
    vb = ctx[:, :, 1].transpose(1, 2).float()
    o = F.scaled_dot_product_attention(q.unsqueeze(2).float(), kb, vb, attn_mask=attend[:, None, None, :],
                                       enable_gqa=True)
    return o.squeeze(2)


def _run(k, q, kv, tables, lens):
    return k.attention(q, kv, tables, lens, int(lens.max()), BLOCK, DIM ** -0.5)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
def test_the_kernel_computes_what_the_eager_path_does(dtype, atol):
    k = native_kernels()
    lens = [1, 2, 15, 16, 17, 64, 100, 333, 1030]
    q, kv, tables, lens_t = _case(dtype, lens)
    got = _run(k, q, kv, tables, lens_t)
    assert got.dtype == dtype and got.shape == q.shape
    want = _eager(q, kv, tables, lens_t)
    # fp32: both accumulate in fp32 (other orders); bf16: the output is rounded to bf16 (8 bits)
    torch.testing.assert_close(got.float(), want, rtol=0 if dtype == torch.float32 else 1e-2, atol=atol)
    # A context of one position is that position's V, exactly.
    v0 = kv[tables[0, 0] * BLOCK, 1].float().repeat_interleave(HEADS // KV_HEADS, dim=0)
    torch.testing.assert_close(got[0].float(), v0.to(dtype).float(), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_row_is_the_same_bits_alone_in_a_batch_split_between_threads_and_moved(dtype, monkeypatch):
    """Invariant 4 for the kernel: neither the other rows, nor the thread split, nor where the row's
    blocks lie changes a bit of its output."""
    k = native_kernels()
    lens = [5, 700, 64, 65, 1, 300, 129, 17] * 4  # 32 rows: a batch large enough to split
    q, kv, tables, lens_t = _case(dtype, lens, seed=1)
    monkeypatch.setattr(bindings, "SPLIT_MIN_WORK", 1 << 62)
    one_thread = _run(k, q, kv, tables, lens_t)
    monkeypatch.setattr(bindings, "SPLIT_MIN_WORK", 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the split path runs whatever the host's default
    try:
        split = _run(k, q, kv, tables, lens_t)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, split)
    for row in (0, 1, 7, 31):
        alone = _run(k, q[row:row + 1], kv, tables[row:row + 1], lens_t[row:row + 1])
        assert torch.equal(alone[0], one_thread[row]), f"row {row} differs alone"
    # Row 1's K/V copied into other blocks (its own, in reverse order): positions map to other slots.
    row, used = 1, -(-lens[1] // BLOCK)
    new_blocks = tables[row].flip(0)
    moved_kv = kv.clone()
    for b in range(used):
        src, dst = int(tables[row, b]), int(new_blocks[b])
        moved_kv[dst * BLOCK:(dst + 1) * BLOCK] = kv[src * BLOCK:(src + 1) * BLOCK]
    moved = _run(k, q[row:row + 1], moved_kv, new_blocks[None, :].contiguous(), lens_t[row:row + 1])
    assert torch.equal(moved[0], one_thread[row])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_one_row_split_by_positions_and_dims_is_the_same_bits_as_by_heads(dtype, monkeypatch):
    """One row on two threads (decode at one stream, from ROW_SPLIT_MIN = 128 positions) splits its positions
    between the threads for the scores and its dims for V, where a batch splits (row, head) items: the same
    bits as the row gets on one thread and inside a batch, at lengths around the switch and the blocks,
    scattered blocks included."""
    k = native_kernels()
    lens = [127, 128, 129, 144, 200, 1030, 2049]
    q, kv, tables, lens_t = _case(dtype, lens, seed=7)
    monkeypatch.setattr(bindings, "SPLIT_MIN_WORK", 0)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch = _run(k, q, kv, tables, lens_t)
        split = [_run(k, q[r:r + 1], kv, tables[r:r + 1], lens_t[r:r + 1])[0] for r in range(len(lens))]
        torch.set_num_threads(1)
        alone = [_run(k, q[r:r + 1], kv, tables[r:r + 1], lens_t[r:r + 1])[0] for r in range(len(lens))]
    finally:
        torch.set_num_threads(threads)
    for r, n in enumerate(lens):
        assert torch.equal(split[r], alone[r]), f"{n} positions: two threads differ from one"
        assert torch.equal(split[r], batch[r]), f"{n} positions: alone differs from inside the batch"
    torch.testing.assert_close(torch.stack(split).float(), _eager(q, kv, tables, lens_t),
                               rtol=0 if dtype == torch.float32 else 1e-2, atol=1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_batch_of_mixed_contexts_handed_out_by_cost_is_the_same_bits(dtype, monkeypatch):
    """A batch's work goes to the threads one unit at a time, the dearest first: a whole row, or one KV
    head's query heads of a row longer than half a thread's share of the positions (here the 2,000- and
    1,500-position rows are split, the others not). Every row gets the bits it gets alone on one thread,
    whoever took its units, on 2 and on 3 threads."""
    k = native_kernels()
    lens = [5, 2000, 17, 300, 1500, 1, 64, 129]
    q, kv, tables, lens_t = _case(dtype, lens, seed=9)
    monkeypatch.setattr(bindings, "SPLIT_MIN_WORK", 0)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [_run(k, q[r:r + 1], kv, tables[r:r + 1], lens_t[r:r + 1])[0] for r in range(len(lens))]
        for n in (2, 3):
            torch.set_num_threads(n)
            batch = _run(k, q, kv, tables, lens_t)
            for r, want in enumerate(alone):
                assert torch.equal(batch[r], want), f"row {r} ({lens[r]} positions) on {n} threads"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("extra", [("-mno-avx2",), ()], ids=["plain-c", "portable-avx2"])
def test_other_builds_compute_the_same_bits(tmp_path, extra):
    """The plain C loops, the AVX2 kernel (8 positions' scores side by side, V's sums in registers by half
    rows) and this host's build (AVX-512 where it has it: 16 positions, whole rows) sum in one order: a
    worker's tokens do not depend on which build or CPU it runs. Lengths cross the 8- and 16-position chunks
    and the blocks; rows split between threads and not. The plain loops are built with FMA (x86-64-v3 less
    AVX2), as every build the project ships: a build without FMA (-march=x86-64) rounds each product before
    adding it, other bits in fp32."""
    k = native_kernels()
    other = other_build(tmp_path, "x86-64-v3", extra)
    lens = [1, 7, 8, 9, 15, 16, 17, 31, 33, 100, 1030]
    threads = torch.get_num_threads()
    try:
        for dtype in (torch.float32, torch.bfloat16):
            q, kv, tables, lens_t = _case(dtype, lens, seed=5)
            for n in (1, 2):
                torch.set_num_threads(n)
                assert torch.equal(_run(other, q, kv, tables, lens_t), _run(k, q, kv, tables, lens_t)), (dtype, n)
            # one row of 1,030 positions on two threads: the positions split for the scores, the dims for V
            assert torch.equal(_run(other, q[-1:], kv, tables[-1:], lens_t[-1:]),
                               _run(k, q[-1:], kv, tables[-1:], lens_t[-1:])), dtype
    finally:
        torch.set_num_threads(threads)


def test_non_finite_values_outside_a_row_do_not_reach_it():
    """Blocks a row does not own may hold anything (a previous owner's K/V, a rejected push): the
    kernel reads positions 0 .. len-1 only."""
    k = native_kernels()
    q, kv, tables, lens_t = _case(torch.bfloat16, [20, 40])
    clean = _run(k, q, kv, tables, lens_t)
    poisoned = kv.clone()
    # Row 0's second block past position 19 and every block row 0 does not own.
    owned = {int(tables[0, 0]), int(tables[0, 1])}
    for b in range(poisoned.shape[0] // BLOCK):
        if b not in owned:
            poisoned[b * BLOCK:(b + 1) * BLOCK] = float("nan")
    second = int(tables[0, 1])
    poisoned[second * BLOCK + 4:(second + 1) * BLOCK] = float("inf")  # positions 20..31 of row 0
    got = _run(k, q[:1], poisoned, tables[:1], lens_t[:1])
    assert torch.equal(got[0], clean[0])


def test_no_compiler_means_the_eager_path_and_a_warning_that_says_so(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", "no-such-compiler-handoff")
    monkeypatch.setenv(build.ENV_CACHE, str(tmp_path))
    with pytest.raises(RuntimeError, match="no C compiler 'no-such-compiler-handoff' on PATH"):
        build.build_host()
    build.kernel.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="common.engine.native"):
            assert build.kernel() is None
        assert "eager path" in caplog.text and "install gcc, or set CC" in caplog.text
    finally:
        build.kernel.cache_clear()


def test_a_compiler_error_is_reported_with_the_compilers_message(monkeypatch, tmp_path):
    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    bad = tmp_path / "csrc"
    bad.mkdir()
    (bad / "attention.c").write_text("int broken( {\n")
    monkeypatch.setattr(build, "CSRC", bad)
    monkeypatch.setenv(build.ENV_CACHE, str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match="failed building the native library from .*csrc: .*error"):
        build.build_host()
    assert not [p for p in (tmp_path / "cache").iterdir() if p.suffix == ".so"], "a failed build left a library"


def test_the_switch_turns_the_kernel_off(monkeypatch):
    monkeypatch.setenv(build.ENV_SWITCH, "0")
    build.kernel.cache_clear()
    try:
        assert build.kernel() is None
    finally:
        build.kernel.cache_clear()


def test_builds_are_kept_per_cpu_and_source(monkeypatch, tmp_path):
    """A second build finds the first; another CPU's flags (a shared home folder) get their own file."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv(build.ENV_CACHE, str(tmp_path))
    first = build.build_host()
    mtime = first.stat().st_mtime_ns
    assert build.build_host() == first and first.stat().st_mtime_ns == mtime
    monkeypatch.setattr(build, "cpu_flags", lambda: frozenset({"avx2", "another-host"}))
    assert build.build_host() != first


def test_the_portable_library_an_image_ships_loads_and_computes_the_same(tmp_path, monkeypatch):
    """`python -m common.engine.native --portable OUT` (deploy/Dockerfile), loaded through
    HANDOFF_NATIVE_LIBRARY as a compiler-less pod does. Its attention sums 8 positions' scores side by
    side (AVX2), an AVX-512 build 16: the same bits, so a pod's tokens do not depend on which library it
    loaded."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    host = native_kernels()  # this host's own build, before the environment points elsewhere
    out = tmp_path / "decode_kernels.so"
    assert main(["--portable", str(out)]) == 0 and out.exists()
    monkeypatch.setenv(build.ENV_LIBRARY, str(out))
    monkeypatch.setenv("CC", "no-such-compiler-handoff")  # the pod has none: nothing may try to build
    build.kernel.cache_clear()
    try:
        k = build.kernel()
        assert k is not None and k.path == out
        q, kv, tables, lens = _case(torch.float32, [3, 90, 400])
        torch.testing.assert_close(_run(k, q, kv, tables, lens), _eager(q, kv, tables, lens), rtol=0, atol=1e-5)
        for dtype in (torch.float32, torch.bfloat16):
            q, kv, tables, lens = _case(dtype, [1, 15, 16, 17, 90, 400, 1031], seed=3)
            assert torch.equal(_run(k, q, kv, tables, lens), _run(host, q, kv, tables, lens)), dtype
    finally:
        build.kernel.cache_clear()


@pytest.mark.parametrize("rows, threads", [(1, 1), (1, 2), (2, 2)], ids=["one-thread", "row-split", "items-split"])
def test_a_failed_allocation_is_out_of_memory_not_refused_arguments(rows, threads, monkeypatch):
    """The kernel's scratch for a context no host can hold (2**45 positions: petabytes of scores) cannot be
    allocated. That is MemoryError, as every other kernel reports it; the attention kernel's own code for it
    was read as "refused its arguments", which sends whoever debugs it after a bad call, not a full host."""
    k = native_kernels()
    q, kv, tables, _ = _case(torch.float32, [16] * rows)
    lens = torch.full((rows,), 1 << 45, dtype=torch.int64)
    monkeypatch.setattr(bindings, "SPLIT_MIN_WORK", 1 << 62 if threads == 1 else 0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with pytest.raises(MemoryError, match="attention: out of memory"):
            k.attention(q, kv, tables, lens, 1 << 45, BLOCK, DIM ** -0.5)
    finally:
        torch.set_num_threads(before)
