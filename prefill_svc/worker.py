"""The prefill worker: batches prompts, samples their first token, pushes their KV to a decode worker."""
from __future__ import annotations

import logging
import queue
import time

import grpc

from common import grpc_util, metrics
from common.engine.engine import EngineConfig, TokenEvent
from common.grpc_util import ServiceError
from common.kv_wire import encode_kv
from common.engine.output import FinishReason
from common.state import WorkerInfo
from common.wire import check_request_id, check_token_ids, logprobs_to_pb, sampling_from_pb
from common.worker import WorkerBase
from protos import internal_pb2, internal_pb2_grpc

log = logging.getLogger(__name__)


class PrefillWorker(WorkerBase):
    service_names = ["handoff.v1.PrefillWorker"]

    def __init__(self, config, state, **kwargs):
        super().__init__(config, state, **kwargs)
        # Channels to decode workers' KV ports; targets come with each request, pods come and go.
        self.kv_channels = grpc_util.ChannelCache(credentials=self.channel_credentials,
                                                  server_name=self.config.tls.server_name)

    def _num_blocks(self) -> int:
        # K/V lives here only while a prompt is computed and exported.
        return -(-self.config.prefill_kv_tokens // self.config.block_size)

    def _engine_config(self) -> EngineConfig:
        return EngineConfig(max_prefill_tokens=self.config.max_prefill_tokens, max_running=self.config.max_running,
                            prefill_only=True, prefill_chunk_tokens=self.config.prefill_chunk_tokens,
                            prefix_caching=self.config.prefix_caching)

    def _add_services(self, server) -> None:
        internal_pb2_grpc.add_PrefillWorkerServicer_to_server(PrefillServicer(self), server)

    def info(self) -> WorkerInfo:
        queued = len(self.engine.waiting) + self.num_inflight
        metrics.PREFILL_QUEUE.labels(self.config.worker_id).set(queued)
        pool = self.engine.pool
        return WorkerInfo(worker_id=self.config.worker_id, role="prefill", address=self.address, kv_address="",
                          epoch=self.epoch, model_id=self.model.weights_id, total_blocks=pool.num_blocks,
                          free_blocks=pool.num_free_blocks, num_running=self.num_inflight,
                          num_waiting=len(self.engine.waiting), started_at=self.started_at,
                          block_size=self.config.block_size, metrics_port=self.metrics_port, **self.prefix_info())

    def stop(self, drain_timeout_s: float | None = None) -> None:
        super().stop(drain_timeout_s)
        self.kv_channels.close()


class PrefillServicer(internal_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, worker: PrefillWorker):
        self.w = worker

    def Prefill(self, request: internal_pb2.PrefillRequest, context):
        key = f"{request.request_id}#{request.target.attempt}"
        with self.w.serving("Prefill", key):
            yield from self._prefill(request, key, context)

    def _prefill(self, request, key: str, context):
        w = self.w
        rid = check_request_id(request.request_id)
        cfg = w.model.config
        params, seed = sampling_from_pb(request.sampling, cfg.vocab_size)
        ids = check_token_ids(request.prompt_ids, cfg.vocab_size, cfg.max_position - 1)
        resumed = list(request.output_ids)
        if resumed:
            check_token_ids(resumed, cfg.vocab_size, cfg.max_position - len(ids), "output_ids")
        target = request.target
        if not (target.worker_id and target.kv_address and target.epoch):
            raise ValueError("target must name the decode worker: worker_id, kv_address and epoch")
        t0 = time.perf_counter()
        events: queue.SimpleQueue[TokenEvent] = queue.SimpleQueue()
        context.add_callback(lambda: w.engine.cancel(key))
        w.engine.submit(key, ids, params, events.put, seed=seed, output_ids=resumed)
        ev = events.get()
        if ev.finish_reason in (FinishReason.ERROR, FinishReason.CANCELLED):
            if not context.is_active():
                return
            raise ServiceError(grpc.StatusCode.INTERNAL if ev.finish_reason == FinishReason.ERROR
                               else grpc.StatusCode.UNAVAILABLE, f"prefill of {rid} failed: {ev.error}")
        if resumed and ev.finish_reason is not None:
            # The engine replays the completion first and stops where it ends: no KV was computed.
            raise ValueError(f"output_ids already end the request ({ev.finish_reason.value}: a stop token or "
                             f"string, max_tokens or the context); there is nothing to resume")
        prefill_s = time.perf_counter() - t0
        metrics.PREFILL_SECONDS.labels(w.config.worker_id).observe(prefill_s)
        metrics.PREFIX_TOKENS.labels(w.config.worker_id, "prompt").inc(len(ids))
        metrics.PREFIX_TOKENS.labels(w.config.worker_id, "cached").inc(ev.cached_tokens)
        if ev.token_ids:
            # The first token goes out at once; TTFT does not wait for the KV transfer. When it ends
            # the request already (EOS, a stop, max_tokens 1), nobody will decode: no KV is pushed.
            finished = ev.finish_reason is not None
            first = internal_pb2.FirstToken(token_id=ev.token_ids[0], prefill_s=prefill_s, finished=finished,
                                           cached_tokens=ev.cached_tokens)
            if ev.logprobs:
                first.logprob.CopyFrom(logprobs_to_pb(ev.logprobs[0]))
            yield internal_pb2.PrefillEvent(first_token=first)
            if finished:
                return
        if context.is_active():
            yield internal_pb2.PrefillEvent(transfer_done=self._push(rid, ev, target, context))

    def _push(self, rid: str, ev: TokenEvent, target, context) -> internal_pb2.TransferDone:
        """Push the prompt's K/V, less the leading blocks the decode worker's prefix cache holds."""
        t0 = time.perf_counter()
        bs = self.w.config.block_size
        with self.w.kv_channels.use(target.kv_address) as ch:
            stub = internal_pb2_grpc.KVTransferStub(ch)
            # The last token's block always travels: a push carries at least one token.
            hashes = (ev.block_hashes or [])[:(ev.kv.shape[2] - 1) // bs]
            skip = self._cached_prefix(stub, rid, hashes, target, context) if hashes else 0
            try:
                reply = self._send(stub, rid, ev.kv[:, :, skip * bs:], hashes[:skip], target, context)
            except grpc.RpcError as exc:
                if not skip or exc.code() != grpc.StatusCode.ABORTED:
                    raise self._push_failed(rid, target, exc) from exc
                skip = 0  # the prefix was evicted meanwhile: all of it, then
                try:
                    reply = self._send(stub, rid, ev.kv, [], target, context)
                except grpc.RpcError as exc:
                    raise self._push_failed(rid, target, exc) from exc
        transfer_s = time.perf_counter() - t0
        wid = self.w.config.worker_id
        metrics.KV_BYTES.labels(wid, "out").inc(reply.kv_bytes)
        metrics.KV_SECONDS.labels(wid).observe(transfer_s)
        num_chunks = -(-reply.kv_bytes // (1 << 20))
        return internal_pb2.TransferDone(kv_bytes=reply.kv_bytes, num_chunks=num_chunks, transfer_s=transfer_s,
                                         skipped_tokens=skip * bs)

    def _cached_prefix(self, stub, rid: str, hashes: list[bytes], target, context) -> int:
        try:
            reply = stub.CachedPrefix(internal_pb2.CachedPrefixRequest(block_hashes=hashes),
                                      timeout=min(2.0, context.time_remaining() or 2.0))
        except grpc.RpcError as exc:
            raise self._push_failed(rid, target, exc) from exc
        return min(reply.num_blocks, len(hashes))

    def _send(self, stub, rid: str, kv, prefix_hashes: list[bytes], target, context) -> internal_pb2.PushKVReply:
        chunks = encode_kv(kv.contiguous(), request_id=rid, target_worker_id=target.worker_id,
                           target_epoch=target.epoch, fingerprint=self.w.fingerprint(),
                           reservation_id=target.reservation_id, attempt=target.attempt, prefix_hashes=prefix_hashes)
        push = stub.PushKV.future(chunks, timeout=context.time_remaining())
        # The Prefill call ending (request cancelled, router gone) ends the push too.
        context.add_callback(push.cancel)
        try:
            return push.result()
        except grpc.FutureCancelledError:
            raise ServiceError(grpc.StatusCode.CANCELLED, f"KV push of {rid} cancelled with its request") from None

    def _push_failed(self, rid: str, target, exc: grpc.RpcError) -> ServiceError:
        """The status a failed push ends the Prefill call with, charged to whoever failed."""
        code = exc.code()
        metrics.KV_FAILURES.labels(self.w.config.worker_id, code.name.lower()).inc()
        message = (f"KV push of {rid} to decode worker {target.worker_id} ({target.kv_address}) failed: "
                   f"{code.name}: {exc.details()}")
        if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL):
            return ServiceError(grpc.StatusCode.INTERNAL, message)  # what this worker sent was bad
        if code == grpc.StatusCode.DATA_LOSS:  # damaged in transit: neither worker is to blame
            return ServiceError(code, message, grpc_util.blame("link", target.worker_id, target.epoch))
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            code = grpc.StatusCode.UNAVAILABLE
        return ServiceError(code, message, grpc_util.blame("decode", target.worker_id, target.epoch))
