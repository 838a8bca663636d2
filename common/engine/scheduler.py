"""The Scheduler: which sequences hold KV blocks, which prompt chunks run next, what a decode step computes.

It decides and keeps the books (the queues, the parked K/V, the pool's block tables and prefix names);
the Engine runs the model, samples and streams. No thread: the Engine calls it from its own.
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

from common.engine.config import EngineConfig
from common.engine.kv_cache import BlockPool
from common.engine.prefix import PrefixHasher
from common.engine.sequence import Sequence


@dataclass(frozen=True)
class ParkRefused:
    """Why park() did not place K/V: code is one of duplicate, evicted, too_big, no_room, unclaimed (its
    claim said nobody wants it any more: freed at once), unplaceable (it could not be copied into the pool:
    another device, a shape that does not fit; freed at once), stopped (the engine is shutting down) or
    failed (the engine thread failed)."""

    code: str
    message: str

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class Parked:
    """K/V that park() placed in the pool, not yet claimed by a submit(parked=True)."""

    num_tokens: int
    parked_s: float  # time.monotonic() when it was placed
    prefix_hashes: list[bytes]  # the pool's cached prefix it builds on


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt positions start .. end-1 of seq, run in one prefill forward."""

    seq: Sequence
    start: int
    end: int

    @property
    def last(self) -> bool:
        return self.end == len(self.seq.prompt_ids)


@dataclass(frozen=True)
class DecodeRows:
    """Positions start .. end-1 of seq run as rows of this decode step; with `sample`, the last is its
    newest token, whose row gives the logits of the next."""

    seq: Sequence
    start: int
    end: int
    sample: bool


@dataclass
class Admission:
    admitted: list[Sequence] = field(default_factory=list)  # given their blocks, in admission order
    refused: list[tuple[Sequence, str]] = field(default_factory=list)  # (sequence, why): too big for the pool


class Scheduler:
    def __init__(self, config: EngineConfig, pool: BlockPool, hasher: PrefixHasher):
        self.config = config
        self.pool = pool
        self.hasher = hasher
        self.seqs: dict[str, Sequence] = {}  # every sequence from add() to remove()
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.prefilling: list[Sequence] = []  # admitted, blocks allocated, prompt chunks still to run
        self.running: list[Sequence] = []  # the decode batch, oldest first
        self.parked: dict[str, Parked] = {}  # counted in the pool like any sequence's K/V
        self._chunk_ends: collections.OrderedDict[bytes, None] = collections.OrderedDict()  # newest last
        self.num_prompt_tokens = 0  # prompt tokens admitted for prefill ...
        self.num_cached_tokens = 0  # ... of which the prefix cache already held the K/V

    @property
    def num_active(self) -> int:
        return len(self.seqs) + len(self.parked)

    # ------------------------------------------------------------------ in and out

    def add(self, seq: Sequence) -> str | None:
        """Queue a submitted sequence; or why not (its id is taken, the K/V parked for it is not its)."""
        if seq.seq_id in self.seqs:
            return f"sequence id {seq.seq_id!r} is already running"
        if self.config.prefix_caching:
            seq.block_hashes = self.hasher.block_hashes(seq.prompt_ids, self.hasher.chunk_blocks(len(seq.prompt_ids)))
        if seq.parked:
            parked = self.parked.pop(seq.seq_id, None)
            error = None
            if parked is None:
                error = f"no K/V parked for {seq.seq_id!r}"
            elif parked.num_tokens != len(seq.prompt_ids):
                error = (f"the K/V parked for {seq.seq_id!r} holds {parked.num_tokens} tokens, the prompt has "
                         f"{len(seq.prompt_ids)}")
            elif parked.prefix_hashes != seq.block_hashes[:len(parked.prefix_hashes)]:
                error = f"the cached prefix the push of {seq.seq_id!r} named is not this prompt's"
            if error is not None:
                if parked is not None:
                    self.pool.free(seq.seq_id)
                return error
            seq.num_computed = parked.num_tokens
            self._register(seq)  # its K/V came from prefill chunks: name its full-chunk blocks
        self.seqs[seq.seq_id] = seq
        self.waiting.append(seq)
        return None

    def remove(self, seq: Sequence) -> None:
        """Forget the sequence, wherever it is, and free its blocks (forgotten first: a pool that fails to free
        them does not leave it behind to be ended twice)."""
        self.seqs.pop(seq.seq_id, None)
        for queue_ in (self.running, self.prefilling, self.waiting):
            if seq in queue_:
                queue_.remove(seq)
                break
        self.pool.free(seq.seq_id)

    def park_refusal(self, seq_id: str, prefix_hashes: list[bytes], num_new_tokens: int) -> ParkRefused | None:
        """Why park() cannot place K/V of num_new_tokens after the cached prefix_hashes now; None if it can."""
        prefix = self.pool.match_prefix(prefix_hashes)
        num_tokens = len(prefix_hashes) * self.pool.block_size + num_new_tokens
        if seq_id in self.seqs or seq_id in self.parked:
            return ParkRefused("duplicate", f"K/V for {seq_id!r} is already in this worker's pool")
        if len(prefix) != len(prefix_hashes):
            return ParkRefused("evicted", f"the cached prefix of {len(prefix_hashes)} blocks the push builds on "
                                          f"is no longer in this worker's pool: push it all")
        if self.pool.blocks_for(num_tokens) > self.pool.num_blocks:
            return ParkRefused("too_big", self.too_big(num_tokens))
        if not self.pool.can_allocate(num_tokens, prefix):
            return ParkRefused("no_room", f"the KV pool has {self.pool.num_free_blocks} free blocks, the K/V of "
                                          f"{num_tokens} tokens needs {self.pool.blocks_for(num_tokens) - len(prefix)} "
                                          f"more")
        return None

    def park(self, seq_id: str, prefix_hashes: list[bytes], num_new_tokens: int) -> int:
        """Allocate what park_refusal() allowed; returns the position the new K/V starts at."""
        start = len(prefix_hashes) * self.pool.block_size
        self.pool.allocate(seq_id, start + num_new_tokens, self.pool.match_prefix(prefix_hashes))
        self.parked[seq_id] = Parked(start + num_new_tokens, time.monotonic(), prefix_hashes)
        return start

    def unpark(self, seq_id: str) -> None:
        del self.parked[seq_id]
        self.pool.free(seq_id)

    def too_big(self, num_tokens: int) -> str:
        return (f"a sequence of {num_tokens} tokens needs {self.pool.blocks_for(num_tokens)} KV blocks; "
                f"the whole pool has {self.pool.num_blocks}")

    # ------------------------------------------------------------------ admission and prefill

    def admit(self) -> Admission:
        """Admit waiting sequences, oldest first, while the batch has room: parked or handed-in K/V go
        straight to decoding; others get their blocks (a cached prefix reused) and join the prefills.
        One the pool cannot hold now waits, and everyone behind it: nothing is allocated in part.
        Handed-in K/V (seq.kv) is the caller's to place in the blocks."""
        out = Admission()
        while self.waiting and len(self.running) + len(self.prefilling) < self.config.max_running:
            seq = self.waiting[0]
            if seq.num_computed:  # parked: its blocks are already in the pool
                self.running.append(self.waiting.popleft())
                out.admitted.append(seq)
                continue
            # Room for every token it holds, and for a new sequence the one its prefill samples.
            n = seq.num_tokens + (0 if seq.output_ids else 1)
            if self.pool.blocks_for(n) > self.pool.num_blocks:
                out.refused.append((self.waiting.popleft(), self.too_big(n)))
                continue
            prefix = self._cached_prefix(seq) if seq.kv is None else []
            if not self.pool.can_allocate(n, prefix):
                break
            self.waiting.popleft()
            self.pool.allocate(seq.seq_id, n, prefix)
            if seq.kv is not None:
                seq.num_computed = len(seq.prompt_ids)
                self.running.append(seq)
            else:
                seq.num_computed = seq.num_cached = len(prefix) * self.pool.block_size
                seq.num_registered = len(prefix)
                self.num_prompt_tokens += len(seq.prompt_ids)
                self.num_cached_tokens += seq.num_computed
                self.prefilling.append(seq)
            out.admitted.append(seq)
        return out

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The pool's blocks for the longest run of whole chunks of the prompt it already holds, short
        of the last token (always computed, for its logits)."""
        if not self.config.prefix_caching:
            return []
        blocks = self.pool.match_prefix(seq.block_hashes[:self.hasher.reusable_blocks(len(seq.prompt_ids))])
        per_chunk = self.hasher.chunk_tokens // self.pool.block_size
        return blocks[:len(blocks) // per_chunk * per_chunk]

    def schedule_prefill(self) -> list[PrefillChunk]:
        """The prompt chunks to run now, in order: up to the token budget (at least one chunk), oldest
        sequence first; prefill_only, one chunk (_next_chunk)."""
        if not self.prefilling:
            return []
        if self.config.prefill_only:
            return [self._next_chunk()]
        budget = self.config.max_prefill_tokens
        chunks: list[PrefillChunk] = []
        for seq in self.prefilling:
            start = seq.num_computed
            while start < len(seq.prompt_ids) and (budget > 0 or not chunks):
                chunks.append(self._chunk_at(seq, start))
                budget -= chunks[-1].end - start
                start = chunks[-1].end
            if budget <= 0:
                break
        return chunks

    def _next_chunk(self) -> PrefillChunk:
        """A prefill worker's step: one chunk, of the prompt with the fewest tokens left, so that a short
        prompt that comes while a long one prefills waits for one chunk, not for the whole prompt (its
        first token, and its push, go out at once). A prompt passed over for a budget's worth of chunks
        (max_prefill_tokens / chunk) runs next whatever its length: a long prompt is never starved. The
        chunks are the same either way (fixed positions, one prompt a call), so are the bits."""
        limit = max(1, self.config.max_prefill_tokens // self.hasher.chunk_tokens)
        overdue = [s for s in self.prefilling if s.passed_over >= limit]
        # min() keeps the first of equals: the oldest, among prompts with as many tokens left.
        seq = overdue[0] if overdue else min(self.prefilling, key=lambda s: len(s.prompt_ids) - s.num_computed)
        for other in self.prefilling:
            other.passed_over = 0 if other is seq else other.passed_over + 1
        return self._chunk_at(seq, seq.num_computed)

    def _chunk_at(self, seq: Sequence, start: int) -> PrefillChunk:
        chunk = self.hasher.chunk_tokens
        return PrefillChunk(seq, start, min(start // chunk * chunk + chunk, len(seq.prompt_ids)))

    def chunk_done(self, chunk: PrefillChunk) -> None:
        """The chunk's K/V is in the cache: name its blocks; a prompt whose last chunk ran leaves the
        prefills (for the decode batch, unless prefill_only)."""
        seq = chunk.seq
        seq.num_computed = chunk.end
        self._register(seq)
        if chunk.last:
            self.prefilling.remove(seq)
            if not self.config.prefill_only:
                self.running.append(seq)

    def _register(self, seq: Sequence) -> None:
        """Name the blocks of the prompt's chunks computed so far, so later prompts can reuse them."""
        if not seq.block_hashes:
            return
        per_chunk = self.hasher.chunk_tokens // self.pool.block_size
        full = min(seq.num_computed // self.hasher.chunk_tokens * per_chunk, len(seq.block_hashes))
        table = self.pool.block_table(seq.seq_id)
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

    # ------------------------------------------------------------------ decode

    def schedule_decode(self) -> tuple[list[DecodeRows], list[Sequence]]:
        """Grow every running table, oldest first, by the slot its next token needs; on shortage preempt
        the newest (it has the least work to recompute) until the older one fits. Then the rows to run:
        per sequence its replayed tokens, within max_replay_rows for the whole step, then its newest.
        Returns the rows and the sequences preempted."""
        preempted: list[Sequence] = []
        for seq in list(self.running):
            if seq not in self.running:
                continue  # preempted below for an older sequence
            while not self.pool.can_grow(seq.seq_id, seq.num_tokens) and self.running[-1] is not seq:
                preempted.append(self._preempt(self.running[-1]))
            if self.pool.can_grow(seq.seq_id, seq.num_tokens):
                self.pool.grow(seq.seq_id, seq.num_tokens)
            else:
                preempted.append(self._preempt(seq))
        rows: list[DecodeRows] = []
        replay_budget = self.config.max_replay_rows
        for seq in self.running:
            # Positions num_computed .. num_tokens-1 lack K/V: replayed tokens, then the newest.
            num_replay = seq.num_tokens - 1 - seq.num_computed
            k = min(num_replay, replay_budget)
            replay_budget -= k
            end = seq.num_computed + k + (1 if k == num_replay else 0)
            rows.append(DecodeRows(seq, seq.num_computed, end, sample=end == seq.num_tokens))
            seq.num_computed = end
        return rows, preempted

    def _preempt(self, seq: Sequence) -> Sequence:
        # Recompute later: its tokens are kept; its prompt is prefilled again and its completion replayed.
        self.pool.free(seq.seq_id)
        seq.num_computed = seq.num_registered = 0
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        return seq

    def check_integrity(self) -> None:
        """The pool's own books balance, and it holds blocks for exactly the sequences that should."""
        self.pool.check_integrity()
        holders = {s.seq_id for s in self.running + self.prefilling} | set(self.parked) | {
            s.seq_id for s in self.waiting if self.pool.holds(s.seq_id)}
        assert self.pool.num_seqs == len(holders), (
            f"KV pool holds {self.pool.num_seqs} sequences; {len(self.running)} are running, "
            f"{len(self.parked)} parked")
