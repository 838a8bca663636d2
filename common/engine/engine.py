"""A single-process engine: admits requests, prefills them, then decodes them with continuous batching.

Sequences join and leave the running batch at any step. Each sequence streams its
tokens to a `sink` callback, called from the engine thread (keep it non-blocking).
The prefill and decode services wrap exactly this: a prefill worker runs it with
`prefill_only=True` (it stops after the first token and exports the K/V), a decode
worker parks K/V that arrived over the wire in its pool (`park`) and then submits the
sequence that continues from it. The Scheduler (scheduler.py) decides what runs; the
Engine runs it on its thread, samples and streams.

A sequence's tokens never depend on how it got its K/V (invariant 4: same inputs, same tokens). The
prompt's K/V always comes from one prefill forward of the prompt alone, and every completion token's K/V
from a decode-step row (rows are batch-invariant, see model.py). So a sequence that resumes with tokens
it already has (after a failover, or after preemption here) prefills its prompt only and then *replays*
the known tokens as decode rows (several per step, K/V only), instead of prefilling them, which would
compute their K/V with other GEMM shapes and other bits.
"""
from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from common.engine.config import EngineConfig
from common.engine.grammar import GrammarCompiler, bitmask_words, fill_bitmask
from common.engine.output import FinishReason, OutputProcessor
from common.engine.prefix import PrefixHasher
from common.engine.runner import DecodeItem, ModelRunner, PrefillItem
from common.engine.sampling import Sampler, SamplingParams, TokenLogprobs, derive_seed, token_logprobs
from common.engine.scheduler import ParkRefused, Scheduler
from common.engine.sequence import Sequence, TokenEvent
from common.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

__all__ = ["Engine", "EngineConfig", "ParkRefused", "TokenEvent"]  # what callers of the Engine use


# What other threads hand the engine thread, through its inbox.
@dataclass(frozen=True)
class Submit:
    seq: Sequence


@dataclass(frozen=True)
class Park:
    seq_id: str
    kv: torch.Tensor  # [layers, 2, tokens, Hkv, D], the tokens after the prefix_hashes blocks
    prefix_hashes: list[bytes]
    claim: Callable[[], bool] | None
    done: concurrent.futures.Future


@dataclass(frozen=True)
class Cancel:
    seq_id: str


class Engine:
    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, config: EngineConfig = EngineConfig()):
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config
        self.pool = runner.cache.pool
        self.max_context = runner.model.config.max_position
        kernels = runner.model.kernels
        self.sampler = Sampler(argmax=kernels.argmax if kernels is not None else None)
        # Structured outputs' compiled constraints. Callers compile a request's on their own thread first
        # (grammars.check), so that submit() only copies a cached matcher.
        self.grammars = GrammarCompiler(tokenizer)
        self.hasher = PrefixHasher(weights_id=getattr(runner.model, "weights_id", ""),
                                   dtype=str(runner.model.dtype), block_size=self.pool.block_size,
                                   chunk_tokens=config.prefill_chunk_tokens)
        self.scheduler = Scheduler(config, self.pool, self.hasher)  # engine-thread only
        self._inbox: queue.SimpleQueue[Submit | Park | Cancel] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Called on the engine thread after every step that did work, once its tokens were all sent to
        # the sinks: a sink that batches (a decode session) sends one message per step. Thread-safe to
        # append to and remove from.
        self.step_listeners: list[Callable[[], None]] = []
        # Called on the engine thread, once, if the thread fails (the exception it died of), before it ends
        # what it holds: a worker takes itself out of service there. Keep it short; append before start().
        self.failure_listeners: list[Callable[[BaseException], None]] = []
        self.failure: BaseException | None = None  # what the thread died of, if it did
        # Once the thread has ended, how it answers what is still handed to it: (finish reason, error, park
        # refusal). Set under _closing, which every put into the inbox takes too: after the thread's last
        # drain nothing can land in the inbox unanswered.
        self._closed: tuple[FinishReason, str, ParkRefused] | None = None
        self._closing = threading.Lock()
        self._in_hand: Submit | Park | Cancel | None = None  # the inbox message being handled
        self.num_steps = 0

    # ------------------------------------------------------------------ public, thread-safe

    def submit(self, seq_id: str, prompt_ids: list[int], params: SamplingParams,
               sink: Callable[[TokenEvent], None], *, seed: int | None = None,
               output_ids: list[int] | None = None, kv: torch.Tensor | None = None,
               parked: bool = False, kv_sink: Callable[[int, int, torch.Tensor], None] | None = None) -> None:
        """Queue a sequence. With `output_ids`, it resumes after tokens already generated (their K/V
        is replayed). With `kv` (the prompt's K/V, [layers, 2, len(prompt_ids), Hkv, D]) or `parked`
        (that K/V was placed by park() under seq_id), it skips the prompt's prefill. With `kv_sink`
        (prefill_only), the prompt's K/V goes to it piece by piece as it is computed, called from the
        engine thread (keep it non-blocking), instead of with the last event. A params.constraint that does
        not compile raises ValueError (grammars.check() it first, off the engine thread)."""
        seq = Sequence(seq_id, list(prompt_ids), params,
                       seed if seed is not None else derive_seed(params.seed), sink,
                       OutputProcessor(self.tokenizer, params, len(prompt_ids), self.max_context,
                                       detokenize=self.config.detokenize),
                       output_ids=list(output_ids or []), kv=kv, parked=parked,
                       kv_sink=kv_sink if self.config.prefill_only else None,
                       matcher=self.grammars.matcher(params.constraint) if params.constraint else None)
        if kv is not None and kv.shape[2] != len(seq.prompt_ids):
            raise ValueError(f"kv holds {kv.shape[2]} tokens, the prompt has {len(seq.prompt_ids)}")
        # Resumed sequences: replay earlier tokens so stop strings, length and the constraint's matcher see
        # them (the matcher then stands where it stood when the tokens were first sampled).
        for i, t in enumerate(seq.output_ids):
            seq.output.push(t)
            reason, error = seq.output.finish_reason, None
            if reason is None and seq.matcher is not None and not seq.matcher.consume_token(t):
                reason, error = FinishReason.ERROR, (f"output_ids[{i}] (token {t}) does not match the structured "
                                                     f"output constraint: {seq.matcher.get_error()}")
            if reason is not None:
                # Already over (say the first token was EOS): nothing to compute.
                if parked:
                    self.cancel(seq_id)  # free what was parked for it
                sink(TokenEvent(seq_id, [], "", reason, error=error, invalid=error is not None))
                return
        if not self._put(Submit(seq)):
            reason, error, _ = self._closed
            sink(TokenEvent(seq_id, [], "", reason, error=error))

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
        from another thread after the future resolves, it would wait for the end of that step.

        kv may be on any device: it is copied into the pool's. One that cannot be (a device the pool cannot
        read from, a shape that does not fit) is refused alone ("unplaceable"), its blocks freed at once."""
        if kv.dim() != 5:
            raise ValueError(f"kv must be [layers, 2, tokens, kv_heads, head_dim], got shape {list(kv.shape)}")
        done: concurrent.futures.Future = concurrent.futures.Future()
        if not self._put(Park(seq_id, kv, list(prefix_hashes), claim, done)):
            done.set_result(self._closed[2])
        return done

    def cancel(self, seq_id: str) -> None:
        self._put(Cancel(seq_id))  # once the thread has ended, there is nothing left to cancel

    def _put(self, msg: Submit | Park | Cancel) -> bool:
        """Hand msg to the engine thread; False once the thread has ended (nothing would ever answer it)."""
        with self._closing:
            if self._closed is not None:
                return False
            self._inbox.put(msg)
        self._wake.set()
        return True

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
        return self.scheduler.num_active

    @property
    def num_parked(self) -> int:
        return len(self.scheduler.parked)

    # The scheduler's queues and counters, read by the services' metrics and by tests.
    waiting = property(lambda self: self.scheduler.waiting)
    prefilling = property(lambda self: self.scheduler.prefilling)
    running = property(lambda self: self.scheduler.running)
    num_prompt_tokens = property(lambda self: self.scheduler.num_prompt_tokens)
    num_cached_tokens = property(lambda self: self.scheduler.num_cached_tokens)

    def cached_chunk_hashes(self, limit: int = 2048) -> list[bytes]:
        """The newest whole-chunk prefixes the pool still holds; safe from other threads."""
        return self.scheduler.cached_chunk_hashes(limit)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    # ------------------------------------------------------------------ engine thread

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.step():
                    self._wake.wait(0.05)
                    self._wake.clear()
        except BaseException as exc:  # noqa: BLE001 - whatever ends the thread must not leave work hanging
            log.exception("the engine thread failed; ending its %d sequences and %d parked K/V, and taking no "
                          "more work", len(self.scheduler.seqs), len(self.scheduler.parked))
            self._fail(exc)
            return
        self._close(FinishReason.CANCELLED, "engine stopped",
                    ParkRefused("stopped", "the engine stopped (the worker is shutting down)"))

    def _fail(self, exc: BaseException) -> None:
        """The thread cannot go on (a bug, a device error, running out of memory in a step no one request
        can be blamed for): tell the listeners (the worker leaves service), then end every sequence with
        the cause and answer everything handed in, now and later, so nothing waits for a thread that is gone."""
        self.failure = exc
        for listener in list(self.failure_listeners):
            try:
                listener(exc)
            except Exception:  # noqa: BLE001 - the sequences must still be ended
                log.exception("an engine failure listener failed")
        error = f"the engine failed: {type(exc).__name__}: {exc}"
        self._close(FinishReason.ERROR, error, ParkRefused("failed", f"K/V refused: {error}"))

    def _close(self, reason: FinishReason, error: str, refusal: ParkRefused) -> None:
        """The thread's last act: nothing is taken in from now on; every sequence ends with (reason, error),
        parked K/V is freed, and what is left in the inbox is answered (parks with `refusal`)."""
        with self._closing:
            self._closed = (reason, error, refusal)
        msg, self._in_hand = self._in_hand, None
        try:
            if isinstance(msg, Park) and not msg.done.done():
                msg.done.set_result(refusal)
            elif isinstance(msg, Submit) and msg.seq.seq_id not in self.scheduler.seqs:  # never added
                self.runner.cache.pool.free(msg.seq.seq_id)  # the K/V parked for it, if add() took it
                msg.seq.sink(TokenEvent(msg.seq.seq_id, [], "", reason, error=error))
        except Exception:  # noqa: BLE001
            log.exception("answering what the engine was handling when it failed failed")
        for seq in list(self.scheduler.seqs.values()):
            try:
                self._finish(seq, reason, error=error)
            except Exception:  # noqa: BLE001 - its last event went out (_finish); end the others too
                log.exception("freeing the blocks of %s failed", seq.seq_id)
        for seq_id in list(self.scheduler.parked):
            try:
                self.scheduler.unpark(seq_id)
            except Exception:  # noqa: BLE001
                log.exception("freeing the K/V parked for %s failed", seq_id)
        while True:  # handed in after the last step: answered, never left waiting
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                break
            try:
                if isinstance(msg, Park):
                    msg.done.set_result(refusal)
                elif isinstance(msg, Submit):
                    msg.seq.sink(TokenEvent(msg.seq.seq_id, [], "", reason, error=error))
            except Exception:  # noqa: BLE001 - a failing sink must not keep the others unanswered
                log.exception("answering what was handed to the engine failed")

    def step(self) -> bool:
        """One scheduling iteration; returns False when there was nothing to do. An exception here is the
        engine's, not a request's (those are ended where they fail): run by the thread, it ends the thread
        (_fail); run by a caller, it reaches the caller."""
        self._drain_inbox()
        did = False
        if self.scheduler.waiting or self.scheduler.prefilling:
            admitted = self._admit()
            did = self._prefill() or admitted
        if self.scheduler.running:
            self._decode_step()
            did = True
        self.num_steps += did
        if did:
            for listener in list(self.step_listeners):
                listener()
        return did

    def _drain_inbox(self) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._in_hand = msg  # out of the inbox, maybe not yet answered: _close answers it if this fails
            match msg:
                case Submit(seq):
                    if (error := self.scheduler.add(seq)) is not None:
                        seq.sink(TokenEvent(seq.seq_id, [], "", FinishReason.ERROR, error=error))
                case Park():
                    self._park(msg)
                case Cancel(seq_id):
                    if seq_id in self.scheduler.seqs:
                        self._finish(self.scheduler.seqs[seq_id], FinishReason.CANCELLED)
                    elif seq_id in self.scheduler.parked:
                        self.scheduler.unpark(seq_id)
            self._in_hand = None

    def _park(self, msg: Park) -> None:
        refused = self.scheduler.park_refusal(msg.seq_id, msg.prefix_hashes, msg.kv.shape[2])
        if refused is not None:
            msg.done.set_result(refused)
            return
        start = self.scheduler.park(msg.seq_id, msg.prefix_hashes, msg.kv.shape[2])
        try:
            self.runner.cache.import_seq(msg.seq_id, msg.kv, start)
        except Exception as exc:  # noqa: BLE001 - this K/V's fault (or this copy's): refuse it alone
            self.scheduler.unpark(msg.seq_id)
            msg.done.set_result(ParkRefused("unplaceable", f"the K/V of {msg.seq_id!r} cannot be placed in the KV "
                                                           f"pool: {self._placement_error(msg.kv, exc)}"))
            return
        # The claim's submit lands in self._inbox, which the drain running now empties next: the
        # sequence is admitted into this iteration's step.
        try:
            wanted = msg.claim is None or msg.claim()
        except Exception as exc:  # noqa: BLE001 - a failing claim must not stop the engine thread
            log.exception("claim of the K/V parked for %s failed", msg.seq_id)
            wanted, why = False, f"its claim failed: {exc}"
        else:
            why = "nobody claims it any more (its Decode call ended, or its K/V had already come)"
        if not wanted:
            if msg.seq_id in self.scheduler.parked:  # a claim may have cancelled it itself
                self.scheduler.unpark(msg.seq_id)
            msg.done.set_result(ParkRefused("unclaimed", f"K/V for {msg.seq_id!r} freed: {why}"))
            return
        msg.done.set_result(None)

    def _admit(self) -> bool:
        """Admit what the pool and the batch have room for; place handed-in K/V, and hand a prefill
        worker's kv_sink the K/V of a prompt's cached prefix."""
        admission = self.scheduler.admit()
        for seq, error in admission.refused:
            self._finish(seq, FinishReason.ERROR, error=error)
        for seq in admission.admitted:
            if seq.kv is not None:
                kv, seq.kv = seq.kv, None
                try:
                    self.runner.cache.import_seq(seq.seq_id, kv)
                except Exception as exc:  # noqa: BLE001 - this sequence's K/V: it fails alone
                    self._finish(seq, FinishReason.ERROR,
                                 error=f"its K/V cannot be placed in the KV pool: {self._placement_error(kv, exc)}")
            elif seq.kv_sink is not None and seq.num_cached:
                seq.kv_sink(0, seq.num_cached, self.runner.cache.export_seq(seq.seq_id, seq.num_cached))
        return bool(admission.admitted)

    def _prefill(self) -> bool:
        """Run the prompt chunks the scheduler picks; a sequence whose last chunk ran gets its first token
        (the prompt alone, even for a resumed sequence: its completion is replayed by decode rows), at the
        end of the pass with the others': the decode step that gives their second tokens comes only after
        the whole pass, and a first token that came early would only make its gap to the second one
        longer. Sampling is row-invariant, so a first token does not depend on what ran with it, or when.
        prefill_only, the pass is one chunk: a first token goes out at once, and its K/V push overlaps
        the next prompt's chunks."""
        chunks = self.scheduler.schedule_prefill()
        done: list[tuple[Sequence, torch.Tensor, torch.Tensor]] = []  # (seq, logits, last hidden state)
        for chunk in chunks:
            seq, n = chunk.seq, len(chunk.seq.prompt_ids)
            logits = self.runner.prefill([PrefillItem(seq.seq_id, seq.prompt_ids[chunk.start:chunk.end], chunk.start)])
            hidden = self.runner.last_hidden
            self.scheduler.chunk_done(chunk)
            if seq.kv_sink is not None and chunk.end < n:  # the last chunk's waits for the first token
                seq.kv_sink(chunk.start, chunk.end, self.runner.cache.export_seq(seq.seq_id, chunk.end, chunk.start))
            if chunk.last:
                done.append((seq, logits, hidden))
        for seq, logits, hidden in done:
            self._first_token(seq, logits, hidden)
        return bool(chunks)

    def _first_token(self, seq: Sequence, logits: torch.Tensor, hidden: torch.Tensor) -> None:
        """A prompt is prefilled: sample its first token (none for a resumed sequence), hand it out, and
        export the K/V (prefill_only; colocated, the scheduler moved it to the decode batch)."""
        tok = logprob = None
        if not seq.output_ids:
            tok = self._sample([seq], logits)[0]
            if tok is None:
                self._finish(seq, FinishReason.ERROR, error=_dead_end(seq), invalid=True)
                return
            logprob = self._logprobs([seq], {0: tok}, hidden).get(0)
        seq.first_token_s = seq.first_token_s or time.perf_counter()
        if self.config.prefill_only:
            self._prefilled(seq, tok, logprob)
        elif tok is not None:
            self._emit(seq, tok, logprob)

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

    def _decode_step(self) -> None:
        rows, preempted = self.scheduler.schedule_decode()
        for seq in preempted:
            log.warning("KV pool full: preempting %s (%d tokens) for recompute", seq.seq_id, seq.num_tokens)
        if not self.scheduler.running:
            return
        items = [DecodeItem(r.seq.seq_id, r.seq.token_at(pos), pos, sample=pos == r.seq.num_tokens - 1)
                 for r in rows for pos in range(r.start, r.end)]
        logits = self.runner.decode(items)
        sampled = [r.seq for r in rows if r.sample]
        if sampled:
            tokens = self._sample(sampled, logits)
            logprobs = self._logprobs(sampled, {i: tok for i, tok in enumerate(tokens) if tok is not None})
            for i, (seq, tok) in enumerate(zip(sampled, tokens)):
                if tok is None:
                    self._finish(seq, FinishReason.ERROR, error=_dead_end(seq), invalid=True)
                else:
                    self._emit(seq, tok, logprobs.get(i))

    def _sample(self, batch: list[Sequence], logits: torch.Tensor) -> list[int | None]:
        """Row i's token for batch[i]; None for a row whose constraint allows no token (a dead end). Masks are
        computed for the constrained rows only; the others' logits are not touched."""
        mask_rows = [i for i, s in enumerate(batch) if s.matcher is not None]
        bitmask, dead = None, []
        if mask_rows:
            bitmask = torch.empty(len(mask_rows), bitmask_words(self.grammars.vocab_size), dtype=torch.int32)
            fill_bitmask([batch[i].matcher for i in mask_rows], bitmask)
            # A matcher in its error state allows only EOS, which would end the request as if its constraint
            # were met: that is a dead end too, as is a mask that allows nothing.
            empty = (bitmask == 0).all(dim=1).tolist()
            dead_rows = [j for j, i in enumerate(mask_rows) if empty[j] or batch[i].matcher.is_error()]
            if dead_rows:
                dead = [mask_rows[j] for j in dead_rows]
                bitmask[dead_rows] = -1  # sampled as if free, then dropped: no row of -inf reaches the sampler
        tokens = self.sampler(logits, [s.params for s in batch], [s.seed for s in batch],
                              [len(s.output_ids) for s in batch], [s.prompt_ids for s in batch],
                              [s.output_ids for s in batch], mask_rows, bitmask).tolist()
        for i in dead:
            tokens[i] = None
        return tokens

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
        if seq.output.finish_reason is None and seq.matcher is not None and not seq.matcher.consume_token(tok):
            self._finish(seq, FinishReason.ERROR, text=text, token_ids=[tok], logprobs=logprobs,
                         error=f"token {tok} broke the structured output constraint: {seq.matcher.get_error()}",
                         invalid=True)
        elif seq.output.finish_reason is not None:
            self._finish(seq, seq.output.finish_reason, text=text, token_ids=[tok], logprobs=logprobs)
        else:
            seq.sink(TokenEvent(seq.seq_id, [tok], text, logprobs=logprobs))

    def _finish(self, seq: Sequence, reason: FinishReason | None, *, text: str = "",
                token_ids: list[int] | None = None, error: str | None = None,
                kv: torch.Tensor | None = None, logprobs: list[TokenLogprobs] | None = None,
                block_hashes: list[bytes] | None = None, cached_tokens: int = 0, invalid: bool = False) -> None:
        """The one way out for a sequence: frees its blocks and sends its last event (even if freeing fails)."""
        try:
            self.scheduler.remove(seq)
        finally:
            try:
                seq.sink(TokenEvent(seq.seq_id, token_ids or [], text, reason, error=error, kv=kv, logprobs=logprobs,
                                    block_hashes=block_hashes, cached_tokens=cached_tokens, invalid=invalid))
            except Exception:
                log.exception("sink of %s failed", seq.seq_id)

    def _placement_error(self, kv: torch.Tensor, exc: Exception) -> str:
        """Why K/V handed in could not be copied into the pool, for the refusal (and the log)."""
        pool = self.runner.cache.kv
        why = (f"{type(exc).__name__}: {exc} (K/V {list(kv.shape)} {kv.dtype} on {kv.device}; the pool is "
               f"{pool.dtype} on {pool.device})")
        log.warning("K/V handed to the engine refused: %s", why)
        return why


def _dead_end(seq: Sequence) -> str:
    why = seq.matcher.get_error() or "no token can continue the completion"
    return (f"the structured output constraint reached a dead end after {len(seq.output_ids)} tokens: {why} "
            f"(the grammar cannot be completed from here)")
