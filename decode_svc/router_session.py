"""One router's DecodeSession: many requests over one stream, one message of everyone's new tokens per step.

A Decode call costs a handler thread, a queue and a gRPC message per token per request. A session
costs one stream per router: the reader thread starts and cancels requests as the router asks, the
engine's sinks drop each sequence's events into one queue, and the writer (the RPC's own thread)
sends what gathered there once the engine ends a step. KV waits hold no thread either
(KVInbox.take_async).

The reader never waits on Redis: a start's checks (its lease is a Redis round trip) run on the worker's
small start pool, so while Redis stalls the cancels behind it still land at once (a cancelled request
stops decoding and frees its KV). A message that does not parse, or a start that fails, fails that
request alone; the session goes on.
"""
from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time

import grpc

from common import metrics, tracing
from common.engine.engine import TokenEvent
from common.engine.output import FinishReason
from common.grpc_common import ServiceError
from common.pb_convert import FINISH_TO_PB, logprobs_to_pb
from decode_svc.inbox import seq_key
from decode_svc.spans import DecodeSpans
from protos import internal_pb2

log = logging.getLogger(__name__)

_FLUSH = object()  # the engine ended a step: send what gathered
_END = object()  # the stream ended: stop writing
_IDLE_FLUSH_S = 0.02  # events that come outside a step (failures, KV waits) go out after this


class PendingEvent:
    """A sequence's events not yet sent, merged into one DecodeEvent."""

    def __init__(self, request_id: str, kv_wait_s: float = 0.0, spans: DecodeSpans | None = None):
        self.request_id = request_id
        self.kv_wait_s = kv_wait_s
        self.spans = spans  # its claim and decode spans (decode sessions)
        self.t_start = time.perf_counter()
        self.num_tokens = 0  # sent so far
        self.token_ids: list[int] = []
        self.logprobs: list = []
        self.finish: FinishReason | None = None
        self.error: str | None = None
        self.invalid = False  # the request's own fault (TokenEvent.invalid)
        self._first = True

    def add(self, ev: TokenEvent) -> None:
        self.token_ids += ev.token_ids
        self.logprobs += ev.logprobs or ()
        self.finish, self.error, self.invalid = ev.finish_reason, ev.error, ev.invalid

    def failure(self) -> ServiceError | None:
        """The status the request ends with when the engine failed or stopped it."""
        if self.finish == FinishReason.ERROR and self.invalid:  # any worker would fail it: not retried
            return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"decode of {self.request_id}: {self.error}")
        if self.finish == FinishReason.ERROR:
            return ServiceError(grpc.StatusCode.INTERNAL, f"decode of {self.request_id} failed: {self.error}")
        if self.finish == FinishReason.CANCELLED:
            return ServiceError(grpc.StatusCode.UNAVAILABLE, f"decode of {self.request_id} was stopped: {self.error}")
        return None

    def take(self) -> internal_pb2.DecodeEvent:
        msg = internal_pb2.DecodeEvent(token_ids=self.token_ids, decode_s=time.perf_counter() - self.t_start,
                                       logprobs=[logprobs_to_pb(lp) for lp in self.logprobs])
        if self._first:
            msg.kv_wait_s = self.kv_wait_s
            self._first = False
        if self.finish is not None:
            msg.finish_reason = FINISH_TO_PB[self.finish]
        self.num_tokens += len(self.token_ids)
        self.token_ids, self.logprobs = [], []
        return msg


class DecodeSession:
    """The requests of one DecodeSession stream, from start to their last event."""

    def __init__(self, worker, context: grpc.ServicerContext):
        self.w = worker
        self.context = context
        self._out: queue.SimpleQueue = queue.SimpleQueue()  # (key, TokenEvent | ServiceError) | _FLUSH | _END
        self._lock = threading.Lock()
        self._live: dict[str, tuple[PendingEvent, int, contextlib.ExitStack]] = {}  # key -> (pending, attempt, guard)
        self._closed = False  # set by _close(), under _lock: a start that comes later is not taken
        # Keys whose start's checks are running on the start pool, and keys the router cancelled while starting
        # or before their sequence reached the engine (the engine takes a cancel only for what it holds).
        self._starting: set[str] = set()
        self._cancelled: set[str] = set()

    def run(self, requests):
        """The RPC: read requests on a thread of their own, write events here until the stream ends."""
        self.w.engine.step_listeners.append(self._flush)
        self.context.add_callback(self._close)
        threading.Thread(target=self._read, args=(requests,), name="decode-session", daemon=True).start()
        try:
            yield from self._write()
        finally:
            self.w.engine.step_listeners.remove(self._flush)
            self._close()

    # ---- requests in (the reader thread; the checks of a start on the start pool)

    def _read(self, requests) -> None:
        requests = iter(requests)
        while True:
            try:
                req = next(requests)
            except StopIteration:
                return
            except grpc.RpcError:
                return  # the router went away: _close() (the context's callback) cancels what it left
            except ServiceError as exc:  # a message that did not parse: its request is unknown, the others go on
                log.warning("decode session: a message was skipped: %s", exc.message)
                continue
            except Exception:  # noqa: BLE001 - the stream itself broke: end it, not leave it hanging
                log.exception("decode session reader failed")
                self.context.cancel()
                return
            if req.HasField("start"):
                self._submit_start(req.start)
            elif req.HasField("cancel"):
                self._cancel(seq_key(req.cancel.request_id, req.cancel.attempt))

    def _submit_start(self, request: internal_pb2.DecodeRequest) -> None:
        key = seq_key(request.request_id, request.attempt)
        with self._lock:
            self._starting.add(key)
        try:
            self.w.start_pool.submit(self._start, request)
        except RuntimeError:  # the pool is shut down: the worker is stopping
            with self._lock:
                self._starting.discard(key)
            self._fail_now(request.request_id, request.attempt, ServiceError(
                grpc.StatusCode.UNAVAILABLE, f"decode worker {self.w.config.worker_id} is shutting down; "
                                             f"retry on another worker"))

    def _start(self, request: internal_pb2.DecodeRequest) -> None:
        """On the start pool: a start's checks, then the request joins the session (unless it closed, or the
        request was cancelled, meanwhile)."""
        key = seq_key(request.request_id, request.attempt)
        try:
            self._start_checked(request, key)
        except Exception as exc:  # noqa: BLE001 - a bug fails this request, not the session
            log.exception("decode session: the start of %s failed", key)
            with self._lock:
                self._starting.discard(key)
                self._cancelled.discard(key)
            self._fail_now(request.request_id, request.attempt,
                           ServiceError(grpc.StatusCode.INTERNAL, f"the start of {key} failed: {type(exc).__name__}"))

    def _start_checked(self, request: internal_pb2.DecodeRequest, key: str) -> None:
        w = self.w
        # Many requests share this stream: each carries its own trace context.
        spans = DecodeSpans(w, request, tracing.from_traceparent(request.traceparent))
        guard = contextlib.ExitStack()
        try:
            guard.enter_context(w.serving("Decode", key))
            job = w.check_decode(request)
        except (ServiceError, ValueError) as exc:
            guard.close()
            spans.refused(exc)
            with self._lock:
                self._starting.discard(key)
                self._cancelled.discard(key)
            self._fail_now(request.request_id, request.attempt, exc)
            return
        with self._lock:
            # The lease check above is a Redis round trip: the stream may have closed meanwhile, and nobody
            # would ever end a request that joined after that (invariant 2: every KV block freed); or the
            # router may have cancelled it.
            self._starting.discard(key)
            dropped = self._closed or key in self._cancelled
            if dropped:
                self._cancelled.discard(key)
            else:
                self._live[key] = (PendingEvent(job.request_id, spans=spans), request.attempt, guard)
        if dropped:
            w.inbox.cancel(key)
            guard.close()
            spans.refused("the session closed, or the router cancelled the request, before it started")
            return
        sink = lambda ev: self._out.put((key, ev))  # noqa: E731 - engine thread: a put, nothing more

        def submit(parked: bool) -> None:
            spans.decoding(job)
            w.engine.submit(key, job.prompt, job.params, sink, seed=job.seed, output_ids=job.output, parked=parked)
            with self._lock:  # the stream closed, or the router cancelled it, meanwhile: nobody reads its tokens
                gone = key not in self._live or key in self._cancelled
            if gone:
                w.engine.cancel(key)

        if job.prefill_here:
            submit(parked=False)
            return
        t0 = time.perf_counter()

        def kv_arrived(kv_len: int | None) -> None:
            try:
                w.check_kv(job, kv_len, job.kv_wait_s)
            except ServiceError as exc:
                spans.refused(exc)
                self._out.put((key, exc))
                return
            spans.claimed()
            entry = self._live.get(key)
            if entry is not None:
                entry[0].kv_wait_s = time.perf_counter() - t0
            submit(parked=True)

        w.inbox.take_async(key, job.kv_wait_s, kv_arrived)

    def _cancel(self, key: str) -> None:
        # Also for a request never started here: a push of its KV that came already is dropped, one
        # still to come is refused (the router cancels attempts that ended before their decode began).
        self.w.inbox.cancel(key)
        with self._lock:
            live = key in self._live
            if live or key in self._starting:  # a start still checking is dropped when its checks end
                self._cancelled.add(key)
        if live:
            self.w.engine.cancel(key)

    def _fail_now(self, request_id: str, attempt: int, exc: Exception) -> None:
        code = exc.code if isinstance(exc, ServiceError) else grpc.StatusCode.INVALID_ARGUMENT
        message = exc.message if isinstance(exc, ServiceError) else str(exc)
        self._out.put(internal_pb2.SessionEvent(request_id=request_id, attempt=attempt, status_code=code.value[0],
                                                status_message=message))

    def _flush(self) -> None:
        self._out.put(_FLUSH)

    def _close(self) -> None:
        """The stream ended: every request still on it is cancelled, its blocks freed, its guard let go."""
        with self._lock:
            self._closed = True
            live, self._live = self._live, {}
            self._cancelled.clear()
        for key, (pending, _, guard) in live.items():
            self.w.inbox.cancel(key)
            self.w.engine.cancel(key)
            guard.close()
            pending.spans.ended(pending.num_tokens, FinishReason.CANCELLED)
        self._out.put(_END)

    # ---- events out (the RPC's thread)

    def _write(self):
        while True:
            item = self._out.get()
            if item is _END:
                return
            ready: dict[str, internal_pb2.SessionEvent | None] = {}  # key -> its failure, or None: tokens
            while item is not _FLUSH and item is not _END:
                self._gather(item, ready)
                try:
                    item = self._out.get(timeout=_IDLE_FLUSH_S)
                except queue.Empty:
                    break
            events = [ev if ev is not None else self._tokens(key) for key, ev in ready.items()]
            events = [ev for ev in events if ev is not None]
            if events:
                metrics.DECODE_SESSION_MESSAGES.labels(self.w.config.worker_id).inc()
                yield internal_pb2.SessionEvents(events=events)
            if item is _END:
                return

    def _gather(self, item, ready: dict) -> None:
        if isinstance(item, internal_pb2.SessionEvent):  # refused at its start
            ready[seq_key(item.request_id, item.attempt)] = item
            return
        key, ev = item
        with self._lock:
            entry = self._live.get(key)
        if entry is None:
            return  # ended already (a late event after a failure, or the stream closed)
        pending, attempt, _ = entry
        failed = ev if isinstance(ev, ServiceError) else None
        if failed is None:
            pending.add(ev)
            failed = pending.failure()
        if failed is None:
            ready.setdefault(key, None)
            return
        pending.spans.ended(pending.num_tokens, pending.finish, failed.message)
        self._end(key)
        self.w.engine.cancel(key)  # a KV check that failed may leave the push parked: free it
        ready[key] = internal_pb2.SessionEvent(request_id=pending.request_id, attempt=attempt,
                                               status_code=failed.code.value[0], status_message=failed.message)

    def _tokens(self, key: str) -> internal_pb2.SessionEvent | None:
        """The tokens gathered for key since the last message, and its end if it finished."""
        with self._lock:
            entry = self._live.get(key)
        if entry is None:
            return None
        pending, attempt, _ = entry
        finished = pending.finish is not None
        msg = internal_pb2.SessionEvent(request_id=pending.request_id, attempt=attempt, event=pending.take())
        if finished:
            self._end(key)
        return msg

    def _end(self, key: str) -> None:
        with self._lock:
            entry = self._live.pop(key, None)
            self._cancelled.discard(key)
        if entry is not None:
            entry[2].close()
            entry[0].spans.ended(entry[0].num_tokens, entry[0].finish)  # a no-op after a failure
