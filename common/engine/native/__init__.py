"""The decode step's native kernels: attention over the paged cache, and the row-wise ops around the
matmuls (residual add + RMSNorm, rotary + K/V write, SiLU * up), fused (decode_kernels.c); the weight
matmuls themselves, on the model file's packed 4-bit blocks and the int8 LM head (decode_matmul.c).

Built on first use with the system's C compiler (`cc`, or $CC) for this CPU (-march=native) and kept
in a cache folder keyed by the source, the flags and the CPU's feature flags, so a fleet of different
hosts sharing a home folder never loads another machine's build. Plain C through ctypes: no torch
headers, so the build takes about a second, and ctypes releases the GIL for the call, so two threads
can each take half of a large batch.

An image without a compiler ships a library built for any x86-64 with AVX2 (`python -m
common.engine.native --portable OUT`, deploy/Dockerfile) and names it in HANDOFF_NATIVE_LIBRARY, which
is then loaded as it is.

Where no compiler is found, or HANDOFF_NATIVE_ATTENTION=0, `kernel()` returns None and the model uses
its eager path (gather, widen, SDPA), which computes the same attention in other rounding: a worker's
tokens are then self-consistent but not bit-identical to those of a worker with the kernel, the same
way two CPU families differ (docs/operations.md).
"""
from __future__ import annotations

import ctypes
import errno
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

from common.engine.hardware import OFF, ON, auto_matmuls, cpu_flags, switched_off
from common.engine.pages import WeightArena

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCE = CSRC / "attention.c"
MATMUL_SOURCE = CSRC / "matmul.c"
LAYERS_SOURCE = CSRC / "layers.c"
LOGITS_SOURCE = CSRC / "logits.c"
# No -ffast-math: the kernel's sums must keep the order the source gives them (invariant 4).
# -fno-trapping-math (one part of it, which changes no value: FP exceptions are never read here) lets GCC
# turn a select into a blend, so that attention's softmax loop (exp_nonpositive's two selects) vectorizes:
# with traps assumed it stayed scalar.
# -fopenmp: the matmuls run on an OpenMP team, linked against the libgomp torch loaded (decode_matmul.c).
FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fno-trapping-math", "-std=c11", "-fPIC", "-shared",
         "-fopenmp"]
# For a library built on one machine and run on others (an image): AVX2 + FMA, which every host here has.
def march_flags(march: str) -> list[str]:
    """FLAGS for another -march (a build for other machines, or the tests' other builds)."""
    return [f if f != "-march=native" else f"-march={march}" for f in FLAGS]


PORTABLE_FLAGS = march_flags("x86-64-v3")
ENV_SWITCH = "HANDOFF_NATIVE_ATTENTION"
# 1 (or int): the packed weights go through decode_matmul.c's integer kernel; bf16: through its bf16 dot
# kernel; f32: through its fp32 one; vnni / amx: through its int8 digit kernels; 0: through torch's int4
# kernel (and the int8 head through torch._int_mm), attention and the row-wise ops staying native; auto
# (unset): by the CPU (hardware.auto_matmuls).
ENV_MATMUL = "HANDOFF_NATIVE_MATMUL"
ENV_CACHE = "HANDOFF_NATIVE_CACHE"
ENV_LIBRARY = "HANDOFF_NATIVE_LIBRARY"  # a prebuilt library, loaded instead of building one
# Below this much work ((row, query head) items times the longest context) one thread does it all. The
# split runs on torch's OpenMP team, whose threads are already awake, so it pays early: 2 rows of 107
# positions took 36 against 55 us on 2 threads, 32 rows of 130 0.43 against 0.84 ms (fp32, an AVX2 host).
# One row of 107 splits too: a whole 1-row step took 2.37 / 2.41 / 2.46 ms (min / p25 / median of 16
# alternating rounds) against 2.47 / 2.51 / 2.67 with 1536 (bf16, an AVX-512 EPYC), 4.27 / 4.35 / 4.43 against
# 4.47 / 4.52 / 4.58 in fp32 on the portable AVX2 build (AVX-512 EPYC), and at 60 positions 2.45 / 2.54 /
# 2.58 against 2.52 / 2.60 / 2.67.
SPLIT_MIN_WORK = 256

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
SIGNATURES = {  # function (one per dtype suffix) -> argument types, as in decode_kernels.c
    "decode_attention": [_P, _I, _P, _P, _I, _P, _I, _I, _I, _I, _F, _P, _I, _I],  # ..., out, rows, threads
    "add_rms_norm": [_P, _P, _P, _I, _I, _F, _P],
    "rope_kv_write": [_P, _P, _P, _P, _I, _I, _I, _I, _P, _P],
    "silu_mul": [_P, _I, _I, _P, _I],
    # decode_layers.c: h, rows, layers, the layers' weight pointers, kv, layer stride, cos, sin, positions,
    # slots, block tables, their stride, lens, block, heads, kv heads, head dim, hidden, ffn, eps, attention
    # scale, threads, attention threads, the q4 kernel (Q4_KERNELS' index)
    "decode_layers": [_P, _I, _I, _P, _P, _I, _P, _P, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _I, _F, _F, _I, _I,
                      _I],  # ..., q4 kernel
}
SUFFIXES = {torch.bfloat16: "bf16", torch.float32: "f32"}
# decode_matmul.c: x, x is bf16, x's row stride, rows, the packed weight (+ q8's scales), out, in, y, y is
# bf16, y's row stride, threads
# decode_matmul.c's kernels for the packed Q4 weights, in decode_layers.c's numbering (Q4_INDEX)
Q4_KERNELS = {"int": "q4_matmul", "bf16dot": "q4_matmul_bf16dot", "f32": "q4_matmul_f32", "amx": "q4_matmul_amx",
              "vnni": "q4_matmul_vnni", "avx2": "q4_matmul_avx2"}
Q4_INDEX = {kernel: i for i, kernel in enumerate(Q4_KERNELS)}
# Not a mode: the AMX kernel with its tiles at every batch size, for the tests (q4_matmul's kernel="amx_tiles")
Q4_ENTRIES = {**Q4_KERNELS, "amx_tiles": "q4_matmul_amx_tiles"}
# pack_q4's layout for each kernel: the int8 digit kernels read 16 outputs a block together, in their own order
DIGIT_KERNELS = ("avx2", "vnni", "amx", "amx_tiles")  # one kernel on three units: the same bits on each
Q4_LAYOUT = {kernel: "digits" if kernel in DIGIT_KERNELS else "quads" for kernel in Q4_ENTRIES}
MATMUL_ARGS = {**{name: [_P, ctypes.c_int, _I, _I, _P, _I, _I, _P, ctypes.c_int, _I, _I]
                  for name in Q4_ENTRIES.values()},
               "q8_matmul": [_P, ctypes.c_int, _I, _I, _P, _P, _I, _I, _P, ctypes.c_int, _I, _I]}
# decode_logits.c: logits, rows, vocab, hidden, head, dim, k, threads; x, rows, cols, out, threads
LOGITS_ARGS = {"refine_top": [_P, _I, _I, _P, _P, _I, _I, _I], "argmax_rows": [_P, _I, _I, _P, _I]}
Q4_RECORD = 80  # bytes of one block of a quad: 4 x 16 code bytes, 4 fp16 d, 4 fp16 m
QUAD = 4  # decode_matmul.c packs outputs by fours, each four's blocks interleaved: one stream per tile
GROUP = 32
DIGIT_OUTPUTS = 16  # the int8 digit kernels' group of outputs
DIGIT_RECORD = 320  # their bytes of a group's block: 16 x 16 code bytes, 16 fp16 d, 16 fp16 m


def pack_q4(codes: np.ndarray, scales: np.ndarray, mins: np.ndarray, arena: WeightArena | None = None,
            layout: str = "quads") -> torch.Tensor:
    """GGUF Q4 weights (codes [out, in] in 0..15; scales and mins [out, in / 32], fp16-exact values) → one of
    decode_matmul.c's layouts (Q4_LAYOUT says which a kernel takes), in `arena`'s memory where one is given:

    quads: [quads, in / 32, 80] bytes, per block the four outputs' 16 code bytes (input j in byte j's low
      nibble, j + 16 in its high one, as GGUF stores them), their four fp16 d, their four fp16 m.
    digits (the int8 digit kernels): [groups of 16 outputs, in / 32, 320] bytes, per block 4 chunks of 64
      (chunk k, byte 4n + t: output n's input 4k + t in the low nibble, 16 + 4k + t in the high one: the
      kernel's registers, one mask or shift away), then the 16 outputs' fp16 d, then their fp16 m. Outputs
      padded with zero weights to a multiple of 16.
    """
    out_features, in_features = codes.shape
    blocks = in_features // GROUP
    if layout == "digits":
        pad = -out_features % DIGIT_OUTPUTS
        c, d, m = (np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)]) if pad else a
                   for a in (codes, scales, mins))
        groups = c.shape[0] // DIGIT_OUTPUTS
        c = c.reshape(groups, DIGIT_OUTPUTS, blocks, 2, 4, 4).astype(np.uint8)  # [g, n, b, half, k, t]
        nibbles = (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).transpose(0, 2, 3, 1, 4)  # [g, b, k, n, t]

        def per_block(a: np.ndarray) -> np.ndarray:  # [out, blocks] → [g, b, 16 fp16 as 32 bytes]
            a = a.astype(np.float16).reshape(groups, DIGIT_OUTPUTS, blocks).transpose(0, 2, 1)
            return np.ascontiguousarray(a).view(np.uint8)

        records = np.concatenate([nibbles.reshape(groups, blocks, 256), per_block(d), per_block(m)], axis=-1)
    elif layout == "quads":
        pad = -out_features % QUAD

        def quads(a: np.ndarray) -> np.ndarray:  # [out, blocks, ...] → [quads, blocks, 4, ...]
            a = np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)]) if pad else a
            return a.reshape(-1, QUAD, blocks, *a.shape[2:]).swapaxes(1, 2)

        c = codes.reshape(out_features, blocks, 2, GROUP // 2)
        qs = quads((c[:, :, 0] | (c[:, :, 1] << 4)).astype(np.uint8))  # [quads, blocks, 4, 16]
        d = np.ascontiguousarray(quads(scales.astype(np.float16))).view(np.uint8)  # [quads, blocks, 8]
        m = np.ascontiguousarray(quads(mins.astype(np.float16))).view(np.uint8)
        n = qs.shape[0]
        records = np.concatenate([qs.reshape(n, blocks, 64), d, m], axis=-1)  # [quads, blocks, 80]
    else:
        raise ValueError(f"pack_q4: layout {layout!r} is not one of quads, digits")
    if arena is None:
        return torch.from_numpy(np.ascontiguousarray(records))
    packed = arena.take(records.nbytes).view(records.shape)
    packed.numpy()[...] = records
    return packed


def pack_q8(codes: torch.Tensor, scales: torch.Tensor,
            arena: WeightArena | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes [out, in] with scales [out] → decode_matmul.c's layout: codes [quads, in / 32, 4, 32],
    scales padded to [quads * 4]. The codes in `arena`'s memory where one is given."""
    out_features, in_features = codes.shape
    pad = -out_features % QUAD
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad, in_features)])
        scales = torch.cat([scales, scales.new_zeros(pad)])
    layout = codes.view(-1, QUAD, in_features // GROUP, GROUP).transpose(1, 2)
    if arena is None:
        return layout.contiguous(), scales.contiguous()
    packed = arena.take(layout.numel()).view(torch.int8).view(layout.shape)
    packed.copy_(layout)
    return packed, scales.contiguous()


def _sources() -> list[Path]:
    """The library's C files (read at call time: tests point SOURCE elsewhere)."""
    return [SOURCE, MATMUL_SOURCE, LAYERS_SOURCE, LOGITS_SOURCE]


def cache_dir() -> Path:
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "handoff" / "native"


HEADERS = [CSRC / "bf16.h"]  # included by the sources, part of the build key


def _build_key(compiler: str) -> str:
    h = hashlib.sha256()
    for source in [*_sources(), *HEADERS]:
        h.update(source.read_bytes())
    h.update(" ".join([compiler, *FLAGS, platform.machine(), *sorted(cpu_flags())]).encode())
    return h.hexdigest()[:16]


def _compiler(compiler: str | None) -> str:
    compiler = compiler or os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler {compiler!r} on PATH (install gcc, or set CC)")
    return compiler


def build(compiler: str | None = None) -> Path:
    """Compile the kernel for this CPU (or find its earlier build); returns the shared library's path.

    Raises RuntimeError saying what failed: no compiler, or the compiler's own message."""
    compiler = _compiler(compiler)
    target = cache_dir() / f"decode_kernels-{_build_key(compiler)}.so"
    if not target.exists():
        _compile(compiler, FLAGS, target)
    return target


def _compile(compiler: str, flags: list[str], target: Path) -> None:
    folder = target.parent
    folder.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed: processes starting at once never load a half-written file.
    fd, tmp = tempfile.mkstemp(prefix=".decode_kernels-", suffix=".so", dir=folder)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *flags, *map(str, _sources()), "-o", tmp, "-lm"],
                              capture_output=True,
                              text=True, timeout=120)
        if done.returncode:
            raise RuntimeError(f"{compiler} failed building {SOURCE.name}: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


class DecodeKernels:
    """The shared library's functions for one model's decode step, called on torch tensors' memory."""

    def __init__(self, path: Path):
        self.path = path
        lib = ctypes.CDLL(str(path))  # CDLL, not PyDLL: the GIL is released during each call
        self._fns: dict[tuple[str, torch.dtype], ctypes._CFuncPtr] = {}
        for name, argtypes in SIGNATURES.items():
            for dtype, suffix in SUFFIXES.items():
                fn = getattr(lib, f"{name}_{suffix}")
                fn.argtypes, fn.restype = argtypes, ctypes.c_int
                self._fns[name, dtype] = fn
        self._matmuls = {}
        for name, argtypes in {**MATMUL_ARGS, **LOGITS_ARGS}.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
            self._matmuls[name] = fn
        # The bf16 dot kernel runs where the CPU has AVX512_BF16 (a GCC build carries it for any AVX2
        # target, the portable one included); elsewhere it answers -ENOSYS.
        self.has_bf16dot = self._matmuls["q4_matmul_bf16dot"](None, 1, 32, 0, None, 1, 32, None, 1, 1, 1) == 0
        # The int8 digit kernels (GCC 11 or later, any AVX2 build): by the vector unit where the CPU has
        # AVX512_VNNI, and by AMX tiles where it also has AMX_INT8 and the OS grants the tile state.
        self.has_vnni = self._matmuls["q4_matmul_vnni"](None, 1, 32, 0, None, 1, 32, None, 1, 1, 1) == 0
        self.has_amx = self._matmuls["q4_matmul_amx"](None, 1, 32, 0, None, 1, 32, None, 1, 1, 1) == 0
        # Its AVX2 unit, the same bits again, in every GCC 11+ AVX2 build (the portable one included).
        self.has_avx2_digits = self._matmuls["q4_matmul_avx2"](None, 1, 32, 0, None, 1, 32, None, 1, 1, 1) == 0

    @staticmethod
    def supports(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, hidden_size: int) -> bool:
        return (dtype in SUFFIXES and head_dim % 16 == 0 and head_dim <= 256 and hidden_size % 16 == 0
                and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= 16 and num_heads <= 256)

    @staticmethod
    def _check(code: int, what: str) -> None:
        if code == -errno.ENOMEM:
            raise MemoryError(f"native {what}: out of memory")
        if code:
            raise RuntimeError(f"native {what} refused its arguments (code {code})")

    def attention(self, q: torch.Tensor, layer_kv: torch.Tensor, block_tables: torch.Tensor,
                  lens: torch.Tensor, longest: int, block_size: int, scale: float) -> torch.Tensor:
        """q [B, H, D] (rows of any stride, heads and dims contiguous); layer_kv [slots, 2, Hkv, D]
        contiguous; block_tables [B, blocks] and lens [B] int64 contiguous, every row's table covering its
        length (`longest` is the largest). Returns [B, H, D]."""
        rows, heads, dim = q.shape
        kv_heads = layer_kv.shape[2]
        if q.stride(2) != 1 or q.stride(1) != dim or not layer_kv.is_contiguous():
            raise ValueError("paged attention: q needs contiguous heads and a contiguous layer cache")
        out = torch.empty(rows, heads, dim, dtype=q.dtype)
        fn = self._fns["decode_attention", q.dtype]
        args = (q.data_ptr(), q.stride(0), layer_kv.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
                lens.data_ptr(), block_size, heads, kv_heads, dim, scale, out.data_ptr())
        self._check(fn(*args, rows, self.attention_threads(rows, heads, longest)), "attention")
        return out

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     dtype: torch.dtype) -> torch.Tensor:
        """h [rows, dim] fp32 contiguous += delta (dtype, contiguous; None adds nothing), in place; returns
        RMSNorm(h) * weight (fp32 [dim]) in dtype."""
        rows, dim = h.shape
        if not (h.is_contiguous() and h.dtype == torch.float32) or (
                delta is not None and not (delta.is_contiguous() and delta.dtype == dtype and delta.shape == h.shape)):
            raise ValueError("add_rms_norm: h must be contiguous fp32 and delta contiguous, of h's shape, in dtype")
        out = torch.empty(rows, dim, dtype=dtype)
        self._check(self._fns["add_rms_norm", dtype](
            h.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(), rows, dim, eps,
            out.data_ptr()), "add_rms_norm")
        return out

    def rope_kv_write(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                      heads: int, kv_heads: int, dim: int, layer_kv: torch.Tensor, slots: torch.Tensor) -> None:
        """Rotates qkv's q and k heads in place (cos/sin: [positions, dim] tables, qkv's dtype) and copies
        each row's K and V into layer_kv [slots, 2, Hkv, D] at slots[row]."""
        if not (qkv.is_contiguous() and layer_kv.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()
                and qkv.dtype == layer_kv.dtype == cos.dtype == sin.dtype and qkv.shape[1] == (heads + 2 * kv_heads) * dim):
            raise ValueError("rope_kv_write: qkv, the cache and the tables must be contiguous, of one dtype")
        self._check(self._fns["rope_kv_write", qkv.dtype](
            qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), positions.data_ptr(), qkv.shape[0], heads, kv_heads,
            dim, layer_kv.data_ptr(), slots.data_ptr()), "rope_kv_write")

    def q4_matmul(self, x: torch.Tensor, packed: torch.Tensor, out_features: int, kernel: str = "int") -> torch.Tensor:
        """x [rows, in] (fp32 or bf16, rows of any stride) @ W^T → [rows, out] in x's dtype; W in GGUF Q4
        blocks as `pack_q4` lays them out for the kernel (Q4_LAYOUT). kernel: one of Q4_KERNELS, "int"
        (integer products), "bf16dot" (the bf16 dot instruction, `has_bf16dot`), "f32" (fp32 FMAs), "vnni"
        (integer products by int8 digits, `has_vnni`), "amx" (those by AMX tiles from 13 rows, the same
        bits, `has_amx`) or "avx2" (those by AVX2, the same bits, `has_avx2_digits`); or "amx_tiles" (the
        tiles at any batch, for tests). A weight packed in another layout, or for other sizes, is refused
        (ValueError): the kernel would read it as garbage."""
        if x.shape[1] % GROUP:
            raise ValueError(f"q4_matmul: x has {x.shape[1]} inputs, not whole blocks of {GROUP}")
        layout = Q4_LAYOUT[kernel]
        outputs, record = (DIGIT_OUTPUTS, DIGIT_RECORD) if layout == "digits" else (QUAD, Q4_RECORD)
        want = (-(-out_features // outputs), x.shape[1] // GROUP, record)
        if tuple(packed.shape) != want or packed.dtype != torch.uint8:
            raise ValueError(f"q4_matmul ({kernel}): the weight is {tuple(packed.shape)} {packed.dtype}, where "
                             f"{out_features} outputs x {x.shape[1]} inputs in the {layout!r} layout are {want} "
                             f"uint8: pack it with pack_q4(..., layout={layout!r})")
        return self._matmul(Q4_ENTRIES[kernel], x, (packed,), out_features, x.dtype)

    def q8_matmul(self, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, out_features: int) -> torch.Tensor:
        """x [rows, in] (fp32 or bf16) @ (codes * scale[:, None])^T → fp32 [rows, out], as `pack_q8` lays
        them out."""
        return self._matmul("q8_matmul", x, (packed, scales), out_features, torch.float32)

    def _matmul(self, name: str, x: torch.Tensor, weight: tuple[torch.Tensor, ...], out_features: int,
                out_dtype: torch.dtype) -> torch.Tensor:
        rows, in_features = x.shape
        if x.dtype not in SUFFIXES or x.stride(1) != 1 or not all(t.is_contiguous() for t in weight):
            raise ValueError(f"{name}: x must be fp32 or bf16 with contiguous rows, the weight contiguous")
        y = torch.empty(rows, out_features, dtype=out_dtype)
        self._check(self._matmuls[name](
            x.data_ptr(), x.dtype == torch.bfloat16, x.stride(0), rows, *(t.data_ptr() for t in weight),
            out_features, in_features, y.data_ptr(), out_dtype == torch.bfloat16, out_features,
            torch.get_num_threads()), name)
        return y

    def refine_top(self, logits: torch.Tensor, hidden: torch.Tensor, head: torch.Tensor, k: int) -> torch.Tensor:
        """logits [rows, vocab] fp32 contiguous, in place: each row's k best (NaN first, ties to the lower id)
        become the exact fp32 product of hidden [rows, dim] with head [vocab, dim] (both fp32 contiguous,
        dim a multiple of 8). Returns logits."""
        rows, vocab = logits.shape
        if not (logits.dtype == hidden.dtype == head.dtype == torch.float32 and logits.is_contiguous()
                and hidden.is_contiguous() and head.is_contiguous() and hidden.shape == (rows, head.shape[1])
                and head.shape[0] == vocab):
            raise ValueError("refine_top: logits [rows, vocab], hidden [rows, dim] and head [vocab, dim], "
                             "fp32 contiguous")
        self._check(self._matmuls["refine_top"](logits.data_ptr(), rows, vocab, hidden.data_ptr(), head.data_ptr(),
                                                head.shape[1], k, torch.get_num_threads()), "refine_top")
        return logits

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, cols] fp32 → int64 [rows]: the first index of each row's largest value, a NaN counting as
        the largest (torch's max(dim=-1).indices)."""
        rows, cols = x.shape
        if x.dtype != torch.float32 or not x.is_contiguous():
            raise ValueError("argmax: x must be fp32 and contiguous")
        out = torch.empty(rows, dtype=torch.int64)
        self._check(self._matmuls["argmax_rows"](x.data_ptr(), rows, cols, out.data_ptr(), torch.get_num_threads()),
                    "argmax")
        return out

    def attention_threads(self, rows: int, heads: int, longest: int) -> int:
        return torch.get_num_threads() if rows * heads > 1 and rows * heads * longest >= SPLIT_MIN_WORK else 1

    def decode_layers(self, h: torch.Tensor, layer_weights: ctypes.Array, kv: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
                      lens: torch.Tensor, longest: int, block_size: int, heads: int, head_dim: int, ffn: int,
                      eps: float, kernel: str = "int") -> None:
        """Every layer of a decode step (decode_layers.c) on the fp32 residual h [rows, hidden], in place:
        the same kernels as the per-op path, in one call. layer_weights: 6 pointers a layer (attn_norm, wqkv,
        wo, mlp_norm, w13, w2; the norms fp32, the matmuls as `pack_q4` lays them out); kv [layers, slots,
        2, kv_heads, head_dim] contiguous; the rest as `attention` and `rope_kv_write` take them; kernel as
        `q4_matmul` takes it."""
        rows, hidden = h.shape
        layers, kv_heads = kv.shape[0], kv.shape[3]
        if not (h.is_contiguous() and h.dtype == torch.float32 and kv.is_contiguous() and cos.dtype == kv.dtype
                and cos.is_contiguous() and sin.is_contiguous() and len(layer_weights) == 6 * layers):
            raise ValueError("decode_layers: h must be contiguous fp32, kv and the rotary tables contiguous, of "
                             "one dtype, with 6 weight pointers a layer")
        self._check(self._fns["decode_layers", kv.dtype](
            h.data_ptr(), rows, layers, layer_weights, kv.data_ptr(), kv[0].numel(), cos.data_ptr(), sin.data_ptr(),
            positions.data_ptr(), slots.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
            lens.data_ptr(), block_size, heads, kv_heads, head_dim, hidden, ffn, eps, head_dim ** -0.5,
            torch.get_num_threads(), self.attention_threads(rows, heads, longest),
            Q4_INDEX[kernel]), "decode_layers")

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [rows, 2 F] contiguous → silu(gate) * up [rows, F]."""
        if not gate_up.is_contiguous():
            raise ValueError("silu_mul: gate_up must be contiguous")
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, width, dtype=gate_up.dtype)
        self._check(self._fns["silu_mul", gate_up.dtype](gate_up.data_ptr(), rows, width, out.data_ptr(),
                                                        torch.get_num_threads()), "silu_mul")
        return out


MATMUL_MODES = ("torch", *Q4_KERNELS)


def matmuls_mode() -> tuple[str, str]:
    """How decode's packed-weight matmuls run, and why (HANDOFF_NATIVE_MATMUL, else by the CPU): "torch"
    (torch's int4 kernel and torch._int_mm), or one of decode_matmul.c's kernels: "int" (integer
    products), "bf16dot" (the bf16 dot instruction, CPUs with AVX512_BF16), "f32" (fp32 FMAs), "vnni"
    (integer products by int8 digits, CPUs with AVX512_VNNI), "amx" (those by AMX tiles from 13 rows, CPUs
    with AMX_INT8), "avx2" (those by AVX2 alone); the last three give the same bits. Raises ValueError on a
    value it does not know."""
    value = os.environ.get(ENV_MATMUL, "auto").strip().lower()
    if value in OFF:
        return "torch", f"torch's int4 kernel ({ENV_MATMUL}={value})"
    if value in ON or value == "int":
        return "int", f"decode_matmul.c, integer products ({ENV_MATMUL}={value})"
    if value == "bf16":
        return "bf16dot", f"decode_matmul.c, the bf16 dot instruction ({ENV_MATMUL}={value})"
    if value in ("f32", "fp32"):
        return "f32", f"decode_matmul.c, fp32 products ({ENV_MATMUL}={value})"
    if value == "amx":
        return "amx", f"decode_matmul.c, int8 digits by AMX tiles ({ENV_MATMUL}={value})"
    if value == "vnni":
        return "vnni", f"decode_matmul.c, int8 digits by AVX512_VNNI ({ENV_MATMUL}={value})"
    if value == "avx2":
        return "avx2", f"decode_matmul.c, int8 digits by AVX2 ({ENV_MATMUL}={value})"
    if value in ("", "auto"):
        return auto_matmuls()
    raise ValueError(f"{ENV_MATMUL}={value!r}: use 1 or int (decode_matmul.c, integer products), bf16 "
                     "(decode_matmul.c, the bf16 dot instruction), f32 (decode_matmul.c, fp32 products), vnni "
                     "(decode_matmul.c, int8 digits by AVX512_VNNI), amx (the same by AMX tiles), avx2 (the "
                     "same by AVX2), 0 (torch's int4 kernel) or auto")


@functools.cache
def kernel() -> DecodeKernels | None:
    """This process's kernels, built on first call; None where it is switched off or cannot be built."""
    if switched_off(ENV_SWITCH):
        log.info("decode: eager path (%s=0)", ENV_SWITCH)
        return None
    try:
        prebuilt = os.environ.get(ENV_LIBRARY)
        return DecodeKernels(Path(prebuilt) if prebuilt else build())
    except (RuntimeError, OSError, AttributeError, subprocess.SubprocessError) as exc:
        log.warning("decode: the native kernels are unavailable, using the eager path (torch ops, gather + SDPA), "
                    "slower at every batch size: %s", exc)
        return None


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m common.engine.native", description=__doc__.split("\n")[0])
    parser.add_argument("--portable", metavar="OUT", type=Path,
                        help="build for any x86-64 with AVX2 into OUT (for an image; see HANDOFF_NATIVE_LIBRARY)")
    args = parser.parse_args(argv)
    if args.portable:
        _compile(_compiler(None), PORTABLE_FLAGS, args.portable.resolve())
        DecodeKernels(args.portable.resolve())  # it loads and has every function
        print(args.portable)
    else:
        print(build())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
