"""The decode worker: receives KV pushes into its paged pool and streams tokens until each sequence stops."""
from __future__ import annotations

import logging
import math
import queue
import time

import grpc

from common import grpc_util, metrics
from common.engine.engine import EngineConfig, TokenEvent
from common.grpc_util import ServiceError
from common.kv_wire import KVReceiver, KVTransferError
from common.engine.output import FinishReason
from common.engine.planner import plan
from common.state import WorkerInfo
from common.wire import FINISH_TO_PB, check_token_ids, sampling_from_pb
from common.worker import WorkerBase
from decode_svc.inbox import KVInbox
from protos import internal_pb2, internal_pb2_grpc

log = logging.getLogger(__name__)

# A rejected push says why in its status code: the sender can tell a stale target from bad bytes.
_KV_ERROR_CODES = {
    "fingerprint": grpc.StatusCode.FAILED_PRECONDITION,
    "worker": grpc.StatusCode.FAILED_PRECONDITION,
    "epoch": grpc.StatusCode.FAILED_PRECONDITION,
    "checksum": grpc.StatusCode.DATA_LOSS,
    "truncated": grpc.StatusCode.DATA_LOSS,
}


class DecodeWorker(WorkerBase):
    service_names = ["handoff.v1.DecodeWorker", "handoff.v1.KVTransfer"]

    def __init__(self, config, state, **kwargs):
        super().__init__(config, state, **kwargs)
        self.inbox = KVInbox(ttl_s=config.kv_wait_s)
        self.kv_port = 0

    def _num_blocks(self) -> int:
        c = self.model.config
        p = plan(c.num_layers, c.num_kv_heads, c.head_dim, self.model.dtype.itemsize,
                 int(self.config.kv_memory_gib * (1 << 30)), self.config.block_size)
        if p.num_blocks * self.config.block_size < c.max_position:
            log.warning("KV budget of %.2f GiB holds %d tokens, less than one full context (%d)",
                        self.config.kv_memory_gib, p.num_tokens, c.max_position)
        return max(1, p.num_blocks)

    def _engine_config(self) -> EngineConfig:
        return EngineConfig(max_prefill_tokens=self.config.max_prefill_tokens, max_running=self.config.max_running)

    def _add_services(self, server) -> None:
        internal_pb2_grpc.add_DecodeWorkerServicer_to_server(DecodeServicer(self), server)
        internal_pb2_grpc.add_KVTransferServicer_to_server(KVTransferServicer(self), server)

    def _bind_extra(self, server) -> None:
        # Decode's KV port is its own, so a NetworkPolicy can open it to prefill pods alone.
        self.kv_port = grpc_util.bind(server, self.config.host, self.config.kv_port, self.server_credentials)

    @property
    def kv_address(self) -> str:
        return f"{self.config.advertise_host}:{self.kv_port}"

    def info(self) -> WorkerInfo:
        pool = self.engine.pool
        wid = self.config.worker_id
        metrics.DECODE_RUNNING.labels(wid).set(len(self.engine.running))
        metrics.DECODE_WAITING.labels(wid).set(len(self.engine.waiting) + self.inbox.num_parked)
        metrics.KV_BLOCKS_USED.labels(wid).set(pool.num_used_blocks)
        metrics.KV_BLOCKS_TOTAL.labels(wid).set(pool.num_blocks)
        metrics.KV_USED_RATIO.labels(wid).set(pool.num_used_blocks / pool.num_blocks)
        self.inbox.sweep()
        return WorkerInfo(worker_id=wid, role="decode", address=self.address, kv_address=self.kv_address,
                          epoch=self.epoch, model_id=self.model.weights_id, total_blocks=pool.num_blocks,
                          free_blocks=pool.num_free_blocks, num_running=len(self.engine.running),
                          num_waiting=len(self.engine.waiting), started_at=self.started_at,
                          block_size=self.config.block_size)

    def max_kv_bytes(self) -> int:
        # The largest push a Decode could use: a prompt that fits the context and, with the token
        # decode feeds next, the whole pool. Anything larger is refused at its header, before its
        # buffer is allocated.
        pool = self.engine.pool
        max_tokens = min(self.model.config.max_position, pool.num_blocks * pool.block_size) - 1
        return self.fingerprint().kv_bytes(max_tokens)


class DecodeServicer(internal_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, worker: DecodeWorker):
        self.w = worker

    def Decode(self, request: internal_pb2.DecodeRequest, context):
        with self.w.serving("Decode", request.request_id):
            yield from self._decode(request, context)

    def _decode(self, request, context):
        w = self.w
        rid = request.request_id
        if request.epoch != w.epoch:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"Decode for {rid} addressed to epoch {request.epoch!r}, this worker runs "
                               f"epoch {w.epoch!r} (it restarted); reserve again")
        cfg = w.model.config
        params, seed = sampling_from_pb(request.sampling, cfg.vocab_size)
        ids = check_token_ids(request.prompt_ids, cfg.vocab_size, cfg.max_position - 1)
        check_token_ids([request.first_token_id], cfg.vocab_size, 1, "first_token_id")
        if request.num_generated >= len(ids):
            raise ValueError(f"num_generated ({request.num_generated}) must be less than the "
                             f"{len(ids)} tokens of prompt_ids")
        # NaN would make the KV wait below endless; a negative wait is a caller's bug, not a timeout.
        if not (math.isfinite(request.kv_wait_s) and request.kv_wait_s >= 0):
            raise ValueError(f"kv_wait_s must be a finite number of seconds > 0 (0: this worker's "
                             f"default), got {request.kv_wait_s}")
        split = len(ids) - request.num_generated
        # The most tokens the sequence can come to hold, as the router reserves them. More than the
        # whole pool could never finish: it would fail in the engine once the pool runs out.
        num_tokens = max(len(ids) + 1, min(split + params.max_tokens, cfg.max_position))
        pool = w.engine.pool
        if pool.blocks_for(num_tokens) > pool.num_blocks:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"{rid} may need KV for {num_tokens} tokens (prompt_ids + max_tokens), more "
                               f"than this worker's whole pool of {pool.num_blocks * pool.block_size}; "
                               f"lower max_tokens")
        prompt, earlier = ids[:split], ids[split:]
        # Whatever ends this call (client gone, deadline), the KV must not be admitted later.
        context.add_callback(lambda: (w.inbox.cancel(rid), w.engine.cancel(rid)))
        wait_s = min(request.kv_wait_s or w.config.kv_wait_s, context.time_remaining() or w.config.kv_wait_s)
        t0 = time.perf_counter()
        kv = w.inbox.take(rid, wait_s, context.is_active)
        if kv is None:
            if not context.is_active():
                return
            raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                               f"the KV of {rid} did not arrive within {wait_s:.1f} s; the prefill "
                               f"worker may have failed, retry the request")
        if kv.shape[2] != len(ids):
            raise ValueError(f"KV of {rid} holds {kv.shape[2]} tokens, prompt_ids has {len(ids)}")
        kv_wait_s = time.perf_counter() - t0
        events: queue.SimpleQueue[TokenEvent] = queue.SimpleQueue()
        w.engine.submit(rid, prompt, params, events.put, seed=seed,
                        output_ids=earlier + [request.first_token_id], kv=kv)
        del kv
        t_start = time.perf_counter()
        first = True
        while True:
            ev = events.get()
            # Drain what else is ready so a slow reader gets tokens in fewer, larger messages.
            token_ids, finish, error = list(ev.token_ids), ev.finish_reason, ev.error
            while finish is None:
                try:
                    more = events.get_nowait()
                except queue.Empty:
                    break
                token_ids += more.token_ids
                finish, error = more.finish_reason, more.error
            if finish == FinishReason.ERROR:
                raise ServiceError(grpc.StatusCode.INTERNAL, f"decode of {rid} failed: {error}")
            if finish == FinishReason.CANCELLED:
                if context.is_active():
                    raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"decode of {rid} was stopped: {error}")
                return
            msg = internal_pb2.DecodeEvent(token_ids=token_ids, decode_s=time.perf_counter() - t_start)
            if first:
                msg.kv_wait_s = kv_wait_s
                first = False
            if finish is not None:
                msg.finish_reason = FINISH_TO_PB[finish]
            yield msg
            if finish is not None:
                return


class KVTransferServicer(internal_pb2_grpc.KVTransferServicer):
    def __init__(self, worker: DecodeWorker):
        self.w = worker

    def PushKV(self, request_iterator, context):
        w = self.w
        wid = w.config.worker_id
        receiver = KVReceiver(expected_fingerprint=w.fingerprint(), worker_id=wid, epoch=w.epoch,
                              max_bytes=w.max_kv_bytes())
        t0 = time.perf_counter()
        try:
            for chunk in request_iterator:
                receiver.on_chunk(chunk)
            kv = receiver.finish()
        except KVTransferError as exc:
            metrics.KV_FAILURES.labels(wid, exc.code).inc()
            raise ServiceError(_KV_ERROR_CODES.get(exc.code, grpc.StatusCode.INVALID_ARGUMENT), str(exc)) from exc
        rid = receiver.request_id
        kv_bytes = kv.numel() * kv.element_size()
        metrics.KV_BYTES.labels(wid, "in").inc(kv_bytes)
        metrics.KV_SECONDS.labels(wid).observe(time.perf_counter() - t0)
        if not w.inbox.deliver(rid, kv):
            raise ServiceError(grpc.StatusCode.CANCELLED,
                               f"KV of {rid} refused: the request was cancelled or its KV already arrived")
        return internal_pb2.PushKVReply(request_id=rid, num_tokens=kv.shape[2], kv_bytes=kv_bytes)
