"""Configs: the model's shape, read from a checkpoint's metadata (nothing about one model is hard-coded),
and the engine's batching and caching knobs."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder; every size comes from the checkpoint."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position: int  # context length the model was trained for
    tie_embeddings: bool

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
