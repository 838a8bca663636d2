"""The K-quant and Q8_0 kernels (common/engine/native/csrc/matmul_kquants.c, kquant_rows.c, matmul_dispatch.c
through bindings.py and quant_linear.py) on their own.

Weights are random but valid GGUF blocks (random bytes, their fp16 d and dmin set to sane finite values), as
a Q4_K_M, Q5_K_M, Q6_K or Q8_0 file holds them. Against gguf.quants.dequantize (the reference for every GGML
type): the packed rows read back bit for bit, the product within the error the 16-bit activation quantization
allows of the float64 product. For invariant 4 (same prompt, parameters and seed, same tokens): a row's output
is the same bits alone or in any batch of 1-40 rows, on any number of threads, by the AVX2 unit or the
AVX512_VNNI one, in this host's build or the image's portable one.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize

from common.engine.native.bindings import HnWeight
from common.engine.native.choice import Q4_INDEX, quant_unit
from common.engine.native.header import DEFINES
from common.engine.native.packing import QUANT_FORMATS, pack_q4, pack_quant, quant_block, quant_shape
from common.engine.pages import WeightArena
from common.engine.quant_linear import QuantLinear
from common.engine.weights import QuantRows
from tests.support.native import native_kernels, other_build

QTYPES = ("Q8_0", "Q4_K", "Q5_K", "Q6_K")
XD_MAX = 32639.0  # the int8 digit kernels' activation integers: 127 * 256 + 127
GROUP = 32


def random_rows(qtype: str, out_features: int, in_features: int, seed: int = 0) -> QuantRows:
    """Random valid blocks: every byte random (codes, 6-bit scales and mins, int8 scales of either sign),
    but the fp16 d (and dmin) uniform in a sane range, d of either sign where the format allows it."""
    rng = np.random.default_rng(seed)
    inputs, nbytes = quant_block(qtype)
    blocks = rng.integers(0, 256, (out_features, in_features // inputs, nbytes), dtype=np.uint8)
    halves = {"Q8_0": ((0, -0.01, 0.01),), "Q4_K": ((0, 0.0, 0.002), (2, 0.0, 0.004)),
              "Q5_K": ((0, 0.0, 0.002), (2, 0.0, 0.004)), "Q6_K": ((208, -0.001, 0.001),)}[qtype]
    for at, lo, hi in halves:
        d = rng.uniform(lo, hi, blocks.shape[:2]).astype(np.float16)
        blocks[:, :, at:at + 2] = d.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return QuantRows(qtype, blocks.reshape(out_features, -1), in_features)


def reference(rows: QuantRows) -> np.ndarray:
    """gguf's dequantization of the rows: fp32 [out, in]."""
    return dequantize(rows.data, GGMLQuantizationType[rows.qtype]).reshape(rows.rows, rows.cols)


def activations(rows: int, in_features: int, seed: int = 1, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows of x with uneven channel scales and an outlier (it coarsens only its own block's quantization)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen) * torch.rand(1, in_features, generator=gen) * 4
    x[min(2, rows - 1), 40] = 300.0
    return x.to(dtype)


def quant_error_bound(x: torch.Tensor, dense: np.ndarray) -> np.ndarray:
    """|y - x @ W^T| allowed per [row, output]: each block of 32 of a row rounded to 1/XD_MAX of its largest
    |x| (half a step at most an element), plus fp32 accumulation slack."""
    xd = x.double().numpy()
    step = np.abs(xd.reshape(x.shape[0], -1, GROUP)).max(-1) / XD_MAX  # [rows, blocks]
    wb = np.abs(dense.astype(np.float64)).reshape(dense.shape[0], -1, GROUP).sum(-1)  # [out, blocks]
    return 0.5 * step @ wb.T + 1e-5 * (np.abs(xd) @ np.abs(dense.astype(np.float64)).T) + 1e-6


def units(k) -> list[str]:
    return ["avx2"] + ["vnni", "amx"] * k.has_vnni


def quant_kernels():
    k = native_kernels()
    if not k.has_quant:
        pytest.skip("this build has no int8 digit kernels (the compiler is not GCC 11+, or the build has no AVX2)")
    return k


@pytest.mark.parametrize("qtype", QTYPES)
def test_packing_moves_the_files_bytes_and_rows_read_back_as_gguf_dequantizes_them(qtype):
    """pack_quant's records are the file's bytes, moved (16 x the block's bytes a record, and Q6_K's 32 zero
    bytes: none changed, the same multiset of bytes, the padding outputs and bytes zero); kq_dequant_rows reads
    any rows back, in any order, to gguf.quants.dequantize's fp32 values bit for bit; in an arena as well."""
    k = native_kernels()
    out, cols = 37, 768 if qtype != "Q8_0" else 160  # the last group of 16 padded; 3 super-blocks (5 blocks)
    rows = random_rows(qtype, out, cols)
    packed = pack_quant(rows)
    assert tuple(packed.shape) == quant_shape(qtype, out, cols) and packed.dtype == torch.uint8
    records = packed.shape[0] * packed.shape[1]
    pad_bytes = {"Q6_K": 32}.get(qtype, 0)  # to a whole number of cache lines
    assert packed.numel() == 48 * rows.data.shape[1] + records * pad_bytes  # 3 groups of 16 rows: the file's bytes
    padding = np.zeros((48 - out) * rows.data.shape[1] + records * pad_bytes, np.uint8)
    assert np.array_equal(np.sort(packed.numpy(), axis=None), np.sort(np.concatenate([rows.data.ravel(), padding])))
    want = reference(rows)
    ids = torch.tensor([36, 0, 17, 17, 5, 31, 16, 15])
    got = k.dequant_rows(packed, qtype, out, cols, ids)
    assert np.array_equal(got.numpy().view(np.uint32), want[ids.numpy()].view(np.uint32))
    everything = k.dequant_rows(packed, qtype, out, cols, torch.arange(out)).numpy()
    assert np.array_equal(everything.view(np.uint32), want.view(np.uint32))
    in_arena = pack_quant(rows, WeightArena(huge=False))
    assert torch.equal(in_arena, packed)
    with pytest.raises(RuntimeError, match="refused its arguments"):
        k.dequant_rows(packed, qtype, out, cols, torch.tensor([out]))  # past the last row


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_product_is_the_files_weights_times_x_within_the_quantization_error(qtype, dtype):
    """Each unit's product of x with the packed weight: within the 16-bit activations' rounding of the exact
    product of x with gguf's dequantized weight (float64), and far inside it at the median; a bf16 result is
    the fp32 one rounded. The units give each other's bits."""
    k = quant_kernels()
    out, cols = 37, 768 if qtype != "Q8_0" else 160
    rows = random_rows(qtype, out, cols, seed=2)
    dense = reference(rows)
    packed = pack_quant(rows)
    x = activations(7, cols, dtype=dtype)
    exact = x.double().numpy() @ dense.astype(np.float64).T
    bound = quant_error_bound(x, dense) + (np.abs(exact) / 128 if dtype == torch.bfloat16 else 0)  # bf16 out
    results = {}
    for unit in units(k):
        y = k.quant_matmul(x, packed, qtype, out, unit)
        assert y.shape == (7, out) and y.dtype == dtype
        err = np.abs(y.double().numpy() - exact)
        assert (err <= bound).all(), f"{unit}: worst error {err.max():.3g} against {bound.flat[err.argmax()]:.3g}"
        if dtype == torch.float32:
            assert np.median(err / (np.abs(x.double().numpy()) @ np.abs(dense.astype(np.float64)).T)) < 1e-5
        else:
            assert torch.equal(y, k.quant_matmul(x.float(), packed, qtype, out, unit).to(torch.bfloat16))
        results[unit] = y
    for unit, y in results.items():
        assert torch.equal(y, results["avx2"]), unit


@pytest.mark.parametrize("qtype", QTYPES)
def test_a_row_is_the_same_bits_alone_or_in_any_batch_on_any_unit_and_threads(qtype):
    """Invariant 4 at its root: batches of 1 to 40 rows (every tile: 4, 3, 2, 1 rows) on 1, 2 or 7 threads
    (more than the cores: threads take each other's parts), by every unit, give each row the bits it gets
    alone by the AVX2 unit on one thread. 200 outputs: 12 groups of 16 and one of 8."""
    k = quant_kernels()
    cols = 512 if qtype != "Q8_0" else 96
    packed = pack_quant(random_rows(qtype, 200, cols, seed=3))
    x = activations(40, cols, seed=4)  # fp32 out: every bit of the sums shows (bf16 would round most away)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([k.quant_matmul(x[i:i + 1], packed, qtype, 200, "avx2") for i in range(40)])
        for n_threads in (1, 2, 7):
            torch.set_num_threads(n_threads)
            for unit in units(k):
                for bsz in range(1, 41):
                    start = (7 * bsz) % (41 - bsz)  # each batch a different slice of the 40 rows
                    y = k.quant_matmul(x[start:start + bsz], packed, qtype, 200, unit)
                    assert torch.equal(y, alone[start:start + bsz]), (unit, bsz, n_threads)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("qtype", QTYPES)
def test_a_nan_or_inf_in_a_row_reaches_its_outputs_and_no_other_row(qtype):
    """A non-finite activation is not quantized away into a plausible number: its block's scale is NaN, so
    the row's outputs are NaN; the other rows keep their bits."""
    k = quant_kernels()
    cols = 512 if qtype != "Q8_0" else 96
    packed = pack_quant(random_rows(qtype, 40, cols, seed=5))
    x = activations(3, cols, seed=6)
    for unit in units(k):
        clean = k.quant_matmul(x, packed, qtype, 40, unit)
        for bad in (float("nan"), float("inf"), float("-inf")):
            x_bad = x.clone()
            x_bad[1, 17] = bad
            y = k.quant_matmul(x_bad, packed, qtype, 40, unit)
            assert torch.isnan(y[1]).all(), (unit, bad)
            assert torch.equal(y[0], clean[0]) and torch.equal(y[2], clean[2])
        assert not k.quant_matmul(torch.zeros(1, cols), packed, qtype, 40, unit).any()


@pytest.mark.parametrize("march", ["x86-64", "x86-64-v3"], ids=["plain-c", "portable-avx2"])
def test_other_builds_compute_the_same_bits(tmp_path, march):
    """The image's portable AVX2 build runs both units, with this host's native build's bits (its AVX2 unit
    gives what the native build's widest unit gives); a build without AVX2 (plain C) has no kernel for them
    (the model keeps such a weight dense) but reads the rows back with the same bits."""
    k = quant_kernels()
    other = other_build(tmp_path, march)
    assert other.has_quant == (march == "x86-64-v3")
    for qtype in QTYPES:
        cols = 512 if qtype != "Q8_0" else 96
        rows = random_rows(qtype, 36, cols, seed=7)
        packed = pack_quant(rows)
        ids = torch.tensor([35, 3, 20])
        assert torch.equal(other.dequant_rows(packed, qtype, 36, cols, ids),
                           k.dequant_rows(packed, qtype, 36, cols, ids))
        if not other.has_quant:
            with pytest.raises(RuntimeError, match="code -38"):  # -ENOSYS
                other.quant_matmul(torch.randn(1, cols), packed, qtype, 36, "avx2")
            continue
        for rows_n in (1, 6, 17):
            for dtype in (torch.float32, torch.bfloat16):
                x = activations(rows_n, cols, seed=rows_n, dtype=dtype)
                mine = k.quant_matmul(x, packed, qtype, 36, units(k)[-1])
                for unit in units(other):
                    y = other.quant_matmul(x, packed, qtype, 36, unit)
                    assert torch.equal(y, mine), (qtype, unit, rows_n, dtype)


def test_hn_matmul_runs_every_format_by_the_kernel_its_descriptor_names():
    """The one matmul entry (layers.c's): each format and unit gives what that kernel gives directly; a fused
    matrix of parts in different formats (HN_PARTS) gives each part's columns; what no kernel takes is
    refused."""
    k = quant_kernels()
    x = activations(5, 512, seed=8)
    for qtype in QTYPES:
        packed = pack_quant(random_rows(qtype, 40, 512, seed=9))
        for unit in units(k):
            w = HnWeight(QUANT_FORMATS[qtype], Q4_INDEX[unit], packed.data_ptr(), None, 40, 512)
            assert torch.equal(k.hn_matmul(x, w), k.quant_matmul(x, packed, qtype, 40, unit)), (qtype, unit)
        for unit in ("int", "f32", "bf16dot"):  # the Q4 kernels' units take no K-quant
            with pytest.raises(RuntimeError, match="refused its arguments"):
                k.hn_matmul(x, HnWeight(QUANT_FORMATS[qtype], Q4_INDEX[unit], packed.data_ptr(), None, 40, 512))
    rng = np.random.default_rng(10)
    codes = rng.integers(0, 16, (40, 512), dtype=np.uint8)
    d = rng.uniform(0.001, 0.05, (40, 16)).astype(np.float16).astype(np.float32)
    for kernel in ("int", "f32", "avx2"):
        q4 = pack_q4(codes, d, -8 * d, layout="digits" if kernel == "avx2" else "quads")
        w = HnWeight(DEFINES["HN_Q4"], Q4_INDEX[kernel], q4.data_ptr(), None, 40, 512)
        assert torch.equal(k.hn_matmul(x, w), k.q4_matmul(x, q4, 40, kernel)), kernel
    with pytest.raises(RuntimeError, match="refused its arguments"):
        k.hn_matmul(x, HnWeight(99, Q4_INDEX["avx2"], q4.data_ptr(), None, 40, 512))


def test_a_fused_matrix_of_parts_in_different_formats_is_each_parts_product():
    """QuantLinear over a Q4_K_M file's wqkv (q and k in Q4_K, v in Q6_K): q and k packed as one matrix, v as
    another; its product the parts' products side by side, by itself and through its descriptor (the layer
    stack's hn_weight_t), with a row's bits whatever the batch."""
    k = quant_kernels()
    q, kk, v = random_rows("Q4_K", 64, 512, 11), random_rows("Q4_K", 16, 512, 12), random_rows("Q6_K", 16, 512, 13)
    unit = quant_unit("auto", k)
    wqkv = QuantLinear.create([q, kk, v], k, unit, WeightArena(huge=False))
    assert [(qtype, out) for qtype, _, out in wqkv.segments] == [("Q4_K", 80), ("Q6_K", 16)]
    assert wqkv.out_features == 96 and wqkv.nbytes == 80 * q.data.shape[1] + 16 * v.data.shape[1] + 2 * 32  # Q6_K pad
    for dtype in (torch.float32, torch.bfloat16):
        x = activations(6, 512, seed=14, dtype=dtype)
        y = wqkv(x)
        parts = [k.quant_matmul(x, pack_quant(r), r.qtype, r.rows, unit) for r in (q, kk, v)]
        assert torch.equal(y, torch.cat(parts, dim=1)), dtype
        assert torch.equal(k.hn_matmul(x, HnWeight.of(wqkv.descriptor())), y), dtype
        assert torch.equal(torch.cat([wqkv(x[i:i + 1]) for i in range(6)]), y), dtype
    with pytest.raises(ValueError, match="several formats"):
        wqkv.rows(torch.tensor([0]))


def test_quant_linear_is_the_kernel_on_the_files_rows_and_reads_them_back():
    """One matrix (an embedding / LM head in Q6_K): its product the kernel's, its descriptor names it, its
    rows the file's values; formats without a kernel here stay dense (create answers None)."""
    k = quant_kernels()
    head = random_rows("Q6_K", 50, 512, seed=15)
    unit = quant_unit("avx2", k)
    lin = QuantLinear.create([head], k, unit)
    x = activations(3, 512, seed=16)
    assert torch.equal(lin(x), k.quant_matmul(x, pack_quant(head), "Q6_K", 50, unit))
    fmt, unit_index, packed, scale, out, cols = lin.descriptor()
    assert (fmt, unit_index, scale, out, cols) == (QUANT_FORMATS["Q6_K"], Q4_INDEX[unit], None, 50, 512)
    assert torch.equal(k.hn_matmul(x, HnWeight.of(lin.descriptor())), lin(x))
    ids = torch.tensor([49, 7, 7])
    assert np.array_equal(lin.rows(ids).numpy().view(np.uint32), reference(head)[ids.numpy()].view(np.uint32))
    q3 = QuantRows("Q3_K", np.zeros((16, 110 * 2), np.uint8), 512)
    assert QuantLinear.create([q3], k, unit) is None
    assert QuantLinear.create([head, random_rows("Q8_0", 16, 256)], k, unit) is None  # inputs differ
    assert QuantLinear.create([head], None, unit) is None


def test_bad_arguments_are_refused_with_a_reason():
    k = quant_kernels()
    rows = random_rows("Q4_K", 20, 512)
    packed = pack_quant(rows)
    with pytest.raises(ValueError, match="not whole Q4_K blocks of 256"):
        k.quant_matmul(torch.randn(2, 480), packed, "Q4_K", 20)
    with pytest.raises(ValueError, match=r"\(2, 2, 2304\) torch.uint8, where these sizes are \(1, 2, 2304\)"):
        k.quant_matmul(torch.randn(2, 512), packed, "Q4_K", 16)
    with pytest.raises(ValueError, match="Q3_K by 'avx2'"):
        k.quant_matmul(torch.randn(2, 512), packed, "Q3_K", 20, "avx2")
    with pytest.raises(ValueError, match="Q4_0 is not one of"):
        pack_quant(QuantRows("Q4_0", np.zeros((4, 18 * 16), np.uint8), 512))
    with pytest.raises(ValueError, match="whole blocks of 256"):
        pack_quant(QuantRows("Q4_K", np.zeros((4, 144), np.uint8), 200))
    assert k.quant_matmul(torch.randn(0, 512), packed, "Q4_K", 20).shape == (0, 20)
    # The library checks too, for its other callers (layers.c): a K-quant's inputs in whole super-blocks
    with pytest.raises(RuntimeError, match="refused its arguments"):
        k._matmul("kq_matmul", torch.randn(2, 480), (packed,), 20, torch.float32,
                  (QUANT_FORMATS["Q4_K"], Q4_INDEX["avx2"]))
