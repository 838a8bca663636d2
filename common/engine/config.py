"""Configs: the model's shape, read from a checkpoint's metadata (nothing about one model is hard-coded),
and the engine's batching and caching knobs (EngineConfig).

`ModelConfig` holds one model's numbers; what a family changes in the shared decoder layer (biases,
norms, the MLP's activation, ...) is its `Family` (common/engine/families.py), named by `family`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from common.engine.families import FAMILIES, Family


@dataclass(frozen=True)
class RopeScaling:
    """How rotary frequencies are stretched past the trained context, as HF and llama.cpp define it.

    kind: "linear" (positions / factor), "llama3" (Llama 3.x: low frequencies / factor, high ones kept,
    a smooth ramp between), "yarn" (a ramp between interpolation and extrapolation, cos/sin scaled by
    attention_factor), "longrope" (Phi-3.5: per-frequency factors, cos/sin scaled by attention_factor),
    or "factors": per-frequency divisors given as they are (a GGUF's rope_freqs tensor, which llama.cpp's
    converter writes for llama3 scaling)."""

    kind: str
    factor: float = 1.0
    original_max_position: int = 0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn, longrope: None = the formula's default
    freq_factors: tuple[float, ...] = ()  # factors, longrope: one divisor per frequency

    KINDS = ("linear", "llama3", "yarn", "longrope", "factors")

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS:
            raise ValueError(f"rotary scaling {self.kind!r} is not supported (supported: {', '.join(self.KINDS)})")
        if self.kind in ("linear", "llama3", "yarn") and not self.factor > 0:
            raise ValueError(f"rotary scaling {self.kind!r}: factor must be positive, got {self.factor}")
        if self.kind in ("llama3", "yarn") and self.original_max_position <= 0:
            raise ValueError(f"rotary scaling {self.kind!r} needs original_max_position_embeddings")
        if self.kind in ("longrope", "factors") and not self.freq_factors:
            raise ValueError(f"rotary scaling {self.kind!r} needs its per-frequency factors")

    def inv_freq(self, base_inv_freq: list[float], head_dim: int, theta: float) -> list[float]:
        """The scaled inverse frequencies (one per rotated pair), in float64, from the plain ones."""
        if self.kind == "linear":
            return [f / self.factor for f in base_inv_freq]
        if self.kind in ("factors", "longrope"):
            if len(self.freq_factors) != len(base_inv_freq):
                raise ValueError(f"rotary scaling {self.kind!r}: {len(self.freq_factors)} factors for "
                                 f"{len(base_inv_freq)} frequencies")
            return [f / s for f, s in zip(base_inv_freq, self.freq_factors)]
        if self.kind == "llama3":  # transformers' _compute_llama3_parameters
            low_wavelen = self.original_max_position / self.low_freq_factor
            high_wavelen = self.original_max_position / self.high_freq_factor
            out = []
            for f in base_inv_freq:
                wavelen = 2 * math.pi / f
                if wavelen > low_wavelen:
                    out.append(f / self.factor)
                elif wavelen < high_wavelen:
                    out.append(f)
                else:
                    smooth = ((self.original_max_position / wavelen - self.low_freq_factor)
                              / (self.high_freq_factor - self.low_freq_factor))
                    out.append((1 - smooth) * f / self.factor + smooth * f)
            return out
        # yarn: transformers' _compute_yarn_parameters (truncated ramp bounds, as its default)
        def correction_dim(rotations: float) -> float:
            return (head_dim * math.log(self.original_max_position / (rotations * 2 * math.pi))) / (2 * math.log(theta))

        low = max(math.floor(correction_dim(self.beta_fast)), 0)
        high = min(math.ceil(correction_dim(self.beta_slow)), head_dim - 1)
        if low == high:
            high += 0.001
        out = []
        for i, f in enumerate(base_inv_freq):
            ramp = min(max((i - low) / (high - low), 0.0), 1.0)
            extrapolation = 1 - ramp
            out.append(f / self.factor * (1 - extrapolation) + f * extrapolation)
        return out

    def cos_sin_scale(self) -> float:
        """What cos and sin are multiplied by (the attention temperature of yarn and longrope)."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.kind == "yarn":
            return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0
        return 1.0


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder of one of FAMILIES; every size comes from the checkpoint."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position: int  # context length the model was trained for (or serves, where its rope allows less)
    tie_embeddings: bool
    family: str = "llama"
    rope_scaling: RopeScaling | None = None  # of the full-attention layers
    # Sliding-window layers' own rotary base (Gemma 3's local layers: 10,000 against 1M; no scaling);
    # None: the same as the full layers'.
    rope_local_theta: float | None = None
    # Attention of layer i sees the last layer_windows[i] positions (itself included); 0 = all of them.
    layer_windows: tuple[int, ...] = ()
    attn_scale: float | None = None  # scores are q.k * attn_scale; None = head_dim ** -0.5
    attn_softcap: float | None = None  # scores -> tanh(scores / cap) * cap (Gemma 2)
    final_softcap: float | None = None  # logits -> tanh(logits / cap) * cap (Gemma 2)
    qkv_bias: bool = False  # q, k and v projections add a bias (Qwen 2, and Llama-family models that ask)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model config: num_heads ({self.num_heads}) must be a multiple "
                             f"of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"model config: head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.family not in FAMILIES:
            raise ValueError(f"model config: family {self.family!r} is not one of {', '.join(FAMILIES)}")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"model config: {len(self.layer_windows)} layer windows for {self.num_layers} layers")
        if any(w < 0 for w in self.layer_windows):
            raise ValueError(f"model config: a layer window is negative: {self.layer_windows}")
        for name in ("attn_softcap", "final_softcap"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"model config: {name} must be positive, got {getattr(self, name)}")

    @property
    def arch(self) -> Family:
        """What the family changes in the shared layer."""
        return FAMILIES[self.family]

    @property
    def scale(self) -> float:
        """The attention scores' scale."""
        return self.head_dim ** -0.5 if self.attn_scale is None else self.attn_scale

    def window(self, layer: int) -> int:
        """How many positions layer `layer` attends to (itself included); 0 = every one."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def has_windows(self) -> bool:
        return any(self.layer_windows)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V that one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


@dataclass(frozen=True)
class EngineConfig:
    max_prefill_tokens: int = 2048  # token budget of one prefill batch
    max_running: int = 64  # sequences in the decode batch
    prefill_only: bool = False
    # Rows of replayed tokens (a resumed sequence recomputing its completion's K/V) per decode step,
    # on top of one row per running sequence: bounds how much one resume slows everyone's step.
    max_replay_rows: int = 64
    # Prompts are prefilled in chunks of this many tokens, at fixed positions (chunk k covers tokens
    # k*C .. (k+1)*C - 1), and full chunks' K/V is kept for prompts that share the prefix.
    prefill_chunk_tokens: int = 256
    prefix_caching: bool = True
    # Detokenize every token (TokenEvent.text). Off, a sequence is detokenized only when it has stop
    # strings to match: a decode worker's caller (the router) detokenizes the stream once itself.
    detokenize: bool = True
