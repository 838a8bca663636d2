"""The shared library's functions, called on torch tensors' memory: their ctypes signatures and the mirrors of
its structs (the layer stack's descriptors), as csrc/handoff_native.h declares them, and DecodeKernels, one
loaded library."""
from __future__ import annotations

import ctypes
import errno
from pathlib import Path

import torch

from common.engine.native.choice import Q4_ENTRIES, Q4_INDEX, Q4_LAYOUT
from common.engine.native.header import DEFINES
from common.engine.native.packing import GROUP, QUANT_FORMATS, q4_shape, quant_block, quant_shape

LANES = DEFINES["LANES"]  # attention's and add_rms_norm's sums: head_dim and hidden multiples of it
MAX_HEADS_PER_KV, MAX_HEADS, MAX_HEAD_DIM = DEFINES["MAX_HEADS_PER_KV"], DEFINES["MAX_HEADS"], DEFINES["MAX_HEAD_DIM"]
REFINE_LANES = DEFINES["REFINE_LANES"]  # refine_top's dim: a multiple of it
# Below this much work ((row, query head) items times the longest context) one thread does it all. The split
# runs on torch's OpenMP team, whose threads are already awake, so it pays early: at 2 and 32 rows, and for
# one row of a short chat context too (docs/benchmarks.md, "Figures behind the code": Attention's thread split
# threshold).
SPLIT_MIN_WORK = 256

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
SIGNATURES = {  # function (one per dtype suffix) -> argument types
    # q, its row stride, kv, tables, their stride, lens, block, heads, kv heads, dim, scale, window, soft-cap,
    # out, rows, threads
    "decode_attention": [_P, _I, _P, _P, _I, _P, _I, _I, _I, _I, _F, _I, _F, _P, _I, _I],
    "add_rms_norm": [_P, _P, _P, _I, _I, _F, _P],
    "rms_norm": [_P, _P, _I, _I, _F, _P],
    # qkv, bias, q norm, k norm, eps, cos, sin, positions, rows, heads, kv heads, dim, kv, slots
    "rope_kv_write": [_P, _P, _P, _P, _F, _P, _P, _P, _I, _I, _I, _I, _P, _P],
    "silu_mul": [_P, _I, _I, _P, _I],
    "gelu_tanh_mul": [_P, _I, _I, _P, _I],
    # h, rows, layers, their hn_layer_t array, the hn_model_t, kv, layer stride, positions, slots, block tables,
    # their stride, lens, block, threads, attention threads
    "decode_layers": [_P, _I, _I, _P, _P, _P, _I, _P, _P, _P, _I, _P, _I, _I, _I],
}
ACT_MUL = {"silu": "silu_mul", "gelu_tanh": "gelu_tanh_mul"}  # a family's mlp_act -> its kernel
SUFFIXES = {torch.bfloat16: "bf16", torch.float32: "f32"}
# The matmuls: x, x is bf16, x's row stride, rows, the packed weight (+ q8's scales), out, in, y, y is bf16,
# y's row stride, threads
MATMUL_ARGS = {**{name: [_P, ctypes.c_int, _I, _I, _P, _I, _I, _P, ctypes.c_int, _I, _I]
                  for name in Q4_ENTRIES.values()},
               "q8_matmul": [_P, ctypes.c_int, _I, _I, _P, _P, _I, _I, _P, ctypes.c_int, _I, _I]}
# The logits: logits, rows, vocab, hidden, head, dim, k, threads; x, rows, cols, out, threads
LOGITS_ARGS = {"refine_top": [_P, _I, _I, _P, _P, _I, _I, _I], "argmax_rows": [_P, _I, _I, _P, _I]}
# The K-quants and Q8_0: format, unit, then a Q4 kernel's arguments; rows of them dequantized: format, packed,
# out, in, ids, n, y, threads; any packed format: the weight (HnWeight), x, x is bf16, its stride, rows, y, y is
# bf16, its stride, threads
QUANT_ARGS = {"kq_matmul": [_I, _I, _P, ctypes.c_int, _I, _I, _P, _I, _I, _P, ctypes.c_int, _I, _I],
              "kq_dequant_rows": [_I, _P, _I, _I, _P, _I, _P, _I],
              "hn_matmul": [_P, _P, ctypes.c_int, _I, _I, _P, ctypes.c_int, _I, _I]}
# The int8 digit kernel's units that multiply the K-quants and Q8_0 (choice.DIGIT_KERNELS'; amx runs vnni's)
QUANT_UNITS = ("avx2", "vnni", "amx")


class _Struct(ctypes.Structure):
    """A ctypes mirror of one of handoff_native.h's structs; two are equal when their bytes are."""

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and bytes(self) == bytes(other)

    __hash__ = None


class HnWeight(_Struct):
    """hn_weight_t: one packed matrix, as hn_matmul takes it: its format (HN_*), the kernel unit (a
    Q4_KERNEL_*), its bytes, the int8 head's scales (else None), its sizes."""

    _fields_ = [("format", _I), ("unit", _I), ("packed", _P), ("scale", _P), ("out", _I), ("in_", _I)]

    @classmethod
    def of(cls, descriptor: tuple) -> HnWeight:
        """From a packed linear's descriptor() (hn_weight)."""
        return hn_weight(descriptor)


class HnLayer(_Struct):
    """hn_layer_t: one decoder layer of any family; a part the family lacks is NULL (None) or 0."""

    _fields_ = [("wqkv", HnWeight), ("wo", HnWeight), ("w13", HnWeight), ("w2", HnWeight),
                ("attn_norm", _P), ("mlp_norm", _P), ("attn_post_norm", _P), ("mlp_post_norm", _P),
                ("bqkv", _P), ("q_norm", _P), ("k_norm", _P), ("cos", _P), ("sin", _P), ("window", _I)]


class HnModel(_Struct):
    """hn_model_t: what every layer shares."""

    _fields_ = [("heads", _I), ("kv_heads", _I), ("head_dim", _I), ("hidden", _I), ("ffn", _I),
                ("activation", _I), ("eps", _F), ("attn_scale", _F), ("attn_softcap", _F)]


STRUCTS = (HnWeight, HnLayer, HnModel)  # in hn_struct_bytes' numbering
ACTIVATIONS = {"silu": DEFINES["HN_ACT_SILU"], "gelu_tanh": DEFINES["HN_ACT_GELU_TANH"]}


def hn_weight(descriptor: tuple) -> HnWeight:
    """A packed linear's `descriptor()`, (format, unit, packed tensor, scale tensor or None, out, in), as the
    struct that points into those tensors (keep them alive)."""
    fmt, unit, packed, scale, out_features, in_features = descriptor
    return HnWeight(fmt, unit, packed.data_ptr(), None if scale is None else scale.data_ptr(), out_features,
                    in_features)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def hn_layer(wqkv: tuple, wo: tuple, w13: tuple, w2: tuple, attn_norm: torch.Tensor, mlp_norm: torch.Tensor,
             cos: torch.Tensor, sin: torch.Tensor, window: int = 0, attn_post_norm: torch.Tensor | None = None,
             mlp_post_norm: torch.Tensor | None = None, bqkv: torch.Tensor | None = None,
             q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None) -> HnLayer:
    """One layer's descriptor, pointing into these tensors (keep them alive): the four matrices as their
    `descriptor()`s, the norms fp32 and contiguous, bqkv, cos and sin in the model's dtype, contiguous."""
    tensors = [attn_norm, mlp_norm, attn_post_norm, mlp_post_norm, q_norm, k_norm]
    if any(t is not None and not (t.dtype == torch.float32 and t.is_contiguous()) for t in tensors) or not all(
            t is None or t.is_contiguous() for t in (bqkv, cos, sin)):
        raise ValueError("hn_layer: the norms must be contiguous fp32, bqkv and the rotary tables contiguous")
    return HnLayer(hn_weight(wqkv), hn_weight(wo), hn_weight(w13), hn_weight(w2), attn_norm.data_ptr(),
                   mlp_norm.data_ptr(), _ptr(attn_post_norm), _ptr(mlp_post_norm), _ptr(bqkv), _ptr(q_norm),
                   _ptr(k_norm), cos.data_ptr(), sin.data_ptr(), window)


class DecodeKernels:
    """The shared library's functions for one model's decode step, called on torch tensors' memory."""

    def __init__(self, path: Path):
        self.path = path
        lib = ctypes.CDLL(str(path))  # CDLL, not PyDLL: the GIL is released during each call
        lib.hn_struct_bytes.argtypes, lib.hn_struct_bytes.restype = [_I], _I
        for which, struct in enumerate(STRUCTS):
            if lib.hn_struct_bytes(which) != ctypes.sizeof(struct):
                raise RuntimeError(f"{path}: its struct {which} is {lib.hn_struct_bytes(which)} bytes, "
                                   f"{struct.__name__} {ctypes.sizeof(struct)}: the library and bindings.py disagree")
        self._fns: dict[tuple[str, torch.dtype], ctypes._CFuncPtr] = {}
        for name, argtypes in SIGNATURES.items():
            for dtype, suffix in SUFFIXES.items():
                fn = getattr(lib, f"{name}_{suffix}")
                fn.argtypes, fn.restype = argtypes, ctypes.c_int
                self._fns[name, dtype] = fn
        self._matmuls = {}
        for name, argtypes in {**MATMUL_ARGS, **LOGITS_ARGS, **QUANT_ARGS}.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
            self._matmuls[name] = fn
        # The bf16 dot kernel runs where the CPU has AVX512_BF16 (a GCC build carries it for any AVX2
        # target, the portable one included); elsewhere it answers -ENOSYS.
        self.has_bf16dot = self._runs("q4_matmul_bf16dot")
        # The int8 digit kernels (GCC 11 or later, any AVX2 build): by the vector unit where the CPU has
        # AVX512_VNNI, and by AMX tiles where it also has AMX_INT8 and the OS grants the tile state.
        self.has_vnni = self._runs("q4_matmul_vnni")
        self.has_amx = self._runs("q4_matmul_amx")
        # Its AVX2 unit, the same bits again, in every GCC 11+ AVX2 build (the portable one included).
        self.has_avx2_digits = self._runs("q4_matmul_avx2")
        # The K-quant and Q8_0 kernels: the same digit units, in the same builds.
        self.has_quant = self._matmuls["kq_matmul"](QUANT_FORMATS["Q8_0"], Q4_INDEX["avx2"], None, 1, GROUP, 0,
                                                     None, 1, GROUP, None, 1, 1, 1) == 0

    def _runs(self, name: str) -> bool:
        """Whether this build and CPU run Q4 kernel `name`: asked with no rows, it answers 0 or -ENOSYS."""
        return self._matmuls[name](None, 1, GROUP, 0, None, 1, GROUP, None, 1, 1, 1) == 0

    @staticmethod
    def supports(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, hidden_size: int) -> bool:
        return (dtype in SUFFIXES and head_dim % LANES == 0 and head_dim <= MAX_HEAD_DIM and hidden_size % LANES == 0
                and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= MAX_HEADS_PER_KV
                and num_heads <= MAX_HEADS)

    @staticmethod
    def refines(dim: int) -> bool:
        """Whether refine_top takes hidden states of `dim`."""
        return dim % REFINE_LANES == 0

    @staticmethod
    def _check(code: int, what: str) -> None:
        if code == -errno.ENOMEM:
            raise MemoryError(f"native {what}: out of memory")
        if code:
            raise RuntimeError(f"native {what} refused its arguments (code {code})")

    def attention(self, q: torch.Tensor, layer_kv: torch.Tensor, block_tables: torch.Tensor,
                  lens: torch.Tensor, longest: int, block_size: int, scale: float, window: int = 0,
                  softcap: float | None = None) -> torch.Tensor:
        """q [B, H, D] (rows of any stride, heads and dims contiguous); layer_kv [slots, 2, Hkv, D]
        contiguous; block_tables [B, blocks] and lens [B] int64 contiguous, every row's table covering its
        length (`longest` is the largest). Row r attends to its last `window` positions (0: all of its lens[r]),
        scores q.k * scale, soft-capped to tanh(s / softcap) * softcap where softcap is given. Returns [B, H, D]."""
        rows, heads, dim = q.shape
        kv_heads = layer_kv.shape[2]
        if q.stride(2) != 1 or q.stride(1) != dim or not layer_kv.is_contiguous():
            raise ValueError("paged attention: q needs contiguous heads and a contiguous layer cache")
        out = torch.empty(rows, heads, dim, dtype=q.dtype)
        fn = self._fns["decode_attention", q.dtype]
        args = (q.data_ptr(), q.stride(0), layer_kv.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
                lens.data_ptr(), block_size, heads, kv_heads, dim, scale, window, softcap or 0.0, out.data_ptr())
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
                      heads: int, kv_heads: int, dim: int, layer_kv: torch.Tensor, slots: torch.Tensor,
                      bias: torch.Tensor | None = None, q_norm: torch.Tensor | None = None,
                      k_norm: torch.Tensor | None = None, eps: float = 0.0) -> None:
        """In place on qkv's rows: + bias (where given, [(heads + 2 kv_heads) dim], qkv's dtype), RMSNorm of every
        q head by q_norm and every k head by k_norm (where given, fp32 [dim], eps), then the rotation of the q and
        k heads (cos/sin: [positions, dim] tables, qkv's dtype); then copies each row's K and V into layer_kv
        [slots, 2, Hkv, D] at slots[row]."""
        width = (heads + 2 * kv_heads) * dim
        if not (qkv.is_contiguous() and layer_kv.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()
                and qkv.dtype == layer_kv.dtype == cos.dtype == sin.dtype and qkv.shape[1] == width):
            raise ValueError("rope_kv_write: qkv, the cache and the tables must be contiguous, of one dtype")
        if bias is not None and not (bias.is_contiguous() and bias.dtype == qkv.dtype and bias.numel() == width):
            raise ValueError("rope_kv_write: the bias must be contiguous, of qkv's dtype and row width")
        if any(n is not None and not (n.is_contiguous() and n.dtype == torch.float32 and n.numel() == dim)
               for n in (q_norm, k_norm)):
            raise ValueError("rope_kv_write: the q and k norms must be contiguous fp32 [head_dim]")
        self._check(self._fns["rope_kv_write", qkv.dtype](
            qkv.data_ptr(), _ptr(bias), _ptr(q_norm), _ptr(k_norm), eps, cos.data_ptr(), sin.data_ptr(),
            positions.data_ptr(), qkv.shape[0], heads, kv_heads, dim, layer_kv.data_ptr(), slots.data_ptr()),
            "rope_kv_write")

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [rows, dim] contiguous, fp32 or bf16 → RMSNorm(x) * weight (fp32 [dim]) in x's dtype: a sublayer's
        output before the residual add (Gemma's post norms)."""
        if not (x.is_contiguous() and weight.is_contiguous() and weight.dtype == torch.float32):
            raise ValueError("rms_norm: x must be contiguous and the weight contiguous fp32")
        out = torch.empty_like(x)
        self._check(self._fns["rms_norm", x.dtype](x.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1], eps,
                                                   out.data_ptr()), "rms_norm")
        return out

    def q4_matmul(self, x: torch.Tensor, packed: torch.Tensor, out_features: int, kernel: str = "int") -> torch.Tensor:
        """x [rows, in] (fp32 or bf16, rows of any stride) @ W^T → [rows, out] in x's dtype; W in GGUF Q4
        blocks as `pack_q4` lays them out for the kernel (choice.Q4_LAYOUT). kernel: one of choice.Q4_KERNELS,
        "int" (integer products), "bf16dot" (the bf16 dot instruction, `has_bf16dot`), "f32" (fp32 FMAs),
        "vnni" (integer products by int8 digits, `has_vnni`), "amx" (those by AMX tiles from 13 rows, the
        same bits, `has_amx`) or "avx2" (those by AVX2, the same bits, `has_avx2_digits`); or "amx_tiles"
        (the tiles at any batch, for tests). A weight packed in another layout, or for other sizes, is
        refused (ValueError): the kernel would read it as garbage."""
        if x.shape[1] % GROUP:
            raise ValueError(f"q4_matmul: x has {x.shape[1]} inputs, not whole blocks of {GROUP}")
        layout = Q4_LAYOUT[kernel]
        want = q4_shape(out_features, x.shape[1], layout)
        if tuple(packed.shape) != want or packed.dtype != torch.uint8:
            raise ValueError(f"q4_matmul ({kernel}): the weight is {tuple(packed.shape)} {packed.dtype}, where "
                             f"{out_features} outputs x {x.shape[1]} inputs in the {layout!r} layout are {want} "
                             f"uint8: pack it with pack_q4(..., layout={layout!r})")
        return self._matmul(Q4_ENTRIES[kernel], x, (packed,), out_features, x.dtype)

    def q8_matmul(self, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, out_features: int) -> torch.Tensor:
        """x [rows, in] (fp32 or bf16) @ (codes * scale[:, None])^T → fp32 [rows, out], as `pack_q8` lays
        them out."""
        return self._matmul("q8_matmul", x, (packed, scales), out_features, torch.float32)

    def quant_matmul(self, x: torch.Tensor, packed: torch.Tensor, qtype: str, out_features: int,
                     unit: str = "vnni") -> torch.Tensor:
        """x [rows, in] (fp32 or bf16, rows of any stride) @ W^T -> [rows, out] in x's dtype; W a GGUF Q8_0,
        Q4_K, Q5_K or Q6_K matrix as pack_quant lays it out (`has_quant`), by the digit kernel's unit "avx2",
        "vnni" (`has_vnni`) or "amx" (the vnni unit): the same bits on each."""
        if qtype not in QUANT_FORMATS or unit not in QUANT_UNITS:
            raise ValueError(f"quant_matmul: {qtype} by {unit!r}: use one of {', '.join(QUANT_FORMATS)} by one of "
                             f"{QUANT_UNITS}")
        if x.shape[1] % quant_block(qtype)[0]:
            raise ValueError(f"quant_matmul: x has {x.shape[1]} inputs, not whole {qtype} blocks of "
                             f"{quant_block(qtype)[0]}")
        self._check_packed(packed, quant_shape(qtype, out_features, x.shape[1]), "quant_matmul")
        args = (QUANT_FORMATS[qtype], Q4_INDEX[unit])
        return self._matmul("kq_matmul", x, (packed,), out_features, x.dtype, args)

    def dequant_rows(self, packed: torch.Tensor, qtype: str, out_features: int, in_features: int,
                     ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (int64) of a pack_quant weight, dequantized: fp32 [len(ids), in], gguf.quants.dequantize's
        values bit for bit (kquant_rows.c: every build)."""
        self._check_packed(packed, quant_shape(qtype, out_features, in_features), "dequant_rows")
        ids = ids.to(torch.int64).contiguous()
        y = torch.empty(len(ids), in_features, dtype=torch.float32)
        self._check(self._matmuls["kq_dequant_rows"](QUANT_FORMATS[qtype], packed.data_ptr(), out_features,
                                                     in_features, ids.data_ptr(), len(ids), y.data_ptr(),
                                                     torch.get_num_threads()), "dequant_rows")
        return y

    def hn_matmul(self, x: torch.Tensor, weight: HnWeight) -> torch.Tensor:
        """x [rows, in] @ W^T -> [rows, out] in x's dtype, W any packed weight (hn_matmul, the layer stack's
        entry); the caller keeps W's tensors alive and checked (the C checks the sizes it can)."""
        if x.dtype not in SUFFIXES or x.stride(1) != 1 or x.shape[1] != weight.in_:
            raise ValueError("hn_matmul: x must be fp32 or bf16 with contiguous rows of the weight's inputs")
        y = torch.empty(x.shape[0], weight.out, dtype=x.dtype)
        self._check(self._matmuls["hn_matmul"](ctypes.byref(weight), x.data_ptr(), x.dtype == torch.bfloat16,
                                               x.stride(0), x.shape[0], y.data_ptr(), x.dtype == torch.bfloat16,
                                               weight.out, torch.get_num_threads()), "hn_matmul")
        return y

    @staticmethod
    def _check_packed(packed: torch.Tensor, want: tuple, what: str) -> None:
        if tuple(packed.shape) != want or packed.dtype != torch.uint8 or not packed.is_contiguous():
            raise ValueError(f"{what}: the weight is {tuple(packed.shape)} {packed.dtype}, where these sizes are "
                             f"{want} uint8, contiguous: pack it with pack_quant")

    def _matmul(self, name: str, x: torch.Tensor, weight: tuple[torch.Tensor, ...], out_features: int,
                out_dtype: torch.dtype, lead: tuple = ()) -> torch.Tensor:
        """`lead`: the arguments before x (kq_matmul's format and unit)."""
        rows, in_features = x.shape
        if x.dtype not in SUFFIXES or x.stride(1) != 1 or not all(t.is_contiguous() for t in weight):
            raise ValueError(f"{name}: x must be fp32 or bf16 with contiguous rows, the weight contiguous")
        y = torch.empty(rows, out_features, dtype=out_dtype)
        self._check(self._matmuls[name](
            *lead, x.data_ptr(), x.dtype == torch.bfloat16, x.stride(0), rows, *(t.data_ptr() for t in weight),
            out_features, in_features, y.data_ptr(), out_dtype == torch.bfloat16, out_features,
            torch.get_num_threads()), name)
        return y

    def refine_top(self, logits: torch.Tensor, hidden: torch.Tensor, head: torch.Tensor, k: int) -> torch.Tensor:
        """logits [rows, vocab] fp32 contiguous, in place: each row's k best (NaN first, ties to the lower id)
        become the exact fp32 product of hidden [rows, dim] with head [vocab, dim] (both fp32 contiguous,
        `refines(dim)`). Returns logits."""
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

    def decode_layers(self, h: torch.Tensor, layers: ctypes.Array, model: HnModel, kv: torch.Tensor,
                      positions: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor, lens: torch.Tensor,
                      longest: int, block_size: int) -> None:
        """Every layer of a decode step (layers.c) on the fp32 residual h [rows, hidden], in place: the
        same kernels as the per-op path, in one call. layers: an array of HnLayer (`hn_layer`), one a layer of
        kv [layers, slots, 2, kv_heads, head_dim] (contiguous, the model's dtype); the rest as `attention` and
        `rope_kv_write` take them."""
        rows, hidden = h.shape
        if not (h.is_contiguous() and h.dtype == torch.float32 and kv.is_contiguous() and len(layers) == kv.shape[0]
                and hidden == model.hidden):
            raise ValueError("decode_layers: h must be contiguous fp32 [rows, hidden], kv contiguous, with one "
                             "layer descriptor a layer")
        self._check(self._fns["decode_layers", kv.dtype](
            h.data_ptr(), rows, len(layers), layers, ctypes.byref(model), kv.data_ptr(), kv[0].numel(),
            positions.data_ptr(), slots.data_ptr(), block_tables.data_ptr(), block_tables.stride(0), lens.data_ptr(),
            block_size, torch.get_num_threads(), self.attention_threads(rows, model.heads, longest)), "decode_layers")

    def act_mul(self, gate_up: torch.Tensor, act: str = "silu") -> torch.Tensor:
        """gate_up [rows, 2 F] contiguous → act(gate) * up [rows, F]; act: "silu" or "gelu_tanh" (GeGLU)."""
        if not gate_up.is_contiguous():
            raise ValueError(f"{ACT_MUL[act]}: gate_up must be contiguous")
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, width, dtype=gate_up.dtype)
        self._check(self._fns[ACT_MUL[act], gate_up.dtype](gate_up.data_ptr(), rows, width, out.data_ptr(),
                                                          torch.get_num_threads()), ACT_MUL[act])
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [rows, 2 F] contiguous → silu(gate) * up [rows, F]."""
        return self.act_mul(gate_up, "silu")
