"""A single-process engine: admits requests, prefills them, then decodes them with continuous batching.

Sequences join and leave the running batch at any step. Each sequence streams its
tokens to a `sink` callback, called from the engine thread (keep it non-blocking).
The prefill and decode services wrap exactly this: a prefill worker runs it with
`prefill_only=True` (it stops after the first token and exports the K/V), a decode
worker submits sequences whose K/V arrived over the wire.
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from common.engine.output import FinishReason, OutputProcessor
from common.engine.runner import DecodeItem, ModelRunner, PrefillItem
from common.engine.sampling import Sampler, SamplingParams, derive_seed
from common.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class TokenEvent:
    """What a sequence streams: new tokens and text; the last event carries finish_reason."""

    seq_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    error: str | None = None
    kv: torch.Tensor | None = None  # prefill_only: the prompt's K/V, [layers, 2, tokens, Hkv, D]


@dataclass
class Sequence:
    seq_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    sink: Callable[[TokenEvent], None]
    output: OutputProcessor | None
    output_ids: list[int] = field(default_factory=list)
    kv: torch.Tensor | None = None  # K/V that arrived from a prefill worker, not yet placed
    arrival_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


@dataclass(frozen=True)
class EngineConfig:
    max_prefill_tokens: int = 2048  # token budget of one prefill batch
    max_running: int = 64  # sequences in the decode batch
    prefill_only: bool = False


class Engine:
    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, config: EngineConfig = EngineConfig()):
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config
        self.pool = runner.cache.pool
        self.max_context = runner.model.config.max_position
        self.sampler = Sampler()
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seqs: dict[str, Sequence] = {}  # engine-thread only
        self.num_steps = 0

    # ------------------------------------------------------------------ public, thread-safe

    def submit(self, seq_id: str, prompt_ids: list[int], params: SamplingParams,
               sink: Callable[[TokenEvent], None], *, seed: int | None = None,
               output_ids: list[int] | None = None, kv: torch.Tensor | None = None) -> None:
        """Queue a sequence. With `output_ids`, it resumes after tokens already generated;
        with `kv` (K/V of every token but the last of prompt+output), it skips prefill."""
        seq = Sequence(seq_id, list(prompt_ids), params,
                       seed if seed is not None else derive_seed(params.seed), sink,
                       None if self.config.prefill_only else
                       OutputProcessor(self.tokenizer, params, len(prompt_ids), self.max_context),
                       output_ids=list(output_ids or []), kv=kv)
        if seq.output is not None:
            # Resumed sequences: replay earlier tokens so stop strings and length see them.
            for t in seq.output_ids:
                seq.output.push(t)
                if seq.output.finish_reason is not None:
                    # Already over (say the first token was EOS): nothing to compute.
                    sink(TokenEvent(seq_id, [], "", seq.output.finish_reason))
                    return
        self._inbox.put(("submit", seq))
        self._wake.set()

    def cancel(self, seq_id: str) -> None:
        self._inbox.put(("cancel", seq_id))
        self._wake.set()

    def start(self) -> "Engine":
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread:
            self._thread.join()

    @property
    def num_active(self) -> int:
        return len(self._seqs)

    # ------------------------------------------------------------------ engine thread

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self.step():
                self._wake.wait(0.05)
                self._wake.clear()
        for seq in list(self._seqs.values()):
            self._finish(seq, FinishReason.CANCELLED, error="engine stopped")

    def step(self) -> bool:
        """One scheduling iteration; returns False when there was nothing to do."""
        self._drain_inbox()
        did = False
        try:
            if self.waiting:
                did = self._place_or_prefill()
            if self.running:
                self._decode_step()
                did = True
        except Exception as exc:  # a bug or OOM must end the affected requests, not hang them
            log.exception("engine step failed")
            for seq in list(self._seqs.values()):
                self._finish(seq, FinishReason.ERROR, error=f"engine step failed: {exc}")
        self.num_steps += did
        return did

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                if arg.seq_id in self._seqs:
                    arg.sink(TokenEvent(arg.seq_id, [], "", FinishReason.ERROR,
                                        error=f"sequence id {arg.seq_id!r} is already running"))
                    continue
                self._seqs[arg.seq_id] = arg
                self.waiting.append(arg)
            elif kind == "cancel" and arg in self._seqs:
                self._finish(self._seqs[arg], FinishReason.CANCELLED)

    def _place_or_prefill(self) -> bool:
        """Admit waiting sequences: place arrived K/V, or prefill a batch under the token budget."""
        batch: list[Sequence] = []
        budget = self.config.max_prefill_tokens
        while self.waiting and len(self.running) + len(batch) < self.config.max_running:
            seq = self.waiting[0]
            if seq.kv is not None:
                if self.pool.blocks_for(seq.num_tokens) > self.pool.num_blocks:
                    self.waiting.popleft()
                    self._finish(seq, FinishReason.ERROR, error=self._too_big(seq.num_tokens))
                    continue
                if not self.pool.can_allocate(seq.num_tokens):
                    break
                self.waiting.popleft()
                self.pool.allocate(seq.seq_id, seq.num_tokens)
                self.runner.cache.import_seq(seq.seq_id, seq.kv)
                seq.kv = None
                self.running.append(seq)
                continue
            n = seq.num_tokens
            if batch and n > budget:
                break
            # +1: room for the token this prefill samples, so its first decode step fits.
            if not self.pool.can_allocate(n + 1):
                if not batch and not self.running:
                    self.waiting.popleft()
                    self._finish(seq, FinishReason.ERROR, error=self._too_big(n + 1))
                    continue
                break
            self.waiting.popleft()
            self.pool.allocate(seq.seq_id, n + 1)
            batch.append(seq)
            budget -= n
        if not batch:
            return False
        logits = self.runner.prefill([PrefillItem(s.seq_id, s.all_ids()) for s in batch])
        tokens = self._sample(batch, logits)
        now = time.perf_counter()
        for seq, tok in zip(batch, tokens):
            seq.first_token_s = seq.first_token_s or now
            if self.config.prefill_only:
                kv = self.runner.cache.export_seq(seq.seq_id, seq.num_tokens)
                seq.output_ids.append(tok)
                self._finish(seq, None, kv=kv, token_ids=[tok])
            else:
                self.running.append(seq)
                self._emit(seq, tok)
        return True

    def _too_big(self, num_tokens: int) -> str:
        return (f"a sequence of {num_tokens} tokens needs {self.pool.blocks_for(num_tokens)} KV blocks; "
                f"the whole pool has {self.pool.num_blocks}")

    def _decode_step(self) -> None:
        # Grow every table, oldest first, by the slot its next token needs; on shortage evict the
        # newest (it has the least work to recompute) until the older one fits.
        for seq in list(self.running):
            if seq not in self.running:
                continue  # evicted below for an older sequence
            need = seq.num_tokens
            while not self.pool.can_grow(seq.seq_id, need) and self.running[-1] is not seq:
                self._preempt(self.running[-1])
            if self.pool.can_grow(seq.seq_id, need):
                self.pool.grow(seq.seq_id, need)
            else:
                self._preempt(seq)
        if not self.running:
            return
        batch = list(self.running)
        items = [DecodeItem(s.seq_id, s.output_ids[-1], s.num_tokens - 1) for s in batch]
        logits = self.runner.decode(items)
        for seq, tok in zip(batch, self._sample(batch, logits)):
            self._emit(seq, tok)

    def _preempt(self, seq: Sequence) -> None:
        # Recompute later: its tokens are kept, its K/V is rebuilt by a prefill of all of them.
        log.warning("KV pool full: preempting %s (%d tokens) for recompute", seq.seq_id, seq.num_tokens)
        self.pool.free(seq.seq_id)
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def _sample(self, batch: list[Sequence], logits: torch.Tensor) -> list[int]:
        tokens = self.sampler(logits, [s.params for s in batch], [s.seed for s in batch],
                              [len(s.output_ids) for s in batch], [s.prompt_ids for s in batch],
                              [s.output_ids for s in batch])
        return tokens.tolist()

    def _emit(self, seq: Sequence, tok: int) -> None:
        seq.output_ids.append(tok)
        text = seq.output.push(tok)
        if seq.output.finish_reason is not None:
            self._finish(seq, seq.output.finish_reason, text=text, token_ids=[tok])
        else:
            seq.sink(TokenEvent(seq.seq_id, [tok], text))

    def _finish(self, seq: Sequence, reason: FinishReason | None, *, text: str = "",
                token_ids: list[int] | None = None, error: str | None = None,
                kv: torch.Tensor | None = None) -> None:
        """The one way out for a sequence: frees its blocks and sends its last event."""
        self.pool.free(seq.seq_id)
        self._seqs.pop(seq.seq_id, None)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        try:
            seq.sink(TokenEvent(seq.seq_id, token_ids or [], text, reason, error=error, kv=kv))
        except Exception:
            log.exception("sink of %s failed", seq.seq_id)

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        live = {s.seq_id for s in self.running}
        assert self.pool.num_seqs == len(live), (
            f"KV pool holds {self.pool.num_seqs} sequences, {len(live)} are running")
