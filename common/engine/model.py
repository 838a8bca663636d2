"""The decoder of every family (families.py) in plain PyTorch, reading and writing K/V through the paged cache;
decode through the native kernels (common/engine/native) where they build.

The forward takes flattened tokens of many sequences, `(input_ids, positions)`,
plus one small `AttnContext` that says how they group into sequences; prefill and
decode are two entry points of the same weights.
"""
from __future__ import annotations

import ctypes
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from common.engine import native, pages
from common.engine.config import ModelConfig
from common.engine.native.bindings import ACTIVATIONS, DecodeKernels, HnLayer, HnModel, hn_layer
from common.engine.native.choice import MATMUL_MODES, Q4_INDEX, Q4_LAYOUT, matmuls_mode, quant_unit, runnable_mode
from common.engine.native.header import DEFINES
from common.engine.native.packing import pack_q4, pack_q8
from common.engine.quant_linear import QuantLinear
from common.engine.weights import Int4Weight, QuantRows, release_freed_pages

log = logging.getLogger(__name__)

# A layer's matrices as the model holds them (fused: one product for q, k and v, one for gate and up) and
# their parts by canonical name (weights.expected_shapes), after "model.layers.{i}.".
LAYER_MATRICES = {
    "wqkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "wo": ("self_attn.o_proj.weight",),
    "w13": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "w2": ("mlp.down_proj.weight",),
}


@dataclass
class AttnContext:
    """Per-batch attention metadata, built once per step by the runner."""

    slot_mapping: torch.Tensor  # [N] flat KV slot of every input token
    # prefill: tokens of each sequence are contiguous; attention is causal within one.
    prefill_lens: list[int] | None = None
    # A prefill chunk that continues a sequence (one sequence, its tokens from prefill_start on): it also
    # attends to the K/V already in the cache, through context_slots (positions 0 .. end-1).
    prefill_start: int = 0
    # decode: one token per sequence, attending to its whole context through its block table.
    context_slots: torch.Tensor | None = None  # decode: [B * S] KV slots of each row's context, padded to S
    attn_mask: torch.Tensor | None = None  # [B, 1, 1, S] bool, True = attend; a continued chunk: [T, end]
    use_packed: bool = False  # decode reads packed 4-bit weights: a quarter of the bytes
    # decode with the native kernels (Llama.kernels) instead of context_slots and attn_mask: each row
    # reads its own blocks in place, positions 0 .. lens[row]-1.
    block_tables: torch.Tensor | None = None  # [B, blocks] int64
    lens: torch.Tensor | None = None  # [B] int64
    longest: int = 0
    block_size: int = 0


def rope_tables(config: ModelConfig, max_positions: int, device, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_positions, head_dim] in HF's rotate_half layout, computed in fp32: of the
    full-attention layers, or (local) of the sliding-window layers where they have their own base."""
    d = config.head_dim
    theta = config.rope_local_theta if local and config.rope_local_theta is not None else config.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scale = 1.0
    scaling = None if local else config.rope_scaling
    if scaling is not None:
        inv_freq = torch.tensor(scaling.inv_freq(inv_freq.tolist(), d, theta), dtype=torch.float32)
        scale = scaling.cos_sin_scale()
    t = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scale).to(device), (emb.sin() * scale).to(device)


# Invariant 4 (same inputs, same tokens: a request's tokens never depend on its batch) needs every op of a decode
# step to give a row the same bits whatever the other rows are. Measured on CPU (tests/engine/test_model_numerics):
# - the int4 and int8 weight-only kernels: yes, at any row count;
# - a dense GEMM: only for a fixed row count (oneDNN/MKL pick other kernels, blockings and, at 2 threads,
#   splits as M changes: fp32 rows differ between M=1 and M=2 already), so dense decode GEMMs run in
#   blocks of exactly DENSE_ROW_BLOCK rows, the last one padded;
# - SDPA over a padded context: only while the padded span is a multiple of 64 (the kernel's vector
#   tails then fall the same way), so every decode span is rounded up to ATTN_SPAN_MULTIPLE.
DENSE_ROW_BLOCK = 8
ATTN_SPAN_MULTIPLE = 64


def dense_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear in blocks of exactly DENSE_ROW_BLOCK rows, so each row's result is independent of the others."""
    n = x.shape[0]
    pad = -n % DENSE_ROW_BLOCK
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    if x.shape[0] == DENSE_ROW_BLOCK:
        return F.linear(x, weight)[:n]
    return torch.cat([F.linear(block, weight) for block in x.split(DENSE_ROW_BLOCK)])[:n]


class Int8Linear:
    """A weight as int8 codes with one scale per output row: the decode LM head, half a 16-bit head's bytes.

    With the native kernels (matmul_q8_head.c) the codes are widened to fp32 on the fly and multiplied
    with the fp32 activations, each row's sums in a fixed order, so a row's logits never depend on the
    batch (invariant 4: same inputs, same tokens). Without them, on the CPU, the activations are quantized too, each row to two
    int8 digits with its own scale, and the product is integer (`torch._int_mm`, int32 accumulation):
    integer sums are exact, so no blocking of the batch changes a row either. The logits are approximate
    either way: the best REFINE_TOP of each row are then recomputed in fp32.
    """

    def __init__(self, weight: torch.Tensor, device, kernels: DecodeKernels | None = None,
                 arena: pages.WeightArena | None = None):
        w = weight.to(device=device, dtype=torch.float32)
        # max |w| per row without a full-size |w| temporary (the LM head is the largest weight)
        scales = torch.maximum(w.amax(dim=1), -w.amin(dim=1)).clamp_min(1e-12) / 127.0  # [out]
        codes = (w / scales[:, None]).round_().clamp_(-127, 127).to(torch.int8)
        self.out_features = codes.shape[0]
        self.kernels = kernels if codes.device.type == "cpu" else None
        self.integer = self.kernels is None and codes.device.type == "cpu"
        self.scales_fp32 = scales
        if self.kernels is not None:
            self.codes, self.scales_fp32 = pack_q8(codes, scales, arena)
        else:  # _int_mm wants [in, out]; contiguous, it ran 1.70 against 2.06 ms for two rows (a transposed view)
            self.codes = codes.t().contiguous() if self.integer else codes.contiguous()
        self.scales = scales.to(torch.bfloat16)  # the weight-only kernel's (off the CPU)
        self.nbytes = self.codes.numel() + self.scales.numel() * 2

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.q8_matmul(x, self.codes, self.scales_fp32, self.out_features)
        if not self.integer:
            return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.codes, self.scales)
        # Each row in two int8 digits, x ~ hi * s + lo * s / 254 (about 15 bits). With one digit the
        # refined distribution's total-variation distance from fp32's was 2.5e-4 (median over 150 decode
        # rows), twice the weight-only kernel's 1.2e-4; with two, 0.9e-4. Both digits go through one
        # product, so the weights are read once whatever the row count.
        x = x.float()
        rows = x.shape[0]
        scale = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0  # [rows, 1]
        hi = (x / scale).round_().clamp_(-127, 127)
        lo = (x - hi * scale).div_(scale / 254.0).round_().clamp_(-127, 127)
        # 576 x 127 x 127 < 2^31: no int32 overflow for any head narrower than 133,000 inputs
        both = torch._int_mm(torch.cat([hi, lo]).to(torch.int8), self.codes).float()  # [2 rows, out]
        return both[:rows].mul_(scale).add_(both[rows:].mul_(scale / 254.0)).mul_(self.scales_fp32)


class Int4Linear:
    """A weight in the model file's 4-bit blocks: w = q * d + m per 32 inputs (GGUF Q4_0 / Q4_1).

    With the native kernels (native/csrc/matmul_q4_*.c) it stays in the file's layout, fp16 d and m exact, and the
    product takes the activations as 16-bit integers per block (the integer kernel), in bf16 (bf16dot:
    the bf16 dot kernel, CPUs with AVX512_BF16, the codes exact in bf16) or in fp32 (f32): the same
    weights as the dense path,
    every row's sums in a fixed order. Without them it is packed for torch's CPU int4 kernel
    (bf16 activations, bf16 scales and zeros), which is also row-invariant but rounds more, and at 8-32
    rows was 10-20x slower here (an AVX2 host).
    """

    def __init__(self, parts: list, device, kernels: DecodeKernels | None = None, kernel: str = "int",
                 arena: pages.WeightArena | None = None):
        codes = np.concatenate([p.codes for p in parts])  # [out, in] 0..15
        scales = np.concatenate([p.scales for p in parts])
        mins = np.concatenate([p.mins for p in parts])
        self.group = parts[0].GROUP
        self.kernels = kernels
        self.kernel = kernel  # one of native.choice.Q4_KERNELS, with kernels
        self.out_features, self.in_features = codes.shape
        if kernels is not None:
            # the file's codes and fp16 scales, exactly, in the kernel's order
            self.packed = pack_q4(codes, scales, mins, arena, Q4_LAYOUT[kernel])
            self.nbytes = self.packed.numel()
            return
        zeros = mins + 8 * scales
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            torch.from_numpy(codes).to(device=device, dtype=torch.int32), 2)
        # [in / group, out, 2]: the layout the kernel wants.
        self.scales_zeros = torch.stack([torch.from_numpy(scales), torch.from_numpy(zeros)], -1).transpose(
            0, 1).contiguous().to(device=device, dtype=torch.bfloat16)
        self.nbytes = self.packed.numel() * self.packed.element_size() + self.scales_zeros.numel() * 2

    def descriptor(self) -> tuple | None:
        """(format, unit, packed tensor, scale tensor or None, out, in): the weight as the native layer stack's
        hn_matmul takes it (handoff_native.h's hn_weight_t); None where it is packed for torch's kernel."""
        if self.kernels is None:
            return None
        return DEFINES["HN_Q4"], Q4_INDEX[self.kernel], self.packed, None, self.out_features, self.in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.q4_matmul(x, self.packed, self.out_features, self.kernel)
        if x.dtype != torch.bfloat16:  # an fp32 model: the kernel's fast path is bf16 in, bf16 out
            return torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(torch.bfloat16), self.packed, self.group, self.scales_zeros).to(x.dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group, self.scales_zeros)


class Llama(torch.nn.Module):
    """Weights held as fused matrices (wqkv, w13) so a layer is few, large ops."""

    REFINE_TOP = 64  # logits recomputed in fp32 when the model runs in a 16-bit dtype

    def __init__(self, config: ModelConfig, tensors: Mapping[str, torch.Tensor],
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 packed: Mapping[str, QuantRows] | None = None, native_matmuls: bool | str | None = None, *,
                 pack_layers: bool = True, keep_dense: bool = True):
        """tensors: the checkpoint's weights by canonical name (weights.py), fp32; packed: a GGUF's quantized
        matrices as stored (LoadedWeights.packed).

        Which form each weight is held in, so that each pool holds what its phase reads:
        - pack_layers: decode multiplies the layers' matrices packed as the file stores them (Q4_0 / Q4_1:
          Int4Linear; Q8_0, Q4_K, Q5_K, Q6_K: QuantLinear), where the file has them so and the native kernels
          run here; other formats stay dense. A prefill worker, which never decodes, sets it False.
        - keep_dense: prefill's GEMMs read dense copies of the packed matrices, held from load (True), or made
          from the file each time a prefill runs, layer by layer (False: a decode worker that only decodes,
          whose memory is then the file's bytes; its rare prefill, a preempted sequence recomputed, is slower
          and gives the same bits). A matrix with no packed form is held dense either way.
        - the LM head and the embedding are read packed wherever the file stores them in a format the kernels
          take (Q8_0 and the K-quants), in every role alike: the logits, and the tokens, of a row then do not
          depend on the role of the worker computing them (invariant 4: same inputs, same tokens).

        native_matmuls: how the packed Q4 weights are multiplied, one of native.choice.MATMUL_MODES ("int":
        the native integer kernel, also True; "bf16dot": its bf16 dot kernel; "f32": its fp32 one; "vnni":
        its int8 digit kernel; "amx": that kernel with AMX tiles from 13 rows (the same bits); "torch":
        torch's int4 kernel and torch._int_mm, also False; None: as HANDOFF_NATIVE_MATMUL says, by default by
        the CPU); attention and the row-wise ops are native either way, where the library builds."""
        super().__init__()
        self.config = c = config
        self.dtype = dtype
        self.device = torch.device(device)
        packed = packed or {}
        self._tensors = tensors  # read again for the dense matrices not kept (keep_dense False)

        def w(name: str) -> torch.Tensor:
            return tensors[name].to(device=device, dtype=dtype).contiguous()

        def w32(name: str) -> torch.Tensor:
            return tensors[name].to(device=device, dtype=torch.float32).contiguous()

        # Decode's native kernels (common/engine/native: attention over the paged cache in place, the
        # row-wise ops fused, the packed-weight matmuls; every family's layer), where they build and suit the
        # dtype and shape; else decode runs torch ops.
        kernels = native.kernel() if self.device.type == "cpu" else None
        self.kernels = kernels if kernels is not None and kernels.supports(
            dtype, c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size) else None

        mode = {True: "int", False: "torch"}.get(native_matmuls, native_matmuls)
        if mode is None:
            mode, why = matmuls_mode()
            if self.kernels is not None and packed and pack_layers:
                log.info("decode's packed-weight matmuls: %s", why)
        if mode not in MATMUL_MODES:
            raise ValueError(f"native_matmuls={native_matmuls!r}: use one of {MATMUL_MODES}, True or False")
        if self.kernels is not None:
            mode = runnable_mode(mode, self.kernels)
        self.matmuls = mode if self.kernels is not None else "torch"  # how the packed weights are multiplied
        matmul_kernels = self.kernels if mode != "torch" else None
        # The packed weights decode streams every step, together in huge pages (common/engine/pages.py).
        self.weight_arena = pages.WeightArena() if matmul_kernels is not None else None

        unit = quant_unit(self.matmuls, matmul_kernels) if matmul_kernels is not None else "avx2"

        def packed_linear(names: tuple[str, ...]) -> Int4Linear | QuantLinear | None:
            if self.device.type != "cpu" or any(n not in packed for n in names):
                return None
            parts = [packed[n] for n in names]
            if all(part.qtype in ("Q4_0", "Q4_1") for part in parts):
                return Int4Linear([Int4Weight.from_rows(part) for part in parts], device, matmul_kernels,
                                  self.matmuls, self.weight_arena)
            return QuantLinear.create(parts, matmul_kernels, unit, self.weight_arena)

        # The LM head and the embedding: packed where the kernels take the file's format (they then give the
        # embedding's rows and the refined logits exactly as stored); else dense, with decode's int8 head.
        def row_linear(name: str) -> QuantLinear | None:
            if self.device.type != "cpu" or name not in packed:
                return None
            return QuantLinear.create([packed[name]], matmul_kernels, unit, self.weight_arena)

        def read_out(names) -> None:
            """Once these tensors are in the model's own copies: a GGUF's pages of them out of the resident
            set (GGUFTensors.drop_pages), so loading peaks near the model's size, not it and the file's."""
            for source in (tensors, packed):
                if hasattr(source, "drop_pages"):
                    for n in names:
                        if n in source:
                            source.drop_pages(n)

        head = "model.embed_tokens.weight" if c.tie_embeddings else "lm_head.weight"
        self.head_packed = row_linear(head)
        self.embed_packed = self.head_packed if c.tie_embeddings else row_linear("model.embed_tokens.weight")
        self.embed = w("model.embed_tokens.weight") if self.embed_packed is None else None  # [V, dim]
        self.lm_head = self.lm_head_fp32 = self.lm_head_int8 = None
        if self.head_packed is None:
            self.lm_head = self.embed if c.tie_embeddings and self.embed is not None else w(head)
            head_fp32 = w32(head)  # read once: the refinement's exact copy and the int8 head's source
            self.lm_head_fp32 = None if dtype == torch.float32 else head_fp32
            # Decode's LM head on the CPU: int8 rows (row-invariant at any batch, half the bytes of bf16); the
            # best REFINE_TOP logits of every row are then recomputed exactly in fp32. Off the CPU decode uses
            # the dtype's dense head in fixed row blocks (dense_rows) instead: torch's int8 weight-only kernel
            # is not built for every device, and a GPU reads the 16-bit head fast enough.
            self.lm_head_int8 = Int8Linear(head_fp32, device, matmul_kernels, self.weight_arena) \
                if self.device.type == "cpu" else None
            del head_fp32
        read_out({head, "model.embed_tokens.weight"})
        release_freed_pages()
        self.final_norm = w32("model.norm.weight")
        arch = c.arch
        self.layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            layer = dict(
                index=i,
                attn_norm=w32(p + "input_layernorm.weight"),
                bqkv=torch.cat([w(p + "self_attn.q_proj.bias"), w(p + "self_attn.k_proj.bias"),
                                w(p + "self_attn.v_proj.bias")]) if c.qkv_bias else None,
                q_norm=w32(p + "self_attn.q_norm.weight") if arch.qk_norm else None,
                k_norm=w32(p + "self_attn.k_norm.weight") if arch.qk_norm else None,
                attn_post_norm=w32(p + "post_attention_norm.weight") if arch.post_norms else None,
                mlp_post_norm=w32(p + "post_feedforward_layernorm.weight") if arch.post_norms else None,
                mlp_norm=w32(p + "post_attention_layernorm.weight"),
            )
            for name, parts in LAYER_MATRICES.items():  # wqkv [(H + 2 Hkv) * D, dim], wo, w13 [2 F, dim], w2
                names = tuple(p + part for part in parts)
                layer[name + "_packed"] = packed_linear(names) if pack_layers else None
                keep = keep_dense or layer[name + "_packed"] is None
                layer[name] = torch.cat([w(n) for n in names]) if keep else None  # None: _dense reads the file
                read_out(names)
            self.layers.append(layer)
            release_freed_pages()  # the layer's temporary fp32 copies: peak memory stays near the model's
        self.has_packed = any(layer[name + "_packed"] is not None for layer in self.layers for name in LAYER_MATRICES)
        if all(layer[name] is not None for layer in self.layers for name in LAYER_MATRICES):
            self._tensors = None  # every dense matrix is held: nothing to read again (an HF folder's fp32 set goes)
        cos, sin = rope_tables(c, c.max_position, device)
        self.cos, self.sin = cos.to(dtype), sin.to(dtype)
        # Sliding-window layers with a rotary base of their own (Gemma 3) read their own tables.
        self.cos_local, self.sin_local = self.cos, self.sin
        if c.rope_local_theta is not None and c.has_windows:
            cos, sin = rope_tables(c, c.max_position, device, local=True)
            self.cos_local, self.sin_local = cos.to(dtype), sin.to(dtype)
        # Gemma: embeddings times sqrt(hidden), HF's normalizer in fp32 (the residual stream's dtype here).
        self.embed_scale = float(torch.tensor(c.hidden_size ** 0.5, dtype=torch.float32)) if arch.embed_scaled else None
        # The whole packed layer stack in one native call (native/csrc/layers.c), where every matrix of every
        # layer is packed for the native kernels: one descriptor a layer, pointing into tensors the layers hold.
        self.native_model = HnModel(c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size, c.intermediate_size,
                                    ACTIVATIONS[arch.mlp_act], c.rms_norm_eps, c.scale, c.attn_softcap or 0.0)
        self.native_layers = None
        if self.kernels is not None:
            self.native_layers = self._layer_descriptors()
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim

    def _rope_tables(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s cos/sin tables: a sliding-window layer's own where they differ (Gemma 3)."""
        return (self.cos_local, self.sin_local) if self.config.window(layer) else (self.cos, self.sin)

    def _layer_descriptors(self) -> ctypes.Array | None:
        """Every layer as layers.c's hn_layer_t, or None where some matrix is not packed for the native kernels."""
        packed = [[None if layer[n] is None else layer[n].descriptor() for n in ("wqkv_packed", "wo_packed", "w13_packed", "w2_packed")]
                  for layer in self.layers]
        if not all(d is not None for matrices in packed for d in matrices):
            return None
        descriptors = []
        for i, (layer, matrices) in enumerate(zip(self.layers, packed)):
            cos, sin = self._rope_tables(i)
            descriptors.append(hn_layer(*matrices, attn_norm=layer["attn_norm"], mlp_norm=layer["mlp_norm"], cos=cos,
                                        sin=sin, window=self.config.window(i), attn_post_norm=layer["attn_post_norm"],
                                        mlp_post_norm=layer["mlp_post_norm"], bqkv=layer["bqkv"],
                                        q_norm=layer["q_norm"], k_norm=layer["k_norm"]))
        return (HnLayer * len(descriptors))(*descriptors)

    @property
    def lm_head_exact(self) -> torch.Tensor:
        """The fp32 LM head the best logits are refined with."""
        return self.lm_head if self.lm_head_fp32 is None else self.lm_head_fp32

    def weight_bytes(self) -> int:
        """Bytes of every weight the model holds, in whatever form (dense, packed)."""
        dense = [self.embed, self.final_norm, self.lm_head if self.lm_head is not self.embed else None,
                 self.lm_head_fp32]
        dense += [t for layer in self.layers for t in layer.values() if isinstance(t, torch.Tensor)]
        packed = [self.lm_head_int8, self.head_packed, self.embed_packed if self.embed_packed is not self.head_packed
                  else None]
        packed += [layer[name + "_packed"] for layer in self.layers for name in LAYER_MATRICES]
        return (sum(t.numel() * t.element_size() for t in dense if t is not None)
                + sum(linear.nbytes for linear in packed if linear is not None))

    def decode_weight_bytes(self, use_packed: bool) -> int:
        """Bytes of weights one decode step reads (the embedding row gather aside)."""
        if self.head_packed is not None:
            head = self.head_packed.nbytes
        elif self.lm_head_int8 is not None:
            head = self.lm_head_int8.nbytes
        else:
            head = self.lm_head.numel() * self.lm_head.element_size()
        return head + self.decode_layer_weight_bytes(use_packed)

    def decode_layer_weight_bytes(self, use_packed: bool) -> int:
        """Bytes of the layers' matmul weights one decode step reads (the LM head aside)."""
        total = 0
        for layer in self.layers:
            for name in LAYER_MATRICES:
                packed = layer[name + "_packed"] if use_packed else None
                total += packed.nbytes if packed is not None else self._matrix_numel(name) * self.dtype.itemsize
        return total

    def _matrix_numel(self, name: str) -> int:
        c = self.config
        q, kv, f = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
        return {"wqkv": (q + 2 * kv) * c.hidden_size, "wo": c.hidden_size * q, "w13": 2 * f * c.hidden_size,
                "w2": c.hidden_size * f}[name]

    def _linear(self, x: torch.Tensor, layer: dict, name: str, ctx: AttnContext) -> torch.Tensor:
        packed = layer[name + "_packed"]
        if ctx.use_packed and packed is not None:
            return packed(x)
        weight = layer[name] if layer[name] is not None else self._dense(layer["index"], name)
        if ctx.prefill_lens is None:
            return dense_rows(x, weight)  # decode: rows independent of their company
        return F.linear(x, weight)

    def _dense(self, i: int, name: str) -> torch.Tensor:
        """Layer i's matrix `name` in the model's dtype, made from the file now (keep_dense False): the same
        operations, so the same bits, as the copy a worker that keeps them made at load."""
        p = f"model.layers.{i}."
        out = torch.cat([self._tensors[p + part].to(device=self.device, dtype=self.dtype).contiguous()
                         for part in LAYER_MATRICES[name]])
        if hasattr(self._tensors, "drop_pages"):  # read again from the page cache next time, not held here
            for part in LAYER_MATRICES[name]:
                self._tensors.drop_pages(p + part)
        return out

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The fp32 residual stream's start: the tokens' embedding rows, rounded to the model's dtype (as a
        dense embedding in that dtype holds them, so both forms give the same bits)."""
        if self.embed is not None:
            return self.embed.index_select(0, input_ids).float()
        return self.embed_packed.rows(input_ids).to(self.dtype).float()

    def _rms_norm(self, x: torch.Tensor, weight_fp32: torch.Tensor) -> torch.Tensor:
        # x is the fp32 residual stream: it carries outliers (~2.5e4 in SmolLM2) next to which a
        # bf16 stream and norm lose the small channels, enough to change greedy tokens.
        return F.rms_norm(x.float(), (x.shape[-1],), weight_fp32, self.config.rms_norm_eps).to(self.dtype)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [N, heads, D]; cos/sin: [N, 1, D] (HF's rotate_half convention)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttnContext,
                kv: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [N]; kv: [layers, slots, 2, Hkv, D]. Returns fp32 hidden states [N, dim]."""
        c = self.config
        n = input_ids.shape[0]
        # Decode with the native kernels fuses the row-wise ops around the matmuls; prefill and the eager
        # decode path run them as torch ops. The same layer either way.
        native_ops = self.kernels if ctx.block_tables is not None else None
        # The residual stream stays fp32 (adds promote for free); only matmul inputs are 16-bit.
        h = self._embed(input_ids)  # [N, dim]
        if self.embed_scale is not None:
            h.mul_(self.embed_scale)
        if native_ops is not None and ctx.use_packed and self.native_layers is not None:
            # The same layers in one native call (the per-op path below, on the same kernels, bit for bit).
            native_ops.decode_layers(h, self.native_layers, self.native_model, kv, positions, ctx.slot_mapping,
                                     ctx.block_tables, ctx.lens, ctx.longest, ctx.block_size)
            # The final norm natively too (torch's right after the native call took ~100 us a step).
            return native_ops.add_rms_norm(h, None, self.final_norm, c.rms_norm_eps, torch.float32)
        delta = None  # the last sublayer's output, not yet added to h
        for i, layer in enumerate(self.layers):
            layer_kv = kv[i]  # [slots, 2, Hkv, D]
            window = c.window(i)
            x = self._add_norm(h, delta, layer["attn_norm"], native_ops)
            qkv = self._linear(x, layer, "wqkv", ctx)  # [N, (H + 2 Hkv) * D]
            q = qkv[:, :self.q_size].view(n, c.num_heads, c.head_dim)
            cos_table, sin_table = self._rope_tables(i)
            if native_ops is not None:
                # bias, q/k norms, rotary and the K/V write in one pass over the rows
                native_ops.rope_kv_write(qkv, cos_table, sin_table, positions, c.num_heads, c.num_kv_heads,
                                         c.head_dim, layer_kv, ctx.slot_mapping, layer["bqkv"], layer["q_norm"],
                                         layer["k_norm"], c.rms_norm_eps)
                o = native_ops.attention(q, layer_kv, ctx.block_tables, ctx.lens, ctx.longest, ctx.block_size,
                                         c.scale, window, c.attn_softcap)
            else:
                if layer["bqkv"] is not None:
                    qkv.add_(layer["bqkv"])
                if layer["q_norm"] is not None:
                    qk = qkv[:, :self.q_size + self.kv_size].view(n, c.num_heads + c.num_kv_heads, c.head_dim)
                    qk[:, :c.num_heads] = self._rms_norm(qk[:, :c.num_heads], layer["q_norm"])
                    qk[:, c.num_heads:] = self._rms_norm(qk[:, c.num_heads:], layer["k_norm"])
                cos = cos_table.index_select(0, positions).unsqueeze(1)  # [N, 1, D]
                sin = sin_table.index_select(0, positions).unsqueeze(1)
                # Rotate q and k together, in place, so K and V sit side by side for one cache write.
                qk = qkv[:, :self.q_size + self.kv_size].view(n, c.num_heads + c.num_kv_heads, c.head_dim)
                qk.copy_(self._rotate(qk, cos, sin))
                new_kv = qkv[:, self.q_size:].view(n, 2, c.num_kv_heads, c.head_dim)
                layer_kv.index_copy_(0, ctx.slot_mapping, new_kv)
                if ctx.prefill_lens is not None and ctx.prefill_start:
                    o = self._chunk_attention(q, layer_kv, ctx, positions, window)
                elif ctx.prefill_lens is not None:
                    o = self._prefill_attention(q, new_kv[:, 0], new_kv[:, 1], ctx.prefill_lens, window)
                else:
                    o = self._decode_attention(q, layer_kv, ctx, positions, window)
            o = self._linear(o.reshape(n, self.q_size), layer, "wo", ctx)
            if layer["attn_post_norm"] is not None:
                o = self._post_norm(o, layer["attn_post_norm"], native_ops)
            x = self._add_norm(h, o, layer["mlp_norm"], native_ops)
            gate_up = self._linear(x, layer, "w13", ctx)
            if native_ops is not None:
                act = native_ops.act_mul(gate_up, c.arch.mlp_act)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                act = (F.gelu(gate, approximate="tanh") if c.arch.mlp_act == "gelu_tanh" else F.silu(gate)) * up
            delta = self._linear(act, layer, "w2", ctx)
            if layer["mlp_post_norm"] is not None:
                delta = self._post_norm(delta, layer["mlp_post_norm"], native_ops)
        h.add_(delta)
        # Kept in fp32: logits() refines the top candidates in full precision.
        if native_ops is not None:  # as the one-call path ends
            return native_ops.add_rms_norm(h, None, self.final_norm, c.rms_norm_eps, torch.float32)
        return F.rms_norm(h, (c.hidden_size,), self.final_norm, c.rms_norm_eps)

    def _add_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight_fp32: torch.Tensor,
                  native_ops: DecodeKernels | None) -> torch.Tensor:
        """h += delta (in place; None adds nothing), then RMSNorm(h) in the model's dtype."""
        if native_ops is not None:
            return native_ops.add_rms_norm(h, delta, weight_fp32, self.config.rms_norm_eps, self.dtype)
        if delta is not None:
            h.add_(delta)
        return self._rms_norm(h, weight_fp32)

    def _post_norm(self, x: torch.Tensor, weight_fp32: torch.Tensor, native_ops: DecodeKernels | None) -> torch.Tensor:
        """RMSNorm of a sublayer's output [N, dim] (model dtype) before the residual add, in the model's dtype."""
        if native_ops is not None:
            return native_ops.rms_norm(x, weight_fp32, self.config.rms_norm_eps)
        return self._rms_norm(x.float(), weight_fp32)

    def _scores_attention(self, q, k, v, mask) -> torch.Tensor:
        """softmax(softcap(q k^T * scale), masked) v for q [1, H, T, D] and k, v [1, Hkv, S, D], in fp32: the
        soft-capped attention SDPA does not do (Gemma 2). One sequence a call: its shapes, and so its bits,
        depend on that sequence alone."""
        c = self.config
        group = c.num_heads // c.num_kv_heads
        k = k.repeat_interleave(group, dim=1).float()  # [1, H, S, D]
        v = v.repeat_interleave(group, dim=1).float()
        scores = torch.matmul(q.float(), k.transpose(-1, -2)) * c.scale  # [1, H, T, S]
        cap = c.attn_softcap
        scores = torch.tanh(scores / cap) * cap
        p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        return torch.matmul(p, v).to(q.dtype)  # [1, H, T, D]

    def _attend(self, q, k, v, mask) -> torch.Tensor:
        """Attention of q [B, H, T, D] over k, v [B, Hkv, S, D]; mask [B or 1, 1, T, S] bool (True = attend)."""
        if self.config.attn_softcap is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=self.config.scale)
        if q.shape[0] == 1:
            return self._scores_attention(q, k, v, mask)
        # Decode rows one by one, each over its own positions only (not the batch's padded span).
        outs = []
        for b in range(q.shape[0]):
            length = int(mask[b].reshape(-1, mask.shape[-1]).any(0).nonzero().max()) + 1
            outs.append(self._scores_attention(q[b:b + 1], k[b:b + 1, :, :length], v[b:b + 1, :, :length],
                                               mask[b:b + 1, ..., :length]))
        return torch.cat(outs)

    @staticmethod
    def _window_mask(q_positions: torch.Tensor, num_keys: int, window: int) -> torch.Tensor:
        """[T, S] bool: key position s within the window of query position q (q - window < s)."""
        keys = torch.arange(num_keys, device=q_positions.device)
        return keys[None, :] > q_positions[:, None] - window

    def _prefill_attention(self, q, k, v, lens: list[int], window: int = 0) -> torch.Tensor:
        # Each prompt attends causally to itself only; a prompt's own K/V is at hand.
        c = self.config
        outs, start = [], 0
        for length in lens:
            end = start + length
            qs = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
            ks = k[start:end].transpose(0, 1).unsqueeze(0)  # [1, Hkv, T, D]
            vs = v[start:end].transpose(0, 1).unsqueeze(0)
            if window or c.attn_softcap is not None:
                pos = torch.arange(length, device=q.device)
                mask = pos[None, :] <= pos[:, None]
                if window:
                    mask &= self._window_mask(pos, length, window)
                o = self._attend(qs, ks, vs, mask[None, None])
            else:
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True, scale=c.scale)
            outs.append(o[0].transpose(0, 1))  # [T, H, D]
            start = end
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _chunk_attention(self, q, layer_kv, ctx: AttnContext, positions: torch.Tensor, window: int = 0) -> torch.Tensor:
        # A chunk after the first: its queries see the sequence's whole K/V so far (cached prefix,
        # earlier chunks, itself), causally. The same computation whether the prefix was cached or
        # computed a moment ago, so outputs do not depend on cache hits.
        ctx_kv = layer_kv.index_select(0, ctx.context_slots)  # [end, 2, Hkv, D]
        k = ctx_kv[:, 0].transpose(0, 1).unsqueeze(0)  # [1, Hkv, end, D]
        v = ctx_kv[:, 1].transpose(0, 1).unsqueeze(0)
        mask = ctx.attn_mask
        if window:
            mask = mask & self._window_mask(positions, mask.shape[-1], window)
        o = self._attend(q.transpose(0, 1).unsqueeze(0), k, v, mask[None, None] if mask.dim() == 2 else mask)
        return o[0].transpose(0, 1)  # [T, H, D]

    def _decode_attention(self, q, layer_kv, ctx: AttnContext, positions: torch.Tensor, window: int = 0) -> torch.Tensor:
        c = self.config
        bsz = q.shape[0]
        # One gather of every sequence's context, K and V together: [B, S, 2, Hkv, D].
        ctx_kv = layer_kv.index_select(0, ctx.context_slots).view(bsz, -1, 2, c.num_kv_heads, c.head_dim)
        # In fp32: with one query per sequence torch's CPU kernel is about 4x slower in bf16 than in fp32
        # (2.0 against 0.5 ms a layer at 1,536 tokens on one core), and decode attention was then most of
        # a long context's step. A 16-bit cache is widened here, a copy the size of the gather.
        kb = ctx_kv[:, :, 0].transpose(1, 2).float()  # [B, Hkv, S, D]
        vb = ctx_kv[:, :, 1].transpose(1, 2).float()
        mask = ctx.attn_mask  # [B, 1, 1, S]
        if window:
            mask = mask & self._window_mask(positions, mask.shape[-1], window)[:, None, None, :]
        o = self._attend(q.unsqueeze(2).float(), kb, vb, mask)
        return o.squeeze(2).to(q.dtype)  # [B, H, D]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Prefill: fp32 hidden states [B, dim] → fp32 logits [B, V] (B is one row per prompt).

        In bf16 the logits come out rounded to 1/8 near 25, so near-ties among the best tokens
        would be decided by rounding (SmolLM2 ties "The" and "L" on a plain question). The
        REFINE_TOP best are recomputed exactly from fp32 weights: cheap, and greedy is then exact.
        """
        if self.head_packed is not None:
            return self._packed_logits(hidden)
        logits = F.linear(hidden.to(self.dtype), self.lm_head).float()
        if self.lm_head_fp32 is None:
            return self._softcap(logits)
        return self._softcap(self._refine(logits, hidden))

    def decode_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Decode: fp32 hidden states [B, dim] → fp32 logits [B, V], each row independent of the others.

        The int8 head (int8 activations too, on the CPU) approximates every logit (within ~5 % of the
        row's largest, 0.1 on average for SmolLM2); the REFINE_TOP best are then exact fp32, so greedy
        decoding is exact and sampling differs only in the tail. A packed head (the file's Q8_0 or K-quant
        blocks) gives prefill and decode the same logits (_packed_logits).
        """
        if self.head_packed is not None:
            return self._packed_logits(hidden)
        if self.lm_head_int8 is None:  # off the CPU: the dense head, each row in a block of fixed size
            logits = dense_rows(hidden.to(self.dtype), self.lm_head).float()
        else:
            logits = self.lm_head_int8(hidden).float()
        if self.kernels is not None and self.kernels.refines(self.config.hidden_size):  # logits.c, row by row
            return self._softcap(self.kernels.refine_top(logits.contiguous(), hidden.float().contiguous(),
                                                         self.lm_head_exact, self.REFINE_TOP))
        return self._softcap(self._refine(logits, hidden))

    def _packed_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [B, V] through the packed head: every logit from the file's blocks and the row quantized
        to 16 bits a block of 32 (within ~1e-4 of the exact value), then the REFINE_TOP best recomputed in fp32
        from the head's rows as the file stores them. The same function for prefill and decode, and for every
        role, so a row's tokens never depend on where it was computed."""
        hidden = hidden.float().contiguous()
        logits = self.head_packed(hidden).float()
        idx = logits.topk(self.REFINE_TOP, dim=-1).indices  # [B, K]
        rows = self.head_packed.rows(idx.reshape(-1)).view(*idx.shape, -1)  # [B, K, dim]
        # A product and a sum over the last dim: a row's values do not depend on the other rows.
        exact = (rows * hidden.unsqueeze(1)).sum(-1)
        return self._softcap(logits.scatter_(1, idx, exact))

    def _softcap(self, logits: torch.Tensor) -> torch.Tensor:
        """Gemma 2's final soft-cap, tanh(logits / cap) * cap, in place as HF computes it (it keeps the order
        of the logits, so the refined best stay the best)."""
        cap = self.config.final_softcap
        if cap is None:
            return logits
        return logits.div_(cap).tanh_().mul_(cap)

    def log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 hidden states [R, dim] → the exact fp32 log-softmax of the logits over the whole vocabulary [R, V].

        For reported logprobs only, never for sampling. The logits that sampling uses are exact for the
        REFINE_TOP best only, and the normaliser sums over every token: the int8 decode head's tail moves
        it by ~1.5e-3 at a typical position (up to ~4e-2), a bf16 prefill head's too. So the rows that ask
        get the full fp32 product, one row at a time (~9 ms a row on one core here; a padded block of 8
        rows costs 4-6x that), which also keeps a row's values independent of the others.
        """
        if self.head_packed is None:
            return torch.cat([F.log_softmax(self._softcap(F.linear(row, self.lm_head_exact)), dim=-1)
                              for row in hidden.float().split(1)])
        # The packed head's exact rows, a slice of the vocabulary at a time (no dense copy is held).
        vocab, step = self.config.vocab_size, 8192
        out = torch.empty(hidden.shape[0], vocab)
        for start in range(0, vocab, step):
            rows = self.head_packed.rows(torch.arange(start, min(start + step, vocab)))  # [n, dim]
            for r, row in enumerate(hidden.float().split(1)):
                out[r, start:start + rows.shape[0]] = F.linear(row, rows)[0]
        return F.log_softmax(self._softcap(out), dim=-1)

    def _refine(self, logits: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        idx = logits.topk(self.REFINE_TOP, dim=-1).indices  # [B, K]
        # A product and a sum over the last dim, not bmm: bmm picks another kernel at batch 1 than at
        # batch 2, and the refined logits must not depend on the batch (invariant 4: same inputs, same tokens).
        exact = (self.lm_head_exact[idx] * hidden.unsqueeze(1)).sum(-1)  # [B, K, dim] -> [B, K]
        return logits.scatter_(1, idx, exact)
