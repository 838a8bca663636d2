"""python -m bench.tracing_cost: what tracing costs, off against on, in one process and one run.

An in-process cluster (one prefill and one decode worker) serves the same requests in rounds that take
turns (bench.harness.interleave): tracing off (no tracer provider: what a service runs without the OTEL_*
variables) and on (the SDK's provider with the batching OTLP/gRPC exporter, sending every span to a
receiver in this process as a pod sends to its collector, and the decode workers' batch-size log). Figures,
each the median of the rounds with p10-p90, tracing off as the peer:

- `request_ms`: a short request (a one-chunk prompt, 2 tokens) end to end, through the gRPC port: the
  per-request cost (about ten spans over three services, context propagation, export).
- `request_cpu_ms`: the CPU time this process (every service, every thread: the exporter's too) spent on
  such a request; less at the mercy of other processes on a shared machine than the wall time.
- `span_work_us`: the tracing work of one request alone, without the model: the spans, attributes and events
  the three services make for a request, the traceparent written and read at each hop, and their export
  (serialized and sent to the receiver), in CPU microseconds; off, the same calls return at once.
- `decode_token_ms`: the time per token of a 64-token request's decode as the router saw it
  (GenerateResponse.decode_s / its tokens after the first): per-token work, which tracing adds none of.
"""
from __future__ import annotations

import sys
import time

import grpc

from bench.harness import base_parser, emit, emit_load_avg, emit_machine, interleave, log, percentile
from common import tracing
from decode_svc.spans import BatchSizes
from protos import handoff_pb2, handoff_pb2_grpc

SECTIONS = ("cost",)


class Switch:
    """Tracing on and off in a running in-process cluster."""

    def __init__(self, cluster, endpoint: str):
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        self.cluster = cluster
        self.provider = TracerProvider(resource=Resource({"service.name": "bench"}), shutdown_on_exit=False)
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True)))
        self.sizes = [BatchSizes(w.engine) for w in cluster.decode]

    def on(self) -> None:
        tracing.use(self.provider)
        for w, sizes in zip(self.cluster.decode, self.sizes):
            w.batch_sizes = sizes
            if sizes.record not in w.engine.step_listeners:
                w.engine.step_listeners.append(sizes.record)

    def off(self) -> None:
        tracing.use(None)
        for w, sizes in zip(self.cluster.decode, self.sizes):
            w.batch_sizes = None
            if sizes.record in w.engine.step_listeners:
                w.engine.step_listeners.remove(sizes.record)


def span_work(parent_metadata) -> None:
    """The tracing calls one request makes across the services (router/generate.py, prefill_svc, decode_svc)."""
    gen = tracing.start("generate", tracing.extract(parent_metadata), kind=tracing.SERVER,
                        attributes={"handoff.request_id": "r", "handoff.prompt_tokens": 9, "handoff.max_tokens": 2})
    tracing.trace_id(gen)
    attempt = tracing.start("attempt", gen, attributes={"handoff.attempt": 1, "handoff.resumed_tokens": 0})
    reserve = tracing.start("reserve", attempt, attributes={"handoff.kv_tokens": 11})
    reserve.set_attributes({"handoff.decode_worker": "decode-0", "handoff.kv_blocks": 1})
    reserve.end()
    attempt.set_attributes({"handoff.decode_worker": "decode-0", "handoff.prefill_placement": "remote",
                            "handoff.prefill_worker": "prefill-0"})
    prefill = tracing.start("prefill", tracing.extract(tracing.metadata(attempt)), kind=tracing.SERVER,
                            attributes={"handoff.request_id": "r", "handoff.attempt": 1, "handoff.worker_id": "p",
                                        "handoff.decode_worker": "d", "handoff.prompt_tokens": 9,
                                        "handoff.resumed_tokens": 0})
    push = tracing.start("kv.push", prefill, kind=tracing.CLIENT, attributes={"handoff.request_id": "r"})
    prefill.add_event("first_token", {"handoff.finished": False})
    prefill.set_attributes({"handoff.cached_tokens": 0, "handoff.prefill_s": 0.01})
    receive = tracing.start("kv.receive", tracing.extract(tracing.metadata(push)), kind=tracing.SERVER)
    receive.set_attributes({"handoff.request_id": "r", "handoff.attempt": 1, "handoff.kv_segments": 1})
    receive.end()
    push.set_attributes({"handoff.kv_bytes": 1, "handoff.kv_segments": 1, "handoff.skipped_tokens": 0,
                         "handoff.exposed_s": 0.001})
    push.end()
    prefill.end()
    context = tracing.from_traceparent(tracing.traceparent(attempt))
    claim = tracing.start("claim", context, attributes={"handoff.request_id": "r", "handoff.attempt": 1})
    claim.end()
    decode = tracing.start("decode", context, attributes={"handoff.request_id": "r", "handoff.batch_at_start": 1})
    decode.set_attributes({"handoff.completion_tokens": 1, "handoff.batch_max": 1, "handoff.finish_reason": "length"})
    decode.end()
    attempt.end()
    gen.set_attributes({"handoff.completion_tokens": 2, "handoff.finish_reason": "length"})
    gen.end()


def bench_span_work(switch: "Switch", n: int) -> None:
    """span_work_us: CPU time of span_work, export included, per request; tracing off as the peer."""
    caller = [("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")]
    cpu = {}
    for mode in ("off", "on", "off", "on"):  # the second pass of each counts
        switch.on() if mode == "on" else switch.off()
        t0 = time.process_time()
        for i in range(n):
            span_work(caller)
            if mode == "on" and i % 100 == 99:  # within the exporter's queue (2,048 spans): none dropped
                switch.provider.force_flush()
        if mode == "on":
            switch.provider.force_flush()
        cpu[mode] = (time.process_time() - t0) / n
    switch.off()
    emit("span_work_us", 1e6 * cpu["on"], "CPU us a request", peer="tracing off", peer_value=1e6 * cpu["off"],
         requests=n)


def run(argv=None) -> None:
    from router.cluster import Cluster
    from tests.support.otlp import Receiver

    p = base_parser("python -m bench.tracing_cost", __doc__, SECTIONS, threads=1)
    p.add_argument("--rounds", type=int, default=30, help="rounds per mode (default 30; --quick: 6)")
    args = p.parse_args(argv)
    rounds = 6 if args.quick else args.rounds
    emit_machine(dtype=args.dtype, threads=args.threads, rounds=rounds)
    emit_load_avg("start")
    seq = iter(range(10**9))
    with Receiver() as receiver, Cluster(num_prefill=1, num_decode=1, dtype=args.dtype, threads=args.threads,
                                         kv_memory_gib=0.1) as cluster, \
            grpc.insecure_channel(cluster.address) as channel:
        stub = handoff_pb2_grpc.RouterStub(channel)
        switch = Switch(cluster, f"127.0.0.1:{receiver.port}")

        def generate(max_tokens: int, tag: str) -> handoff_pb2.GenerateResponse:
            msgs = list(stub.Generate(handoff_pb2.GenerateRequest(
                prompt="The quick brown fox jumps over the lazy dog", max_tokens=max_tokens, temperature=0.0,
                ignore_eos=True, request_id=f"{tag}-{next(seq)}"), timeout=120))
            return msgs[-1]

        def round_of(mode: str):
            def one() -> tuple[float, float, float]:
                switch.on() if mode == "on" else switch.off()
                t0, cpu0 = time.perf_counter(), time.process_time()
                for _ in range(5):
                    generate(2, mode)
                if mode == "on":
                    switch.provider.force_flush()  # this round's export is this round's cost
                request_s, cpu_s = (time.perf_counter() - t0) / 5, (time.process_time() - cpu0) / 5
                last = generate(64, mode)
                return request_s, last.decode_s / (last.completion_tokens - 1), cpu_s
            return one

        bench_span_work(switch, 200 if args.quick else 2000)
        for mode in ("off", "on"):  # warm-up: the first requests compile and fill caches
            round_of(mode)()
        log(f"{rounds} rounds of 5 short requests and one of 64 tokens, tracing off and on in turns")
        switch.provider.force_flush()
        before = len(receiver.spans)
        got = interleave({"off": round_of("off"), "on": round_of("on")}, rounds)
        switch.off()
        switch.provider.force_flush()
        spans = len(receiver.spans) - before
        for i, (name, unit) in enumerate((("request_ms", "ms a request"), ("decode_token_ms", "ms a token"),
                                          ("request_cpu_ms", "CPU ms a request"))):
            off = [1000 * r[i] for r in got["off"]]
            on = [1000 * r[i] for r in got["on"]]
            emit(name, percentile(on, 50), unit, peer="tracing off", peer_value=percentile(off, 50),
                 on_p10_p90=[percentile(on, 10), percentile(on, 90)],
                 off_p10_p90=[percentile(off, 10), percentile(off, 90)], rounds=rounds)
        emit("spans_exported", spans, "spans", per_traced_request=spans / (6 * rounds))
        switch.provider.shutdown()
    emit_load_avg("end")


if __name__ == "__main__":
    run(sys.argv[1:])
