"""The router's Generate: reserve decode KV, prefill, relay tokens; fail over while the retry budget lasts.

A request is a coroutine on the router's event loop (router/server.py), not a thread: it awaits the
prefill worker's stream (grpc.aio), the decode session's events (router/decode_sessions.py) and, on the
fixed blocking pool, Redis. The client going away cancels its task; the cancellation reaches
whatever it awaits, and its cleanup still records the end, frees the KV and releases the lease.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Awaitable, Callable

import grpc

from common import grpc_common, metrics, security, tracing
from common.grpc_common import ServiceError
from common.engine.output import FinishReason, OutputProcessor
from common.state import RequestState, StateStore, StateUnavailable, WorkerInfo
from common.engine.tokenizer import Tokenizer
from common.pb_convert import FINISH_TO_PB, sampling_to_pb
from protos import handoff_pb2, handoff_pb2_grpc, internal_pb2, internal_pb2_grpc
from router.blocking import BlockingPool, to_the_end
from router.config import RouterConfig
from router.leases import LeaseKeeper
from router.picker import Excluded, Lease, WorkerPicker
from router.decode_sessions import DecodeSessions
from router.validate import RequestValidator, ValidRequest

log = logging.getLogger(__name__)

# Downstream failures that another worker may not have: the attempt is retried elsewhere.
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.DATA_LOSS,
              grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED,
              grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED}
_TERMINAL = {FinishReason.STOP: RequestState.FINISHED, FinishReason.LENGTH: RequestState.FINISHED,
             FinishReason.CANCELLED: RequestState.CANCELLED, FinishReason.ERROR: RequestState.FAILED}

Send = Callable[[handoff_pb2.GenerateResponse], Awaitable[None]]


class _AttemptFailed(Exception):
    """One attempt failed; `role` is what it is charged to: a "prefill" or "decode" worker (excluded
    from this request's retries), the "link" between them, or the "lease" (lost, no worker at fault)."""

    def __init__(self, role: str, worker_id: str, epoch: str, message: str):
        super().__init__(f"{role} worker {worker_id}: {message}" if role in ("prefill", "decode")
                         else f"{role} ({worker_id}): {message}")
        self.role = role
        self.worker_id = worker_id
        self.epoch = epoch


class _StreamClosed(Exception):
    """The client's stream took no more messages: its call is over, or the server stopped (past its grace)
    between the handler's cancellation and its next write. Not a failure: the request ends cancelled."""


class Router:
    """What all Generate calls share: validation, worker choice, channels, Redis, the lease keeper.
    Built and used on the router's event loop."""

    def __init__(self, config: RouterConfig, state: StateStore, tokenizer: Tokenizer, model_config, weights_id: str,
                 router_id: str = "", sampling_defaults: dict | None = None):
        self.config = config
        self.state = state
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.router_id = router_id
        self.weights_id = weights_id
        self.validator = RequestValidator(tokenizer, model_config, default_max_tokens=config.default_max_tokens,
                                          max_messages=config.max_messages, sampling_defaults=sampling_defaults)
        # Redis calls and tokenization: on a few threads, whatever the number of requests in flight.
        self.blocking = BlockingPool(config.blocking_threads)
        self.picker = WorkerPicker(state, self.blocking, weights_id, lease_ttl_s=config.lease_ttl_s,
                                   queue_timeout_s=config.queue_timeout_s, max_queued=config.max_queued,
                                   routing=config.routing, cache_balance=config.cache_balance)
        self.leases = LeaseKeeper(state, config.lease_ttl_s)
        # The router's own certificate is its client certificate towards the workers (mutual TLS), whose
        # certificates must name their role; channels opened after a rotation use the new files.
        files = security.tls_files(config.tls)
        self.channels = grpc_common.AioChannelCache(tls=security.ClientTLS(files, "prefill") if files else None)
        # Decode streams: one DecodeSession per decode worker carries all of this router's requests there.
        self.sessions = DecodeSessions(tls=security.ClientTLS(files, "decode") if files else None)
        self.calls: set[GenerateCall] = set()  # in flight (recorded in Redis, not yet ended)

    async def validate(self, request: handoff_pb2.GenerateRequest) -> ValidRequest:
        """The validator's answer (chat templates and tokenization are CPU work: off the loop)."""
        return await self.blocking.run(self.validator.validate, request)

    async def close(self, timeout_s: float = 5.0) -> None:
        """After the servers stopped: let the requests they cancelled record their end (up to timeout_s),
        then close the sessions, channels and the lease keeper."""
        ending = [asyncio.ensure_future(call.ended.wait()) for call in self.calls]
        if ending:
            _, late = await asyncio.wait(ending, timeout=timeout_s)
            if late:
                log.warning("%d requests did not end within %.0f s of the stop", len(late), timeout_s)
            for fut in late:
                fut.cancel()
        await self.blocking.run(self.leases.close)
        await self.sessions.close()
        await self.channels.aclose()
        self.blocking.close()


class RouterServicer(handoff_pb2_grpc.RouterServicer):
    def __init__(self, router: Router):
        self.router = router

    async def Generate(self, request: handoff_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        try:
            req = await self.router.validate(request)
            remaining = context.time_remaining()
            client_deadline = None if remaining is None else time.monotonic() + remaining
            # A caller's traceparent (gRPC metadata) makes this request a part of its trace.
            trace_parent = tracing.extract(context.invocation_metadata())
            await GenerateCall(self.router, req, client_deadline, trace_parent).run(context.write)
        except (ServiceError, ValueError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # a bug: the log gets its text and traceback (the interceptor), the client not
            raise ServiceError(grpc.StatusCode.INTERNAL, internal_error(request.request_id)) from exc


def internal_error(request_id: str) -> str:
    """What a public client is told of a bug: no exception text (it may hold addresses, ids, paths)."""
    return ("internal error in the router" + (f" [request {request_id}]" if request_id else "") +
            "; its log has the details")


def _unreachable(exc: StateUnavailable, what: str) -> ServiceError:
    """Redis could not be asked: the client learns that, the log and the record where and why."""
    return ServiceError(grpc.StatusCode.UNAVAILABLE,
                        f"the cluster state (Redis) is unreachable{what}; retry shortly",
                        detail=f"the cluster state (Redis) is unreachable{what}: {exc}")


class GenerateCall:
    """One request's life: its attempts, the tokens relayed so far, its terminal state."""

    def __init__(self, router: Router, req: ValidRequest, client_deadline: float | None, trace_parent=None):
        self.r = router
        self.req = req
        self.rid = req.request_id
        # Tracing (common/tracing.py): the caller's context, this request's `generate` span and the current
        # attempt's; with tracing off both are the no-op span and trace_id is "".
        self.trace_parent = trace_parent
        self.span = self.attempt_span = tracing.INVALID_SPAN
        self.trace_id = ""
        # time.monotonic() when the client stops waiting (its gRPC deadline, the HTTP timeout); None: never.
        self.client_deadline = client_deadline
        self.out = OutputProcessor(router.tokenizer, req.params, len(req.prompt_ids),
                                   router.model_config.max_position)
        self.generated: list[int] = []
        self.t_arrival = time.perf_counter()
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.lease: Lease | None = None
        self.ended = asyncio.Event()  # set once the terminal state is recorded and the lease released
        self._send: Send | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lease_lost: str | None = None
        self._calls: list = []

    # ---- bookkeeping that must not break a stream when Redis hiccups

    def _record_now(self, state: RequestState, **fields) -> None:
        try:
            self.r.state.transition(self.rid, state, **fields)
        except StateUnavailable as exc:
            log.warning("%s: could not record %s: %s", self.tag, state, exc)

    async def _record(self, state: RequestState, **fields) -> None:
        await self.r.blocking.run(self._record_now, state, **fields)

    async def _release(self) -> None:
        if self.lease is None:
            return
        lease, self.lease = self.lease, None
        self.r.leases.drop(self.rid)
        try:
            await self.r.blocking.run(self.r.state.release, lease.worker.worker_id, self.rid)
        except StateUnavailable as exc:
            log.warning("%s: could not release lease (it expires in %.0f s): %s", self.tag,
                        self.r.config.lease_ttl_s, exc)

    def _lease_lost_on_keeper(self, reason: str) -> None:
        """The lease keeper's thread: the rest happens on the loop."""
        try:
            self._loop.call_soon_threadsafe(self._on_lease_lost, reason)
        except RuntimeError:  # the loop is closed: the router stopped, nothing is left to cancel
            pass

    def _on_lease_lost(self, reason: str) -> None:
        # The blocks may be someone else's now: stop this attempt; the retry reserves again.
        self._lease_lost = reason
        self._cancel_calls()

    def _cancel_calls(self) -> None:
        calls, self._calls = self._calls, []
        for call in calls:
            call.cancel()

    def _track(self, call):
        self._calls.append(call)
        return call

    @property
    def tag(self) -> str:
        """How log lines name the request: its id, and its trace id when it is traced."""
        return f"{self.rid} (trace {self.trace_id})" if self.trace_id else self.rid

    def _client_gone(self) -> bool:
        return self.client_deadline is not None and time.monotonic() >= self.client_deadline

    # ---- the request

    async def run(self, send: Send) -> None:
        """Serve the request, handing each message to `send` (gRPC's context.write, the HTTP front's queue).
        Traced, it is the `generate` span, and a failure's message names the trace."""
        self.span = tracing.start("generate", self.trace_parent, kind=tracing.SERVER, attributes={
            "handoff.request_id": self.rid, "handoff.prompt_tokens": len(self.req.prompt_ids),
            "handoff.max_tokens": self.req.params.max_tokens})
        self.trace_id = tracing.trace_id(self.span)
        with tracing.ending(self.span):
            try:
                await self._run(send)
            except ServiceError as exc:
                if not self.trace_id:
                    raise
                raise ServiceError(exc.code, f"{exc.message} (trace {self.trace_id})", exc.trailers,
                                   detail=exc.detail) from exc

    async def _run(self, send: Send) -> None:
        cfg = self.r.config
        self._send = self._writer(send)
        self._loop = asyncio.get_running_loop()
        deadline = min(self.client_deadline if self.client_deadline is not None else math.inf,
                       time.monotonic() + cfg.max_request_s)

        def never_served(created: bool) -> None:
            # Cancelled while the record was being made: end it, as nothing else will.
            if created:
                self._record_now(RequestState.CANCELLED, completion_tokens=0,
                                 finish_reason=FinishReason.CANCELLED.value)
        try:
            created = await self.r.blocking.run(
                self.r.state.create_request, self.rid, prompt_tokens=len(self.req.prompt_ids),
                max_tokens=self.req.params.max_tokens, router_id=self.r.router_id, seed=str(self.req.seed),
                **({"trace_id": self.trace_id} if self.trace_id else {}), undo=never_served)
        except StateUnavailable as exc:
            error = _unreachable(exc, "")
            log.warning("%s: %s", self.tag, error.detail)
            raise self._public(error) from exc
        if not created:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS,
                               f"request_id {self.rid!r} is already in use; choose another or leave it empty")
        self.r.calls.add(self)
        metrics.ROUTER_RUNNING.inc()
        reason, error = FinishReason.ERROR, None
        try:
            reason = await self._serve(deadline)
        except ServiceError as exc:
            # Public clients get the message and the request id; the record keeps the detail (invariant 1:
            # the status says what went wrong, without worker ids, addresses or the Redis URL).
            error = exc.detail
            raise self._public(exc) from exc
        except asyncio.CancelledError:  # the client went away (or the server is stopping)
            reason = FinishReason.CANCELLED
            raise
        except _StreamClosed as exc:  # nothing more can reach the client: end quietly, as cancelled
            reason = FinishReason.CANCELLED
            log.info("%s: cancelled after %d tokens, its stream is closed (%s)", self.tag, len(self.generated), exc)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            if reason == FinishReason.ERROR and self._client_gone():
                reason, error = FinishReason.CANCELLED, None
            await to_the_end(self._end(reason, error))

    def _public(self, exc: ServiceError) -> ServiceError:
        return ServiceError(exc.code, f"{exc.message} [request {self.rid}]", exc.trailers, detail=exc.detail)

    @staticmethod
    def _writer(send: Send) -> Send:
        async def write(msg: handoff_pb2.GenerateResponse) -> None:
            try:
                await send(msg)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # Only grpc.aio's "this call is over": a finished call (UsageError) or a stopped server
                # (_ServerStoppedError, not public). Any other write failure stays a failure.
                if isinstance(exc, grpc.aio.UsageError) or type(exc).__name__ == "_ServerStoppedError":
                    raise _StreamClosed(f"{type(exc).__name__}: {exc}") from exc
                raise
        return write

    async def _end(self, reason: FinishReason, error: str | None) -> None:
        try:
            self._cancel_calls()
            fields = {"completion_tokens": len(self.generated), "finish_reason": reason.value}
            if error:
                fields["error"] = error[:2000]
            await self._record(_TERMINAL[reason], **fields)
            await self._release()  # after the record: a request in flight always holds its lease
        finally:
            self.span.set_attributes({"handoff.completion_tokens": len(self.generated),
                                      "handoff.finish_reason": reason.value})
            metrics.ROUTER_RUNNING.dec()
            metrics.REQUESTS.labels(reason.value).inc()
            metrics.E2E.observe(time.perf_counter() - self.t_arrival)
            self.r.calls.discard(self)
            self.ended.set()

    async def _serve(self, deadline: float) -> FinishReason:
        failures: list[str] = []
        exclude: Excluded = set()
        for attempt in range(1, self.r.config.max_attempts + 1):
            # One span per attempt: its workers, and the cause when it fails over.
            span = self.attempt_span = tracing.start("attempt", self.span, attributes={
                "handoff.attempt": attempt, "handoff.resumed_tokens": len(self.generated)})
            with tracing.ending(span):
                try:
                    return await self._attempt(attempt, deadline, exclude)
                except _AttemptFailed as exc:
                    # Whatever the failed attempt still has open downstream must stop now.
                    self._cancel_calls()
                    failures.append(str(exc))
                    if exc.role in ("prefill", "decode"):
                        exclude.add((exc.worker_id, exc.epoch))
                    metrics.RETRIES.labels(exc.role).inc()
                    retrying = attempt < self.r.config.max_attempts
                    log.warning("%s: attempt %d failed (%s); %s", self.tag, attempt, exc,
                                "retrying" if retrying else "giving up")
                    span.set_attributes({"handoff.failed.role": exc.role, "handoff.failed.worker_id": exc.worker_id,
                                         "handoff.retrying": retrying})
                    tracing.fail(span, str(exc))
                    # The decode reservation is kept for the retry unless decode (or the lease) failed.
                    if exc.role in ("decode", "lease"):
                        await self._release()
                except StateUnavailable as exc:
                    raise _unreachable(exc, f" while choosing workers ({len(self.generated)} tokens streamed)") \
                        from exc
            if self._client_gone():
                return FinishReason.CANCELLED
        what = f"failed on {len(failures)} attempts (the retry budget) after {len(self.generated)} tokens"
        raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                           f"the request {what}: the workers it was tried on failed or could not be reached; "
                           f"retry shortly", detail=f"request {self.rid} {what}: " + "; ".join(failures))

    async def _attempt(self, attempt: int, deadline: float, exclude: Excluded) -> FinishReason:
        r, req = self.r, self.req
        self._lease_lost = None
        if self.lease is None:
            t_queue = time.perf_counter()
            metrics.ROUTER_WAITING.inc()
            num_tokens = len(req.prompt_ids) + req.params.max_tokens
            try:
                with tracing.ending(tracing.start("reserve", self.attempt_span,
                                                  attributes={"handoff.kv_tokens": num_tokens})) as span:
                    lease = await r.picker.reserve_decode(self.rid, num_tokens, deadline, exclude, trace=span)
                    span.set_attributes({"handoff.decode_worker": lease.worker.worker_id,
                                         "handoff.kv_blocks": lease.num_blocks})
            finally:
                metrics.ROUTER_WAITING.dec()
            metrics.QUEUE.observe(time.perf_counter() - t_queue)
            self.lease = lease
            # Renewed from now until released, whatever this request waits for.
            r.leases.hold(self.rid, lease.worker.worker_id, lease.worker.epoch, lease.num_blocks,
                          self._lease_lost_on_keeper)
        dw = self.lease.worker
        self.attempt_span.set_attribute("handoff.decode_worker", dw.worker_id)
        if await self._prefill_here(exclude):
            metrics.PLACEMENT.labels("local").inc()
            self.attempt_span.set_attribute("handoff.prefill_placement", "local")
            return await self._relay_local(attempt, dw, deadline)
        pw, _ = await r.picker.pick_prefill(deadline, exclude, req.prompt_ids)
        metrics.PLACEMENT.labels("remote").inc()
        self.attempt_span.set_attributes({"handoff.prefill_placement": "remote", "handoff.prefill_worker": pw.worker_id})
        queued = r.picker.queued_prefill(pw.worker_id, len(req.prompt_ids))
        try:
            with r.channels.use(pw.address, pw.epoch) as prefill_ch:
                return await self._relay(attempt, pw, dw, prefill_ch, deadline, queued)
        finally:
            queued.release()
            r.picker.done_prefill(pw.worker_id)

    async def _prefill_here(self, exclude: Excluded) -> bool:
        """Prefill on the decode worker? Colocated: always. Conditional: when the prompt is too short for
        the KV transfer to pay, when the prefill queue would multiply its TTFT (more than
        remote_prefill_max_queue_ratio times its own length queued ahead of it on the least loaded prefill
        worker, for a prompt of at most remote_prefill_queue_max_tokens; a prefill worker runs the prompt
        with the fewest tokens left first, so a long document queued there does not count), or when no
        prefill worker is left to take it."""
        cfg = self.r.config
        if cfg.prefill_mode != "conditional":
            return cfg.prefill_mode == "colocated"
        n = len(self.req.prompt_ids)
        if n < cfg.remote_prefill_min_tokens:
            return True
        backlog = await self.r.picker.prefill_backlog(n, exclude)
        if backlog is None:
            return True
        return (bool(cfg.remote_prefill_max_queue_ratio) and n <= cfg.remote_prefill_queue_max_tokens
                and backlog > cfg.remote_prefill_max_queue_ratio * n)

    async def _relay_local(self, attempt: int, dw, deadline: float) -> FinishReason:
        """One colocated attempt: the decode worker prefills the prompt (replaying what a resumed request
        already has, as after a push) and streams every token, the first included."""
        await self._record(RequestState.PREFILLING, prefill_worker=dw.worker_id, decode_worker=dw.worker_id,
                           attempt=attempt, prefill_placement="local")
        decode_call = self._start_decode(dw, attempt, deadline, prefill_here=True)
        return await self._relay_decode(decode_call, dw, deadline, prefilled_here=True)

    def _start_decode(self, dw, attempt: int, deadline: float, prefill_here: bool = False):
        """The attempt's decode stream, on this router's session with dw. Stop strings stay here: the
        router detokenizes once and cancels the request when one appears, so the decode worker does
        no text work."""
        r, req = self.r, self.req
        sampling = sampling_to_pb(req.params, req.seed)
        del sampling.stop[:]
        return self._track(r.sessions.start(dw, internal_pb2.DecodeRequest(
            request_id=self.rid, epoch=dw.epoch, prompt_ids=req.prompt_ids, output_ids=self.generated,
            attempt=attempt, sampling=sampling, kv_wait_s=0 if prefill_here else r.config.kv_wait_s,
            prefill_here=prefill_here, traceparent=tracing.traceparent(self.attempt_span)), deadline))

    async def _relay(self, attempt: int, pw, dw, prefill_ch: grpc.aio.Channel, deadline: float,
                     queued) -> FinishReason:
        """One attempt's calls: prefill on pw, decode on dw, tokens relayed to the client. `queued` is the
        prompt's place in this router's count of pw's prefill queue, released once it is prefilled.

        A resumed attempt (tokens already streamed) prefills the prompt alone; the decode worker
        recomputes the completion's K/V by decode steps, so the continuation is bit-identical."""
        r, req = self.r, self.req
        sampling = sampling_to_pb(req.params, req.seed)
        resumed = list(self.generated)
        await self._record(RequestState.PREFILLING, prefill_worker=pw.worker_id, decode_worker=dw.worker_id,
                           attempt=attempt, prefill_placement="remote")
        prefill_call = self._track(internal_pb2_grpc.PrefillWorkerStub(prefill_ch).Prefill(
            internal_pb2.PrefillRequest(
                request_id=self.rid, prompt_ids=req.prompt_ids, sampling=sampling, output_ids=resumed,
                target=internal_pb2.KVTarget(worker_id=dw.worker_id, kv_address=dw.kv_address, epoch=dw.epoch,
                                             reservation_id=self.rid, attempt=attempt)),
            timeout=self._timeout(deadline), metadata=tracing.metadata(self.attempt_span) or None))
        prefill_fields = {}
        try:
            if not resumed:
                first = await self._next(prefill_call, pw, deadline)
                queued.release()  # prefilled: out of pw's queue
                if first is None or not first.HasField("first_token"):
                    raise _AttemptFailed("prefill", pw.worker_id, pw.epoch, "answered without a first token")
                prefill_fields["cached_tokens"] = first.first_token.cached_tokens
                prefill_fields["prefill_s"] = round(first.first_token.prefill_s, 6)
                msg = self._push([first.first_token.token_id],
                                 [first.first_token.logprob] if first.first_token.HasField("logprob") else ())
                if msg is not None:
                    await self._send(msg)
                if self.out.finish_reason is not None:
                    return self.out.finish_reason
            await self._record(RequestState.TRANSFERRING, **prefill_fields)
        except BaseException:
            # Ended (failed, cancelled, client gone) before its decode started: the push may still land,
            # and nobody would claim it. The decode worker drops it, or refuses it if it comes later.
            r.sessions.drop_kv(dw, self.rid, attempt)
            raise
        decode_call = self._start_decode(dw, attempt, deadline)
        done = await self._next(prefill_call, pw, deadline)
        queued.release()  # a resumed attempt has no first token: its prefill ends with the push
        if done is None or not done.HasField("transfer_done"):
            raise _AttemptFailed("prefill", pw.worker_id, pw.epoch, "ended without pushing the KV")
        await self._record(RequestState.DECODING, kv_bytes=done.transfer_done.kv_bytes,
                           transfer_s=round(done.transfer_done.transfer_s, 6),
                           exposed_s=round(done.transfer_done.exposed_s, 6),
                           kv_segments=done.transfer_done.num_segments,
                           skipped_tokens=done.transfer_done.skipped_tokens)
        return await self._relay_decode(decode_call, dw, deadline)

    async def _relay_decode(self, decode_call, dw, deadline: float, prefilled_here: bool = False) -> FinishReason:
        """Relay the decode stream's tokens until the output processor ends the request."""
        while True:
            ev = await self._next(decode_call, dw, deadline)
            if ev is None:
                raise _AttemptFailed("decode", dw.worker_id, dw.epoch, "stream ended without a finish reason")
            if prefilled_here:
                prefilled_here = False
                await self._record(RequestState.DECODING)  # the decode worker's prefill is done
            msg = self._push(list(ev.token_ids), ev.logprobs)
            if msg is not None:
                await self._send(msg)
            if self.out.finish_reason is not None:
                return self.out.finish_reason
            if ev.HasField("finish_reason"):
                raise _AttemptFailed("decode", dw.worker_id, dw.epoch, "finished while the router expected more tokens")

    def _timeout(self, deadline: float) -> float:
        return max(0.001, deadline - time.monotonic())

    async def _next(self, call, worker: WorkerInfo, deadline: float):
        """The call's next message (None at its end); a failure is charged to the worker that failed."""
        try:
            msg = await call.read()
            return None if msg is grpc.aio.EOF else msg
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise  # this request is cancelled
            # An aio call cancelled here (the lease was lost) reads as CancelledError, not as a status.
            if self._lease_lost is not None:
                raise _AttemptFailed("lease", self.rid, "", self._lease_lost) from None
            raise _AttemptFailed(worker.role, worker.worker_id, worker.epoch, "CANCELLED: the call was cancelled") \
                from None
        except grpc.RpcError as exc:
            code = exc.code()
            if self._lease_lost is not None:
                raise _AttemptFailed("lease", self.rid, "", self._lease_lost) from exc
            if code == grpc.StatusCode.DEADLINE_EXCEEDED or time.monotonic() >= deadline:
                late = f"the request ran past its deadline after {len(self.generated)} tokens"
                raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, late,
                                   detail=f"{late} ({worker.role} worker {worker.worker_id})") from exc
            role, worker_id, epoch = grpc_common.blamed(exc) or (worker.role, worker.worker_id, worker.epoch)
            if code in _RETRYABLE:
                raise _AttemptFailed(role, worker_id, epoch, f"{code.name}: {exc.details()}") from exc
            raise ServiceError(code, f"a {role} worker refused the request ({code.name})",
                               detail=f"{role} worker {worker_id}: {exc.details()}") from exc

    def _push(self, token_ids: list[int], logprobs=()) -> handoff_pb2.GenerateResponse | None:
        """Feed tokens through the output processor; the message to stream, the last one when finished.
        `logprobs` (TokenLogprob, one per token when the request asked) go out with the tokens kept."""
        text, new_ids, new_logprobs = "", [], []
        for i, tok in enumerate(token_ids):
            if self.out.finish_reason is not None:
                break
            self.generated.append(tok)
            text += self.out.push(tok)
            if tok not in self.out.stop_ids:
                new_ids.append(tok)
                if i < len(logprobs):
                    new_logprobs.append(logprobs[i])
        now = time.perf_counter()
        if self.t_first is None:
            self.t_first = now
            metrics.TTFT.observe(now - self.t_arrival)
        elif self.t_last is not None and new_ids:
            metrics.ITL.observe((now - self.t_last) / len(new_ids))
        self.t_last = now
        reason = self.out.finish_reason
        if reason is None:
            return handoff_pb2.GenerateResponse(text=text, token_ids=new_ids, request_id=self.rid,
                                                logprobs=new_logprobs) if text or new_ids else None
        return handoff_pb2.GenerateResponse(
            text=text, token_ids=new_ids, finish_reason=FINISH_TO_PB[reason], request_id=self.rid,
            logprobs=new_logprobs,
            prompt_tokens=len(self.req.prompt_ids), completion_tokens=len(self.generated),
            ttft_s=self.t_first - self.t_arrival, decode_s=now - self.t_first, seed=self.req.seed)
