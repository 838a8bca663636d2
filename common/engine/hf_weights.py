"""HF checkpoint folders (config.json + *.safetensors) → ModelConfig and fp32 tensors under canonical names.

config.json comes in two dialects: transformers 5 writes rotary settings as `rope_parameters` (per layer
type for Gemma 3), older versions as `rope_theta` + `rope_scaling`; both are read. What the layer must
not see is undone here: Phi-3's fused qkv_proj / gate_up_proj are split, Gemma's norm weights (stored as
w - 1, the layer multiplying by 1 + w) get their 1 back, Gemma's own norm names become the canonical
ones (weights.expected_shapes), and Gemma 3's multimodal checkpoints give their language model.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from tqdm import tqdm

from common.engine.config import ModelConfig, RopeScaling
from common.engine.families import Family, family_of_hf, supported_hf_types
from common.engine.weights import LoadedWeights, ModelLoadError, check_complete, expected_shapes, file_digest

log = logging.getLogger(__name__)

_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
# Gemma 3 multimodal checkpoints keep the language model under a prefix (two spellings across versions).
_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
             ("language_model.lm_head.", "lm_head."))


def read_config(folder: Path) -> ModelConfig:
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{folder}: no config.json; an HF checkpoint folder needs config.json "
                             f"and *.safetensors")
    try:
        cfg = json.loads(cfg_path.read_text())
    except ValueError as exc:
        raise ModelLoadError(f"{cfg_path}: not valid JSON ({exc})") from exc
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{cfg_path}: not a JSON object")
    try:
        return _config(cfg, cfg_path)
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ModelLoadError):
            raise
        what = f"key {exc} is missing" if isinstance(exc, KeyError) else str(exc)
        raise ModelLoadError(f"{cfg_path}: {what}") from exc


def _config(cfg: dict, cfg_path: Path) -> ModelConfig:
    if isinstance(cfg.get("text_config"), dict):  # Gemma 3 4B+: a language model inside a multimodal one
        cfg = {"model_type": "gemma3_text", **cfg["text_config"]}
    family = family_of_hf(cfg.get("model_type"))
    if family is None:
        raise ModelLoadError(f"{cfg_path}: model_type {cfg.get('model_type')!r} is not supported "
                             f"(supported: {supported_hf_types()})")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if _ACTIVATIONS.get(act) != family.mlp_act:
        raise ModelLoadError(f"{cfg_path}: hidden activation {act!r} is not {family.name}'s "
                             f"({family.mlp_act}); such a checkpoint is not supported")
    if cfg.get("mlp_bias"):
        raise ModelLoadError(f"{cfg_path}: mlp_bias is not supported (MLP projections without biases only)")
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    num_layers = int(cfg["num_hidden_layers"])
    head_dim = int(cfg.get("head_dim") or hidden // num_heads)
    full, local, theta, local_theta = _rope_parameters(cfg)
    if float(full.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0) != 1.0:
        raise ModelLoadError(f"{cfg_path}: partial rotary (partial_rotary_factor "
                             f"{full.get('partial_rotary_factor', cfg.get('partial_rotary_factor'))}) is not supported")
    max_position = int(cfg.get("max_position_embeddings", 2048))
    scaling = _rope_scaling(full, cfg, max_position, cfg_path)
    if scaling is not None and scaling.kind == "longrope":
        max_position = scaling.original_max_position  # served with the short factors (gguf_weights.py says why)
    query_scalar = cfg.get("query_pre_attn_scalar")
    if family.name == "llama" or family.name == "mistral":
        qkv_bias = bool(cfg.get("attention_bias", False))
        if qkv_bias:  # Llama's attention_bias puts one on o_proj too
            raise ModelLoadError(f"{cfg_path}: attention_bias (a bias on o_proj too) is not supported")
    else:
        qkv_bias = family.qkv_bias
    return ModelConfig(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        rope_theta=theta,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position=max_position,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", family.tie_default)),
        family=family.name,
        rope_scaling=scaling,
        rope_local_theta=local_theta,
        layer_windows=_windows(cfg, family, num_layers),
        attn_scale=None if query_scalar is None else float(query_scalar) ** -0.5,
        attn_softcap=float(cfg["attn_logit_softcapping"]) if cfg.get("attn_logit_softcapping") else None,
        final_softcap=float(cfg["final_logit_softcapping"]) if cfg.get("final_logit_softcapping") else None,
        qkv_bias=qkv_bias,
    )


def _rope_parameters(cfg: dict) -> tuple[dict, dict | None, float, float | None]:
    """(the full layers' settings, the sliding layers' if they have their own, their two thetas)."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:  # per layer type (transformers 5, Gemma 3)
        full, local = params["full_attention"], params.get("sliding_attention")
    else:
        full, local = {**(cfg.get("rope_scaling") or {}), **params}, None
    theta = float(full.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    local_theta = (local or {}).get("rope_theta") or cfg.get("rope_local_base_freq")
    return full, local, theta, None if local_theta is None else float(local_theta)


def _rope_scaling(params: dict, cfg: dict, max_position: int, cfg_path: Path) -> RopeScaling | None:
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    original = int(params.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
                   or 0)
    try:
        if kind == "default":
            return None
        if kind == "linear":
            return RopeScaling("linear", factor=float(params["factor"]))
        if kind == "llama3":
            return RopeScaling("llama3", factor=float(params["factor"]), original_max_position=original,
                               low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                               high_freq_factor=float(params.get("high_freq_factor", 4.0)))
        if kind == "yarn":
            attn = params.get("attention_factor")
            return RopeScaling("yarn", factor=float(params["factor"]), original_max_position=original or max_position,
                               beta_fast=float(params.get("beta_fast", 32.0)),
                               beta_slow=float(params.get("beta_slow", 1.0)),
                               attention_factor=None if attn is None else float(attn))
        if kind in ("longrope", "su"):
            original = original or max_position
            factor = params.get("factor") or max_position / original
            attn = params.get("attention_factor")
            if attn is None:  # transformers' default for longrope
                import math
                attn = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
            return RopeScaling("longrope", original_max_position=original, attention_factor=float(attn),
                               freq_factors=tuple(float(f) for f in params["short_factor"]))
    except (KeyError, ValueError) as exc:
        raise ModelLoadError(f"{cfg_path}: rotary scaling {kind!r}: {exc}") from exc
    raise ModelLoadError(f"{cfg_path}: rotary scaling {kind!r} is not supported (supported: linear, llama3, "
                         f"yarn, longrope)")


def _windows(cfg: dict, family: Family, num_layers: int) -> tuple[int, ...]:
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if not window:
        return ()
    window = int(window)
    if types:
        slides = [t == "sliding_attention" for t in types]
    elif family.name in ("qwen2", "qwen3"):
        if not cfg.get("use_sliding_window"):
            return ()
        first = int(cfg.get("max_window_layers", num_layers))
        slides = [i >= first for i in range(num_layers)]
    elif family.name == "gemma2":
        slides = [i % 2 == 0 for i in range(num_layers)]
    elif family.name == "gemma3":
        n = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        slides = [(i + 1) % n != 0 for i in range(num_layers)]
    else:  # Mistral, Phi-3: every layer
        slides = [True] * num_layers
    if not any(slides):
        return ()
    return tuple(window if s else 0 for s in slides)


def weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return [folder / f for f in _index_shards(index)]
    return sorted(folder.glob("*.safetensors"))


def load(folder: Path, progress: bool) -> LoadedWeights:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config = read_config(folder)
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
    expected = expected_shapes(config)
    tensors: dict[str, torch.Tensor] = {}
    for f in tqdm(files, desc=f"loading {folder.name}", unit="shard", disable=not progress, leave=False):
        try:
            shard = load_file(f)
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelLoadError(f"{f}: not a readable safetensors file ({exc}); "
                                 f"the file may be truncated or corrupt") from exc
        for name, t in shard.items():
            for canonical, value in _canonical(name, t.float(), config):
                if canonical in expected:
                    tensors[canonical] = value
                else:
                    log.debug("%s: tensor %s is not one the model reads; ignored", f, name)
    check_complete({name: tuple(t.shape) for name, t in tensors.items()}, config, folder)
    return LoadedWeights(config, tensors, file_digest(files), folder)


def _canonical(name: str, t: torch.Tensor, c: ModelConfig):
    """(canonical name, tensor) pairs of one checkpoint tensor (two or three for a fused one)."""
    for prefix, replacement in _PREFIXES:
        if name.startswith(prefix):
            name = replacement + name[len(prefix):]
    arch = c.arch
    if arch.hf_norm_offset and name.endswith("norm.weight"):
        t = t + arch.hf_norm_offset
    if arch.name in ("gemma2", "gemma3"):
        # Gemma's post_attention_layernorm norms the attention's output; its pre_feedforward_layernorm is
        # the norm in front of the MLP, which is post_attention_layernorm's meaning everywhere else.
        name = (name.replace("post_attention_layernorm", "post_attention_norm")
                .replace("pre_feedforward_layernorm", "post_attention_layernorm"))
    if name.endswith("self_attn.qkv_proj.weight"):
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        base = name[:-len("qkv_proj.weight")]
        return [(base + "q_proj.weight", t[:q]), (base + "k_proj.weight", t[q:q + kv]),
                (base + "v_proj.weight", t[q + kv:q + 2 * kv])]
    if name.endswith("mlp.gate_up_proj.weight"):
        f = c.intermediate_size
        base = name[:-len("gate_up_proj.weight")]
        return [(base + "gate_proj.weight", t[:f]), (base + "up_proj.weight", t[f:2 * f])]
    return [(name, t)]


def _index_shards(index: Path) -> list[str]:
    try:
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelLoadError(f"{index}: not a valid safetensors index ({type(exc).__name__}: {exc})") from exc
