"""Decode's packed weights, laid out as the C matmuls read them: the model file's Q4 blocks (pack_q4, in
the quads layout or the int8 digit kernels' digits layout), its K-quant and Q8_0 blocks (pack_quant) and
the int8 LM head (pack_q8). The sizes come from csrc/handoff_native.h (header.py), where the C reads them
too."""
from __future__ import annotations

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from common.engine.native.header import DEFINES
from common.engine.pages import WeightArena
from common.engine.weights import QuantRows

GROUP = DEFINES["GROUP"]  # inputs a block
QUAD = DEFINES["QUAD"]  # outputs packed together, their blocks interleaved (quads layout, q8)
Q4_RECORD = DEFINES["Q4_RECORD"]  # bytes of one block of a quad
DIGIT_OUTPUTS = DEFINES["DIGIT_OUTPUTS"]  # outputs packed together in the digits layout
DIGIT_RECORD = DEFINES["DIGIT_RECORD"]  # bytes of one block of a group of them
LAYOUTS = ("quads", "digits")
KQ_WORD = DEFINES["KQ_WORD"]  # bytes of a code field an output takes in turn (dword n of a register)
# GGUF's block of each type pack_quant takes, field by field in the file's order: (bytes, the bytes an output
# takes in turn in a record: KQ_WORD of the codes and high bits, 2 of an fp16, 1 of the scales).
QUANT_FIELDS = {
    "Q8_0": ((2, 2), (32, KQ_WORD)),  # d, qs
    "Q4_K": ((2, 2), (2, 2), (12, 1), (128, KQ_WORD)),  # d, dmin, scales (6-bit sc and m), qs
    "Q5_K": ((2, 2), (2, 2), (12, 1), (32, KQ_WORD), (128, KQ_WORD)),  # d, dmin, scales, qh, qs
    "Q6_K": ((128, KQ_WORD), (64, KQ_WORD), (16, 1), (2, 2)),  # ql, qh, scales (int8), d
}
QUANT_FORMATS = {qtype: DEFINES[f"HN_{qtype}"] for qtype in QUANT_FIELDS}  # hn_matmul's format numbers
QUANT_RECORD = {qtype: DEFINES[f"{qtype}_RECORD"] for qtype in QUANT_FIELDS}  # bytes of a group's block


def q4_shape(out_features: int, in_features: int, layout: str) -> tuple[int, int, int]:
    """The uint8 shape pack_q4 gives a weight of these sizes in `layout`: [quads or groups, blocks, record]."""
    outputs, record = (DIGIT_OUTPUTS, DIGIT_RECORD) if layout == "digits" else (QUAD, Q4_RECORD)
    return -(-out_features // outputs), in_features // GROUP, record


def pack_q4(codes: np.ndarray, scales: np.ndarray, mins: np.ndarray, arena: WeightArena | None = None,
            layout: str = "quads") -> torch.Tensor:
    """GGUF Q4 weights (codes [out, in] in 0..15; scales and mins [out, in / 32], fp16-exact values) → one of
    the matmuls' layouts (choice.Q4_LAYOUT says which a kernel takes), in `arena`'s memory where one is given:

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

        code_bytes = nibbles.reshape(groups, blocks, DIGIT_OUTPUTS * GROUP // 2)
        records = np.concatenate([code_bytes, per_block(d), per_block(m)], axis=-1)  # [groups, blocks, 320]
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
        records = np.concatenate([qs.reshape(n, blocks, QUAD * GROUP // 2), d, m], axis=-1)  # [quads, blocks, 80]
    else:
        raise ValueError(f"pack_q4: layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    assert records.shape == q4_shape(out_features, in_features, layout), "pack_q4 disagrees with the header"
    if arena is None:
        return torch.from_numpy(np.ascontiguousarray(records))
    packed = arena.take(records.nbytes).view(records.shape)
    packed.numpy()[...] = records
    return packed


def pack_q8(codes: torch.Tensor, scales: torch.Tensor,
            arena: WeightArena | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes [out, in] with scales [out] → q8_matmul's layout: codes [quads, in / 32, 4, 32], scales
    padded to [quads * 4]. The codes in `arena`'s memory where one is given."""
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


def quant_block(qtype: str) -> tuple[int, int]:
    """GGUF's (inputs, bytes) of one block of `qtype`."""
    return GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]


def quant_shape(qtype: str, out_features: int, in_features: int) -> tuple[int, int, int]:
    """The uint8 shape pack_quant gives a `qtype` weight of these sizes: [groups of 16 outputs, blocks, record]."""
    return -(-out_features // DIGIT_OUTPUTS), in_features // quant_block(qtype)[0], QUANT_RECORD[qtype]


def pack_quant(rows: QuantRows, arena: WeightArena | None = None) -> torch.Tensor:
    """A GGUF Q8_0, Q4_K, Q5_K or Q6_K matrix as stored (rows.data: [out, bytes a row]) -> kq_matmul's layout,
    in `arena`'s memory where one is given: [groups of 16 outputs, blocks, record], a record the group's 16
    blocks of the file, field by field in the file's order (QUANT_FIELDS), each field's bytes interleaved
    across the 16 outputs a word at a time: 4 bytes of codes or high bits (so 64 bytes of a field are one
    register of 16 dwords, dword n output n's), 2 of an fp16, 1 of the scales (csrc/handoff_native.h has
    what each field holds). The file's bytes moved, none changed, none added but Q6_K's 32 zero bytes a record
    (to a whole number of cache lines). Outputs padded with zero blocks (d = 0: zero weights) to a multiple
    of 16."""
    if rows.qtype not in QUANT_FIELDS:
        raise ValueError(f"pack_quant: {rows.qtype} is not one of {', '.join(QUANT_FIELDS)}")
    inputs, block_bytes = quant_block(rows.qtype)
    out_features, in_features = rows.rows, rows.cols
    shape = quant_shape(rows.qtype, out_features, in_features)
    groups, blocks, record = shape
    filled = DIGIT_OUTPUTS * block_bytes  # a record's bytes from the file; the rest (Q6_K's padding) zero
    assert filled <= record < filled + 64, "handoff_native.h's record disagrees with GGUF's block"
    if in_features % inputs or rows.data.shape != (out_features, blocks * block_bytes):
        raise ValueError(f"pack_quant: {rows.qtype} rows of {in_features} inputs are {blocks * block_bytes} bytes "
                         f"(whole blocks of {inputs}), not {rows.data.shape[1]}")
    nbytes = groups * blocks * record
    packed = torch.empty(shape, dtype=torch.uint8) if arena is None else arena.take(nbytes).view(shape)
    dst = packed.numpy()
    dst[:, :, filled:] = 0
    src = rows.data.reshape(out_features, blocks, block_bytes)
    full = out_features // DIGIT_OUTPUTS
    _interleave(src[:full * DIGIT_OUTPUTS], dst[:full], rows.qtype)
    if full < groups:  # the last group's missing outputs: zero blocks
        last = np.zeros((DIGIT_OUTPUTS, blocks, block_bytes), np.uint8)
        last[:out_features - full * DIGIT_OUTPUTS] = src[full * DIGIT_OUTPUTS:]
        _interleave(last, dst[full:], rows.qtype)
    return packed


def _interleave(src: np.ndarray, dst: np.ndarray, qtype: str) -> None:
    """src [16 g, blocks, block bytes] -> dst [g, blocks, record]: each field's words, output by output."""
    groups, blocks = dst.shape[:2]
    at = 0
    for size, word in QUANT_FIELDS[qtype]:
        dtype = {1: np.uint8, 2: np.uint16, 4: np.uint32}[word]
        field = src[:, :, at:at + size].view(dtype).reshape(groups, DIGIT_OUTPUTS, blocks, size // word)
        out = dst[:, :, DIGIT_OUTPUTS * at:DIGIT_OUTPUTS * (at + size)].view(dtype)
        out.reshape(groups, blocks, size // word, DIGIT_OUTPUTS)[...] = field.transpose(0, 2, 3, 1)
        at += size
