"""Weight loaders: GGUF files and HF checkpoint folders, both into HF-named fp32 tensors.

Checkpoint quirks (GGUF's reversed dimension order, llama.cpp's per-head row
permutation of the Q and K projections) are undone here, once, so the model code
never sees them.
"""
from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from common.engine.config import ModelConfig
from common.engine.gguf_file import GGUFFile
from common.engine.models import ModelNotFoundError, resolve_model_path

log = logging.getLogger(__name__)

SUPPORTED_GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                        "Q4_K", "Q5_K", "Q6_K")

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class ModelLoadError(ValueError):
    """A model file could not be used; the message names the file and what is wrong."""


@dataclass
class LoadedWeights:
    config: ModelConfig
    tensors: Mapping[str, torch.Tensor]  # HF names, fp32, [out, in] for projections (GGUF: read at access)
    weights_id: str  # content hash of the weight files: the model's identity on the wire
    source: Path
    # 4-bit tensors exactly as stored (GGUF Q4_0/Q4_1): name -> Int4Weight, for fast small-batch decode.
    int4: Mapping[str, "Int4Weight"] = field(default_factory=dict)


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


def load_weights(name_or_path: str | Path, progress: bool = True) -> LoadedWeights:
    """Load a .gguf file or an HF checkpoint folder (config.json + *.safetensors)."""
    path = resolve_model_path(name_or_path)
    if path.is_dir():
        return _load_hf_folder(path, progress)
    if path.suffix == ".gguf":
        return _load_gguf(path, progress)
    raise ModelLoadError(f"{path}: not a .gguf file nor an HF checkpoint folder "
                         f"(a folder with config.json and *.safetensors)")


def file_digest(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()[:32]


# --------------------------------------------------------------------------- GGUF

def _undo_llama_cpp_permute(w, num_heads: int):  # a numpy array or a torch tensor
    # llama.cpp's converter reorders each head's rows from [first half | second half]
    # (HF's rotate_half layout) to interleaved pairs; this is its exact inverse.
    rows = w.shape[0]
    return (w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _int4_from_gguf(t, num_heads: int | None) -> Int4Weight | None:
    """Q4_0 / Q4_1 blocks → Int4Weight, bit-exact (no dequantize-requantize round trip)."""
    qtype = t.tensor_type.name
    if qtype not in ("Q4_0", "Q4_1"):
        return None
    raw = np.asarray(t.data)
    rows = raw.shape[0]
    block_bytes = 18 if qtype == "Q4_0" else 20
    blocks = raw.reshape(rows, -1, block_bytes)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if qtype == "Q4_0":  # x = (q - 8) * d = q * d + (-8 d)
        m, qs = -8 * d, blocks[..., 2:]
    else:  # x = q * d + m
        m, qs = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32), blocks[..., 4:]
    # Low nibbles hold the block's first 16 values, high nibbles the next 16.
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(rows, -1)
    if num_heads is not None:
        codes = _undo_llama_cpp_permute(codes, num_heads)
        d = _undo_llama_cpp_permute(d, num_heads)
        m = _undo_llama_cpp_permute(m, num_heads)
    return Int4Weight(np.ascontiguousarray(codes), np.ascontiguousarray(d), np.ascontiguousarray(m))


def gguf_config(reader, path: Path) -> ModelConfig:
    arch = reader.fields.get("general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"{path}: architecture {arch!r} is not supported "
                             f"(supported: 'llama' — Llama, Mistral, SmolLM and other Llama-family models)")

    def need(key):
        value = reader.fields.get(f"llama.{key}")
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata key 'llama.{key}' is missing; the file is incomplete")
        return value

    hidden = int(need("embedding_length"))
    num_heads = int(need("attention.head_count"))
    num_kv_heads = int(reader.fields.get("llama.attention.head_count_kv", num_heads))
    head_dim = int(reader.fields.get("llama.attention.key_length", hidden // num_heads))
    names = {t.name for t in reader.tensors}
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ModelLoadError(f"{path}: tensor 'token_embd.weight' is missing")
    if reader.fields.get("llama.rope.scaling.type", "none") not in ("none", None) or "rope_freqs.weight" in names:
        raise ModelLoadError(f"{path}: rotary scaling is not supported yet (plain RoPE only)")
    return ModelConfig(
        vocab_size=int(reader.fields.get("llama.vocab_size", int(embd.shape[1]))),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rope_theta=float(reader.fields.get("llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(reader.fields.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position=int(reader.fields.get("llama.context_length", 2048)),
        tie_embeddings="output.weight" not in names,
    )


def open_gguf(path: Path) -> GGUFFile:
    """The GGUF file's metadata and tensor views, with readable errors for missing, truncated or foreign files."""
    if not path.is_file():
        raise ModelNotFoundError(f"{path}: no such file")
    try:
        return GGUFFile(path)
    except Exception as exc:  # GGUFFormatError, or numpy's own on an empty file
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc}); "
                             f"the file may be truncated or corrupt — download or reinstall it") from exc


def _load_gguf(path: Path, progress: bool) -> LoadedWeights:
    reader = open_gguf(path)
    config = gguf_config(reader, path)
    entries: dict[str, tuple] = {}  # HF name -> (the file's tensor, heads to un-permute or None)
    for t in tqdm(reader.tensors, desc=f"loading {path.name}", unit="tensor", disable=not progress,
                  leave=False):
        hf_name = _gguf_to_hf_name(t.name, path)
        if hf_name is None:
            continue
        qtype = t.tensor_type.name
        if qtype not in SUPPORTED_GGUF_TYPES:
            raise ModelLoadError(f"{path}: tensor {t.name} has type {qtype}, which is not supported "
                                 f"(supported: {', '.join(SUPPORTED_GGUF_TYPES)})")
        if t.data.nbytes != t.n_bytes:  # the memory map ends early: caught now, not at first use
            raise ModelLoadError(f"{path}: tensor {t.name} ({qtype}) has {t.data.nbytes} of its {t.n_bytes} "
                                 f"bytes; the file is truncated or corrupt")
        heads = (config.num_heads if t.name.endswith("attn_q.weight") else
                 config.num_kv_heads if t.name.endswith("attn_k.weight") else None)
        entries[hf_name] = (t, heads)
    _check_complete({name: tuple(int(d) for d in reversed(t.shape)) for name, (t, _) in entries.items()},
                    config, path)
    tensors = GGUFTensors(path, entries, _dequantize)
    int4 = {name: e for name, e in entries.items() if e[0].tensor_type.name in ("Q4_0", "Q4_1")}
    return LoadedWeights(config, tensors, file_digest([path]), path, GGUFTensors(path, int4, _int4_from_gguf))


class GGUFTensors(Mapping):
    """HF name -> a weight read from the memory-mapped GGUF file at each access, and not kept: a model
    built from it holds one copy of its weights (its own), never a second full fp32 set beside it, so
    loading peaks at about the model's own size."""

    def __init__(self, path: Path, entries: dict[str, tuple], read):
        self._path = path
        self._entries = entries
        self._read = read  # (tensor, heads) -> the value

    def __getitem__(self, name: str):
        t, heads = self._entries[name]
        try:
            return self._read(t, heads)
        except Exception as exc:
            raise ModelLoadError(f"{self._path}: tensor {t.name} ({t.tensor_type.name}) could not be read: "
                                 f"{exc}; the file may be truncated or corrupt") from exc

    def __contains__(self, name) -> bool:  # Mapping's reads the tensor to answer
        return name in self._entries

    def __iter__(self):
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def _dequantize(t, heads: int | None) -> torch.Tensor:
    """One GGUF tensor as HF has it: fp32, [out, in], llama.cpp's Q/K row order undone."""
    w = _dequantize_blocks(np.asarray(t.data), t.tensor_type.name)
    if w is None:
        import gguf

        w = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
    # GGUF lists dimensions innermost first; the rows are already [out, in].
    expected = tuple(int(d) for d in reversed(t.shape))
    if tuple(w.shape) != expected:
        w = w.reshape(expected)
    if heads is not None:
        w = _undo_llama_cpp_permute(w, heads)
    return w.contiguous()


def _dequantize_blocks(raw: np.ndarray, qtype: str) -> torch.Tensor | None:
    """Q4_0, Q4_1 or Q8_0 blocks (uint8, [rows, bytes]) → fp32 [rows, values], the whole tensor in a few
    torch operations with the gguf package's arithmetic (fp32 d * q, + m for Q4_1), so the same bits;
    None for other types. The package loops over groups of rows in Python: 3 of a worker's 6 s of
    start-up, this about a fifth of that."""
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


def _gguf_to_hf_name(name: str, path: Path) -> str | None:
    if name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[name]
    if name.startswith("blk."):
        _, idx, rest = name.split(".", 2)
        if rest in _GGUF_LAYER_NAMES:
            return f"model.layers.{idx}.{_GGUF_LAYER_NAMES[rest]}"
    if name.endswith("rot_embd.weight"):  # precomputed rotary tables some old files carry
        return None
    raise ModelLoadError(f"{path}: unexpected tensor {name!r} for a llama model")


# --------------------------------------------------------------------------- HF folders

def hf_config(folder: Path) -> ModelConfig:
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{folder}: no config.json; an HF checkpoint folder needs config.json "
                             f"and *.safetensors")
    try:
        cfg = json.loads(cfg_path.read_text())
    except ValueError as exc:
        raise ModelLoadError(f"{cfg_path}: not valid JSON ({exc})") from exc
    model_type = cfg.get("model_type")
    if model_type not in ("llama", "mistral"):
        raise ModelLoadError(f"{cfg_path}: model_type {model_type!r} is not supported "
                             f"(supported: 'llama', 'mistral')")
    # transformers 5 writes rope settings into rope_parameters, older versions into rope_scaling.
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ModelLoadError(f"{cfg_path}: rotary scaling {rope_type!r} is not supported yet (plain RoPE only)")
    num_heads = int(cfg["num_attention_heads"])
    return ModelConfig(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // num_heads),
        rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta", 10000.0)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position=int(cfg.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def _load_hf_folder(folder: Path, progress: bool) -> LoadedWeights:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config = hf_config(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors files (.bin checkpoints are not supported; "
                             f"convert them to safetensors)")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        wanted = _index_shards(index)
        missing = [f for f in wanted if not (folder / f).is_file()]
        if missing:
            raise ModelLoadError(f"{folder}: shards listed in {index.name} are missing: {', '.join(missing)}")
        files = [folder / f for f in wanted]
    tensors: dict[str, torch.Tensor] = {}
    for f in tqdm(files, desc=f"loading {folder.name}", unit="shard", disable=not progress, leave=False):
        try:
            shard = load_file(f)
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelLoadError(f"{f}: not a readable safetensors file ({exc}); "
                                 f"the file may be truncated or corrupt") from exc
        for name, t in shard.items():
            tensors[name] = t.float()
    _check_complete({name: tuple(t.shape) for name, t in tensors.items()}, config, folder)
    return LoadedWeights(config, tensors, file_digest(files), folder)


def _index_shards(index: Path) -> list[str]:
    try:
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelLoadError(f"{index}: not a valid safetensors index ({type(exc).__name__}: {exc})") from exc


def _check_complete(shapes: Mapping[str, tuple[int, ...]], config: ModelConfig, source: Path) -> None:
    """Every tensor the model needs is there, with the shape its metadata implies (name -> shape)."""
    c = config
    q_rows, kv_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    expected = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
                "model.norm.weight": (c.hidden_size,)}
    if not c.tie_embeddings:
        expected["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        expected.update({
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
    for name, shape in expected.items():
        if name not in shapes:
            raise ModelLoadError(f"{source}: tensor {name} is missing")
        if tuple(shapes[name]) != shape:
            raise ModelLoadError(f"{source}: tensor {name} has shape {tuple(shapes[name])}, "
                                 f"expected {shape} from the model's metadata")


def read_model_config(name_or_path: str | Path) -> ModelConfig:
    """The model's shape from its metadata alone, without reading the weights."""
    path = resolve_model_path(name_or_path)
    if path.is_dir():
        return hf_config(path)
    return gguf_config(open_gguf(path), path)


def weights_id_of(name_or_path: str | Path) -> str:
    """The same identity load_weights() reports, without loading: a hash of the weight files."""
    path = resolve_model_path(name_or_path)
    if path.is_dir():
        index = path / "model.safetensors.index.json"
        files = ([path / f for f in _index_shards(index)]
                 if index.is_file() else sorted(path.glob("*.safetensors")))
        return file_digest(files)
    return file_digest([path])


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
