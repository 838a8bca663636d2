"""A request inside the engine: its tokens, where its K/V stands, and the events it streams out."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from common.engine.output import FinishReason, OutputProcessor
from common.engine.sampling import SamplingParams, TokenLogprobs


@dataclass
class TokenEvent:
    """What a sequence streams: new tokens and text; the last event carries finish_reason."""

    seq_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    error: str | None = None
    kv: torch.Tensor | None = None  # prefill_only: the prompt's K/V, [layers, 2, tokens, Hkv, D]
    logprobs: list[TokenLogprobs] | None = None  # one per token_ids entry, when params.logprobs asks
    block_hashes: list[bytes] | None = None  # prefill_only: prefix hashes of the prompt's full-chunk blocks
    cached_tokens: int = 0  # prefill_only: prompt tokens whose K/V the prefix cache held
    # With an error: the request itself is at fault (its structured output constraint reached a dead end, or
    # output_ids break it), so any worker would fail it the same way: not a worker's failure, not retried.
    invalid: bool = False


@dataclass
class Sequence:
    seq_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    sink: Callable[[TokenEvent], None]
    output: OutputProcessor | None
    output_ids: list[int] = field(default_factory=list)
    kv: torch.Tensor | None = None  # K/V of the prompt handed in with submit(), not yet placed
    parked: bool = False  # its prompt's K/V is already in the pool (park()), under seq_id
    num_computed: int = 0  # tokens whose K/V is in the cache
    block_hashes: list[bytes] = field(default_factory=list)  # of the prompt's full-chunk blocks
    num_registered: int = 0  # of those, blocks already named in the pool (their chunk is computed)
    num_cached: int = 0  # prompt tokens whose K/V came from the prefix cache at admission
    passed_over: int = 0  # prefill_only: chunks of other prompts run in a row while this one waited
    arrival_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    # prefill_only: called (start, end, K/V of positions start .. end-1) as the prompt's K/V is ready: a
    # prefix-cache hit at admission, each computed chunk, the last one after the first token is sampled
    # and only if it does not end the request; the last event then carries no kv.
    kv_sink: Callable[[int, int, torch.Tensor], None] | None = None
    # params.constraint's llguidance matcher, advanced over every output token (grammar.py); None without one.
    matcher: object | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_at(self, position: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[position] if position < n else self.output_ids[position - n]
