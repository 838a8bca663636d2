"""Decode's native weight matmuls (common/engine/native/csrc/matmul_*.c through bindings.py) on their own.

Against the exact product of the same weights (the GGUF Q4 blocks dequantized, the int8 LM head times its
scales) within the error the 16-bit activation quantization allows, and for what invariant 4 (same inputs,
same tokens) needs of them: a row's output is the same bits whatever the other rows, however many
threads split the outputs, and in the AVX2 build and the portable C one alike.
"""
from __future__ import annotations


import numpy as np
import pytest
import torch

from common.engine.native.bindings import DecodeKernels
from common.engine.native.choice import DIGIT_KERNELS, Q4_ENTRIES, Q4_KERNELS, Q4_LAYOUT
from common.engine.native.packing import pack_q4, pack_q8
from tests.support.native import native_kernels, other_build
from tests.support.native import q4_weight

GROUP = 32
XQ_MAX = 32767.0
XD_MAX = 32639.0  # the int8 digit kernels: 127 * 256 + 127


def _q4_case(dtype: torch.dtype, kernel: str = "int"):
    """102 outputs (the last quad padded) of random Q4 weights, packed for `kernel` and dense, and 7 rows of
    x with an outlier channel, as SmolLM2 has (it coarsens only its own block in the integer kernel)."""
    codes, d, m, dense = q4_weight(102, 576)
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(7, 576, generator=gen) * torch.rand(1, 576, generator=gen) * 4).to(dtype)
    x[2, 40] = 300.0
    return _pack(codes, d, m, kernel), dense, x


def _pack(codes, d, m, kernel: str = "int") -> torch.Tensor:
    return pack_q4(codes, d, m, layout=Q4_LAYOUT[kernel])


def _quant_error_bound(x: torch.Tensor, dense: np.ndarray, limit: float = XQ_MAX) -> np.ndarray:
    """|y - x @ W^T| allowed per [row, output]: each block of a row is rounded to 1/limit of its largest
    |x| (half a step at most per element), plus fp32 accumulation slack."""
    xb = x.double().numpy().reshape(x.shape[0], -1, GROUP)
    step = np.abs(xb).max(-1) / limit  # [rows, blocks]
    wb = np.abs(dense).reshape(dense.shape[0], -1, GROUP).sum(-1)  # [out, blocks]
    exact_scale = np.abs(x.double().numpy()) @ np.abs(dense).T
    return 0.5 * step @ wb.T + 1e-5 * exact_scale + 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_q4_is_the_files_weights_times_x_within_the_quantization_error(dtype):
    k = native_kernels()
    packed, dense, x = _q4_case(dtype)
    y = k.q4_matmul(x, packed, 102)
    assert y.shape == (7, 102) and y.dtype == dtype
    exact = x.double().numpy() @ dense.T
    bound = _quant_error_bound(x, dense) + (np.abs(exact) / 128 if dtype == torch.bfloat16 else 0)  # bf16 out
    err = np.abs(y.double().numpy() - exact)
    assert (err <= bound).all(), f"worst error {err.max():.3g} against its bound {bound.flat[err.argmax()]:.3g}"
    # Far closer than bf16 activations would be (~2^-9 of each element):
    if dtype == torch.float32:
        assert np.median(err / (np.abs(x.double().numpy()) @ np.abs(dense).T)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_q8_is_codes_times_scales_times_x(dtype):
    """The LM head quantizes each row whole, to 1/32767 of its largest |x|: every output within half that
    step times the row's sum of |w|, and the median far inside it. 5 rows, one with an outlier (it coarsens
    its whole row), 1001 outputs (the last quad padded), 2,080 inputs (two chunks of int32 sums, the second
    partial)."""
    k = native_kernels()
    gen = torch.Generator().manual_seed(2)
    codes = torch.randint(-127, 128, (1001, 2080), dtype=torch.int8, generator=gen)
    scales = torch.rand(1001, generator=gen) * 0.01 + 1e-4
    packed, packed_scales = pack_q8(codes, scales)
    x = torch.randn(5, 2080, generator=gen).to(dtype)
    x[3, 100] = 300.0
    y = k.q8_matmul(x, packed, packed_scales, 1001)
    dense = (codes.double() * scales.double()[:, None]).numpy()
    xd = x.double().numpy()
    exact = xd @ dense.T
    err = np.abs(y.double().numpy() - exact)
    step = np.abs(xd).max(1, keepdims=True) / XQ_MAX  # [rows, 1]
    bound = 0.5 * step * np.abs(dense).sum(1)[None, :] + 1e-6 * (np.abs(xd) @ np.abs(dense).T) + 1e-9
    assert y.dtype == torch.float32 and (err <= bound).all(), f"worst error {err.max():.3g}"
    assert np.median(err / bound) < 0.1
    # The quantization error, not a defect, sets the error: the outlier's row errs more than the others.
    assert np.median(err[3]) > 3 * np.median(np.delete(err, 3, axis=0))


def test_q8_a_nan_or_inf_makes_its_row_nan_and_no_other():
    k = native_kernels()
    packed, scales = pack_q8(torch.randint(-127, 128, (40, 576), dtype=torch.int8), torch.rand(40) * 0.01)
    x = torch.randn(3, 576)
    clean = k.q8_matmul(x, packed, scales, 40)
    for bad in (float("nan"), float("inf"), float("-inf")):
        x_bad = x.clone()
        x_bad[1, 17] = bad
        y = k.q8_matmul(x_bad, packed, scales, 40)
        assert torch.isnan(y[1]).all(), bad
        assert torch.equal(y[0], clean[0]) and torch.equal(y[2], clean[2])
    assert not k.q8_matmul(torch.zeros(1, 576), packed, scales, 40).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_row_is_the_same_bits_whatever_the_batch_and_the_threads(dtype):
    """Invariant 4 at its root for the matmuls: batches of 1 to 32 rows (every tile shape: 3, 2 and 1 rows)
    and 1 or 2 threads give each row the bits it gets alone on one thread."""
    k = native_kernels()
    codes, d, m, _ = q4_weight(200, 1536, seed=3)
    packed = pack_q4(codes, d, m)
    head, head_scales = pack_q8(torch.randint(-127, 128, (500, 1536), dtype=torch.int8),
                                       torch.rand(500) * 0.01)
    gen = torch.Generator().manual_seed(4)
    rows = (torch.randn(32, 1536, generator=gen) * 3).to(dtype)
    _assert_rows_batch_invariant({"q4": lambda x: k.q4_matmul(x, packed, 200),
                                  "q8": lambda x: k.q8_matmul(x, head, head_scales, 500)}, rows, gen)


def _assert_rows_batch_invariant(matmuls: dict, rows: torch.Tensor, gen: torch.Generator) -> None:
    """Each of `matmuls` gives every row, in batches of 2 to 32 rows (every tile shape) on 1 or 2 threads,
    the bits it gets alone on one thread."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = {name: [f(rows[i:i + 1])[0] for i in range(len(rows))] for name, f in matmuls.items()}
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            for bsz in (2, 3, 4, 5, 13, 32):
                idx = torch.randperm(len(rows), generator=gen)[:bsz]
                for name, f in matmuls.items():
                    y = f(rows[idx])
                    for r, i in enumerate(idx.tolist()):
                        assert torch.equal(y[r], alone[name][i]), \
                            f"{name} row {i} differs at batch {bsz}, {n_threads} threads"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kernel", ["int", "f32", "avx2", "q8"])
def test_more_threads_than_cores_take_each_others_parts_and_every_output_once(kernel):
    """A matmul's threads each stream their own part and then take what is left of the others' from the back
    (matmul_threads.c, run_parts). With 7 threads on this machine's cores most parts wait for a thread the OS
    has not run yet, so they are taken by the others, from both ends at once: every output is computed, once,
    with the bits it gets on one thread, at 1, 3 and 9 rows."""
    k = native_kernels() if kernel != "avx2" else _avx2_digits_kernels()
    codes, d, m, _ = q4_weight(1000, 576, seed=5)
    if kernel == "q8":
        head, scales = pack_q8(torch.randint(-127, 128, (1000, 576), dtype=torch.int8), torch.rand(1000) * 0.01)
        f = lambda x: k.q8_matmul(x, head, scales, 1000)  # noqa: E731
    else:
        packed = _pack(codes, d, m, kernel)
        f = lambda x: k.q4_matmul(x, packed, 1000, kernel=kernel)  # noqa: E731
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(6))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [f(x[:rows]) for rows in (1, 3, 9)]
        torch.set_num_threads(7)
        for _ in range(20):
            for rows, want in zip((1, 3, 9), alone):
                assert torch.equal(f(x[:rows]), want), f"{kernel}: {rows} rows on 7 threads"
    finally:
        torch.set_num_threads(threads)


def test_x_rows_of_a_wider_tensor_are_read_in_place():
    """x may be a view with a row stride (a slice of qkv, say): the same result as a contiguous copy."""
    k = native_kernels()
    codes, d, m, _ = q4_weight(64, 576, seed=5)
    packed = pack_q4(codes, d, m)
    wide = torch.randn(4, 1000)
    assert torch.equal(k.q4_matmul(wide[:, 100:676], packed, 64), k.q4_matmul(wide[:, 100:676].contiguous(), packed, 64))


@pytest.mark.parametrize("kernel", [*Q4_KERNELS, "amx_tiles"])
def test_a_nan_or_inf_in_a_row_reaches_its_outputs_and_no_other_row(kernel):
    """A non-finite activation must not be quantized away into a plausible number: the row's outputs are
    NaN (the integer kernels: its block scale is NaN) or not finite (the float kernels: inf times a
    weight, or NaN), as a float product's would be; the other rows keep their bits."""
    k = _kernels_for(kernel)
    codes, d, m, _ = q4_weight(40, 576, seed=6)
    packed = _pack(codes, d, m, kernel)
    x = torch.randn(3, 576)
    clean = k.q4_matmul(x, packed, 40, kernel)
    for bad in (float("nan"), float("inf"), float("-inf")):
        x_bad = x.clone()
        x_bad[1, 17] = bad
        y = k.q4_matmul(x_bad, packed, 40, kernel)
        integer = kernel in ("int", *DIGIT_KERNELS)
        assert torch.isnan(y[1]).all() if integer else not torch.isfinite(y[1]).any(), bad
        assert torch.equal(y[0], clean[0]) and torch.equal(y[2], clean[2])


def test_bad_arguments_are_refused_with_a_reason():
    k = native_kernels()
    codes, d, m, _ = q4_weight(8, 64)
    packed = pack_q4(codes, d, m)
    with pytest.raises(ValueError, match="fp32 or bf16"):
        k.q4_matmul(torch.randn(2, 64, dtype=torch.float16), packed, 8)
    with pytest.raises(ValueError, match="contiguous rows"):
        k.q4_matmul(torch.randn(64, 2).t(), packed, 8)
    with pytest.raises(ValueError, match="48 inputs, not whole blocks of 32"):
        k.q4_matmul(torch.randn(2, 48), packed, 8)
    with pytest.raises(ValueError, match=r"\(2, 2, 80\) torch.uint8, where 9 outputs x 64 inputs .* are \(3, 2, 80\)"):
        k.q4_matmul(torch.randn(2, 64), packed, 9)  # a weight for other sizes
    for kernel in Q4_ENTRIES:  # a weight in another kernel's layout would be read as garbage
        other = "digits" if Q4_LAYOUT[kernel] == "quads" else "quads"
        with pytest.raises(ValueError, match=f"pack it with pack_q4\\(..., layout='{Q4_LAYOUT[kernel]}'\\)"):
            k.q4_matmul(torch.randn(2, 64), pack_q4(codes, d, m, layout=other), 8, kernel=kernel)
    assert k.q4_matmul(torch.randn(0, 64), packed, 8).shape == (0, 8)
    # The library checks the arguments too, for its other callers (layers.c)
    with pytest.raises(RuntimeError, match="refused its arguments"):
        k._matmul("q4_matmul", torch.randn(2, 48), (packed,), 8, torch.float32)


@pytest.mark.parametrize("march", ["x86-64", "x86-64-v3"], ids=["plain-c", "portable-avx2"])
def test_other_builds_compute_the_same_bits(tmp_path, march):
    """A build without AVX2 (the plain C loops, for other CPUs) and the image's portable AVX2 build sum in
    the same order as this host's native one: a worker's tokens do not depend on which build it runs. The
    portable build carries the bf16 dot, VNNI and AMX kernels too and runs them where the CPU has AVX512_BF16
    (AVX512_VNNI, AMX_INT8), with the native build's bits."""
    k = native_kernels()
    other = other_build(tmp_path, march)
    codes, d, m, _ = q4_weight(36, 576, seed=7)
    packed = pack_q4(codes, d, m)
    head, head_scales = pack_q8(torch.randint(-127, 128, (44, 2080), dtype=torch.int8), torch.rand(44) * 0.01)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(5, 576) * 2).to(dtype)
        assert torch.equal(other.q4_matmul(x, packed, 36), k.q4_matmul(x, packed, 36)), dtype
        for rows in (1, 13):  # the LM head's tiles (8, 4, 1 rows; 3, 1), over two chunks of int32 sums
            x = (torch.randn(rows, 2080) * 2).to(dtype)
            assert torch.equal(other.q8_matmul(x, head, head_scales, 44), k.q8_matmul(x, head, head_scales, 44)), \
                (rows, dtype)
        for rows in (2, 7):  # the fp32 kernel's register and buffer paths
            x = (torch.randn(rows, 576) * 2).to(dtype)
            assert torch.equal(other.q4_matmul(x, packed, 36, "f32"), k.q4_matmul(x, packed, 36, "f32")), (rows, dtype)
    assert other.has_bf16dot == (k.has_bf16dot and march == "x86-64-v3")
    assert other.has_vnni == (k.has_vnni and march == "x86-64-v3")
    assert other.has_amx == (k.has_amx and march == "x86-64-v3")
    assert other.has_avx2_digits == (k.has_avx2_digits and march == "x86-64-v3")
    digit_kernels = ["avx2"] * other.has_avx2_digits + ["vnni"] * other.has_vnni + ["amx", "amx_tiles"] * other.has_amx
    digit_packed = _pack(codes, d, m, "avx2")
    for kernel in digit_kernels:
        for rows in (1, 6, 17):
            for dtype in (torch.float32, torch.bfloat16):
                x = (torch.randn(rows, 576) * 2).to(dtype)
                mine = k.q4_matmul(x, digit_packed, 36, kernel=kernel)
                assert torch.equal(other.q4_matmul(x, digit_packed, 36, kernel=kernel), mine), (kernel, rows, dtype)
                # the portable build's AVX2 unit gives what this build's widest unit gives
                assert torch.equal(other.q4_matmul(x, digit_packed, 36, kernel="avx2"), mine), (kernel, rows, dtype)
    if other.has_bf16dot:
        for rows in (3, 13):  # tiles of 3; of 8, 4 and 1
            for dtype in (torch.float32, torch.bfloat16):
                x = (torch.randn(rows, 576) * 2).to(dtype)
                assert torch.equal(other.q4_matmul(x, packed, 36, kernel="bf16dot"),
                                   k.q4_matmul(x, packed, 36, kernel="bf16dot")), (rows, dtype)


@pytest.mark.parametrize("dtype,matmuls", [(torch.float32, "int"), (torch.bfloat16, "int"),
                                           (torch.bfloat16, "bf16dot"), (torch.float32, "f32"),
                                           (torch.bfloat16, "f32"), (torch.bfloat16, "amx"),
                                           (torch.float32, "vnni"), (torch.float32, "avx2"), (torch.bfloat16, "avx2")],
                         ids=["fp32", "bf16", "bf16-bf16dot", "fp32-f32", "bf16-f32", "bf16-amx", "fp32-vnni",
                              "fp32-avx2", "bf16-avx2"])
def test_the_one_call_layer_stack_is_the_per_op_path_bit_for_bit(make_runner, dtype, matmuls):
    """layers.c runs every layer of a decode step in one call; the model's per-op path (one native
    call per kernel from Python) computes the same hidden states, logits and cache writes."""
    from common.engine.runner import DecodeItem, PrefillItem

    _kernels_for(matmuls)
    runner = make_runner(num_blocks=64, dtype=dtype, packed_decode=True, native_matmuls=matmuls)
    model = runner.model
    assert model.matmuls == matmuls
    assert model.native_layers is not None, "the int4 layers did not get the one-call path"
    gen = torch.Generator().manual_seed(8)
    for i, n in enumerate((1, 30, 77)):
        runner.cache.pool.allocate(f"s{i}", n + 4)
        runner.prefill([PrefillItem(f"s{i}", torch.randint(0, 49152, (n,), generator=gen).tolist())])
    items = [DecodeItem("s0", 11, 1), DecodeItem("s1", 12, 30), DecodeItem("s2", 13, 77), DecodeItem("s2", 14, 78)]
    kv_before = runner.cache.kv.clone()
    one_call = runner.decode(items)
    hidden, kv_after = runner.last_hidden.clone(), runner.cache.kv.clone()
    runner.cache.kv.copy_(kv_before)
    layers, model.native_layers = model.native_layers, None
    try:
        per_op = runner.decode(items)
    finally:
        model.native_layers = layers
    assert torch.equal(runner.last_hidden, hidden) and torch.equal(per_op, one_call)
    assert torch.equal(runner.cache.kv, kv_after)


def _bf16dot_kernels() -> DecodeKernels:
    k = native_kernels()
    if not k.has_bf16dot:
        pytest.skip("this build has no bf16 dot kernel (the CPU has no AVX512_BF16)")
    return k


def _vnni_kernels() -> DecodeKernels:
    k = native_kernels()
    if not k.has_vnni:
        pytest.skip("this build has no VNNI kernel (the CPU has no AVX512_VNNI, or the compiler is not GCC 11+)")
    return k


def _amx_kernels() -> DecodeKernels:
    k = native_kernels()
    if not k.has_amx:
        pytest.skip("this build or host has no AMX kernel (the CPU has no AMX_INT8, or the OS did not grant it)")
    return k


def _avx2_digits_kernels() -> DecodeKernels:
    k = native_kernels()
    if not k.has_avx2_digits:
        pytest.skip("this build has no int8 digit kernels (the compiler is not GCC 11+, or the build has no AVX2)")
    return k


def _kernels_for(kernel: str) -> DecodeKernels:
    return {"bf16dot": _bf16dot_kernels, "vnni": _vnni_kernels, "amx": _amx_kernels, "amx_tiles": _amx_kernels,
            "avx2": _avx2_digits_kernels}.get(kernel, native_kernels)()


@pytest.mark.parametrize("kernel", ["avx2", "vnni", "amx", "amx_tiles"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_q4_by_int8_digits_is_the_files_weights_times_x_within_the_quantization_error(dtype, kernel):
    """The int8 digit kernels quantize a row as the integer kernel does, to 1/32639 of each block's largest
    |x| (two signed bytes hold every such integer), and sum the products exactly: within the integer
    kernel's bound at that step, far closer than bf16 activations; a bf16 result is the fp32 one rounded
    (the bits torch's conversion gives), and an fp32 x that bf16 holds exactly gives the bf16 x's result."""
    k = _kernels_for(kernel)
    packed, dense, x = _q4_case(dtype, kernel)
    y = k.q4_matmul(x, packed, 102, kernel=kernel)
    assert y.shape == (7, 102) and y.dtype == dtype
    exact = x.double().numpy() @ dense.T
    bound = _quant_error_bound(x, dense, XD_MAX) + (np.abs(exact) / 128 if dtype == torch.bfloat16 else 0)
    err = np.abs(y.double().numpy() - exact)
    assert (err <= bound).all(), f"worst error {err.max():.3g} against its bound {bound.flat[err.argmax()]:.3g}"
    if dtype == torch.float32:
        assert np.median(err / (np.abs(x.double().numpy()) @ np.abs(dense).T)) < 1e-5
    else:
        assert torch.equal(y, k.q4_matmul(x.float(), packed, 102, kernel=kernel).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="refused its arguments"):
        k._matmul(Q4_ENTRIES[kernel], torch.randn(2, 48), (packed,), 8, torch.float32)


@pytest.mark.parametrize("kernel", ["bf16dot"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_q4_by_the_bf16_dot_is_the_files_exact_weights_times_x_in_bf16(dtype, kernel):
    """The bf16 dot kernel multiplies the file's codes as integers (128 + q, exact in bf16) with each
    activation rounded to bf16 (2^-9 of it at most), sums in fp32 from -128 * (the sum of x), then scales by
    d and adds m * (the sum of x): within 2^-8 of sum |x| |w| of the exact product, the same bits for an fp32
    x as for that x rounded to bf16 first, and for that rounded x within fp32 sum error of the exact weights
    (no weight is rounded: 2^-12 of sum_b (d_b + |m_b|) sum |x_b| covers the sums' cancellation of 128 x)."""
    k = _kernels_for(kernel)
    codes, d, m, dense = q4_weight(102, 576)
    packed, _, x = _q4_case(dtype)
    y = k.q4_matmul(x, packed, 102, kernel=kernel)
    assert y.shape == (7, 102) and y.dtype == dtype
    exact = x.double().numpy() @ dense.T
    scale = np.abs(x.double().numpy()) @ np.abs(dense).T
    bound = scale * (2.0 ** -8 + 1e-5) + 1e-6 + (np.abs(exact) / 128 if dtype == torch.bfloat16 else 0)  # bf16 out
    err = np.abs(y.double().numpy() - exact)
    assert (err <= bound).all(), f"worst error {err.max():.3g} against its bound {bound.flat[err.argmax()]:.3g}"
    if dtype == torch.float32:
        assert torch.equal(y, k.q4_matmul(x.to(torch.bfloat16).float(), packed, 102, kernel=kernel))
        x_bf16 = x.to(torch.bfloat16).double().numpy()
        x_blocks = np.abs(x_bf16).reshape(x.shape[0], -1, GROUP).sum(-1)  # [rows, blocks]
        sums_bound = 2.0 ** -12 * x_blocks @ (d + np.abs(m)).T.astype(np.float64) + 1e-6
        err = np.abs(y.double().numpy() - x_bf16 @ dense.T)
        assert (err <= sums_bound).all(), f"worst {err.max():.3g} against {sums_bound.flat[err.argmax()]:.3g}"
        assert np.median(err / scale) < 1e-7  # the weights are not rounded (dequantized to bf16: ~1e-4)
    with pytest.raises(RuntimeError, match="refused its arguments"):
        k._matmul(Q4_ENTRIES[kernel], torch.randn(2, 48), (packed,), 8, torch.float32)


def test_q4_by_the_bf16_dot_gives_a_row_the_same_bits_whatever_the_batch_and_the_threads():
    """Invariant 4 for the bf16 dot kernel: rows in tiles of 8, 4, 3, 2 or 1 share a block's unpacked codes;
    in any tile, and on 1 or 2 threads, a row gets its bits alone."""
    k = _bf16dot_kernels()
    codes, d, m, _ = q4_weight(200, 1536, seed=3)
    packed = pack_q4(codes, d, m)
    gen = torch.Generator().manual_seed(4)
    rows = (torch.randn(32, 1536, generator=gen) * 3).to(torch.bfloat16)
    _assert_rows_batch_invariant({"q4 bf16dot": lambda x: k.q4_matmul(x, packed, 200, kernel="bf16dot")}, rows, gen)


def test_q4_by_int8_digits_gives_a_row_the_same_bits_whatever_the_batch_the_unit_and_the_threads():
    """Invariant 4 for the int8 digit kernels: the AVX2 unit (rows in tiles of 4, 3, 2, 1, 8 outputs a
    register), the AVX-512 one (tiles of 4, 3, 2, 1, 16 outputs a register) and the tile unit (tiles of 16
    rows, the last padded with zero rows) compute the same exact integer sums and scale them by the same
    fp32 operations, so q4_matmul_amx may switch units at 13 rows and a pool may mix AVX2, AVX512_VNNI and
    AMX nodes: every row gets the bits it gets alone from any unit this host has, at every batch size across
    the switch, on 1 or 2 threads. 200 outputs: 12 groups of 16 and one of 8 (two quads, the others zero)."""
    k = _avx2_digits_kernels()
    codes, d, m, _ = q4_weight(200, 1536, seed=3)
    packed = _pack(codes, d, m, "avx2")
    gen = torch.Generator().manual_seed(4)
    rows = (torch.randn(40, 1536, generator=gen) * 3).to(torch.bfloat16)
    units = ["avx2"] + ["vnni"] * k.has_vnni + ["amx", "amx_tiles"] * k.has_amx
    kernels = {kernel: (lambda x, kernel=kernel: k.q4_matmul(x, packed, 200, kernel=kernel)) for kernel in units}
    _assert_rows_batch_invariant(kernels, rows, gen)
    alone = torch.cat([kernels["avx2"](rows[i:i + 1]) for i in range(len(rows))])
    for bsz in (1, 2, 5, 9, 12, 13, 14, 16, 17, 33, 40):
        for name, f in kernels.items():
            assert torch.equal(f(rows[:bsz]), alone[:bsz]), (name, bsz)


def test_q4_by_amx_tiles_is_unchanged_by_torchs_own_amx_work_between_calls():
    """torch's bf16 GEMMs (oneDNN) run AMX on the same OpenMP threads and load their own tile configurations;
    each call loads ours again (llama.cpp kept one a thread and crashed here: docs/benchmarks.md)."""
    k = _amx_kernels()
    codes, d, m, _ = q4_weight(64, 576, seed=9)
    packed = _pack(codes, d, m, "amx")
    x = (torch.randn(12, 576) * 2).to(torch.bfloat16)
    first = k.q4_matmul(x, packed, 64, kernel="amx")  # 12 rows: the tiles
    a, b = torch.randn(48, 1024, dtype=torch.bfloat16), torch.randn(1024, 96, dtype=torch.bfloat16)
    for _ in range(3):
        (a @ b).sum()
        assert torch.equal(k.q4_matmul(x, packed, 64, kernel="amx"), first)
        assert torch.equal(k.q4_matmul(x[2:3], packed, 64, kernel="amx_tiles"), first[2:3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_q4_in_fp32_is_the_files_weights_times_x_to_fp32_rounding(dtype):
    """The fp32 kernel dequantizes each weight as fma(q, d, m) in fp32 (one rounding, 2^-24 of |w|) and sums
    the products with x in fp32: within fp32 accumulation error of the exact product, 2^8 times closer than
    the bf16 dot kernel's bound, with a bf16 x widened exactly."""
    k = native_kernels()
    packed, dense, x = _q4_case(dtype)
    y = k.q4_matmul(x, packed, 102, "f32")
    assert y.shape == (7, 102) and y.dtype == dtype
    exact = x.double().numpy() @ dense.T
    scale = np.abs(x.double().numpy()) @ np.abs(dense).T
    bound = scale * 2.0 ** -16 + 1e-6 + (np.abs(exact) / 128 if dtype == torch.bfloat16 else 0)  # bf16 out
    err = np.abs(y.double().numpy() - exact)
    assert (err <= bound).all(), f"worst error {err.max():.3g} against its bound {bound.flat[err.argmax()]:.3g}"
    if dtype == torch.float32:
        assert np.median(err / scale) < 1e-7  # the integer kernel's is ~1e-5 (15-bit activations)
    with pytest.raises(RuntimeError, match="refused its arguments"):
        k._matmul("q4_matmul_f32", torch.randn(2, 48), (packed,), 8, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_q4_in_fp32_gives_a_row_the_same_bits_whatever_the_batch_and_the_threads(dtype):
    """Invariant 4 for the fp32 kernel: 1-2 rows dequantize in registers, 3 and more read one buffer per
    quad; either way, and on 1 or 2 threads, a row gets its bits alone."""
    k = native_kernels()
    codes, d, m, _ = q4_weight(200, 1536, seed=3)
    packed = pack_q4(codes, d, m)
    gen = torch.Generator().manual_seed(4)
    rows = (torch.randn(32, 1536, generator=gen) * 3).to(dtype)
    _assert_rows_batch_invariant({"q4 f32": lambda x: k.q4_matmul(x, packed, 200, "f32")}, rows, gen)
