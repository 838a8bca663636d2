"""The native kernels in tests: the host's build, builds for other -march, random Q4 weights."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from common.engine.native.header import DEFINES

GROUP = DEFINES["GROUP"]


def native_kernels():
    """The decode kernels built for this CPU; the test is skipped where no C compiler is (the engine then
    runs its torch paths), and fails where one is but the build did not succeed."""
    from common.engine import native
    if shutil.which("cc") is None:
        pytest.skip("no C compiler: decode runs its torch paths here")
    k = native.kernel()
    assert k is not None, "the kernels did not build although a compiler is there: see the log"
    return k


def skip_where_bf16_is_emulated(what: str) -> None:
    """Skip a bf16 case that an fp32 case covers on hosts whose CPU has no native bf16 (AVX2 only), where
    `auto` serves fp32 and torch's bf16 GEMMs are emulated (prefill 5-6x slower): the case still runs on
    every host with native bf16, where bf16 is the default."""
    from common.engine.hardware import auto_dtype
    if auto_dtype()[0] != torch.bfloat16:
        pytest.skip(f"{what}: bf16 is emulated on this CPU (auto serves fp32 here, whose case covers it)")


def other_build(tmp_path: Path, march: str, extra: tuple[str, ...] = ()):
    """The decode kernels built for another -march into tmp_path (x86-64: the plain C loops; x86-64-v3: the
    image's portable AVX2 build; extra flags after it, e.g. -mno-avx2), for tests that compare builds bit
    for bit."""
    from common.engine.native import build
    from common.engine.native.bindings import DecodeKernels
    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    path = tmp_path / f"decode_kernels-{march}{''.join(extra)}.so"
    build.compile_library(build.find_compiler(), build.march_flags(march) + list(extra), path)
    return DecodeKernels(path)



def q4_weight(out_features: int, in_features: int, seed: int = 0):
    """Random Q4 blocks as GGUF holds them: codes 0..15, fp16 d > 0 and fp16 m of either sign (Q4_1; Q4_0's
    m = -8 d among them). Returns codes, d, m (float32 holding fp16 values) and the dense weight."""
    rng = np.random.default_rng(seed)
    blocks = in_features // GROUP
    codes = rng.integers(0, 16, (out_features, in_features), dtype=np.uint8)
    d = rng.uniform(0.001, 0.05, (out_features, blocks)).astype(np.float16).astype(np.float32)
    m = rng.uniform(-0.4, 0.1, (out_features, blocks)).astype(np.float16).astype(np.float32)
    m[::3] = -8 * d[::3]
    dense = codes.astype(np.float64) * np.repeat(d, GROUP, 1) + np.repeat(m, GROUP, 1)
    return codes, d, m, dense

