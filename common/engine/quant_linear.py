"""QuantLinear: a weight kept in the model file's own K-quant or Q8_0 blocks (a GGUF Q4_K_M, Q5_K_M, Q6_K or
Q8_0 file's matrices), multiplied by the native int8 digit kernels (native/csrc/matmul_kquants.c) as stored,
its rows read back exactly (the embedding, the LM head's refinement) without a dense copy."""
from __future__ import annotations

import ctypes
from itertools import groupby

import numpy as np
import torch

from common.engine import pages
from common.engine.native.bindings import DecodeKernels, HnWeight
from common.engine.native.choice import Q4_INDEX
from common.engine.native.header import DEFINES
from common.engine.native.packing import QUANT_FORMATS, pack_quant, quant_block
from common.engine.weights import QuantRows

HN_PARTS = DEFINES["HN_PARTS"]


class QuantLinear:
    """y = x @ W^T for W given as the file's rows (QuantRows), one matrix or the parts of a fused one (wqkv:
    q, k, v), packed once into `arena` (pack_quant): consecutive parts of one format become one packed matrix,
    and a fused matrix whose parts differ in format (a Q4_K_M file's v in Q6_K beside q and k in Q4_K) is
    several, multiplied in turn into their columns of y (hn_matmul's HN_PARTS). Every row's result depends on
    that row alone, and is the same bits on the AVX2 and the AVX512_VNNI unit (invariant 4: same prompt,
    parameters and seed, same tokens). Build it with `create`, which answers None for what it cannot take."""

    def __init__(self, parts: list[QuantRows], kernels: DecodeKernels, unit: str,
                 arena: pages.WeightArena | None = None):
        self.kernels = kernels
        self.unit = unit  # the digit kernel's: "avx2", "vnni" or "amx" (choice.quant_unit)
        self.in_features = parts[0].cols
        # [(qtype, packed [groups, blocks, record], outputs)], one a run of parts in one format
        self.segments: list[tuple[str, torch.Tensor, int]] = []
        for qtype, run in groupby(parts, key=lambda p: p.qtype):
            run = list(run)
            rows = run[0] if len(run) == 1 else QuantRows(qtype, np.concatenate([p.data for p in run]),
                                                          self.in_features)
            self.segments.append((qtype, pack_quant(rows, arena), rows.rows))
        self.out_features = sum(out for _, _, out in self.segments)
        self.nbytes = sum(packed.numel() for _, packed, _ in self.segments)
        self._weight = self._hn_weight()

    @classmethod
    def create(cls, parts: list[QuantRows], kernels: DecodeKernels | None, unit: str,
               arena: pages.WeightArena | None = None) -> QuantLinear | None:
        """A QuantLinear of these parts, or None where they must stay dense: no library or none with these
        kernels (`kernels.has_quant`), a format without a kernel here (Q4_0 / Q4_1 go to Int4Linear, F16,
        Q2_K, Q3_K, IQ... to the dense path), or parts that do not share their inputs."""
        if kernels is None or not kernels.has_quant or not parts:
            return None
        cols = parts[0].cols
        if any(p.qtype not in QUANT_FORMATS or p.cols != cols or cols % quant_block(p.qtype)[0] for p in parts):
            return None
        return cls(parts, kernels, unit, arena)

    def _hn_weight(self) -> HnWeight:
        """The weight as hn_matmul takes it (one segment: itself; several: HN_PARTS over an array of them)."""
        weights = [HnWeight(QUANT_FORMATS[qtype], Q4_INDEX[self.unit], packed.data_ptr(), None, out, self.in_features)
                   for qtype, packed, out in self.segments]
        if len(weights) == 1:
            self._parts = None
            return weights[0]
        self._parts = (HnWeight * len(weights))(*weights)  # kept alive: the struct points to it
        return HnWeight(HN_PARTS, len(weights), ctypes.addressof(self._parts), None, self.out_features,
                        self.in_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] (fp32 or bf16, rows of any stride) -> [rows, out] in x's dtype."""
        if len(self.segments) == 1:
            qtype, packed, out = self.segments[0]
            return self.kernels.quant_matmul(x, packed, qtype, out, self.unit)
        return self.kernels.hn_matmul(x, self._weight)

    def descriptor(self) -> tuple:
        """(format, unit, packed, scale, out, in) for an hn_weight_t (layers.c): the format's HN_* number, the
        unit's Q4_KERNEL_* one, the packed bytes (for HN_PARTS, the array of the segments' hn_weight_t, as
        bytes: keep this object alive), no scale."""
        w = self._weight
        if self._parts is None:
            return w.format, w.unit, self.segments[0][1], None, w.out, w.in_
        parts = torch.frombuffer(self._parts, dtype=torch.uint8)
        return w.format, w.unit, parts, None, w.out, w.in_

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W in fp32 [len(ids), in]: the file's values exactly (gguf.quants.dequantize's), for
        the embedding's tokens and the LM head's best logits."""
        if len(self.segments) != 1:
            raise ValueError("QuantLinear.rows: a fused matrix of several formats has no rows of one layout")
        qtype, packed, out = self.segments[0]
        return self.kernels.dequant_rows(packed, qtype, out, self.in_features, ids)
