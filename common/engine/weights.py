"""Weight loading: a GGUF file or an HF checkpoint folder → one model description and its tensors.

Every family's checkpoints come out under one set of names (HF Llama's, plus the extras some families
have; `expected_shapes` lists them), in fp32, with every quirk of the file undone here, once, so the
model code never sees it: GGUF's reversed dimension order, llama.cpp's per-head Q/K row permutation,
fused tensors (Phi-3), Gemma's norm weights stored as w - 1 in HF folders. A GGUF's quantized tensors
also come out exactly as stored (`LoadedWeights.packed`), for the decode kernels that read them packed.
The loaders themselves: gguf_weights.py and hf_weights.py.
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from common.engine.config import ModelConfig
from common.engine.model_files import ModelNotFoundError, resolve_model_path  # noqa: F401 (re-exported)


class ModelLoadError(ValueError):
    """A model file could not be used; the message names the file and what is wrong."""


@dataclass(frozen=True)
class QuantRows:
    """A quantized matrix exactly as the GGUF file stores it: row r is the blocks of output r's inputs.

    Rows are independent (every GGML block format quantizes within a row), so selecting or reordering
    rows (a fused tensor's parts, llama.cpp's Q/K permutation undone) keeps every byte as stored."""

    qtype: str  # the GGML type's name: Q4_0, Q4_K, Q6_K, Q8_0, ...
    data: np.ndarray  # uint8 [rows, bytes per row]
    cols: int  # inputs per row

    @property
    def rows(self) -> int:
        return self.data.shape[0]


@dataclass
class Int4Weight:
    """w = codes * scales + mins, per group of 32 along the input dimension (GGUF Q4_1; Q4_0 has mins = -8 scales).

    scales and mins hold the file's fp16 values exactly."""

    codes: np.ndarray  # [out, in] uint8 in 0..15
    scales: np.ndarray  # [out, in / 32] float32
    mins: np.ndarray  # [out, in / 32] float32

    GROUP = 32

    @property
    def zeros(self) -> np.ndarray:
        """The same weight as (codes - 8) * scales + zeros, the form torch's int4 kernel takes."""
        return self.mins + 8 * self.scales

    @classmethod
    def from_rows(cls, q: QuantRows) -> Int4Weight | None:
        """Q4_0 / Q4_1 rows → codes, scales and mins, bit-exact (no dequantize-requantize round trip)."""
        if q.qtype not in ("Q4_0", "Q4_1"):
            return None
        rows = q.rows
        blocks = q.data.reshape(rows, -1, 18 if q.qtype == "Q4_0" else 20)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        if q.qtype == "Q4_0":  # x = (q - 8) * d = q * d + (-8 d)
            m, qs = -8 * d, blocks[..., 2:]
        else:  # x = q * d + m
            m, qs = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32), blocks[..., 4:]
        # Low nibbles hold the block's first 16 values, high nibbles the next 16.
        codes = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(rows, -1)
        return cls(np.ascontiguousarray(codes), np.ascontiguousarray(d), np.ascontiguousarray(m))


class _Int4View(Mapping):
    """name -> Int4Weight of the packed tensors in Q4_0 / Q4_1, made at access."""

    def __init__(self, packed: Mapping[str, QuantRows]):
        self._packed = packed
        self._names = [n for n, q in packed.items() if q.qtype in ("Q4_0", "Q4_1")]

    def __getitem__(self, name: str) -> Int4Weight:
        if name not in self._names:
            raise KeyError(name)
        return Int4Weight.from_rows(self._packed[name])

    def __contains__(self, name) -> bool:
        return name in self._names

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


@dataclass
class LoadedWeights:
    config: ModelConfig
    tensors: Mapping[str, torch.Tensor]  # canonical names, fp32, [out, in] for projections (GGUF: read at access)
    weights_id: str  # content hash of the weight files: the model's identity on the wire
    source: Path
    # GGUF: the quantized matrices exactly as stored, by canonical name (read at access).
    packed: Mapping[str, QuantRows] = field(default_factory=dict)

    @property
    def int4(self) -> Mapping[str, Int4Weight]:
        """The packed matrices in Q4_0 / Q4_1 as codes, scales and mins."""
        return _Int4View(self.packed)


def load_weights(name_or_path: str | Path, progress: bool = True) -> LoadedWeights:
    """Load a .gguf file or an HF checkpoint folder (config.json + *.safetensors)."""
    from common.engine import gguf_weights, hf_weights

    path = resolve_model_path(name_or_path)
    if path.is_dir():
        return hf_weights.load(path, progress)
    if path.suffix == ".gguf":
        return gguf_weights.load(path, progress)
    raise ModelLoadError(f"{path}: not a .gguf file nor an HF checkpoint folder "
                         f"(a folder with config.json and *.safetensors)")


def read_model_config(name_or_path: str | Path) -> ModelConfig:
    """The model's shape from its metadata alone, without reading the weights."""
    from common.engine import gguf_weights, hf_weights

    path = resolve_model_path(name_or_path)
    if path.is_dir():
        return hf_weights.read_config(path)
    return gguf_weights.read_config(path)


def weights_id_of(name_or_path: str | Path) -> str:
    """The same identity load_weights() reports, without loading: a hash of the weight files."""
    from common.engine import hf_weights

    path = resolve_model_path(name_or_path)
    return file_digest(hf_weights.weight_files(path) if path.is_dir() else [path])


def file_digest(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()[:32]


def expected_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model of config c reads, by canonical name, with its shape.

    Canonical names are HF Llama's, plus: q/k/v_proj.bias (Qwen 2), self_attn.q_norm / k_norm (Qwen 3,
    Gemma 3), post_attention_norm and post_feedforward_layernorm (Gemma's norms of a sublayer's output).
    `post_attention_layernorm` is always the norm in front of the MLP, whatever a family calls it."""
    q_rows, kv_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    arch = c.arch
    out = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size), "model.norm.weight": (c.hidden_size,)}
    if not c.tie_embeddings:
        out["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": (c.hidden_size,),
            p + "post_attention_layernorm.weight": (c.hidden_size,),
            p + "self_attn.q_proj.weight": (q_rows, c.hidden_size),
            p + "self_attn.k_proj.weight": (kv_rows, c.hidden_size),
            p + "self_attn.v_proj.weight": (kv_rows, c.hidden_size),
            p + "self_attn.o_proj.weight": (c.hidden_size, q_rows),
            p + "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
        })
        if c.qkv_bias:
            out.update({p + "self_attn.q_proj.bias": (q_rows,), p + "self_attn.k_proj.bias": (kv_rows,),
                        p + "self_attn.v_proj.bias": (kv_rows,)})
        if arch.qk_norm:
            out.update({p + "self_attn.q_norm.weight": (c.head_dim,), p + "self_attn.k_norm.weight": (c.head_dim,)})
        if arch.post_norms:
            out.update({p + "post_attention_norm.weight": (c.hidden_size,),
                        p + "post_feedforward_layernorm.weight": (c.hidden_size,)})
    return out


def check_complete(shapes: Mapping[str, tuple[int, ...]], config: ModelConfig, source: Path) -> None:
    """Every tensor the model needs is there, with the shape its metadata implies (name -> shape)."""
    for name, shape in expected_shapes(config).items():
        if name not in shapes:
            raise ModelLoadError(f"{source}: tensor {name} is missing")
        if tuple(shapes[name]) != shape:
            raise ModelLoadError(f"{source}: tensor {name} has shape {tuple(shapes[name])}, "
                                 f"expected {shape} from the model's metadata")


def trim_memory() -> None:
    """Hand freed heap pages back to the OS: the fp32 copies made while loading are gone by now,
    but glibc keeps their pages (~550 MiB for SmolLM2) unless asked."""
    import gc

    gc.collect()
    release_freed_pages()


def release_freed_pages() -> None:
    """glibc's malloc_trim alone (no garbage collection: cheap enough to call once per layer while a
    model is built, so that one layer's temporary fp32 copies never pile up on the next ones')."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: nothing to do
        pass
