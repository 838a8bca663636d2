"""What the machine offers the engine: CPU instruction sets, and the dtype `auto` picks from them; and the
operator's on/off switches for the machine-dependent paths (native kernels, huge pages). The native
matmul kernel `auto` picks from them is native/choice.py's."""
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

