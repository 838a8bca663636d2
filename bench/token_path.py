"""python -m bench.token_path: the whole cluster against the engine alone, in one process and one run.

    python -m bench.token_path                      # every figure (a few minutes)
    python -m bench.token_path --quick              # CI smoke: small sizes, under 2 minutes
    python -m bench.token_path --only ttft kv --decode-workers 2

The cluster is `router.cluster.Cluster`: embedded Redis, a prefill and a decode worker and the router,
talking real gRPC on loopback; the client calls the public Generate API. The peer, "engine-alone", is
`common.engine.engine.Engine` on a fresh ModelRunner over the same weights in the same process: what one
colocated worker would do with no router, no Redis and no KV transfer. Every torch engine here (the
cluster's and the peer) runs with the same intra-op thread count, so the difference is the path.

Prints one JSON object per figure on stdout, as every benchmark here does. For latencies the value is the
cluster's, "ratio" = cluster / engine-alone and lower is better; for throughput higher is better.
"""
from __future__ import annotations

import concurrent.futures
import logging
import math
import os
import statistics
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace

import grpc
import torch

from common import settings
from bench.harness import (MODEL, base_parser, chat_prompt, emit, emit_load_avg, emit_skipped, interleave, log,
                           percentile, system_prompt)
from common.worker import WorkerConfig
from router.cluster import Cluster
from router.config import RouterConfig

SECTIONS = ("ttft", "kv", "stream", "placement", "itl", "streams32", "prefix")
PEER = "engine-alone"
TIMEOUT_S = 600.0
TTFT_TOLERANCE = 1.1  # placement: remote may cost a request this much more TTFT than local
HTTP2_FRAME_BYTES = 16384  # gRPC's default SETTINGS_MAX_FRAME_SIZE: one 9-byte frame header per this many bytes


@dataclass
class Stream:
    """What one generation looked like from the caller's side."""

    start_s: float
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (perf_counter, tokens in that message)
    finish_reason: str = ""
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def ttft_s(self) -> float:
        return self.arrivals[0][0] - self.start_s

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.arrivals)

    @property
    def handoff_gap_s(self) -> float:
        """First token to second: in the cluster, the KV push and the decode admission sit in this gap."""
        return self.arrivals[1][0] - self.arrivals[0][0]

    def token_gaps_s(self) -> list[float]:
        """Seconds between consecutive tokens. A message carrying k tokens after a gap g counts as k gaps of
        g / k (the decode worker coalesces tokens when its reader lags, so that is what a reader sees)."""
        gaps = [0.0] * (self.arrivals[0][1] - 1) if self.arrivals else []
        for (t_prev, _), (t, k) in zip(self.arrivals, self.arrivals[1:]):
            gaps.extend([(t - t_prev) / k] * k)
        return gaps


# ----------------------------------------------------------------------------- the two systems

class ClusterClient:
    """Generate through the router's public API, as any client would."""

    name = "cluster"

    def __init__(self, address: str):
        from common import grpc_common
        from protos import handoff_pb2_grpc

        self.channel = grpc_common.channel(address, max_message_bytes=grpc_common.MAX_PUBLIC_MESSAGE_BYTES)
        self.stub = handoff_pb2_grpc.RouterStub(self.channel)

    def generate(self, text: str, max_tokens: int, request_id: str, system: str | None = None) -> Stream:
        """A raw prompt, or with `system` a chat: that system prompt and `text` as the user's turn."""
        from protos import handoff_pb2

        prompt = dict(prompt=text) if system is None else dict(messages=[
            handoff_pb2.ChatMessage(role="system", content=system), handoff_pb2.ChatMessage(role="user", content=text)])
        req = handoff_pb2.GenerateRequest(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                          request_id=request_id, **prompt)
        s = Stream(time.perf_counter())
        last = None
        for msg in self.stub.Generate(req, timeout=TIMEOUT_S):
            if msg.token_ids:
                s.arrivals.append((time.perf_counter(), len(msg.token_ids)))
            last = msg
        s.finish_reason = handoff_pb2.FinishReason.Name(last.finish_reason) if last else "none"
        s.finish_reason = s.finish_reason.removeprefix("FINISH_REASON_").lower()
        s.done.set()
        return s

    def generate_many(self, text: str, max_tokens: int, n: int, tag: str) -> tuple[list[Stream], float]:
        """n concurrent calls released together; returns the streams and the wall time of all of them."""
        go = threading.Barrier(n + 1)

        def one(i: int) -> Stream:
            go.wait()
            return self.generate(text, max_tokens, f"{tag}-{i}")

        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(one, i) for i in range(n)]
            go.wait()
            t0 = time.perf_counter()
            streams = [f.result() for f in futures]
        return streams, time.perf_counter() - t0

    def close(self) -> None:
        self.channel.close()


class EngineAlone:
    """Engine on its own ModelRunner and KV cache, its thread running as in a worker; the sink timestamps."""

    name = PEER

    def __init__(self, model, tokenizer, num_blocks: int, packed_decode: bool):
        from common.engine.engine import Engine, EngineConfig
        from common.engine.kv_cache import KVCache
        from common.engine.runner import ModelRunner

        cache = KVCache(model.config, num_blocks, 16, model.dtype, model.device)
        # No prefix cache on either side of these comparisons: they measure the path, and the prompts
        # repeat (the "prefix" section measures the cache).
        self.engine = Engine(ModelRunner(model, cache, packed_decode), tokenizer,
                             EngineConfig(prefix_caching=False)).start()
        self._n = 0

    def _submit(self, ids: list[int], max_tokens: int) -> Stream:
        from common.engine.sampling import SamplingParams

        self._n += 1
        s = Stream(time.perf_counter())

        def sink(ev) -> None:
            if ev.token_ids:
                s.arrivals.append((time.perf_counter(), len(ev.token_ids)))
            if ev.finish_reason is not None:
                s.finish_reason = ev.finish_reason.value
                s.done.set()

        self.engine.submit(f"alone-{self._n}", ids, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                   ignore_eos=True), sink, seed=0)
        return s

    def generate(self, ids: list[int], max_tokens: int) -> Stream:
        s = self._submit(ids, max_tokens)
        if not s.done.wait(TIMEOUT_S):
            raise TimeoutError("engine alone: a generation did not finish")
        return s

    def generate_many(self, ids: list[int], max_tokens: int, n: int) -> tuple[list[Stream], float]:
        t0 = time.perf_counter()
        streams = [self._submit(ids, max_tokens) for _ in range(n)]
        for s in streams:
            if not s.done.wait(TIMEOUT_S):
                raise TimeoutError("engine alone: a generation did not finish")
        return streams, time.perf_counter() - t0

    def close(self) -> None:
        self.engine.stop()


# ----------------------------------------------------------------------------- sections

def ms(seconds: float) -> float:
    return seconds * 1e3


LOWER = "ms (lower is better; ratio = cluster / engine-alone)"


def bench_ttft(cluster: ClusterClient, alone: EngineAlone, prompts: dict, reps: dict[int, int]) -> dict[int, list[str]]:
    """Time to first token, one request at a time (each runs to its end before the next starts).
    Returns the cluster's request ids by prompt length, for the KV figures."""
    rids: dict[int, list[str]] = defaultdict(list)
    for n, count in reps.items():
        text, ids = prompts[n]

        def via_cluster(n=n, text=text) -> float:
            rid = f"bench-ttft-{n}-{len(rids[n])}-{os.getpid()}"
            rids[n].append(rid)
            return cluster.generate(text, 2, rid).ttft_s

        cluster.generate(text, 2, f"bench-warm-{n}-{os.getpid()}"), alone.generate(ids, 2)  # warm-up
        t = interleave({"cluster": via_cluster, "alone": lambda ids=ids: alone.generate(ids, 2).ttft_s}, count)
        for q in (50, 99):
            v, pv = ms(percentile(t["cluster"], q)), ms(percentile(t["alone"], q))
            emit(f"ttft_p{q}_ms_{n}tok", v, LOWER, peer=PEER, peer_value=pv, target="ratio <= 1.15",
                 met=v / pv <= 1.15, prompt_len=n, samples=count)
        log(f"TTFT {n} tokens: cluster p50 {ms(statistics.median(t['cluster'])):.1f} ms, "
            f"engine alone {ms(statistics.median(t['alone'])):.1f} ms")
    return rids


def bench_prefix(args, rounds: int) -> None:
    """Cache-aware against least-loaded routing, each on a fresh cluster of 2 prefill workers and 1 decode
    worker: 4 system prompts of ~1,024 tokens, each asked a new 32-token question in turn. Figures: hit
    rate (prompt tokens found in the prefill worker's cache), TTFT p50, and the KV bytes pushed when the
    decode worker already holds the prefix, against the whole prompt's."""
    from common.engine.model_files import resolve_model_path
    from common.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_path(MODEL))
    topics = ["opening hours", "borrowing rules", "the reading room", "the local history archive"]
    systems = {t: system_prompt(tokenizer, t, 1024) for t in topics}
    questions = [f"Question {i}: please tell me, in one short sentence, what matters most about this and why, "
                 f"for a first visit." for i in range(rounds)]
    results = {}
    for routing in ("least_loaded", "cache_aware"):
        cl = Cluster(model=MODEL, num_prefill=2, num_decode=1, dtype=args.dtype, kv_memory_gib=args.kv_memory_gib,
                     threads=args.threads, router=RouterConfig(routing=routing))
        log(f"prefix: a cluster of 2 prefill + 1 decode workers, routing {routing}")
        cl.start()
        client = ClusterClient(cl.address)
        ttft, prompt_tokens, cached, pushed, full, hit_pushed = [], 0, 0, [], [], []
        try:
            for i, q in enumerate(questions):
                for t, system in systems.items():
                    rid = f"bench-prefix-{routing}-{i}-{topics.index(t)}-{os.getpid()}"
                    s = client.generate(q, 2, rid, system=system)
                    rec = cl.state.get_request(rid)
                    n = cl.prefill[0].tokenizer.encode(cl.prefill[0].tokenizer.apply_chat_template(
                        [{"role": "system", "content": system}, {"role": "user", "content": q}]))
                    if i:  # the first round fills the caches
                        ttft.append(s.ttft_s)
                        prompt_tokens += len(n)
                        cached += int(rec.get("cached_tokens", 0))
                    kv = int(rec["kv_bytes"])
                    whole = cl.decode[0].fingerprint().kv_bytes(len(n))
                    if int(rec.get("skipped_tokens", 0)):
                        hit_pushed.append(kv)
                        full.append(whole)
                    time.sleep(0.6)  # a heartbeat: the workers publish what they now hold
        finally:
            client.close()
            cl.stop()
        results[routing] = dict(ttft_p50_ms=ms(statistics.median(ttft)), hit_rate=cached / prompt_tokens)
        log(f"prefix, {routing}: hit rate {cached / prompt_tokens:.2f}, TTFT p50 {ms(statistics.median(ttft)):.0f} ms")
        emit(f"prefix_hit_rate_{routing}", cached / prompt_tokens, "prompt tokens found in the prefill worker's cache",
             requests=len(ttft), rounds=rounds)
        if hit_pushed:
            emit(f"prefix_kv_bytes_pushed_on_a_decode_hit_{routing}", statistics.mean(hit_pushed),
                 "bytes (lower is better; ratio = pushed / whole prompt's KV)", peer="whole prompt",
                 peer_value=statistics.mean(full), pushes=len(hit_pushed))
    ca, ll = results["cache_aware"], results["least_loaded"]
    emit("prefix_ttft_p50_ms_cache_aware", ca["ttft_p50_ms"], "ms (lower is better; ratio = cache_aware / least_loaded)",
         peer="least_loaded routing", peer_value=ll["ttft_p50_ms"])
    emit("prefix_hit_rate_cache_aware_vs_least_loaded", ca["hit_rate"], "hit rate (ratio = cache_aware / least_loaded)",
         peer="least_loaded routing", peer_value=ll["hit_rate"])


def bench_kv(cl, client: ClusterClient, prompts: dict, rids: dict[int, list[str]], reps: int) -> None:
    """KV bytes on the wire vs 2 x layers x tokens x kv_heads x head_dim x bytes, and transfer time."""
    from prometheus_client import REGISTRY

    from common.kv_wire import encode_kv

    model = cl.prefill[0].model
    c = model.config
    for n, (text, _) in prompts.items():
        # Requests of our own, so the process-wide byte counter's increase is theirs alone.
        own = [f"bench-kv-{n}-{i}-{os.getpid()}" for i in range(reps)]
        before = _kv_counter(REGISTRY, cl)
        for rid in own:
            client.generate(text, 2, rid)
        counted = round((_kv_counter(REGISTRY, cl) - before) / reps)
        # transfer_s of every request of this length that went through (ttft's too, if it ran)
        records = [cl.state.get_request(rid) for rid in rids.get(n, []) + own]
        records = [r for r in records if r and r.get("transfer_s")]
        theory = 2 * c.num_layers * n * c.num_kv_heads * c.head_dim * model.dtype.itemsize
        # What crossed: the same messages the prefill worker sends, each with gRPC's 5-byte length prefix
        # and HTTP/2's 9-byte header per DATA frame (TCP/IP headers below that are not counted).
        dw = cl.decode[0]
        kv = torch.zeros(c.num_layers, 2, n, c.num_kv_heads, c.head_dim, dtype=model.dtype)
        wire = 0
        for msg in encode_kv(kv, request_id=own[0], target_worker_id=dw.config.worker_id,
                             target_epoch=dw.epoch, fingerprint=cl.prefill[0].fingerprint(), reservation_id=own[0]):
            framed = msg.ByteSize() + 5
            wire += framed + 9 * math.ceil(framed / HTTP2_FRAME_BYTES)
        emit(f"kv_wire_bytes_{n}tok", wire, "bytes per request (lower is better; ratio = wire / theoretical)",
             peer="theoretical", peer_value=theory, target="ratio <= 1.05", met=wire / theory <= 1.05,
             prompt_len=n)
        emit(f"kv_counted_bytes_{n}tok", counted, "bytes per request by the handoff_kv_transfer_bytes_total "
             "counter (payload only; ratio = counted / theoretical)", peer="theoretical", peer_value=theory)
        if records:
            kv_bytes = [int(r["kv_bytes"]) for r in records]
            transfer_s = [float(r["transfer_s"]) for r in records]
            emit(f"kv_transfer_ms_p50_{n}tok", ms(statistics.median(transfer_s)),
                 "ms (Redis record transfer_s: encode + push + receive, on the prefill worker)",
                 samples=len(records), kv_bytes=kv_bytes[0])
            emit(f"kv_transfer_gb_s_{n}tok", statistics.median(b / s for b, s in zip(kv_bytes, transfer_s)) / 1e9,
                 "GB/s (KV payload / transfer_s, median)")
        log(f"KV {n} tokens: wire {wire} B, theoretical {theory} B, {len(records)} records")


def bench_stream(cl, client: ClusterClient, tokenizer, lengths: tuple[int, ...], reps: int) -> None:
    """The KV transfer the prefill leaves exposed (from sending the first token to the push's reply, when
    the decode worker has every byte placed), streamed while the prefill computes against pushed after
    it: the prefill worker's stream_kv switched between requests, alternating, in the same run."""
    p = cl.prefill[0]
    try:
        for n in lengths:
            text, _ = chat_prompt(tokenizer, n)
            got: dict[bool, list[dict]] = {True: [], False: []}
            for i in range(reps):
                for stream in (True, False) if i % 2 == 0 else (False, True):
                    p.stream_kv = stream
                    rid = f"bench-stream-{n}-{stream}-{i}-{os.getpid()}"
                    client.generate(text, 2, rid)
                    record = cl.state.get_request(rid)
                    if record and record.get("exposed_s") is not None:
                        got[stream].append(record)
            if not got[True] or not got[False]:
                log(f"stream {n} tokens: no record with a transfer")
                continue
            exposed = {k: statistics.median(float(r["exposed_s"]) for r in v) for k, v in got.items()}
            prefill = statistics.median(float(r["prefill_s"]) for r in got[True])
            segments = int(got[True][0]["kv_segments"])
            emit(f"kv_exposed_ms_{n}tok", ms(exposed[True]), "ms from the first token to the push's reply, streamed "
                 "(ratio = streamed / pushed after the prefill)", peer="pushed after the prefill",
                 peer_value=ms(exposed[False]), samples=len(got[True]), segments=segments, prompt_len=n)
            ratio = exposed[True] / prefill
            emit(f"kv_exposed_vs_prefill_{n}tok", ratio, "exposed transfer / prefill time (medians, streamed)",
                 prefill_ms=ms(prefill), exposed_ms=ms(exposed[True]),
                 **(dict(target="<= 0.10 at 1,024 tokens and above", met=ratio <= 0.10) if n >= 1024 else {}))
            log(f"stream {n} tokens: exposed {ms(exposed[True]):.1f} ms streamed ({segments} segments), "
                f"{ms(exposed[False]):.1f} ms after; prefill {ms(prefill):.0f} ms")
    finally:
        p.stream_kv = p.config.stream_kv


class Background:
    """One long Generate stream kept running on the decode worker: what a prompt's placement costs the
    streams already decoding shows in its gaps. Restarted when it ends."""

    def __init__(self, client: ClusterClient, text: str, max_tokens: int = 400):
        self.client, self.text, self.max_tokens = client, text, max_tokens
        self.streams: list[Stream] = []
        self._call = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-background", daemon=True)
        self._thread.start()
        while not self.streams or len(self.streams[-1].arrivals) < 8:  # decoding, not prefilling
            time.sleep(0.01)

    def _run(self) -> None:
        from protos import handoff_pb2

        i = 0
        while not self._stop.is_set():
            s = Stream(time.perf_counter())
            self.streams.append(s)
            req = handoff_pb2.GenerateRequest(prompt=self.text, max_tokens=self.max_tokens, temperature=0.0,
                                              ignore_eos=True, request_id=f"bench-bg-{i}-{os.getpid()}")
            self._call = self.client.stub.Generate(req, timeout=TIMEOUT_S)
            try:
                for msg in self._call:
                    if msg.token_ids:
                        s.arrivals.append((time.perf_counter(), len(msg.token_ids)))
            except grpc.RpcError:
                if not self._stop.is_set():  # cancelled by stop() is the only expected end
                    raise
            i += 1

    def gaps_between(self, t0: float, t1: float) -> list[float]:
        """Gaps between the background's token messages that end within [t0, t1], per token."""
        out = []
        for s in self.streams:
            for (tp, _), (t, k) in zip(s.arrivals, s.arrivals[1:]):
                if t0 <= t <= t1:
                    out.extend([(t - tp) / k] * k)
        return out

    def stop(self) -> None:
        self._stop.set()
        if self._call is not None:
            self._call.cancel()
        self._thread.join(timeout=60)


def bench_placement(cl, client: ClusterClient, tokenizer, lengths: tuple[int, ...], reps: int) -> None:
    """Where a prompt should be prefilled, by length: on the prefill worker (remote: prefill there, push the
    KV) or on the decode worker (local: prefill in chunks between its decode steps). For each length, the
    request's TTFT both ways and what it cost one stream already decoding there (its longest gap while
    the request was in flight), the router's placement switched between requests, alternating. The
    threshold is the shortest length from which remote prefill pays (remote_pays below) at that length
    and every longer one measured."""
    router = cl.router.router
    config = router.config
    bg_text, _ = chat_prompt(tokenizer, 64)
    bg = Background(client, bg_text)
    ttft: dict[int, dict[str, float]] = {}
    stalls: dict[int, dict[str, float]] = {}
    try:
        baseline = statistics.median(bg.gaps_between(0, time.perf_counter()))
        for n in lengths:
            text, _ = chat_prompt(tokenizer, n)
            got: dict[str, list[tuple[float, float]]] = {"remote": [], "local": []}
            for i in range(reps):
                for where in ("remote", "local") if i % 2 == 0 else ("local", "remote"):
                    router.config = replace(config, prefill_mode="disaggregated" if where == "remote" else "colocated")
                    time.sleep(0.1)  # a background gap or two before the request
                    t0 = time.perf_counter()
                    s = client.generate(text, 2, f"bench-place-{n}-{where}-{i}-{os.getpid()}")
                    t1 = s.arrivals[-1][0]
                    gaps = bg.gaps_between(t0, t1 + 0.05)
                    got[where].append((s.ttft_s, max(gaps, default=0.0)))
            ttft[n] = {w: statistics.median(t for t, _ in v) for w, v in got.items()}
            stalls[n] = stall = {w: statistics.median(g for _, g in v) for w, v in got.items()}
            emit(f"placement_ttft_ms_{n}tok", ms(ttft[n]["remote"]), "ms TTFT prefilled on the prefill worker "
                 "(ratio = remote / local: below 1, remote pays)", peer="local (on the decode worker)",
                 peer_value=ms(ttft[n]["local"]), samples=reps, prompt_len=n)
            emit(f"placement_decode_stall_ms_{n}tok", ms(stall["remote"]), "ms: a decoding stream's longest gap "
                 "while the request was in flight, remote (ratio = remote / local)", peer="local",
                 peer_value=ms(stall["local"]), baseline_itl_ms=ms(baseline), prompt_len=n)
            log(f"placement {n} tokens: TTFT remote {ms(ttft[n]['remote']):.1f} / local {ms(ttft[n]['local']):.1f} ms; "
                f"decoding stream's longest gap {ms(stall['remote']):.1f} / {ms(stall['local']):.1f} ms "
                f"(its ITL p50 {ms(baseline):.1f} ms)")
    finally:
        router.config = config
        bg.stop()
    # Remote pays at a length when it costs the decoding streams no more than local prefill does and the
    # request's own TTFT no more than TTFT_TOLERANCE above local's (the push's fixed cost is what short
    # prompts pay remotely: docs/benchmarks.md, "Figures behind the code": Remote prefill's TTFT tolerance).
    def remote_pays(n: int) -> bool:
        return stalls[n]["remote"] <= stalls[n]["local"] and ttft[n]["remote"] <= TTFT_TOLERANCE * ttft[n]["local"]

    pays = [n for n in lengths if all(remote_pays(m) for m in lengths if m >= n)]
    if not pays:
        emit_skipped("placement_threshold_tokens", f"remote prefill did not pay at {lengths[-1]} tokens",
                     "measure longer prompts", lengths=list(lengths))
        return
    emit("placement_threshold_tokens", pays[0], f"prompt tokens from which remote prefill costs the decoding "
         f"streams no more than local and its TTFT is within {TTFT_TOLERANCE}x of local, at every longer length "
         "measured (--remote-prefill-min-tokens)", lengths=list(lengths),
         configured=config.remote_prefill_min_tokens)


def _kv_counter(registry, cl) -> float:
    """KV bytes the prefill workers have counted as pushed so far."""
    return sum(registry.get_sample_value("handoff_kv_transfer_bytes_total",
                                         {"worker": w.config.worker_id, "direction": "out"}) or 0.0
               for w in cl.prefill)


def bench_itl(cluster: ClusterClient, alone: EngineAlone, prompt: tuple[str, list[int]], streams: dict[int, int],
              max_tokens: int) -> None:
    """Inter-token latency with n concurrent streams: client-side arrival gaps vs gaps between TokenEvents.
    streams: number of concurrent streams -> rounds (each round: one batch through each system)."""
    text, ids = prompt
    for n, rounds in streams.items():
        tags = (f"bench-itl{n}-{r}-{os.getpid()}" for r in range(rounds))
        t = interleave({"cluster": lambda n=n: cluster.generate_many(text, max_tokens, n, next(tags))[0],
                        "alone": lambda n=n: alone.generate_many(ids, max_tokens, n)[0]}, rounds)
        gaps = {who: [g for streams_ in runs for s in streams_ for g in s.token_gaps_s()] for who, runs in t.items()}
        msgs = [len(s.arrivals) for runs in t["cluster"] for s in runs]
        toks = [s.num_tokens for runs in t["cluster"] for s in runs]
        for q in (50, 99):
            v, pv = ms(percentile(gaps["cluster"], q)), ms(percentile(gaps["alone"], q))
            goal = dict(target="ratio <= 1.3", met=v <= 1.3 * pv) if q == 99 and n >= 16 else {}
            emit(f"itl_p{q}_ms_{n}stream", v, LOWER, peer=PEER, peer_value=pv, streams=n,
                 samples=len(gaps["cluster"]), rounds=rounds, **goal)
        handoff = {who: [s.handoff_gap_s for streams_ in runs for s in streams_] for who, runs in t.items()}
        v, pv = ms(statistics.median(handoff["cluster"])), ms(statistics.median(handoff["alone"]))
        emit(f"itl_first_gap_ms_p50_{n}stream", v, LOWER + "; first to second token only", peer=PEER,
             peer_value=pv, streams=n, samples=len(handoff["cluster"]))
        if n >= 16:
            itl = ms(percentile(gaps["alone"], 50))
            emit(f"itl_first_gap_vs_engine_itl_{n}stream", v, LOWER + "; the cluster's first-to-second token gap "
                 "against the engine alone's ITL p50", peer=PEER, peer_value=itl, target="ratio <= 1.5",
                 met=v <= 1.5 * itl, streams=n)
        overhead = ms(percentile(gaps["cluster"], 50) - percentile(gaps["alone"], 50))
        emit(f"itl_relay_overhead_ms_p50_{n}stream", overhead, "ms per token (cluster p50 - engine-alone p50)",
             target="<= 1.0", met=overhead <= 1.0, tokens_per_message=sum(toks) / sum(msgs))
        log(f"ITL {n} streams: cluster p50 {ms(percentile(gaps['cluster'], 50)):.1f} ms, engine alone "
            f"{ms(percentile(gaps['alone'], 50)):.1f} ms, {sum(toks) / sum(msgs):.2f} tokens per message")


def bench_streams32(cluster: ClusterClient, alone: EngineAlone, prompt: tuple[str, list[int]], max_tokens: int) -> None:
    text, ids = prompt
    n = 32
    c_streams, c_wall = cluster.generate_many(text, max_tokens, n, f"bench-s32-{os.getpid()}")
    a_streams, a_wall = alone.generate_many(ids, max_tokens, n)
    finished = sum(s.finish_reason == "length" and s.num_tokens == max_tokens for s in c_streams)
    v, pv = sum(s.num_tokens for s in c_streams) / c_wall, sum(s.num_tokens for s in a_streams) / a_wall
    emit("streams32_finished", finished, f"of {n} concurrent Generate streams ended with all {max_tokens} tokens",
         target=f"== {n}", met=finished == n)
    emit("streams32_tok_s", v, "tok/s (all streams' tokens / wall time, prefill included)", peer=PEER,
         peer_value=pv, streams=n, prompt_len=len(ids), max_tokens=max_tokens, target="ratio >= 0.95",
         met=v >= 0.95 * pv)
    log(f"32 streams: {finished} finished, cluster {v:.1f} tok/s, engine alone {pv:.1f} tok/s")


# ----------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> None:
    from common.engine.tokenizer import load_tokenizer
    from common.engine.model_files import resolve_model_path

    p = base_parser("python -m bench.token_path", __doc__, SECTIONS, threads=0,
                    threads_help="torch intra-op threads of every engine (default 0: the cluster's own "
                                 "choice, cores / workers)")
    p.add_argument("--decode-workers", type=int, default=1, choices=(1, 2))
    p.add_argument("--kv-memory-gib", type=float, default=settings.default("kv_memory_gib"), help="KV pool of each decode worker")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    q = args.quick
    sections = set(args.only or SECTIONS)
    ttft_reps = {128: 5, 1024: 2} if q else {128: 20, 1024: 8}
    itl_tokens, itl_rounds = (16, {1: 2, 16: 1}) if q else (48, {1: 6, 16: 3})
    s32_tokens = 8 if q else 64
    t_start = time.perf_counter()
    emit_load_avg("start")

    # threads 0 = the cluster's own policy (cores / workers); torch's count is per process, so the
    # engine alone runs with the same number as each of the cluster's engines.
    if sections == {"prefix"}:
        return bench_prefix(args, rounds=3 if q else 6)
    cl = Cluster(model=MODEL, num_prefill=1, num_decode=args.decode_workers, dtype=args.dtype,
                 kv_memory_gib=args.kv_memory_gib, threads=args.threads,
                 worker=WorkerConfig(role="prefill", prefix_caching=False))
    log(f"starting a cluster: 1 prefill + {args.decode_workers} decode workers, {args.dtype}")
    cl.start()
    log(f"cluster on {cl.address}; torch threads per engine: {torch.get_num_threads()}")
    tokenizer = load_tokenizer(resolve_model_path(MODEL))
    prompts = {n: chat_prompt(tokenizer, n) for n in (128, 1024)}
    model = cl.decode[0].model
    alone = EngineAlone(model, tokenizer, num_blocks=1024, packed_decode=cl.worker_config.packed_decode)
    client = ClusterClient(cl.address)
    try:
        rids: dict[int, list[str]] = {}
        if "ttft" in sections:
            rids = bench_ttft(client, alone, prompts, ttft_reps)
        if "kv" in sections:
            bench_kv(cl, client, prompts, rids, reps=2 if q else 4)
        if "stream" in sections:
            bench_stream(cl, client, tokenizer, (128, 1024) if q else (128, 1024, 4096), reps=1 if q else 4)
        if "placement" in sections:
            bench_placement(cl, client, tokenizer, (32, 64, 128) if q else (32, 64, 128, 256, 512, 1024),
                            reps=1 if q else 4)
        if "itl" in sections:
            bench_itl(client, alone, prompts[128], itl_rounds, itl_tokens)
        if "streams32" in sections:
            bench_streams32(client, alone, prompts[128], s32_tokens)
        time.sleep(0.5)  # let the last releases land before checking every pool is whole again
        cl.check_integrity()
    finally:
        client.close()
        alone.close()
        cl.stop()
    if "prefix" in sections:
        bench_prefix(args, rounds=3 if q else 6)
    emit_load_avg("end")
    log(f"done in {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
