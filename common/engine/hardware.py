"""What the machine offers the engine: CPU instruction sets, and the dtype `auto` picks from them; and the
operator's on/off switches for the machine-dependent paths (native kernels, huge pages)."""
from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

# CPU flags that decide how fast 16-bit matmuls are (as /proc/cpuinfo and lscpu name them).
REPORTED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8", "avx512_vnni")
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
OFF, ON = ("0", "false", "no", "off"), ("1", "true", "yes", "on")  # an environment switch's spellings


def switched_off(variable: str) -> bool:
    """Whether environment variable `variable` says off (0, false, no, off); unset means on."""
    return os.environ.get(variable, "1").strip().lower() in OFF


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo is not there)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def reported_flags() -> list[str]:
    """The flags that matter here, for logs and benchmark figures."""
    return [f for f in REPORTED_FLAGS if f in cpu_flags()]


def auto_dtype(device: str | torch.device = "cpu", flags: frozenset[str] | None = None) -> tuple[torch.dtype, str]:
    """bf16 where the hardware multiplies bf16 natively (CUDA; CPUs with AVX512_BF16 or AMX), else
    fp32: without them bf16 matmuls are emulated, and prefill ran 4x slower in bf16 than in fp32 on
    such hosts (docs/benchmarks.md). `flags` defaults to this CPU's. Returns the dtype and why."""
    if torch.device(device).type == "cuda":
        return torch.bfloat16, "CUDA"
    flags = cpu_flags() if flags is None else flags
    native = [f for f in NATIVE_BF16_FLAGS if f in flags]
    if native:
        return torch.bfloat16, f"the CPU multiplies bf16 natively ({', '.join(native)})"
    shown = [f for f in REPORTED_FLAGS if f in flags]
    return torch.float32, (f"the CPU has no {' / '.join(NATIVE_BF16_FLAGS)}: bf16 would be emulated "
                           f"(flags: {', '.join(shown) or 'unknown'})")


def auto_matmuls(flags: frozenset[str] | None = None) -> tuple[str, str]:
    """How decode's packed-weight matmuls should run (native.matmuls_mode's modes), and why.

    Where the CPU has AVX512_VNNI, decode_matmul.c's int8 digit kernel: exact integer products (16-bit
    activations as two signed bytes times the file's 4-bit codes) by vpdpbusd, and from 13 rows by the AMX
    tile unit where the CPU also has AMX_INT8, the same bits either way (so AMX and VNNI-only nodes of a
    pool give a request the same tokens). A step's 120 matmuls, weights cold, against the bf16 dot kernel:
    on the Intel AMX VM 0.89x its time at one row and 0.27x at 32; on the AMD Zen VM (VNNI, no AMX) by the
    vector unit 0.88-0.92x at one row, 0.57-0.64x at 8 and 0.56-0.58x at 32, three runs (docs/benchmarks.md).
    Else, where the CPU has AVX512_BF16, the bf16 dot kernel: the file's 4-bit codes themselves (exact in
    bf16) times bf16 activations by the bf16 dot instruction. On the avx512_bf16 VM its 120 matmuls took
    2.4-3.5 ms at one row against the integer kernel's 3.7-5.1 and 45-47 ms at 32 rows against 72-81 (the
    fp32 kernel's: 4.6-6.1 and 62-65).
    Else, with AVX2, the same digit kernel's AVX2 unit (vpmaddubsw; the same bits again): in the portable
    AVX2 build on the AMD VM a step's 120 matmuls took 0.58x the fp32 kernel's time at one row, 0.63x at 8
    and 0.81x at 32, and one stream decoded 1.5-1.7x as fast (runs in turn; docs/benchmarks.md). The fp32
    kernel (HANDOFF_NATIVE_MATMUL=f32), auto's pick there before, is the most exact (fp32 activations
    unrounded). Without AVX2 (the plain C loops), the integer kernel. torch's int4 kernel is 10-20x slower
    at 8-32 rows on AVX2 hosts (and 5x at one)."""
    flags = cpu_flags() if flags is None else flags
    if {"avx512_vnni", "amx_int8", "amx_tile"} <= flags:
        return "amx", "decode_matmul.c, int8 digits by VNNI and AMX tiles: the CPU has amx_int8"
    if "avx512_vnni" in flags:
        return "vnni", "decode_matmul.c, int8 digits by VNNI: the CPU has avx512_vnni (no amx_int8)"
    if "avx512_bf16" in flags:
        return "bf16dot", "decode_matmul.c, the bf16 dot instruction: the CPU has avx512_bf16"
    if "avx2" in flags:
        return "avx2", "decode_matmul.c, int8 digits by AVX2: the CPU has avx2, no avx512_vnni or avx512_bf16"
    return "int", "decode_matmul.c, integer products: the CPU has no avx2"
