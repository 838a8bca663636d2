"""A prompt's K/V on its way to the decode worker: pushed after the prefill, or streamed while it runs.

Both kinds first ask the decode worker which leading blocks its prefix cache holds (CachedPrefix)
and leave those out; both end with the decode worker's PushKVReply, once it has every byte and has
placed the K/V in its pool.

- `push_after`: the whole K/V in one go, once the prefill is done (a prompt of one chunk: its K/V is
  ready when its first token is, so there is nothing to overlap).
- `StreamedPush`: the engine hands over each chunk's K/V as soon as it is computed (`put`, from the
  engine thread); a thread opens the push at once and sends each chunk while the next is computed,
  as one segment of the KV wire format (common/kv_wire.py). When the first token is out only the
  last chunk is left to send: the exposed transfer is one chunk, not the prompt. The checks are
  those of a plain push: the header (fingerprint, epoch, reservation) goes first and is checked
  before a byte of payload is kept, every chunk has its CRC32, and the decode worker admits the
  sequence only when the last segment lands.
"""
from __future__ import annotations

import queue
import threading
import time

import grpc
import torch

from common import grpc_common, metrics, tracing
from common.grpc_common import ServiceError
from common.kv_wire import encode_kv, encode_kv_segments
from protos import internal_pb2, internal_pb2_grpc

_END = object()  # no more K/V will come (the prefill ended or the push was abandoned)


def push_failed(worker_id: str, rid: str, target, exc: grpc.RpcError) -> ServiceError:
    """The status a failed push ends the Prefill call with, charged to whoever failed."""
    code = exc.code()
    metrics.KV_FAILURES.labels(worker_id, code.name.lower()).inc()
    message = (f"KV push of {rid} to decode worker {target.worker_id} ({target.kv_address}) failed: "
               f"{code.name}: {exc.details()}")
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL):
        return ServiceError(grpc.StatusCode.INTERNAL, message)  # what this worker sent was bad
    if code == grpc.StatusCode.DATA_LOSS:  # damaged in transit: neither worker is to blame
        return ServiceError(code, message, grpc_common.blame("link", target.worker_id, target.epoch))
    if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN):
        code = grpc.StatusCode.UNAVAILABLE  # not reached in time, or no status at all (a target gRPC cannot dial)
    return ServiceError(code, message, grpc_common.blame("decode", target.worker_id, target.epoch))


class _Push:
    """What both kinds share: the target, the prefix the decode worker holds, the send, the figures, and the
    `kv.push` span (a child of the prefill's `trace` span; the decode worker's `kv.receive` is its child)."""

    def __init__(self, worker, rid: str, target, context, prompt_len: int, trace=tracing.INVALID_SPAN):
        self.span = tracing.start("kv.push", trace, kind=tracing.CLIENT, attributes={
            "handoff.request_id": rid, "handoff.attempt": target.attempt, "handoff.decode_worker": target.worker_id,
            "handoff.kv_address": target.kv_address, "handoff.prompt_tokens": prompt_len})
        self.w = worker
        self.rid = rid
        self.target = target
        self.context = context
        self.prompt_len = prompt_len
        self.t_open = time.perf_counter()
        self.t_first: float | None = None  # when the first token went out
        self.skip = 0  # leading blocks left out: the decode worker's prefix cache holds them
        self.num_segments = 1

    def _block_hashes(self, hashes: list[bytes] | None) -> list[bytes]:
        # The last token's block always travels: a push carries at least one token.
        return (hashes or [])[:(self.prompt_len - 1) // self.w.config.block_size]

    def _cached_prefix(self, stub, hashes: list[bytes]) -> int:
        if not hashes:
            return 0
        try:
            reply = stub.CachedPrefix(internal_pb2.CachedPrefixRequest(block_hashes=hashes),
                                      timeout=min(2.0, self.context.time_remaining() or 2.0))
        except grpc.RpcError as exc:
            raise self._failed(exc) from exc
        self.span.add_event("kv.cached_prefix", {"handoff.blocks": min(reply.num_blocks, len(hashes))})
        return min(reply.num_blocks, len(hashes))

    def _send(self, stub, chunks) -> internal_pb2.PushKVReply:
        push = stub.PushKV.future(chunks, timeout=self.context.time_remaining(),
                                  metadata=tracing.metadata(self.span) or None)
        # The Prefill call ending (request cancelled, router gone) ends the push too.
        self.context.add_callback(push.cancel)
        self._on_open(push)
        try:
            return push.result()
        except grpc.FutureCancelledError:
            raise ServiceError(grpc.StatusCode.CANCELLED,
                               f"KV push of {self.rid} cancelled with its request") from None

    def _on_open(self, push) -> None:
        pass

    def _send_whole(self, stub, kv: torch.Tensor, prefix_hashes: list[bytes]) -> internal_pb2.PushKVReply:
        t = self.target
        return self._send(stub, encode_kv(
            kv.contiguous(), request_id=self.rid, target_worker_id=t.worker_id, target_epoch=t.epoch,
            fingerprint=self.w.fingerprint(), reservation_id=t.reservation_id, attempt=t.attempt,
            prefix_hashes=prefix_hashes))

    def _send_or_resend(self, stub, send_skipping, whole) -> internal_pb2.PushKVReply:
        """send_skipping() pushes what the decode worker lacks; if it evicted the skipped prefix meanwhile
        (ABORTED), push all of it again: whole() gives the prompt's whole K/V."""
        try:
            return send_skipping()
        except grpc.RpcError as exc:
            if not self.skip or exc.code() != grpc.StatusCode.ABORTED:
                raise self._failed(exc) from exc
        self.span.add_event("kv.resend", {"handoff.reason": "the cached prefix was evicted"})
        self.skip, self.num_segments = 0, 1
        try:
            return self._send_whole(stub, whole(), [])
        except grpc.RpcError as exc:
            raise self._failed(exc) from exc

    def _failed(self, exc: grpc.RpcError) -> ServiceError:
        return push_failed(self.w.config.worker_id, self.rid, self.target, exc)

    def _done(self, reply: internal_pb2.PushKVReply) -> internal_pb2.TransferDone:
        now = time.perf_counter()
        transfer_s = now - self.t_open
        wid = self.w.config.worker_id
        metrics.KV_BYTES.labels(wid, "out").inc(reply.kv_bytes)
        metrics.KV_SECONDS.labels(wid).observe(transfer_s)
        exposed_s = now - self.t_first if self.t_first is not None else 0.0
        metrics.KV_EXPOSED_SECONDS.labels(wid).observe(exposed_s)
        self.span.set_attributes({"handoff.kv_bytes": reply.kv_bytes, "handoff.kv_segments": self.num_segments,
                                  "handoff.skipped_tokens": self.skip * self.w.config.block_size,
                                  "handoff.exposed_s": exposed_s})
        return internal_pb2.TransferDone(kv_bytes=reply.kv_bytes, num_chunks=-(-reply.kv_bytes // (1 << 20)),
                                         transfer_s=transfer_s, skipped_tokens=self.skip * self.w.config.block_size,
                                         exposed_s=exposed_s, num_segments=self.num_segments)


def push_after(worker, rid: str, kv: torch.Tensor, block_hashes: list[bytes] | None, target, context,
               t_first: float | None, trace=tracing.INVALID_SPAN) -> internal_pb2.TransferDone:
    """Push a prompt's whole K/V, prefilled already, less the leading blocks the decode worker holds."""
    p = _Push(worker, rid, target, context, kv.shape[2], trace)
    p.t_first = t_first
    bs = worker.config.block_size
    with tracing.ending(p.span), worker.kv_channels.use(target.kv_address, target.epoch) as ch:
        stub = internal_pb2_grpc.KVTransferStub(ch)
        hashes = p._block_hashes(block_hashes)
        p.skip = p._cached_prefix(stub, hashes)
        reply = p._send_or_resend(stub, lambda: p._send_whole(stub, kv[:, :, p.skip * bs:], hashes[:p.skip]),
                                  lambda: kv)
        return p._done(reply)


class StreamedPush(_Push):
    """One prompt's K/V, sent segment by segment while the prefill computes it.

    `put(start, end, kv)` takes the K/V of positions start .. end-1 from the engine thread (never
    blocks); `start()` opens the push on a thread of its own, which sends what is ready and waits for
    the rest; `first_token_sent()` marks the start of the exposed transfer; `result()` waits for the
    decode worker's reply; `abandon()` cancels it (the decode worker drops what arrived). A failure
    before the first token is sent goes to `on_failure`, so the Prefill call ends at once instead of
    prefilling for nobody.
    """

    def __init__(self, worker, rid: str, target, context, prompt_ids: list[int], on_failure,
                 trace=tracing.INVALID_SPAN):
        super().__init__(worker, rid, target, context, len(prompt_ids), trace)
        self._trace = trace  # the prefill's span: each chunk the engine hands over is an event of it
        self._prompt_ids = prompt_ids
        self._on_failure = on_failure
        self._pieces: list[tuple[int, int, torch.Tensor]] = []  # every piece, for a resend from token 0
        self._ready: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._future = None
        self._abandoned = False
        self._finished = threading.Event()
        self._reply: internal_pb2.TransferDone | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"kv-push-{rid}", daemon=True)

    def start(self) -> "StreamedPush":
        self._thread.start()
        return self

    # ---- the engine thread

    def put(self, start: int, end: int, kv: torch.Tensor) -> None:
        self._trace.add_event("prefill.chunk", {"handoff.start": start, "handoff.end": end})
        self._pieces.append((start, end, kv))
        self._ready.put((start, end, kv))

    # ---- the servicer

    def first_token_sent(self) -> None:
        self.t_first = time.perf_counter()

    def result(self) -> internal_pb2.TransferDone:
        self._finished.wait()
        if self._error is not None:
            raise self._error
        return self._reply

    def abandon(self) -> None:
        """Stop the push wherever it is; idempotent."""
        with self._lock:
            self._abandoned = True
            future = self._future
        if future is not None:
            future.cancel()
        self._ready.put(_END)  # wakes the sender if it waits for a chunk

    # ---- the push's own thread

    def _run(self) -> None:
        try:
            with tracing.ending(self.span):
                self._reply = self._push()
        except BaseException as exc:  # noqa: BLE001 - handed to the servicer, which raises it
            self._error = exc
            if self.t_first is None:
                self._on_failure(self)
        finally:
            self._finished.set()

    def _push(self) -> internal_pb2.TransferDone:
        w, t = self.w, self.target
        bs = w.config.block_size
        chunk = w.config.prefill_chunk_tokens
        hasher = w.engine.hasher
        with w.kv_channels.use(t.kv_address, t.epoch) as ch:
            stub = internal_pb2_grpc.KVTransferStub(ch)
            hashes = self._block_hashes(hasher.block_hashes(self._prompt_ids, hasher.chunk_blocks(self.prompt_len))
                                        if w.engine.config.prefix_caching else [])
            self.skip = self._cached_prefix(stub, hashes)
            first = self.skip * bs
            # One segment per prefill chunk (chunk k covers tokens k*chunk .. (k+1)*chunk - 1), the first
            # one cut where the decode worker's cached prefix ends.
            bounds = [first] + list(range((first // chunk + 1) * chunk, self.prompt_len, chunk)) + [self.prompt_len]
            tokens = [b - a for a, b in zip(bounds, bounds[1:])]
            self.num_segments = len(tokens)
            reply = self._send_or_resend(stub, lambda: self._send(stub, encode_kv_segments(
                self._segments(bounds), tokens, request_id=self.rid, target_worker_id=t.worker_id,
                target_epoch=t.epoch, fingerprint=w.fingerprint(), reservation_id=t.reservation_id,
                attempt=t.attempt, prefix_hashes=hashes[:self.skip])), self._whole)
        return self._done(reply)

    def _on_open(self, push) -> None:
        with self._lock:
            self._future = push
            abandoned = self._abandoned
        if abandoned:
            push.cancel()

    def _segments(self, bounds: list[int]):
        """The K/V of each segment bounds[k] .. bounds[k+1]-1, as soon as the prefill has computed it.
        Runs on gRPC's request-sending thread; ends early (the call is cancelled then) if abandoned."""
        k, have, pending = 0, bounds[0], []  # pending: pieces received past `have`
        while k < len(bounds) - 1:
            lo, hi = bounds[k], bounds[k + 1]
            while have < hi:
                item = self._ready.get()
                if item is _END:
                    return
                start, end, kv = item
                if end <= lo:
                    continue  # the decode worker holds these already
                pending.append((start, end, kv))
                have = max(have, end)
            parts = [kv[:, :, max(lo, s) - s:min(hi, e) - s] for s, e, kv in pending if e > lo and s < hi]
            self.span.add_event("kv.segment", {"handoff.segment": k, "handoff.start": lo, "handoff.end": hi})
            yield parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=2)
            pending = [(s, e, kv) for s, e, kv in pending if e > hi]
            k += 1

    def _whole(self) -> torch.Tensor:
        """The prompt's whole K/V, from every piece the engine handed over. Called after a push that was
        sent to its end, so the last piece is among them."""
        return torch.cat([kv for _, _, kv in self._pieces], dim=2)
