"""Decode's native kernels: one C library (csrc/) for a decode step's attention over the paged cache (sliding
windows and soft-capped scores included), the row-wise ops around the matmuls (residual add + RMSNorm, a
sublayer's post norm, q/k/v bias + q/k norms + rotary + K/V write, SiLU or tanh-GELU * up), the weight
matmuls on the model file's packed 4-bit blocks and the int8 LM head, the whole layer stack of any family in
one call, and the logits after the head (top-k refinement, argmax).

Built on first use with the system's C compiler (`cc`, or $CC) for this CPU (-march=native), every
csrc/*.c into one shared object, kept in a cache folder keyed by the sources, the flags and the CPU's
feature flags (build.py). Plain C through ctypes (bindings.py): no torch headers, so the build is quick
(docs/benchmarks.md, "Figures behind the code": The library's build time), and ctypes releases the GIL for
the call, so two threads can each take half of a large batch. The numbers both sides must agree on (the
packed layouts, packing.py) live in csrc/handoff_native.h, which Python reads (header.py). Which kernel
multiplies the packed weights is choice.py's: by the CPU, or as HANDOFF_NATIVE_MATMUL says.

An image without a compiler ships a library built for any x86-64 with AVX2 (`python -m
common.engine.native --portable OUT`, deploy/Dockerfile) and names it in HANDOFF_NATIVE_LIBRARY, which
is then loaded as it is.

Where no compiler is found, or HANDOFF_NATIVE_ATTENTION=0, `kernel()` returns None and the model uses
its eager path (gather, widen, SDPA), which computes the same attention in other rounding: a worker's
tokens are then self-consistent but not bit-identical to those of a worker with the kernel, the same
way two CPU families differ (docs/operations.md).
"""
from common.engine.native.build import kernel

__all__ = ["kernel"]
