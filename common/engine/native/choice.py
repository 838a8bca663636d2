"""Which kernel multiplies decode's packed weights: by the CPU (auto_matmuls), as the operator asks
(HANDOFF_NATIVE_MATMUL, matmuls_mode), and, where the library at hand cannot run that kernel, the one that
replaces it (runnable_mode): the same bits where one gives them, never a kernel many times slower."""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from common.engine.hardware import OFF, ON, cpu_flags
from common.engine.native.header import DEFINES

if TYPE_CHECKING:
    from common.engine.native.bindings import DecodeKernels

log = logging.getLogger(__name__)

# 1 (or int): the packed weights go through the integer kernel (matmul_q4_int.c); bf16: the bf16 dot
# kernel; f32: the fp32 one; vnni / amx / avx2: the int8 digit kernels on that unit; 0: through torch's
# int4 kernel (and the int8 head through torch._int_mm), attention and the row-wise ops staying native;
# auto (unset): by the CPU (auto_matmuls).
ENV_MATMUL = "HANDOFF_NATIVE_MATMUL"
# The library's kernels for the packed Q4 weights, by mode (their C functions), and their numbers for
# decode_layers (the header's Q4_KERNEL_*).
Q4_KERNELS = {"int": "q4_matmul", "bf16dot": "q4_matmul_bf16dot", "f32": "q4_matmul_f32", "amx": "q4_matmul_amx",
              "vnni": "q4_matmul_vnni", "avx2": "q4_matmul_avx2"}
Q4_INDEX = {kernel: DEFINES[f"Q4_KERNEL_{kernel.upper()}"] for kernel in Q4_KERNELS}
# Not a mode: the AMX kernel with its tiles at every batch size, for the tests (q4_matmul's kernel="amx_tiles")
Q4_ENTRIES = {**Q4_KERNELS, "amx_tiles": "q4_matmul_amx_tiles"}
# pack_q4's layout for each kernel: the int8 digit kernels read 16 outputs a block together, in their own order
DIGIT_KERNELS = ("avx2", "vnni", "amx", "amx_tiles")  # one kernel on three units: the same bits on each
Q4_LAYOUT = {kernel: "digits" if kernel in DIGIT_KERNELS else "quads" for kernel in Q4_ENTRIES}
MATMUL_MODES = ("torch", *Q4_KERNELS)


def auto_matmuls(flags: frozenset[str] | None = None) -> tuple[str, str]:
    """How decode's packed-weight matmuls should run on this CPU (matmuls_mode's modes), and why.

    Where the CPU has AVX512_VNNI, the int8 digit kernel: exact integer products (16-bit activations as two
    signed bytes times the file's 4-bit codes) by vpdpbusd, and from 13 rows by the AMX tile unit where the
    CPU also has AMX_INT8, the same bits either way (so AMX and VNNI-only nodes of a pool give a request the
    same tokens): faster than the bf16 dot kernel at every batch size, most at 32 rows.
    Else, where the CPU has AVX512_BF16, the bf16 dot kernel: the file's 4-bit codes themselves (exact in
    bf16) times bf16 activations by the bf16 dot instruction, faster than the integer and fp32 kernels.
    Else, with AVX2, the same digit kernel's AVX2 unit (vpmaddubsw; the same bits again), faster than the
    fp32 kernel at every batch size. The fp32 kernel (HANDOFF_NATIVE_MATMUL=f32), auto's pick there before,
    is the most exact (fp32 activations unrounded). Without AVX2 (the plain C loops), the integer kernel.
    torch's int4 kernel is many times slower on AVX2 hosts. (docs/benchmarks.md, "Figures behind the code":
    Auto's matmul kernel per CPU; torch's int4 kernel on AVX2 hosts.) `flags` defaults to this CPU's."""
    flags = cpu_flags() if flags is None else flags
    if {"avx512_vnni", "amx_int8", "amx_tile"} <= flags:
        return "amx", "matmul_q4_digits.c, int8 digits by VNNI and AMX tiles: the CPU has amx_int8"
    if "avx512_vnni" in flags:
        return "vnni", "matmul_q4_digits.c, int8 digits by VNNI: the CPU has avx512_vnni (no amx_int8)"
    if "avx512_bf16" in flags:
        return "bf16dot", "matmul_q4_bf16dot.c, the bf16 dot instruction: the CPU has avx512_bf16"
    if "avx2" in flags:
        return "avx2", "matmul_q4_digits.c, int8 digits by AVX2: the CPU has avx2, no avx512_vnni or avx512_bf16"
    return "int", "matmul_q4_int.c, integer products: the CPU has no avx2"


def matmuls_mode() -> tuple[str, str]:
    """How decode's packed-weight matmuls run, and why (HANDOFF_NATIVE_MATMUL, else by the CPU): "torch"
    (torch's int4 kernel and torch._int_mm), or one of the library's kernels: "int" (integer products),
    "bf16dot" (the bf16 dot instruction, CPUs with AVX512_BF16), "f32" (fp32 FMAs), "vnni" (integer
    products by int8 digits, CPUs with AVX512_VNNI), "amx" (those by AMX tiles from 13 rows, CPUs with
    AMX_INT8), "avx2" (those by AVX2 alone); the last three give the same bits. Raises ValueError on a
    value it does not know."""
    value = os.environ.get(ENV_MATMUL, "auto").strip().lower()
    if value in OFF:
        return "torch", f"torch's int4 kernel ({ENV_MATMUL}={value})"
    if value in ON or value == "int":
        return "int", f"matmul_q4_int.c, integer products ({ENV_MATMUL}={value})"
    if value == "bf16":
        return "bf16dot", f"matmul_q4_bf16dot.c, the bf16 dot instruction ({ENV_MATMUL}={value})"
    if value in ("f32", "fp32"):
        return "f32", f"matmul_q4_f32.c, fp32 products ({ENV_MATMUL}={value})"
    if value == "amx":
        return "amx", f"matmul_q4_digits.c, int8 digits by AMX tiles ({ENV_MATMUL}={value})"
    if value == "vnni":
        return "vnni", f"matmul_q4_digits.c, int8 digits by AVX512_VNNI ({ENV_MATMUL}={value})"
    if value == "avx2":
        return "avx2", f"matmul_q4_digits.c, int8 digits by AVX2 ({ENV_MATMUL}={value})"
    if value in ("", "auto"):
        return auto_matmuls()
    raise ValueError(f"{ENV_MATMUL}={value!r}: use 1 or int (integer products), bf16 (the bf16 dot "
                     "instruction), f32 (fp32 products), vnni (int8 digits by AVX512_VNNI), amx (the same by AMX "
                     "tiles), avx2 (the same by AVX2), 0 (torch's int4 kernel) or auto")


def runnable_mode(mode: str, kernels: DecodeKernels) -> str:
    """`mode` where this library and CPU run its kernel; else the kernel that replaces it, with a warning."""
    if mode == "amx" and not kernels.has_amx:
        # A library or a kernel without it (GCC < 11, or Linux < 5.16, which cannot grant the tile state;
        # or no AMX_INT8 under HANDOFF_NATIVE_MATMUL=amx): the same kernel's vector half, whose bits
        # are the same, where it runs.
        log.warning("decode's packed-weight matmuls: the native library cannot run its AMX kernel here "
                    "(this CPU has no AMX_INT8, the kernel did not grant the tile state, or the library "
                    "was built without the kernel); using its AVX512_VNNI half instead")
        mode = "vnni"
    if mode == "vnni" and not kernels.has_vnni:
        # The same kernel's AVX2 unit: the same bits again, on any CPU the library runs on.
        log.warning("decode's packed-weight matmuls: the native library cannot run its VNNI kernel here "
                    "(this CPU has no AVX512_VNNI, or the library was built without the kernel); using "
                    "its AVX2 unit instead (the same bits)")
        mode = "avx2"
    if mode == "avx2" and not kernels.has_avx2_digits:
        # A library without the int8 digit kernels (built by a compiler other than GCC >= 11, or for a CPU
        # without AVX2): bf16dot where it runs, else the fp32 kernel (every library has it), never torch's
        # int4 kernel (many times slower on AVX2 hosts: docs/benchmarks.md, "Figures behind the code": torch's
        # int4 kernel on AVX2 hosts).
        mode = "bf16dot" if kernels.has_bf16dot else "f32"
        log.warning("decode's packed-weight matmuls: the native library has no int8 digit kernel (it was "
                    "built by a compiler other than GCC 11 or later, or without AVX2); using the %s kernel "
                    "instead", "bf16 dot" if mode == "bf16dot" else "fp32")
    if mode == "bf16dot" and not kernels.has_bf16dot:
        # A library without it (a compiler other than GCC >= 10 on a host without AVX512_BF16, or a CPU
        # without it under HANDOFF_NATIVE_MATMUL=bf16): torch's int4 kernel has the same kind of
        # numerics and multiplies bf16 natively where this kernel would have.
        log.warning("decode's packed-weight matmuls: the native library cannot run its bf16 dot kernel "
                    "here (this CPU has no AVX512_BF16, or the library was built without the kernel); "
                    "using torch's int4 kernel instead")
        mode = "torch"
    return mode


def quant_unit(mode: str, kernels: DecodeKernels) -> str:
    """The int8 digit kernel unit that multiplies the K-quants and Q8_0 when the Q4 weights run `mode`: that
    mode's unit where it is one of the digit kernel's (amx runs the K-quants on its vnni half: the same bits),
    else the widest this library and CPU run (another Q4 kernel's mode says nothing of the K-quants, whose
    only kernels these are)."""
    if mode in ("amx", "vnni") and kernels.has_vnni:
        return mode
    if mode == "avx2":
        return mode
    return "vnni" if kernels.has_vnni else "avx2"
