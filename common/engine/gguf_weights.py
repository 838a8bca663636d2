"""GGUF files (llama.cpp's format) → ModelConfig, fp32 tensors under canonical names, and the quantized
matrices exactly as stored.

What a loader must undo, per llama.cpp's converter (convert_hf_to_gguf.py): dims listed innermost first;
the Q and K rows of 'llama' files interleaved per head (its rotary takes pairs, HF's rotate_half takes
halves); Phi-3's q|k|v and gate|up fused (attn_qkv, a double-height ffn_up); llama3 rotary scaling as a
rope_freqs tensor of per-frequency divisors. Gemma's norm weights are stored as HF's w + 1 already, which
is what the layer multiplies by. What the file does not say is taken as llama.cpp takes it: which layers
slide (a pattern per architecture) and Gemma's attention scale (by the 27B shape).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from common.engine import pages
from common.engine.config import ModelConfig, RopeScaling
from common.engine.families import Family, family_of_gguf, supported_gguf_archs
from common.engine.gguf_file import GGUFFile
from common.engine.weights import (LoadedWeights, ModelLoadError, ModelNotFoundError, QuantRows, check_complete,
                                   file_digest)

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
# Types whose rows decode may read packed as stored (common/engine/native); the others are dense only.
PACKED_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",  # the norm in front of the MLP
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "post_attention_norm.weight": "post_attention_norm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Tensors that describe the rotary, not weights: read into the config.
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight")


@dataclass(frozen=True)
class _Ref:
    """Where a canonical tensor lives in the file: a tensor, a range of its rows, and the heads whose
    rows llama.cpp permuted (None if it did not)."""

    tensor: object  # GGUFTensor
    rows: slice | None = None
    heads: int | None = None


def open_gguf(path: Path) -> GGUFFile:
    """The GGUF file's metadata and tensor views, with readable errors for missing, truncated or foreign files."""
    if not path.is_file():
        raise ModelNotFoundError(f"{path}: no such file")
    try:
        return GGUFFile(path)
    except Exception as exc:  # GGUFFormatError, or numpy's own on an empty file
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc}); "
                             f"the file may be truncated or corrupt — download or reinstall it") from exc


def read_config(path: Path) -> ModelConfig:
    return gguf_config(open_gguf(path), path)


def _family(reader: GGUFFile, path: Path) -> tuple[str, Family]:
    arch = reader.fields.get("general.architecture")
    family = family_of_gguf(arch)
    if family is None:
        raise ModelLoadError(f"{path}: architecture {arch!r} is not supported (supported: {supported_gguf_archs()}"
                             f" — Llama 3.x, Mistral, SmolLM, Qwen 2.5 / 3, Phi-3, Gemma 2 / 3)")
    return arch, family


def gguf_config(reader: GGUFFile, path: Path) -> ModelConfig:
    arch, family = _family(reader, path)
    fields = reader.fields

    def get(key, default=None):
        return fields.get(f"{arch}.{key}", default)

    def need(key):
        value = get(key)
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata key '{arch}.{key}' is missing; the file is incomplete")
        return value

    hidden = int(need("embedding_length"))
    num_layers = int(need("block_count"))
    num_heads = int(need("attention.head_count"))
    num_kv_heads = int(get("attention.head_count_kv", num_heads))
    head_dim = int(get("attention.key_length", hidden // num_heads))
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise ModelLoadError(f"{path}: partial rotary ({get('rope.dimension_count')} of {head_dim} dims) is not "
                             f"supported")
    tensors = {t.name: t for t in reader.tensors}
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise ModelLoadError(f"{path}: tensor 'token_embd.weight' is missing")
    max_position = int(get("context_length", 2048))
    rope_scaling = _rope_scaling(get, tensors, path)
    if rope_scaling is not None and rope_scaling.kind == "longrope":
        # Phi-3.5: short factors up to the original context, long ones past it (HF switches by the
        # sequence's length, llama.cpp by the context's): served with the short ones, up to there.
        max_position = rope_scaling.original_max_position
    window = int(get("attention.sliding_window", 0) or 0)
    windows: tuple[int, ...] = ()
    if window:
        pattern = get("attention.sliding_window_pattern", family.gguf_window_pattern)
        if isinstance(pattern, list):
            slides = [bool(p) for p in pattern][:num_layers]
        elif pattern:  # llama.cpp's rule: layer i slides unless i % n == n - 1
            slides = [i % int(pattern) < int(pattern) - 1 for i in range(num_layers)]
        else:  # every layer (Phi-3's window; llama.cpp switches it off, HF keeps it)
            slides = [True] * num_layers
        windows = tuple(window if s else 0 for s in slides)
    attn_scale = None
    if family.name in ("gemma2", "gemma3") and num_layers in (46, 62):
        # llama.cpp's rule for Gemma 2 / 3 27B, whose query_pre_attn_scalar is hidden / heads, not head_dim
        attn_scale = (hidden / num_heads) ** -0.5
    return ModelConfig(
        vocab_size=int(get("vocab_size", int(embd.shape[1]))),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position=max_position,
        tie_embeddings="output.weight" not in tensors,
        family=family.name,
        rope_scaling=rope_scaling,
        rope_local_theta=(float(get("rope.freq_base_swa", 10000.0)) if family.name == "gemma3"
                          else None if get("rope.freq_base_swa") is None else float(get("rope.freq_base_swa"))),
        layer_windows=windows,
        attn_scale=attn_scale,
        attn_softcap=_positive(get("attn_logit_softcapping")),
        final_softcap=_positive(get("final_logit_softcapping")),
        qkv_bias=family.qkv_bias or "blk.0.attn_q.bias" in tensors,
    )


def _positive(value) -> float | None:
    return float(value) if value else None


def _rope_scaling(get, tensors: dict, path: Path) -> RopeScaling | None:
    def factors(name: str) -> tuple[float, ...]:
        return tuple(float(v) for v in np.asarray(tensors[name].data, dtype=np.float32).reshape(-1))

    kind = get("rope.scaling.type", "none") or "none"
    original = int(get("rope.scaling.original_context_length", 0) or 0)
    try:
        if "rope_factors_short.weight" in tensors:
            return RopeScaling("longrope", original_max_position=original or int(get("context_length", 0)),
                               attention_factor=float(get("rope.scaling.attn_factor", 1.0)),
                               freq_factors=factors("rope_factors_short.weight"))
        if "rope_freqs.weight" in tensors:  # llama3 scaling, as llama.cpp's converter writes it
            return RopeScaling("factors", freq_factors=factors("rope_freqs.weight"))
        if kind == "none":
            return None
        if kind == "linear":
            return RopeScaling("linear", factor=float(get("rope.scaling.factor", 1.0)))
        if kind == "yarn":
            attn = get("rope.scaling.attn_factor")
            return RopeScaling("yarn", factor=float(get("rope.scaling.factor", 1.0)), original_max_position=original,
                               beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0)),
                               beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0)),
                               attention_factor=None if attn is None else float(attn))
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    raise ModelLoadError(f"{path}: rotary scaling {kind!r} is not supported (supported: linear, llama3, yarn, "
                         f"longrope)")


def load(path: Path, progress: bool) -> LoadedWeights:
    reader = open_gguf(path)
    arch, family = _family(reader, path)
    config = gguf_config(reader, path)
    refs: dict[str, _Ref] = {}
    for t in tqdm(reader.tensors, desc=f"loading {path.name}", unit="tensor", disable=not progress, leave=False):
        if t.name in _ROPE_TENSORS or t.name.endswith("rot_embd.weight"):
            continue  # read into the config / precomputed tables some old files carry
        qtype = t.tensor_type.name
        if qtype not in SUPPORTED_TYPES:
            raise ModelLoadError(f"{path}: tensor {t.name} has type {qtype}, which is not supported "
                                 f"(supported: {', '.join(SUPPORTED_TYPES)})")
        if t.data.nbytes != t.n_bytes:  # the memory map ends early: caught now, not at first use
            raise ModelLoadError(f"{path}: tensor {t.name} ({qtype}) has {t.data.nbytes} of its {t.n_bytes} "
                                 f"bytes; the file is truncated or corrupt")
        refs.update(_refs(t, config, family, arch, path))
    shapes = {}
    for name, ref in refs.items():
        rows, cols = _shape(ref.tensor)
        if ref.rows is not None:
            rows = len(range(*ref.rows.indices(rows)))
        shapes[name] = (rows, cols) if len(ref.tensor.shape) > 1 else (rows,)
    check_complete(shapes, config, path)
    packed = {n: r for n, r in refs.items() if r.tensor.tensor_type.name in PACKED_TYPES}
    return LoadedWeights(config, GGUFTensors(path, refs, _read_dense), file_digest([path]), path,
                         GGUFTensors(path, packed, _read_rows))


def _shape(t) -> tuple[int, int]:
    dims = [int(d) for d in t.shape]  # innermost first
    return (dims[1] if len(dims) > 1 else dims[0]), dims[0]


def _refs(t, config: ModelConfig, family: Family, arch: str, path: Path) -> dict[str, _Ref]:
    if t.name in _TOP_NAMES:
        return {_TOP_NAMES[t.name]: _Ref(t)}
    if t.name.startswith("blk."):
        _, idx, rest = t.name.split(".", 2)
        p = f"model.layers.{idx}."
        c = config
        if family.fused_projections and rest == "attn_qkv.weight":
            q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
            return {p + "self_attn.q_proj.weight": _Ref(t, slice(0, q)),
                    p + "self_attn.k_proj.weight": _Ref(t, slice(q, q + kv)),
                    p + "self_attn.v_proj.weight": _Ref(t, slice(q + kv, q + 2 * kv))}
        if family.fused_projections and rest == "ffn_up.weight" and _shape(t)[0] == 2 * c.intermediate_size:
            f = c.intermediate_size
            return {p + "mlp.gate_proj.weight": _Ref(t, slice(0, f)), p + "mlp.up_proj.weight": _Ref(t, slice(f, 2 * f))}
        if rest in _LAYER_NAMES:
            heads = None
            if family.gguf_permuted_qk and rest in ("attn_q.weight", "attn_q.bias"):
                heads = c.num_heads
            elif family.gguf_permuted_qk and rest in ("attn_k.weight", "attn_k.bias"):
                heads = c.num_kv_heads
            return {p + _LAYER_NAMES[rest]: _Ref(t, heads=heads)}
    raise ModelLoadError(f"{path}: unexpected tensor {t.name!r} for a {arch!r} model")


def undo_llama_cpp_permute(w, num_heads: int):  # a numpy array or a torch tensor, rows first
    # llama.cpp's converter reorders each head's rows from [first half | second half]
    # (HF's rotate_half layout) to interleaved pairs; this is its exact inverse.
    rows = w.shape[0]
    return (w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _raw_rows(ref: _Ref) -> np.ndarray:
    """The tensor's rows as the file stores them ([rows, bytes] for block types, [rows, cols] or [cols]
    for plain ones), ref.rows selected and llama.cpp's permutation undone."""
    raw = np.asarray(ref.tensor.data)
    if ref.rows is not None:
        raw = raw[ref.rows]
    if ref.heads is not None:
        raw = undo_llama_cpp_permute(raw, ref.heads)
    return raw


def _read_rows(ref: _Ref) -> QuantRows:
    return QuantRows(ref.tensor.tensor_type.name, np.ascontiguousarray(_raw_rows(ref)), _shape(ref.tensor)[1])


def _read_dense(ref: _Ref) -> torch.Tensor:
    """One canonical tensor as HF has it: fp32, [out, in]."""
    t = ref.tensor
    raw = _raw_rows(ref)
    w = dequantize_blocks(raw, t.tensor_type.name)
    if w is None:
        import gguf

        w = torch.from_numpy(np.array(gguf.quants.dequantize(raw, t.tensor_type), dtype=np.float32))
    return w.reshape(raw.shape[0], -1).contiguous() if len(t.shape) > 1 else w.reshape(-1).contiguous()


class GGUFTensors(Mapping):
    """Canonical name -> a tensor read from the memory-mapped GGUF file at each access, and not kept: a
    model built from it holds one copy of its weights (its own), never a second full fp32 set beside it,
    so loading peaks at about the model's own size."""

    def __init__(self, path: Path, refs: dict[str, _Ref], read):
        self._path = path
        self._refs = refs
        self._read = read  # _Ref -> the value

    def __getitem__(self, name: str):
        ref = self._refs[name]
        try:
            return self._read(ref)
        except Exception as exc:
            raise ModelLoadError(f"{self._path}: tensor {ref.tensor.name} ({ref.tensor.tensor_type.name}) could not "
                                 f"be read: {exc}; the file may be truncated or corrupt") from exc

    def __contains__(self, name) -> bool:  # Mapping's reads the tensor to answer
        return name in self._refs

    def __iter__(self):
        return iter(self._refs)

    def __len__(self) -> int:
        return len(self._refs)

    def qtype(self, name: str) -> str:
        """The file's type of a tensor (without reading it)."""
        return self._refs[name].tensor.tensor_type.name

    def drop_pages(self, name: str) -> None:
        """Once a tensor is read into the model's own copy: its file pages out of this process's resident set
        (pages.drop_file_pages; they stay in the page cache, and a later read faults them back)."""
        pages.drop_file_pages(self._refs[name].tensor.data)


def dequantize_blocks(raw: np.ndarray, qtype: str) -> torch.Tensor | None:
    """Plain types, or Q4_0, Q4_1 or Q8_0 blocks (uint8, [rows, bytes]) → fp32 [rows, values], the whole
    tensor in a few torch operations with the gguf package's arithmetic (fp32 d * q, + m for Q4_1), so
    the same bits; None for other types. The package loops over groups of rows in Python: 3 of a
    worker's 6 s of start-up, this about a fifth of that."""
    if qtype in ("F32", "F16"):
        return torch.from_numpy(np.array(raw, dtype=np.float32))
    if qtype == "BF16":  # the reader gives its bytes: the upper halves of fp32 numbers
        return torch.from_numpy((np.array(raw).view(np.uint16).astype(np.uint32) << 16).view(np.float32))
    block_bytes = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}.get(qtype)
    if block_bytes is None or raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] % block_bytes:
        return None
    rows = raw.shape[0]
    blocks = torch.from_numpy(np.array(raw)).view(rows, -1, block_bytes)  # a copy: the map is read-only
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # [rows, blocks, 1]
    if qtype == "Q8_0":
        return (blocks[..., 2:].contiguous().view(torch.int8).float() * d).view(rows, -1)
    qs = blocks[..., 4:] if qtype == "Q4_1" else blocks[..., 2:]
    # Low nibbles hold a block's first 16 values, high nibbles the next 16.
    q = torch.cat([qs & 0xF, qs >> 4], dim=-1).float()
    if qtype == "Q4_0":
        return q.sub_(8).mul_(d).view(rows, -1)
    m = blocks[..., 2:4].contiguous().view(torch.float16).float()
    return q.mul_(d).add_(m).view(rows, -1)
