"""A single-process engine: admits requests, prefills them, then decodes them with continuous batching.

Sequences join and leave the running batch at any step. Each sequence streams its
tokens to a `sink` callback, called from the engine thread (keep it non-blocking).
The prefill and decode services wrap exactly this: a prefill worker runs it with
`prefill_only=True` (it stops after the first token and exports the K/V), a decode
worker parks K/V that arrived over the wire in its pool (`park`) and then submits the
sequence that continues from it.

A sequence's tokens never depend on how it got its K/V (invariant 4). The prompt's K/V always
comes from one prefill forward of the prompt alone, and every completion token's K/V from a
decode-step row (rows are batch-invariant, see model.py). So a sequence that resumes with
tokens it already has (after a failover, or after preemption here) prefills its prompt only and
then *replays* the known tokens as decode rows (several per step, K/V only), instead of
prefilling them, which would compute their K/V with other GEMM shapes and other bits.
"""
from __future__ import annotations

import collections
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from common.engine.config import EngineConfig
from common.engine.output import FinishReason, OutputProcessor
from common.engine.prefix import PrefixHasher
from common.engine.runner import DecodeItem, ModelRunner, PrefillItem
from common.engine.sampling import Sampler, SamplingParams, TokenLogprobs, derive_seed, token_logprobs
from common.engine.sequence import Sequence, TokenEvent
from common.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParkRefused:
    """Why park() did not place K/V: code is one of duplicate, evicted, too_big, no_room, stopped,
    unclaimed (its claim said nobody wants it any more: freed at once)."""

    code: str
    message: str

    def __str__(self) -> str:
        return self.message


class Engine:
    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, config: EngineConfig = EngineConfig()):
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config
        self.pool = runner.cache.pool
        self.max_context = runner.model.config.max_position
        kernels = runner.model.kernels
        self.sampler = Sampler(argmax=kernels.argmax if kernels is not None else None)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seqs: dict[str, Sequence] = {}  # engine-thread only
        # seq_id -> (tokens, time parked, prefix hashes) of K/V placed in the pool by park() and not yet claimed
        # by submit(parked=True); engine-thread only. Counted in the pool like any sequence's.
        self._parked: dict[str, tuple[int, float, list[bytes]]] = {}  # + the cached prefix it builds on
        self.prefilling: list[Sequence] = []  # admitted, blocks allocated, prompt chunks still to run
        self._chunk_ends: collections.OrderedDict[bytes, None] = collections.OrderedDict()  # newest last
        self.hasher = PrefixHasher(weights_id=getattr(runner.model, "weights_id", ""),
                                   dtype=str(runner.model.dtype), block_size=self.pool.block_size,
                                   chunk_tokens=config.prefill_chunk_tokens)
        # Called on the engine thread after every step that did work, once its tokens were all sent to
        # the sinks: a sink that batches (a decode session) sends one message per step. Thread-safe to
        # append to and remove from.
        self.step_listeners: list[Callable[[], None]] = []
        self.num_steps = 0
        self.num_prompt_tokens = 0  # prompt tokens admitted for prefill ...
        self.num_cached_tokens = 0  # ... of which the prefix cache already held the K/V

    # ------------------------------------------------------------------ public, thread-safe

    def submit(self, seq_id: str, prompt_ids: list[int], params: SamplingParams,
               sink: Callable[[TokenEvent], None], *, seed: int | None = None,
               output_ids: list[int] | None = None, kv: torch.Tensor | None = None,
               parked: bool = False, kv_sink: Callable[[int, int, torch.Tensor], None] | None = None) -> None:
        """Queue a sequence. With `output_ids`, it resumes after tokens already generated (their K/V
        is replayed). With `kv` (the prompt's K/V, [layers, 2, len(prompt_ids), Hkv, D]) or `parked`
        (that K/V was placed by park() under seq_id), it skips the prompt's prefill. With `kv_sink`
        (prefill_only), the prompt's K/V goes to it piece by piece as it is computed, called from the
        engine thread (keep it non-blocking), instead of with the last event."""
        seq = Sequence(seq_id, list(prompt_ids), params,
                       seed if seed is not None else derive_seed(params.seed), sink,
                       OutputProcessor(self.tokenizer, params, len(prompt_ids), self.max_context,
                                       detokenize=self.config.detokenize),
                       output_ids=list(output_ids or []), kv=kv, parked=parked,
                       kv_sink=kv_sink if self.config.prefill_only else None)
        if kv is not None and kv.shape[2] != len(seq.prompt_ids):
            raise ValueError(f"kv holds {kv.shape[2]} tokens, the prompt has {len(seq.prompt_ids)}")
        # Resumed sequences: replay earlier tokens so stop strings and length see them.
        for t in seq.output_ids:
            seq.output.push(t)
            if seq.output.finish_reason is not None:
                # Already over (say the first token was EOS): nothing to compute.
                if parked:
                    self.cancel(seq_id)  # free what was parked for it
                sink(TokenEvent(seq_id, [], "", seq.output.finish_reason))
                return
        self._inbox.put(("submit", seq))
        self._wake.set()

    def park(self, seq_id: str, kv: torch.Tensor, prefix_hashes: list[bytes] = (),
             claim: Callable[[], bool] | None = None) -> "concurrent.futures.Future[ParkRefused | None]":
        """Place a prompt's K/V ([layers, 2, tokens, Hkv, D]) in the pool under seq_id, for a later
        submit(parked=True); with prefix_hashes, kv holds only the tokens after those blocks, which
        must be in this pool's prefix cache. The future gives None once placed, or why it was refused
        (the pool has no room now, or could never hold it, the prefix was evicted, the id is taken).
        cancel(seq_id) frees it.

        `claim`, if given, is called on the engine thread as soon as the K/V is placed (keep it short):
        False means nobody wants it any more, and it is freed at once (ParkRefused "unclaimed"). A
        submit(parked=True) that claim makes joins the very step that follows the placing; submitted
        from another thread after the future resolves, it would wait for the end of that step."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("park", (seq_id, kv, list(prefix_hashes), claim, done)))
        self._wake.set()
        return done

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
        return len(self._seqs) + len(self._parked)

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    # ------------------------------------------------------------------ engine thread

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self.step():
                self._wake.wait(0.05)
                self._wake.clear()
        for seq in list(self._seqs.values()):
            self._finish(seq, FinishReason.CANCELLED, error="engine stopped")
        for seq_id in list(self._parked):
            self._unpark(seq_id)
        while True:  # what arrived after the last step must not wait forever
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "park":
                arg[-1].set_result(ParkRefused("stopped", "the engine stopped (the worker is shutting down)"))
            elif kind == "submit":
                arg.sink(TokenEvent(arg.seq_id, [], "", FinishReason.CANCELLED, error="engine stopped"))

    def step(self) -> bool:
        """One scheduling iteration; returns False when there was nothing to do."""
        self._drain_inbox()
        did = False
        try:
            if self.waiting or self.prefilling:
                did = self._place_or_prefill()
            if self.running:
                self._decode_step()
                did = True
        except Exception as exc:  # a bug or OOM must end the affected requests, not hang them
            log.exception("engine step failed")
            for seq in list(self._seqs.values()):
                self._finish(seq, FinishReason.ERROR, error=f"engine step failed: {exc}")
        self.num_steps += did
        if did:
            for listener in list(self.step_listeners):
                listener()
        return did

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                self._admit(arg)
            elif kind == "park":
                self._park(*arg)
            elif kind == "cancel":
                if arg in self._seqs:
                    self._finish(self._seqs[arg], FinishReason.CANCELLED)
                elif arg in self._parked:
                    self._unpark(arg)

    def _admit(self, seq: Sequence) -> None:
        if seq.seq_id in self._seqs:
            seq.sink(TokenEvent(seq.seq_id, [], "", FinishReason.ERROR,
                                error=f"sequence id {seq.seq_id!r} is already running"))
            return
        if self.config.prefix_caching:
            seq.block_hashes = self.hasher.block_hashes(seq.prompt_ids, self.hasher.chunk_blocks(len(seq.prompt_ids)))
        if seq.parked:
            entry = self._parked.pop(seq.seq_id, None)
            error = None
            if entry is None:
                error = f"no K/V parked for {seq.seq_id!r}"
            elif entry[0] != len(seq.prompt_ids):
                error = (f"the K/V parked for {seq.seq_id!r} holds {entry[0]} tokens, the prompt has "
                         f"{len(seq.prompt_ids)}")
            elif entry[2] != seq.block_hashes[:len(entry[2])]:
                error = f"the cached prefix the push of {seq.seq_id!r} named is not this prompt's"
            if error is not None:
                if entry is not None:
                    self.pool.free(seq.seq_id)
                seq.sink(TokenEvent(seq.seq_id, [], "", FinishReason.ERROR, error=error))
                return
            seq.num_computed = entry[0]
            self._register(seq)  # its K/V came from prefill chunks: name its full-chunk blocks
        self._seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    def _park(self, seq_id: str, kv: torch.Tensor, prefix_hashes: list[bytes], claim: Callable[[], bool] | None,
              done: concurrent.futures.Future) -> None:
        prefix = self.pool.match_prefix(prefix_hashes)
        start = len(prefix_hashes) * self.pool.block_size
        num_tokens = start + kv.shape[2]
        if seq_id in self._seqs or seq_id in self._parked:
            done.set_result(ParkRefused("duplicate", f"K/V for {seq_id!r} is already in this worker's pool"))
        elif len(prefix) != len(prefix_hashes):
            done.set_result(ParkRefused("evicted", f"the cached prefix of {len(prefix_hashes)} blocks the push "
                                                   f"builds on is no longer in this worker's pool: push it all"))
        elif self.pool.blocks_for(num_tokens) > self.pool.num_blocks:
            done.set_result(ParkRefused("too_big", self._too_big(num_tokens)))
        elif not self.pool.can_allocate(num_tokens, prefix):
            done.set_result(ParkRefused("no_room", f"the KV pool has {self.pool.num_free_blocks} free blocks, the "
                                                   f"K/V of {num_tokens} tokens needs "
                                                   f"{self.pool.blocks_for(num_tokens) - len(prefix)} more"))
        else:
            self.pool.allocate(seq_id, num_tokens, prefix)
            self.runner.cache.import_seq(seq_id, kv, start)
            self._parked[seq_id] = (num_tokens, time.monotonic(), prefix_hashes)
            # The claim's submit lands in self._inbox, which the drain running now empties next: the
            # sequence is admitted into this iteration's step.
            try:
                wanted = claim is None or claim()
            except Exception as exc:  # noqa: BLE001 - a failing claim must not stop the engine thread
                log.exception("claim of the K/V parked for %s failed", seq_id)
                wanted, why = False, f"its claim failed: {exc}"
            else:
                why = "nobody claims it any more (its Decode call ended, or its K/V had already come)"
            if not wanted:
                if seq_id in self._parked:  # a claim may have cancelled it itself
                    self._unpark(seq_id)
                done.set_result(ParkRefused("unclaimed", f"K/V for {seq_id!r} freed: {why}"))
                return
            done.set_result(None)

    def _unpark(self, seq_id: str) -> None:
        del self._parked[seq_id]
        self.pool.free(seq_id)

    def _place_or_prefill(self) -> bool:
        admitted = self._admit_waiting()
        return self._prefill_chunks() or admitted

    def _admit_waiting(self) -> bool:
        """Admit waiting sequences while the batch has room: parked or handed-in K/V go straight to
        decoding; others get their blocks (a cached prefix reused) and join the prefills."""
        admitted = False
        while self.waiting and len(self.running) + len(self.prefilling) < self.config.max_running:
            seq = self.waiting[0]
            if seq.num_computed:  # parked: its blocks are already in the pool
                self.waiting.popleft()
                self.running.append(seq)
                admitted = True
                continue
            # Room for every token it holds, and for a new sequence the one its prefill samples.
            n = seq.num_tokens + (0 if seq.output_ids else 1)
            if self.pool.blocks_for(n) > self.pool.num_blocks:
                self.waiting.popleft()
                self._finish(seq, FinishReason.ERROR, error=self._too_big(n))
                continue
            if seq.kv is not None:
                if not self.pool.can_allocate(n):
                    break
                self.waiting.popleft()
                self.pool.allocate(seq.seq_id, n)
                self.runner.cache.import_seq(seq.seq_id, seq.kv)
                seq.kv, seq.num_computed = None, len(seq.prompt_ids)
                self.running.append(seq)
                admitted = True
                continue
            prefix = self._cached_prefix(seq)
            if not self.pool.can_allocate(n, prefix):
                break
            self.waiting.popleft()
            self.pool.allocate(seq.seq_id, n, prefix)
            seq.num_computed = seq.num_cached = len(prefix) * self.pool.block_size
            seq.num_registered = len(prefix)
            self.num_prompt_tokens += len(seq.prompt_ids)
            self.num_cached_tokens += seq.num_computed
            if seq.kv_sink is not None and seq.num_computed:
                seq.kv_sink(0, seq.num_computed, self.runner.cache.export_seq(seq.seq_id, seq.num_computed))
            self.prefilling.append(seq)
            admitted = True
        return admitted

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The pool's blocks for the longest run of whole chunks of the prompt it already holds, short
        of the last token (always computed, for its logits)."""
        if not self.config.prefix_caching:
            return []
        blocks = self.pool.match_prefix(seq.block_hashes[:self.hasher.reusable_blocks(len(seq.prompt_ids))])
        per_chunk = self.hasher.chunk_tokens // self.pool.block_size
        return blocks[:len(blocks) // per_chunk * per_chunk]

    def _prefill_chunks(self) -> bool:
        """Run prompt chunks up to the token budget (at least one chunk), oldest sequence first; a
        sequence whose last chunk ran gets its first token (the prompt alone, even for a resumed
        sequence: its completion is replayed by decode rows), at the end of the pass with the others':
        the decode step that gives their second tokens comes only after the whole pass, and a first
        token that came early would only make its gap to the second one longer. Sampling is
        row-invariant, so a first token does not depend on what ran with it, or when.

        prefill_only, one chunk a step (_prefill_next_chunk)."""
        if self.config.prefill_only:
            return self._prefill_next_chunk()
        budget = self.config.max_prefill_tokens
        ran = False
        done: list[tuple[Sequence, torch.Tensor, torch.Tensor]] = []  # (seq, logits, last hidden state)
        for seq in list(self.prefilling):
            logits = hidden = None
            while seq.num_computed < len(seq.prompt_ids) and (budget > 0 or not ran):
                n, logits, hidden = self._run_chunk(seq)
                budget -= n
                ran = True
            if seq.num_computed == len(seq.prompt_ids):
                self.prefilling.remove(seq)
                done.append((seq, logits, hidden))
            if budget <= 0:
                break
        for seq, logits, hidden in done:
            self._first_token(seq, logits, hidden)
        return ran

    def _prefill_next_chunk(self) -> bool:
        """A prefill worker's step: one chunk, of the prompt with the fewest tokens left, so that a short
        prompt that comes while a long one prefills waits for one chunk, not for the whole prompt (its
        first token, and its push, go out at once). A prompt passed over for a budget's worth of chunks
        (max_prefill_tokens / chunk) runs next whatever its length: a long prompt is never starved. The
        chunks are the same either way (fixed positions, one prompt a call), so are the bits."""
        if not self.prefilling:
            return False
        limit = max(1, self.config.max_prefill_tokens // self.hasher.chunk_tokens)
        overdue = [s for s in self.prefilling if s.passed_over >= limit]
        # min() keeps the first of equals: the oldest, among prompts with as many tokens left.
        seq = overdue[0] if overdue else min(self.prefilling, key=lambda s: len(s.prompt_ids) - s.num_computed)
        for other in self.prefilling:
            other.passed_over = 0 if other is seq else other.passed_over + 1
        _, logits, hidden = self._run_chunk(seq)
        if seq.num_computed == len(seq.prompt_ids):
            self.prefilling.remove(seq)
            # Out at once, before the next prompt's chunks run: its K/V push overlaps their compute.
            self._first_token(seq, logits, hidden)
        return True

    def _run_chunk(self, seq: Sequence) -> tuple[int, torch.Tensor, torch.Tensor]:
        """Prefill seq's next chunk (its K/V into the cache): the tokens computed, and the logits and
        hidden state of the chunk's last position."""
        chunk, n = self.hasher.chunk_tokens, len(seq.prompt_ids)
        start = seq.num_computed
        end = min(start // chunk * chunk + chunk, n)
        logits = self.runner.prefill([PrefillItem(seq.seq_id, seq.prompt_ids[start:end], start)])
        hidden = self.runner.last_hidden
        seq.num_computed = end
        self._register(seq)
        if seq.kv_sink is not None and end < n:  # the last chunk's waits for the first token
            seq.kv_sink(start, end, self.runner.cache.export_seq(seq.seq_id, end, start))
        return end - start, logits, hidden

    def _first_token(self, seq: Sequence, logits: torch.Tensor, hidden: torch.Tensor) -> None:
        """A prompt is prefilled: sample its first token (none for a resumed sequence), hand it out, and
        export the K/V (prefill_only) or join the decode batch."""
        tok = logprob = None
        if not seq.output_ids:
            tok = self._sample([seq], logits)[0]
            logprob = self._logprobs([seq], {0: tok}, hidden).get(0)
        seq.first_token_s = seq.first_token_s or time.perf_counter()
        if self.config.prefill_only:
            self._prefilled(seq, tok, logprob)
        else:
            self.running.append(seq)
            if tok is not None:
                self._emit(seq, tok, logprob)

    def _register(self, seq: Sequence) -> None:
        """Name the blocks of the prompt's chunks computed so far, so later prompts can reuse them."""
        if not seq.block_hashes:
            return
        full = min(seq.num_computed // self.hasher.chunk_tokens * self.hasher.chunk_tokens // self.pool.block_size,
                   len(seq.block_hashes))
        table = self.pool.block_table(seq.seq_id)
        per_chunk = self.hasher.chunk_tokens // self.pool.block_size
        for i in range(seq.num_registered, full):
            self.pool.register(table[i], seq.block_hashes[i])
            if (i + 1) % per_chunk == 0:
                self._chunk_ends.pop(seq.block_hashes[i], None)
                self._chunk_ends[seq.block_hashes[i]] = None
        seq.num_registered = max(seq.num_registered, full)
        if len(self._chunk_ends) > 2 * self.pool.num_blocks // per_chunk + 64:  # forget evicted ones
            self._chunk_ends = collections.OrderedDict.fromkeys(h for h in self._chunk_ends
                                                                if self.pool.holds_hash(h))

    def cached_chunk_hashes(self, limit: int = 2048) -> list[bytes]:
        """The newest whole-chunk prefixes the pool still holds (what cache-aware routing looks for).
        Safe from other threads: it copies what only the engine thread changes."""
        return [h for h in list(self._chunk_ends)[-limit:] if self.pool.holds_hash(h)]

    def _prefilled(self, seq: Sequence, tok: int | None, logprob: TokenLogprobs | None = None) -> None:
        """prefill_only: hand back the first token and the prompt's K/V; no K/V when that token already
        ends the request (nobody would decode it), no token when the sequence resumes."""
        logprobs = None if logprob is None else [logprob]
        if tok is not None:
            seq.output_ids.append(tok)
            seq.output.push(tok)
            if seq.output.finish_reason is not None:
                self._finish(seq, seq.output.finish_reason, token_ids=[tok], logprobs=logprobs)
                return
        n, kv = len(seq.prompt_ids), None
        if seq.kv_sink is not None:
            # The last chunk's K/V only now, once the first token does not end the request: a push of a
            # request nobody will decode stays incomplete, and the decode worker drops it.
            start = (n - 1) // self.hasher.chunk_tokens * self.hasher.chunk_tokens
            seq.kv_sink(start, n, self.runner.cache.export_seq(seq.seq_id, n, start))
        else:
            kv = self.runner.cache.export_seq(seq.seq_id, n)
        self._finish(seq, None, kv=kv, token_ids=[] if tok is None else [tok], logprobs=logprobs,
                     block_hashes=seq.block_hashes, cached_tokens=seq.num_cached)

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
        items: list[DecodeItem] = []
        sampled: list[Sequence] = []
        replay_budget = self.config.max_replay_rows
        for seq in self.running:
            # Positions num_computed .. num_tokens-1 lack K/V: replayed tokens, then the newest,
            # whose row gives the logits of the next token.
            num_replay = seq.num_tokens - 1 - seq.num_computed
            k = min(num_replay, replay_budget)
            replay_budget -= k
            end = seq.num_computed + k + (1 if k == num_replay else 0)
            for pos in range(seq.num_computed, end):
                items.append(DecodeItem(seq.seq_id, seq.token_at(pos), pos, sample=pos == seq.num_tokens - 1))
            seq.num_computed = end
            if end == seq.num_tokens:
                sampled.append(seq)
        logits = self.runner.decode(items)
        if sampled:
            tokens = self._sample(sampled, logits)
            logprobs = self._logprobs(sampled, dict(enumerate(tokens)))
            for i, (seq, tok) in enumerate(zip(sampled, tokens)):
                self._emit(seq, tok, logprobs.get(i))

    def _preempt(self, seq: Sequence) -> None:
        # Recompute later: its tokens are kept; its prompt is prefilled again and its completion replayed.
        log.warning("KV pool full: preempting %s (%d tokens) for recompute", seq.seq_id, seq.num_tokens)
        self.pool.free(seq.seq_id)
        seq.num_computed = seq.num_registered = 0
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def _sample(self, batch: list[Sequence], logits: torch.Tensor) -> list[int]:
        tokens = self.sampler(logits, [s.params for s in batch], [s.seed for s in batch],
                              [len(s.output_ids) for s in batch], [s.prompt_ids for s in batch],
                              [s.output_ids for s in batch])
        return tokens.tolist()

    def _logprobs(self, batch: list[Sequence], tokens: dict[int, int],
                  hidden: torch.Tensor | None = None) -> dict[int, TokenLogprobs]:
        """Row i -> the logprobs of its sampled token tokens[i], for the rows whose request asks (row i is
        batch[i] and row i of hidden, by default the runner's last hidden states). Nothing is computed
        when none asks."""
        rows = [i for i in tokens if batch[i].params.logprobs is not None]
        if not rows:
            return {}
        # From the model's raw logits, before temperature and penalties (what vLLM reports by default),
        # with an exact fp32 normaliser: the sampled logits are exact for the best 64 tokens only.
        hidden = self.runner.last_hidden if hidden is None else hidden
        log_probs = self.runner.model.log_probs(hidden[rows])
        found = token_logprobs(log_probs, [tokens[i] for i in rows], [batch[i].params.logprobs for i in rows])
        return dict(zip(rows, found))

    def _emit(self, seq: Sequence, tok: int, logprob: TokenLogprobs | None = None) -> None:
        seq.output_ids.append(tok)
        text = seq.output.push(tok)
        logprobs = None if logprob is None else [logprob]
        if seq.output.finish_reason is not None:
            self._finish(seq, seq.output.finish_reason, text=text, token_ids=[tok], logprobs=logprobs)
        else:
            seq.sink(TokenEvent(seq.seq_id, [tok], text, logprobs=logprobs))

    def _finish(self, seq: Sequence, reason: FinishReason | None, *, text: str = "",
                token_ids: list[int] | None = None, error: str | None = None,
                kv: torch.Tensor | None = None, logprobs: list[TokenLogprobs] | None = None,
                block_hashes: list[bytes] | None = None, cached_tokens: int = 0) -> None:
        """The one way out for a sequence: frees its blocks and sends its last event."""
        self.pool.free(seq.seq_id)
        self._seqs.pop(seq.seq_id, None)
        for queue_ in (self.running, self.prefilling, self.waiting):
            if seq in queue_:
                queue_.remove(seq)
                break
        try:
            seq.sink(TokenEvent(seq.seq_id, token_ids or [], text, reason, error=error, kv=kv, logprobs=logprobs,
                                block_hashes=block_hashes, cached_tokens=cached_tokens))
        except Exception:
            log.exception("sink of %s failed", seq.seq_id)

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        holders = {s.seq_id for s in self.running + self.prefilling} | set(self._parked) | {
            s.seq_id for s in self.waiting if self.pool.holds(s.seq_id)}
        assert self.pool.num_seqs == len(holders), (
            f"KV pool holds {self.pool.num_seqs} sequences; {len(self.running)} are running, "
            f"{len(self._parked)} parked")
