"""The model families handoff serves, each a small description over one shared decoder layer (model.py).

A layer is: x = norm(h); attention (q, k, v projections, rotary, GQA over the paged cache, o projection);
h += out; x = norm(h); MLP (act(x W1) * (x W3)) W2; h += out. A family switches parts of it on:

| family | what differs |
| --- | --- |
| llama, mistral | nothing (Llama 3.x: llama3 rotary scaling; Mistral: a sliding window in some checkpoints) |
| qwen2 | biases on the q, k, v projections |
| qwen3 | RMSNorm of every q and k head before the rotation |
| phi3 | nothing in the layer; its checkpoints store qkv and gate+up fused (split at load) |
| gemma2 | GeGLU (tanh-GELU), embeddings scaled by sqrt(hidden), each sublayer's output normed before the residual add, attention and final logits soft-capped, every other layer a sliding window |
| gemma3 | gemma2's, less the soft-caps, plus q/k norms; five sliding layers (own rotary base) to one full |

Checkpoint quirks live in the loaders (weights.py), never in the layer: Gemma's HF norm weights are
stored as w - 1, llama.cpp permutes the Q/K rows of 'llama' files only, Phi-3's fused tensors.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str
    hf_model_types: tuple[str, ...]  # config.json's model_type
    gguf_archs: tuple[str, ...]  # a GGUF's general.architecture
    qkv_bias: bool = False  # the q, k and v projections carry a bias
    qk_norm: bool = False  # RMSNorm of every q and k head (its own weights) before the rotation
    post_norms: bool = False  # each sublayer's output is normed before it is added to the residual
    mlp_act: str = "silu"  # the gate's activation: "silu" or "gelu_tanh"
    embed_scaled: bool = False  # embeddings are multiplied by sqrt(hidden_size)
    hf_norm_offset: float = 0.0  # HF checkpoints store norm weights minus this (Gemma: x * (1 + w))
    gguf_permuted_qk: bool = False  # llama.cpp's converter interleaved each head's Q and K rows
    fused_projections: bool = False  # checkpoints store q|k|v and gate|up as one matrix each
    tie_default: bool = False  # tie_word_embeddings where config.json does not say
    # GGUF files do not list which layers slide: llama.cpp derives it from a pattern per architecture
    # (layer i slides unless i % n == n - 1), which is what their models were trained with.
    gguf_window_pattern: int = 0


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", ("llama",), ("llama",), gguf_permuted_qk=True),
    # Mistral GGUFs are written as 'llama' files: they load as the llama family, as llama.cpp serves them.
    Family("mistral", ("mistral",), (), gguf_permuted_qk=True),
    Family("qwen2", ("qwen2",), ("qwen2",), qkv_bias=True),
    Family("qwen3", ("qwen3",), ("qwen3",), qk_norm=True),
    Family("phi3", ("phi3",), ("phi3",), fused_projections=True),
    Family("gemma2", ("gemma2",), ("gemma2",), post_norms=True, mlp_act="gelu_tanh", embed_scaled=True,
           hf_norm_offset=1.0, tie_default=True, gguf_window_pattern=2),
    Family("gemma3", ("gemma3_text", "gemma3"), ("gemma3",), qk_norm=True, post_norms=True, mlp_act="gelu_tanh",
           embed_scaled=True, hf_norm_offset=1.0, tie_default=True, gguf_window_pattern=6),
)}


def family_of_hf(model_type: object) -> Family | None:
    return next((f for f in FAMILIES.values() if model_type in f.hf_model_types), None)


def family_of_gguf(arch: object) -> Family | None:
    return next((f for f in FAMILIES.values() if arch in f.gguf_archs), None)


def supported_hf_types() -> str:
    return ", ".join(repr(t) for f in FAMILIES.values() for t in f.hf_model_types)


def supported_gguf_archs() -> str:
    return ", ".join(repr(a) for f in FAMILIES.values() for a in f.gguf_archs)
