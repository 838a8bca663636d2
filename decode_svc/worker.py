"""The decode worker: receives KV pushes into its paged pool and streams tokens until each sequence stops."""
from __future__ import annotations

import concurrent.futures
import logging
import math
import queue
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2_grpc

from common import grpc_common, metrics, tracing
from common.engine.engine import EngineConfig, TokenEvent
from common.engine.output import FinishReason
from common.engine.sampling import SamplingParams
from common.engine.planner import plan
from common.grpc_common import ServiceError
from common.kv_wire import MAX_PREFIX_BLOCKS, KVReceiver, KVTransferError
from common.state import StateUnavailable, WorkerInfo
from common.pb_convert import check_request_id, check_token_ids, sampling_from_pb
from common.worker import WorkerBase
from decode_svc.inbox import KVInbox, seq_key
from decode_svc.pushes import PushesInFlight
from decode_svc.router_session import DecodeSession, PendingEvent
from decode_svc.spans import BatchSizes, DecodeSpans
from protos import internal_pb2, internal_pb2_grpc

log = logging.getLogger(__name__)

# A push the engine did not place: a prefix evicted since CachedPrefix answered is ABORTED (the sender pushes
# it all again); an engine that failed or stops, or K/V it could not copy into its pool (a device error, out
# of device memory), is this worker's failure, UNAVAILABLE; no room is RESOURCE_EXHAUSTED. The sender
# charges each to this worker (prefill_svc/push.py).
_PARK_REFUSED_CODES = {
    "evicted": grpc.StatusCode.ABORTED,
    "failed": grpc.StatusCode.UNAVAILABLE,
    "stopped": grpc.StatusCode.UNAVAILABLE,
    "unplaceable": grpc.StatusCode.UNAVAILABLE,
}

# A rejected push says why in its status code: the sender can tell a stale target from bad bytes.
_KV_ERROR_CODES = {
    "fingerprint": grpc.StatusCode.FAILED_PRECONDITION,
    "worker": grpc.StatusCode.FAILED_PRECONDITION,
    "epoch": grpc.StatusCode.FAILED_PRECONDITION,
    "checksum": grpc.StatusCode.DATA_LOSS,
    "truncated": grpc.StatusCode.DATA_LOSS,
}


@dataclass(frozen=True)
class DecodeJob:
    """A checked Decode request: what the engine is given."""

    request_id: str
    key: str  # the engine's sequence id (seq_key)
    prompt: list[int]
    output: list[int]  # the completion so far (its K/V is replayed)
    params: SamplingParams
    seed: int
    prefill_here: bool  # colocated: prefill the prompt here, no push to wait for
    kv_wait_s: float  # how long to wait for the push


class DecodeWorker(WorkerBase):
    service_names = ["handoff.v1.DecodeWorker", "handoff.v1.KVTransfer"]

    def __init__(self, config, state, **kwargs):
        super().__init__(config, state, **kwargs)
        # The bytes of pushes being received, counted against their leases; max_bytes (the pool's) once started.
        self.pushes = PushesInFlight(max_bytes=0)
        self.inbox = KVInbox(ttl_s=config.kv_wait_s, drop=lambda key: self.engine.cancel(key),
                             on_cancel=self.pushes.cut)
        self.kv_port = 0
        self.kv_server = None
        # Decode sessions' starts: their checks wait on Redis, never on a session's reader (router_session.py).
        self.start_pool = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="session-start")
        self.batch_sizes: BatchSizes | None = None  # while tracing is on

    def _num_blocks(self) -> int:
        c = self.model.config
        p = plan(c.num_layers, c.num_kv_heads, c.head_dim, self.model.dtype.itemsize,
                 int(self.config.kv_memory_gib * (1 << 30)), self.config.block_size)
        if p.num_blocks * self.config.block_size < c.max_position:
            log.warning("KV budget of %.2f GiB holds %d tokens, less than one full context (%d)",
                        self.config.kv_memory_gib, p.num_tokens, c.max_position)
        return max(1, p.num_blocks)

    def _engine_config(self) -> EngineConfig:
        # No text work per token: the router detokenizes once (stop strings, when a caller sends them
        # in a Decode call, still get the text they need).
        return EngineConfig(max_prefill_tokens=self.config.max_prefill_tokens, max_running=self.config.max_running,
                            prefill_chunk_tokens=self.config.prefill_chunk_tokens,
                            prefix_caching=self.config.prefix_caching, detokenize=False)

    def _engine_failure(self, exc: BaseException) -> None:
        super()._engine_failure(exc)
        self.inbox.abandon()  # Decode calls waiting for K/V this worker can no longer decode end now

    def max_rpcs(self) -> int:
        # Every Decode stream and every push holds a lease of at least one block, so the pool bounds
        # them; the margin covers calls refused at once, attempts winding down, health and reflection.
        return self.engine.pool.num_blocks + 64

    def _add_services(self, server) -> None:
        internal_pb2_grpc.add_DecodeWorkerServicer_to_server(DecodeServicer(self), server)

    def _start_extra(self) -> None:
        pool = self.engine.pool
        self.pushes.max_bytes = self.fingerprint().kv_bytes(pool.num_blocks * pool.block_size)
        if tracing.enabled():
            self.batch_sizes = BatchSizes(self.engine)
            self.engine.step_listeners.append(self.batch_sizes.record)
        # Decode's KV port is its own server: pushes never compete with Decode streams or health
        # probes for RPC slots, and a NetworkPolicy can open the port to prefill pods alone.
        self.kv_server = grpc_common.make_server(self.max_rpcs(), max_message_bytes=grpc_common.MAX_INTERNAL_MESSAGE_BYTES,
                                                 interceptors=self.interceptors())
        internal_pb2_grpc.add_KVTransferServicer_to_server(KVTransferServicer(self), self.kv_server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.kv_server)  # same status as the main port
        # Credentials of its own: each port takes re-read TLS files at its own next handshake.
        credentials = self.tls_files.server_credentials(require_client_cert=True) if self.tls_files else None
        self.kv_port = grpc_common.bind(self.kv_server, self.config.host, self.config.kv_port, credentials,
                                        flag="--kv-port")
        self.kv_server.start()

    def _stop_extra(self) -> None:
        if self.kv_server is not None:
            self.kv_server.stop(grace=1.0).wait()
        self.start_pool.shutdown(wait=False, cancel_futures=True)

    @property
    def kv_address(self) -> str:
        return f"{self.config.advertise_host}:{self.kv_port}"

    def info(self) -> WorkerInfo:
        pool = self.engine.pool
        wid = self.config.worker_id
        self.inbox.sweep()
        num_waiting = len(self.engine.waiting) + self.engine.num_parked
        metrics.DECODE_RUNNING.labels(wid).set(len(self.engine.running))
        metrics.DECODE_WAITING.labels(wid).set(num_waiting)
        metrics.KV_BLOCKS_USED.labels(wid).set(pool.num_used_blocks)
        metrics.KV_BLOCKS_TOTAL.labels(wid).set(pool.num_blocks)
        metrics.KV_USED_RATIO.labels(wid).set(pool.num_used_blocks / pool.num_blocks)
        return WorkerInfo(worker_id=wid, role="decode", address=self.address, kv_address=self.kv_address,
                          epoch=self.epoch, model_id=self.model.weights_id, total_blocks=pool.num_blocks,
                          free_blocks=pool.num_free_blocks, num_running=len(self.engine.running),
                          num_waiting=num_waiting, started_at=self.started_at,
                          block_size=self.config.block_size, metrics_port=self.metrics_port, identity=self.identity,
                          **self.prefix_info())

    def max_kv_bytes(self) -> int:
        # The largest push a Decode could use: a prompt that fits the context and, with the token
        # decode feeds next, the whole pool. Anything larger is refused at its header, before its
        # buffer is allocated.
        pool = self.engine.pool
        max_tokens = min(self.model.config.max_position, pool.num_blocks * pool.block_size) - 1
        return self.fingerprint().kv_bytes(max_tokens)

    def check_decode(self, request: internal_pb2.DecodeRequest) -> DecodeJob:
        """A Decode request checked against this worker (epoch, model, pool, lease): what to submit."""
        rid = check_request_id(request.request_id)
        if request.epoch != self.epoch:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"Decode for {rid} addressed to epoch {request.epoch!r}, this worker runs "
                               f"epoch {self.epoch!r} (it restarted); reserve again")
        cfg = self.model.config
        params, seed = sampling_from_pb(request.sampling, cfg.vocab_size)
        if params.constraint is not None:
            self.engine.grammars.check(params.constraint)  # compiled here, off the engine thread (then cached)
        prompt = check_token_ids(request.prompt_ids, cfg.vocab_size, cfg.max_position - 1)
        # Colocated, a new request has no completion yet; otherwise prefill sampled its first token.
        output = [] if request.prefill_here and not request.output_ids else check_token_ids(
            request.output_ids, cfg.vocab_size, cfg.max_position - len(prompt), "output_ids")
        # NaN would make the KV wait endless; a negative wait is a caller's bug, not a timeout.
        if not (math.isfinite(request.kv_wait_s) and request.kv_wait_s >= 0):
            raise ValueError(f"kv_wait_s must be a finite number of seconds > 0 (0: this worker's "
                             f"default), got {request.kv_wait_s}")
        # The most tokens the sequence can come to hold, as the router reserves them. More than the
        # whole pool could never finish: it would fail in the engine once the pool runs out.
        num_tokens = max(len(prompt) + len(output), min(len(prompt) + params.max_tokens, cfg.max_position))
        pool = self.engine.pool
        if pool.blocks_for(num_tokens) > pool.num_blocks:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"{rid} may need KV for {num_tokens} tokens (prompt_ids + max_tokens), more "
                               f"than this worker's whole pool of {pool.num_blocks * pool.block_size}; "
                               f"lower max_tokens")
        # A new colocated sequence also needs the slot of the token its prefill samples.
        self.check_lease(rid, len(prompt) + max(len(output), 1))
        key = seq_key(rid, request.attempt)
        # Colocated, no push may come for this attempt: one that came is dropped, one still to come refused.
        if request.prefill_here and self.inbox.cancel(key):
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"K/V was pushed for {rid} attempt {request.attempt}, yet its Decode asks to "
                               f"prefill here (prefill_here): an attempt is pushed or prefilled here, never "
                               f"both; the pushed K/V is dropped")
        # A peer's wait is bounded by this worker's own: a call waiting longer holds its in-flight guard (and
        # any drain behind it) for nothing (invariant 6: every guarantee has a bound).
        return DecodeJob(rid, key, prompt, output, params, seed, request.prefill_here,
                         min(request.kv_wait_s or self.config.kv_wait_s, self.config.kv_wait_s))

    def check_kv(self, job: DecodeJob, kv_len: int | None, wait_s: float) -> None:
        """What the KV wait gave: the push's token count once it is parked, None if it never came."""
        if kv_len is None and self.engine_failed.is_set():
            raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                               f"decode worker {self.config.worker_id} is out of service: its engine failed "
                               f"({self.engine.failure!r}); retry {job.request_id} on another worker")
        if kv_len is None:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                               f"the KV of {job.request_id} did not arrive within {wait_s:.1f} s; the prefill "
                               f"worker may have failed, retry the request")
        if kv_len != len(job.prompt):
            self.engine.cancel(job.key)  # it is ours now: free it (the engine would refuse it as its own ERROR)
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"the KV pushed for {job.request_id} holds {kv_len} tokens, prompt_ids has "
                               f"{len(job.prompt)}")

    def check_lease(self, request_id: str, num_tokens: int) -> int:
        """Work for a request is taken only under a live reservation of this worker's blocks, at this
        epoch, large enough: otherwise Redis may have promised the blocks to someone else. The lease's
        blocks."""
        try:
            blocks = self.state.lease_blocks(self.config.worker_id, self.epoch, request_id)
        except StateUnavailable as exc:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                               f"cannot check the KV reservation of {request_id}: {exc}") from exc
        if blocks == 0:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"{request_id} holds no live reservation of KV blocks on decode worker "
                               f"{self.config.worker_id} at epoch {self.epoch} (never made, released, expired, "
                               f"or made before a restart); reserve again")
        need = self.engine.pool.blocks_for(num_tokens)
        if need > blocks:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"{request_id} reserved {blocks} KV blocks on {self.config.worker_id}, its "
                               f"{num_tokens} tokens need {need}")
        return blocks

    def _after_beat(self) -> None:
        super()._after_beat()
        if len(self.pushes):
            # A push whose lease ended is cut off: its sender may hang on to it until its own deadline.
            seen_at = time.monotonic()
            self.pushes.cut_unleased(set(self.state.reservations(self.config.worker_id)), seen_at)


class DecodeServicer(internal_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, worker: DecodeWorker):
        self.w = worker

    def Decode(self, request: internal_pb2.DecodeRequest, context):
        with self.w.serving("Decode", seq_key(request.request_id, request.attempt)):
            yield from self._decode(request, context)

    def DecodeSession(self, request_iterator, context):
        yield from DecodeSession(self.w, context).run(request_iterator)

    def _decode(self, request, context):
        w = self.w
        spans = DecodeSpans(w, request, tracing.from_traceparent(request.traceparent)
                            or tracing.extract(context.invocation_metadata()))
        try:
            job = w.check_decode(request)
            # Whatever ends this call (client gone, deadline), the KV must not be admitted later.
            context.add_callback(lambda: (w.inbox.cancel(job.key), w.engine.cancel(job.key)))
            t0 = time.perf_counter()
            if not job.prefill_here:
                wait_s = min(job.kv_wait_s, context.time_remaining() or job.kv_wait_s)
                kv_len = w.inbox.take(job.key, wait_s, context.is_active)
                if kv_len is None and not context.is_active():
                    spans.refused("the call ended before its K/V came")
                    return
                w.check_kv(job, kv_len, wait_s)
        except Exception as exc:
            spans.refused(exc)
            raise
        spans.claimed()
        kv_wait_s = time.perf_counter() - t0
        events: queue.SimpleQueue[TokenEvent] = queue.SimpleQueue()
        spans.decoding(job)
        w.engine.submit(job.key, job.prompt, job.params, events.put, seed=job.seed, output_ids=job.output,
                        parked=not job.prefill_here)
        out = PendingEvent(job.request_id, kv_wait_s)
        try:
            while True:
                out.add(events.get())
                # Drain what else is ready so a slow reader gets tokens in fewer, larger messages.
                while out.finish is None:
                    try:
                        out.add(events.get_nowait())
                    except queue.Empty:
                        break
                if out.finish == FinishReason.CANCELLED and not context.is_active():
                    return
                failed = out.failure()
                if failed is not None:
                    spans.ended(out.num_tokens, out.finish, failed.message)
                    raise failed
                finish = out.finish
                yield out.take()
                if finish is not None:
                    spans.ended(out.num_tokens, finish)
                    return
        finally:
            spans.ended(out.num_tokens, FinishReason.CANCELLED)  # a no-op once ended: the call ended first


class KVTransferServicer(internal_pb2_grpc.KVTransferServicer):
    def __init__(self, worker: DecodeWorker):
        self.w = worker

    def PushKV(self, request_iterator, context):
        # The sender's kv.push span is the parent (traceparent metadata).
        span = tracing.start("kv.receive", tracing.extract(context.invocation_metadata()), kind=tracing.SERVER,
                             attributes={"handoff.worker_id": self.w.config.worker_id})
        with tracing.ending(span):
            reply = self._receive(request_iterator, context, span)
            span.set_attributes({"handoff.kv_bytes": reply.kv_bytes, "handoff.kv_tokens": reply.num_tokens})
            return reply

    def _receive(self, request_iterator, context, span) -> internal_pb2.PushKVReply:
        w = self.w
        wid = w.config.worker_id
        pushes = []  # the push once its header is admitted, counted in w.pushes until the loop below ends

        def admit(header: internal_pb2.KVHeader) -> None:
            blocks = self._admit(header)
            pool = w.engine.pool
            pushes.append(w.pushes.admit(seq_key(header.request_id, header.attempt), header.request_id,
                                         header.total_bytes, w.fingerprint().kv_bytes(blocks * pool.block_size),
                                         context.cancel))

        # Received straight into page-locked memory when the pool is on a GPU: the copy into it is then direct.
        receiver = KVReceiver(expected_fingerprint=w.fingerprint(), worker_id=wid, epoch=w.epoch,
                              max_bytes=w.max_kv_bytes(), admit=admit,
                              pin_memory=w.engine.runner.cache.kv.device.type == "cuda")
        t0 = time.perf_counter()
        try:
            for chunk in request_iterator:
                receiver.on_chunk(chunk)
            kv = receiver.finish()
        except (KVTransferError, grpc.RpcError) as exc:
            if not context.is_active() or any(push.was_cut for push in pushes):  # sender gone, or cut off here
                raise ServiceError(grpc.StatusCode.CANCELLED,
                                   f"KV push of {receiver.request_id} ended before it landed: its sender went "
                                   f"away, or its lease ended or its attempt was dropped") from None
            if isinstance(exc, grpc.RpcError):
                raise
            metrics.KV_FAILURES.labels(wid, exc.code).inc()
            raise ServiceError(_KV_ERROR_CODES.get(exc.code, grpc.StatusCode.INVALID_ARGUMENT), str(exc)) from exc
        finally:
            for push in pushes:
                w.pushes.done(push)
        rid = receiver.request_id
        header = receiver.header
        span.set_attributes({"handoff.request_id": rid, "handoff.attempt": header.attempt,
                             "handoff.kv_segments": max(1, len(header.segment_tokens))})
        key = seq_key(rid, header.attempt)
        kv_bytes = kv.numel() * kv.element_size()
        metrics.KV_BYTES.labels(wid, "in").inc(kv_bytes)
        metrics.KV_SECONDS.labels(wid).observe(time.perf_counter() - t0)
        cancelled = ServiceError(grpc.StatusCode.CANCELLED,
                                 f"KV of {rid} refused: the request's Decode call ended, or its KV already arrived")
        if not w.inbox.accepting(key):
            raise cancelled
        # Into the paged pool now, counted like a running sequence's blocks (the lease made room). The
        # engine thread tells the inbox the moment it is placed, so a Decode already waiting for it is
        # submitted then and joins the next step, instead of the one after it.
        num_tokens = len(header.prefix_hashes) * w.engine.pool.block_size + receiver.num_tokens
        placed = w.engine.park(key, kv, list(header.prefix_hashes), claim=lambda: w.inbox.arrived(key, num_tokens))
        del kv
        try:
            refused = placed.result(timeout=w.config.kv_wait_s)
        except concurrent.futures.TimeoutError:
            # The engine never got to it (a step that hangs): this worker's failure, not the sender's. The
            # tombstone makes its claim fail, so the K/V is freed if it is ever placed.
            w.inbox.cancel(key)
            metrics.KV_FAILURES.labels(wid, "timeout").inc()
            raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                               f"KV of {rid} not placed within {w.config.kv_wait_s:.0f} s: decode worker {wid}'s "
                               f"engine is not answering") from None
        if refused is not None and refused.code == "unclaimed":
            raise cancelled
        if refused is not None:
            metrics.KV_FAILURES.labels(wid, refused.code).inc()
            raise ServiceError(_PARK_REFUSED_CODES.get(refused.code, grpc.StatusCode.RESOURCE_EXHAUSTED),
                               f"KV of {rid} refused by decode worker {wid}: {refused}")
        return internal_pb2.PushKVReply(request_id=rid, num_tokens=receiver.num_tokens, kv_bytes=kv_bytes)

    def _admit(self, header: internal_pb2.KVHeader) -> int:
        """The push's lease (its blocks), checked before its buffer is allocated."""
        prefix_tokens = len(header.prefix_hashes) * self.w.engine.pool.block_size
        return self.w.check_lease(header.request_id, prefix_tokens + header.num_tokens)

    def CachedPrefix(self, request: internal_pb2.CachedPrefixRequest, context) -> internal_pb2.CachedPrefixReply:
        if len(request.block_hashes) > MAX_PREFIX_BLOCKS:
            raise ValueError(f"block_hashes holds {len(request.block_hashes)} hashes, at most {MAX_PREFIX_BLOCKS}")
        # Read from the engine's pool outside its thread: an answer, not a promise (the push checks again).
        num_blocks = len(self.w.engine.pool.match_prefix(list(request.block_hashes)))
        return internal_pb2.CachedPrefixReply(num_blocks=num_blocks)
