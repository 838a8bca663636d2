"""The prefill worker: batches prompts, samples their first token, pushes their KV to a decode worker."""
from __future__ import annotations

import logging
import queue
import time

import grpc

from common import grpc_common, metrics, security, tracing
from common.engine.engine import EngineConfig
from common.grpc_common import ServiceError
from common.engine.output import FinishReason
from common.state import WorkerInfo
from common.pb_convert import check_request_id, check_token_ids, logprobs_to_pb, sampling_from_pb
from common.worker import WorkerBase
from prefill_svc.push import StreamedPush, push_after
from protos import internal_pb2, internal_pb2_grpc

log = logging.getLogger(__name__)


class PrefillWorker(WorkerBase):
    service_names = ["handoff.v1.PrefillWorker"]

    def __init__(self, config, state, **kwargs):
        super().__init__(config, state, **kwargs)
        # Channels to decode workers' KV ports; targets come with each request, pods come and go.
        self.kv_channels = grpc_common.ChannelCache(
            tls=security.ClientTLS(self.tls_files, "decode") if self.tls_files else None)
        self.stream_kv = self.config.stream_kv  # read per request: bench.token_path compares both on one worker

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
                          block_size=self.config.block_size, metrics_port=self.metrics_port, identity=self.identity,
                          **self.prefix_info())

    def stop(self, drain_timeout_s: float | None = None) -> None:
        super().stop(drain_timeout_s)
        self.kv_channels.close()


class PrefillServicer(internal_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, worker: PrefillWorker):
        self.w = worker

    def Prefill(self, request: internal_pb2.PrefillRequest, context):
        key = f"{request.request_id}#{request.target.attempt}"
        # The router's attempt span is the parent (traceparent metadata); the KV push is a child.
        span = tracing.start("prefill", tracing.extract(context.invocation_metadata()), kind=tracing.SERVER,
                             attributes={"handoff.request_id": request.request_id,
                                         "handoff.attempt": request.target.attempt,
                                         "handoff.worker_id": self.w.config.worker_id,
                                         "handoff.decode_worker": request.target.worker_id,
                                         "handoff.prompt_tokens": len(request.prompt_ids),
                                         "handoff.resumed_tokens": len(request.output_ids)})
        with tracing.ending(span), self.w.serving("Prefill", key):
            yield from self._prefill(request, key, context, span)

    def _prefill(self, request, key: str, context, span=tracing.INVALID_SPAN):
        w = self.w
        rid = check_request_id(request.request_id)
        cfg = w.model.config
        params, seed = sampling_from_pb(request.sampling, cfg.vocab_size)
        if params.constraint is not None:
            w.engine.grammars.check(params.constraint)  # compiled here, off the engine thread (then cached)
        ids = check_token_ids(request.prompt_ids, cfg.vocab_size, cfg.max_position - 1)
        resumed = list(request.output_ids)
        if resumed:
            check_token_ids(resumed, cfg.vocab_size, cfg.max_position - len(ids), "output_ids")
        target = request.target
        if not (target.worker_id and target.kv_address and target.epoch):
            raise ValueError("target must name the decode worker: worker_id, kv_address and epoch")
        t0 = time.perf_counter()
        events: queue.SimpleQueue = queue.SimpleQueue()  # TokenEvents, or the StreamedPush that failed
        # A prompt of several chunks streams its K/V while the later chunks are computed; one chunk's K/V
        # is ready with the first token, so it goes after it, as one piece.
        push = None
        if w.stream_kv and len(ids) > w.config.prefill_chunk_tokens:
            push = StreamedPush(w, rid, target, context, ids, on_failure=events.put, trace=span).start()
        try:
            context.add_callback(lambda: w.engine.cancel(key))
            w.engine.submit(key, ids, params, events.put, seed=seed, output_ids=resumed,
                            kv_sink=push.put if push is not None else None)
            ev = events.get()
            if isinstance(ev, StreamedPush):  # the decode worker is gone or refused: nobody to prefill for
                w.engine.cancel(key)
                ev.result()  # raises what the push failed with
            if ev.finish_reason in (FinishReason.ERROR, FinishReason.CANCELLED):
                if not context.is_active():
                    return
                if ev.invalid:  # the request's constraint, not this worker: any worker would fail it
                    raise ValueError(f"prefill of {rid}: {ev.error}")
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
            t_first = None
            if ev.token_ids:
                # The first token goes out at once; TTFT does not wait for the KV transfer. When it ends
                # the request already (EOS, a stop, max_tokens 1), nobody will decode: no KV is pushed
                # (a streamed push is abandoned, and the decode worker drops what arrived).
                finished = ev.finish_reason is not None
                first = internal_pb2.FirstToken(token_id=ev.token_ids[0], prefill_s=prefill_s, finished=finished,
                                               cached_tokens=ev.cached_tokens)
                if ev.logprobs:
                    first.logprob.CopyFrom(logprobs_to_pb(ev.logprobs[0]))
                if push is not None:
                    push.first_token_sent()
                t_first = time.perf_counter()
                span.add_event("first_token", {"handoff.finished": finished})
                span.set_attributes({"handoff.cached_tokens": ev.cached_tokens, "handoff.prefill_s": prefill_s})
                yield internal_pb2.PrefillEvent(first_token=first)
                if finished:
                    return
            if context.is_active():
                done = (push.result() if push is not None else
                        push_after(w, rid, ev.kv, ev.block_hashes, target, context, t_first, trace=span))
                yield internal_pb2.PrefillEvent(transfer_done=done)
        finally:
            if push is not None:
                push.abandon()  # a no-op once the push has its reply
