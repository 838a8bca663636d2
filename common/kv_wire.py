"""The KV wire format: one sequence's KV cache as a KVHeader followed by checksummed KVData chunks.

Payload layout "L2THD": the row-major bytes of a [num_layers, 2 (K, V), num_tokens, num_kv_heads,
head_dim] tensor, or of consecutive segments of the sequence, each laid out so for its own tokens
(a push streamed while the prefill computes, one segment per prefill chunk). The sender (prefill)
calls encode_kv() or encode_kv_segments(); the receiver (decode) feeds the stream to a KVReceiver
chunk by chunk, so it can reject a push the moment it goes wrong and never holds more than
max_bytes (plus one segment). A push from a stale worker epoch or a different model is rejected before a
byte of payload is kept (invariant 3: stale or foreign KV rejected).
"""
from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields

import torch

from common.engine.config import ModelConfig
from common.engine.prefix import HASH_BYTES
from protos import internal_pb2

MAX_PREFIX_BLOCKS = 4096  # block hashes a push or a CachedPrefix query may name
CHUNK_BYTES = 1 << 20  # payload bytes per KVData message: well under gRPC's 4 MiB default limit
LAYOUT = "L2THD"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class KVTransferError(ValueError):
    """A KV push was rejected; `code` is a short machine-readable reason.

    Codes: "fingerprint" (different model), "worker" / "epoch" (addressed to another worker or a
    previous life of this one), "header" (missing or repeated header fields), "shape" (layout or
    tensor shape), "size" (byte counts: total, limit, chunk sizes), "order" (message out of
    place), "duplicate" (a chunk sent twice), "checksum" (crc32 mismatch), "truncated" (stream
    ended early).
    """

    def __init__(self, code: str, message: str):
        super().__init__(f"KV push rejected ({code}): {message}")
        self.code = code


@dataclass(frozen=True)
class ModelFingerprint:
    """What a KV cache depends on; a push is accepted only if every field matches exactly."""

    weights_id: str    # hash of the weights (common.engine.weights: content hash of the weight files)
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int    # tokens per paged-KV block
    dtype: str         # "float32", "bfloat16" or "float16"

    def __post_init__(self) -> None:
        if not self.weights_id:
            raise ValueError("model fingerprint: weights_id must be non-empty")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model fingerprint: {name} must be positive, got {getattr(self, name)}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"model fingerprint: dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")

    @classmethod
    def for_model(cls, config: ModelConfig, *, weights_id: str, block_size: int,
                  dtype: torch.dtype) -> ModelFingerprint:
        return cls(weights_id=weights_id, num_layers=config.num_layers, num_kv_heads=config.num_kv_heads,
                   head_dim=config.head_dim, block_size=block_size, dtype=dtype_name(dtype))

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def kv_bytes(self, num_tokens: int) -> int:
        """Payload bytes of the KV of num_tokens tokens."""
        return (self.num_layers * 2 * num_tokens * self.num_kv_heads * self.head_dim
                * self.torch_dtype.itemsize)

    def to_pb(self) -> internal_pb2.ModelFingerprint:
        return internal_pb2.ModelFingerprint(**{f.name: getattr(self, f.name) for f in fields(self)})

    @classmethod
    def from_pb(cls, pb: internal_pb2.ModelFingerprint) -> ModelFingerprint:
        return cls(**{f.name: getattr(pb, f.name) for f in fields(cls)})


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype ("bfloat16" for torch.bfloat16)."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"KV dtype must be one of {sorted(_DTYPES)}, got {name}")
    return name


def encode_kv(kv: torch.Tensor, *, request_id: str, target_worker_id: str, target_epoch: str,
              fingerprint: ModelFingerprint, reservation_id: str = "", attempt: int = 0,
              prefix_hashes: list[bytes] = (), chunk_bytes: int = CHUNK_BYTES) -> Iterator[internal_pb2.KVChunk]:
    """Yield the header, then the data chunks of one sequence's KV cache.

    kv: [num_layers, 2, num_tokens, num_kv_heads, head_dim], contiguous, of the fingerprint's dtype.
    Chunks are sliced lazily from a byte view of kv (bf16 has no numpy dtype, so the view is
    uint8): the only copy is into each message. kv must not change until the iterator is done.
    """
    num_tokens = _check_kv(kv, fingerprint)
    yield from encode_kv_segments(iter([kv]), [num_tokens], request_id=request_id, target_worker_id=target_worker_id,
                                  target_epoch=target_epoch, fingerprint=fingerprint, reservation_id=reservation_id,
                                  attempt=attempt, prefix_hashes=prefix_hashes, chunk_bytes=chunk_bytes)


def encode_kv_segments(segments: Iterator[torch.Tensor], segment_tokens: list[int], *, request_id: str,
                       target_worker_id: str, target_epoch: str, fingerprint: ModelFingerprint,
                       reservation_id: str = "", attempt: int = 0, prefix_hashes: list[bytes] = (),
                       chunk_bytes: int = CHUNK_BYTES) -> Iterator[internal_pb2.KVChunk]:
    """Yield the header, then each segment's data chunks as `segments` hands the segment over.

    The streamed push: the header announces the segments' token counts up front (a prefill knows
    its chunks before it computes them), and segment k's chunks go out as soon as `segments` yields
    its K/V, [num_layers, 2, segment_tokens[k], num_kv_heads, head_dim]; so a consumer that blocks
    until the prefill computed the next chunk streams the KV while the prefill runs. One segment is
    the plain push (its header names no segments, as before segments existed).
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    if not segment_tokens or any(t < 1 for t in segment_tokens):
        raise ValueError(f"segment_tokens must be a non-empty list of counts >= 1, got {segment_tokens}")
    per_token = fingerprint.kv_bytes(1)
    total_bytes = per_token * sum(segment_tokens)
    num_chunks = sum(math.ceil(t * per_token / chunk_bytes) for t in segment_tokens)
    yield internal_pb2.KVChunk(header=internal_pb2.KVHeader(
        request_id=request_id, target_worker_id=target_worker_id, target_epoch=target_epoch,
        fingerprint=fingerprint.to_pb(), num_tokens=sum(segment_tokens), total_bytes=total_bytes,
        num_chunks=num_chunks, layout=LAYOUT, reservation_id=reservation_id, attempt=attempt,
        prefix_hashes=list(prefix_hashes), segment_tokens=segment_tokens if len(segment_tokens) > 1 else []))
    index = offset = 0
    for k, want in enumerate(segment_tokens):
        kv = next(segments, None)
        if kv is None:
            return  # the caller stopped feeding (the push was abandoned) and cancels the call
        if _check_kv(kv, fingerprint) != want:
            raise ValueError(f"segment {k} holds {kv.shape[2]} tokens, the header announced {want}")
        payload = memoryview(kv.detach().cpu().reshape(-1).view(torch.uint8).numpy())  # [L*2*T*H*D*itemsize]
        for start in range(0, payload.nbytes, chunk_bytes):
            piece = payload[start:start + chunk_bytes]
            # protobuf takes bytes, not a memoryview: this is the one copy per chunk.
            yield internal_pb2.KVChunk(data=internal_pb2.KVData(
                index=index, offset=offset, payload=bytes(piece), crc32=zlib.crc32(piece)))
            index += 1
            offset += piece.nbytes


def _check_kv(kv: torch.Tensor, fp: ModelFingerprint) -> int:
    """Raise unless kv is what the fingerprint says; return num_tokens."""
    if kv.dim() != 5 or kv.shape[0] != fp.num_layers or kv.shape[1] != 2 \
            or kv.shape[3] != fp.num_kv_heads or kv.shape[4] != fp.head_dim or kv.shape[2] < 1:
        raise KVTransferError("shape", f"KV tensor must be [{fp.num_layers}, 2, num_tokens >= 1, "
                                       f"{fp.num_kv_heads}, {fp.head_dim}], got {list(kv.shape)}")
    if kv.dtype != fp.torch_dtype:
        raise KVTransferError("shape", f"KV tensor dtype must be {fp.dtype} (the fingerprint's), got {kv.dtype}")
    if not kv.is_contiguous():
        raise KVTransferError("shape", "KV tensor must be contiguous (call .contiguous() when gathering it)")
    return kv.shape[2]


class KVReceiver:
    """Validates and assembles one incoming push: on_header(), on_data() per chunk, finish().

    Every check happens as the message arrives, so the server can abort the stream at the first
    bad message; any KVTransferError means the push must be dropped.
    """

    def __init__(self, *, expected_fingerprint: ModelFingerprint, worker_id: str, epoch: str, max_bytes: int,
                 admit: Callable[[internal_pb2.KVHeader], None] = lambda header: None, pin_memory: bool = False):
        """pin_memory: assemble the K/V in page-locked memory (where it goes on to a GPU: its copy there is
        then one direct, asynchronous transfer)."""
        self.expected_fingerprint = expected_fingerprint
        self.pin_memory = pin_memory
        self.worker_id = worker_id
        self.epoch = epoch
        self.max_bytes = max_bytes
        # Called with a header that passed every check, before its buffer is allocated: the
        # receiver's own say (e.g. does the push hold a reservation); it raises to refuse.
        self._admit = admit
        self.header: internal_pb2.KVHeader | None = None
        self.num_chunks_received = 0
        self.kv_bytes = 0  # payload bytes received so far
        self._open = False  # a header was accepted and finish() has not run
        # One segment: the payload's bytes, viewed as the tensor at finish() (with pin_memory, a byte view
        # of _kv, page-locked bytes). Several: the segment being received; each is copied into _kv as it
        # completes (_seg is its index, _seg_start its first byte and _seg_token its first token), so
        # finish() has nothing left to assemble.
        self._buf: bytearray | memoryview | None = None
        self._segments: list[int] = []
        self._kv: torch.Tensor | None = None
        self._seg = self._seg_start = self._seg_token = 0

    @property
    def request_id(self) -> str:
        return self.header.request_id if self.header is not None else ""

    @property
    def num_tokens(self) -> int:
        return self.header.num_tokens if self.header is not None else 0

    def on_header(self, header: internal_pb2.KVHeader) -> None:
        if self.header is not None:
            raise KVTransferError("order", f"a second header arrived for request {self.request_id!r}")
        if not header.request_id:
            raise KVTransferError("header", "header has no request_id")
        self._check_fingerprint(header)
        if header.target_worker_id != self.worker_id:
            raise KVTransferError("worker", f"push is addressed to worker {header.target_worker_id!r}, "
                                            f"this is worker {self.worker_id!r}")
        if header.target_epoch != self.epoch:
            raise KVTransferError("epoch", f"push targets epoch {header.target_epoch!r} of worker "
                                           f"{self.worker_id!r}, which is now at epoch {self.epoch!r} "
                                           f"(the worker restarted since the reservation)")
        if len(header.prefix_hashes) > MAX_PREFIX_BLOCKS or any(len(h) != HASH_BYTES for h in header.prefix_hashes):
            raise KVTransferError("header", f"prefix_hashes must be at most {MAX_PREFIX_BLOCKS} hashes of "
                                            f"{HASH_BYTES} bytes each")
        if header.layout != LAYOUT:
            raise KVTransferError("shape", f"layout must be {LAYOUT!r}, got {header.layout!r}")
        if header.num_tokens < 1:
            raise KVTransferError("shape", f"num_tokens must be >= 1, got {header.num_tokens}")
        expected_bytes = self.expected_fingerprint.kv_bytes(header.num_tokens)
        if header.total_bytes != expected_bytes:
            raise KVTransferError("size", f"total_bytes must be {expected_bytes} for {header.num_tokens} tokens "
                                          f"(L*2*T*H*D*itemsize), header says {header.total_bytes}")
        if header.total_bytes > self.max_bytes:
            raise KVTransferError("size", f"push of {header.total_bytes} bytes ({header.num_tokens} tokens) "
                                          f"exceeds the limit of {self.max_bytes} bytes")
        if not 1 <= header.num_chunks <= header.total_bytes:
            raise KVTransferError("size", f"num_chunks must be in [1, total_bytes={header.total_bytes}], "
                                          f"got {header.num_chunks}")
        segments = list(header.segment_tokens) or [header.num_tokens]
        if any(t < 1 for t in segments) or sum(segments) != header.num_tokens:
            raise KVTransferError("shape", f"segment_tokens must be counts >= 1 summing to num_tokens="
                                           f"{header.num_tokens}, got {len(segments)} segments summing to "
                                           f"{sum(segments)}")
        self._admit(header)
        fp = self.expected_fingerprint
        self._segments = segments
        if len(segments) > 1:  # bounded by max_bytes above, plus one segment being received
            self._kv = torch.empty(fp.num_layers, 2, header.num_tokens, fp.num_kv_heads, fp.head_dim,
                                   dtype=fp.torch_dtype, pin_memory=self.pin_memory)
            self._buf = bytearray(fp.kv_bytes(segments[0]))
        elif self.pin_memory:  # written through a byte view; finish() views the tensor itself, not a copy
            self._kv = torch.empty(header.total_bytes, dtype=torch.uint8, pin_memory=True)
            self._buf = memoryview(self._kv.numpy())
        else:
            self._buf = bytearray(header.total_bytes)  # bounded by max_bytes above
        self._open = True
        self.header = header

    def _check_fingerprint(self, header: internal_pb2.KVHeader) -> None:
        if not header.HasField("fingerprint"):
            raise KVTransferError("fingerprint", "header has no model fingerprint")
        got = header.fingerprint
        for f in fields(ModelFingerprint):
            want_value, got_value = getattr(self.expected_fingerprint, f.name), getattr(got, f.name)
            if want_value != got_value:
                raise KVTransferError("fingerprint", f"sender's model differs: {f.name} expected "
                                                     f"{want_value!r}, got {got_value!r}")

    def on_data(self, data: internal_pb2.KVData) -> None:
        header = self.header
        if header is None:
            raise KVTransferError("order", f"data chunk {data.index} arrived before the header")
        if not self._open:
            raise KVTransferError("order", f"data chunk {data.index} arrived after the push was finished")
        if data.index < self.num_chunks_received:
            raise KVTransferError("duplicate", f"chunk {data.index} arrived again "
                                               f"({self.num_chunks_received} chunks already received)")
        if data.index != self.num_chunks_received:
            raise KVTransferError("order", f"expected chunk {self.num_chunks_received}, got chunk {data.index}")
        if data.index >= header.num_chunks:
            raise KVTransferError("order", f"chunk {data.index} is past the {header.num_chunks} chunks "
                                           f"the header announced")
        if data.offset != self.kv_bytes:
            raise KVTransferError("order", f"chunk {data.index} has offset {data.offset}, expected {self.kv_bytes}")
        size = len(data.payload)
        end = data.offset + size
        if size == 0:
            raise KVTransferError("size", f"chunk {data.index} is empty")
        if end > header.total_bytes:
            raise KVTransferError("size", f"chunk {data.index} ends at byte {end}, past total_bytes "
                                          f"{header.total_bytes}")
        is_last = data.index == header.num_chunks - 1
        if is_last and end != header.total_bytes:
            raise KVTransferError("size", f"last chunk {data.index} ends at byte {end}, "
                                          f"total_bytes is {header.total_bytes}")
        if not is_last and end == header.total_bytes:
            raise KVTransferError("size", f"chunk {data.index} reaches total_bytes {header.total_bytes} "
                                          f"but the header announced {header.num_chunks} chunks")
        crc = zlib.crc32(data.payload)
        if crc != data.crc32:
            raise KVTransferError("checksum", f"chunk {data.index} (offset {data.offset}, {size} bytes): "
                                              f"crc32 expected {data.crc32:#010x}, computed {crc:#010x}")
        if len(self._segments) == 1:
            self._buf[data.offset:end] = data.payload
        else:
            self._write_segments(data.offset, memoryview(data.payload))
        self.kv_bytes = end
        self.num_chunks_received += 1

    def _write_segments(self, offset: int, payload: memoryview) -> None:
        """Copy a chunk's bytes into the segment being received; place each segment it completes."""
        fp = self.expected_fingerprint
        while payload.nbytes:
            at = offset - self._seg_start
            take = min(payload.nbytes, len(self._buf) - at)
            self._buf[at:at + take] = payload[:take]
            offset, payload = offset + take, payload[take:]
            if at + take < len(self._buf):
                continue
            tokens = self._segments[self._seg]
            piece = torch.frombuffer(self._buf, dtype=fp.torch_dtype).view(
                fp.num_layers, 2, tokens, fp.num_kv_heads, fp.head_dim)
            self._kv[:, :, self._seg_token:self._seg_token + tokens].copy_(piece)
            self._seg += 1
            self._seg_start, self._seg_token = offset, self._seg_token + tokens
            more = self._seg < len(self._segments)
            self._buf = bytearray(fp.kv_bytes(self._segments[self._seg])) if more else bytearray()

    def on_chunk(self, chunk: internal_pb2.KVChunk) -> None:
        """Dispatch one stream message to on_header or on_data."""
        kind = chunk.WhichOneof("chunk")
        if kind == "header":
            self.on_header(chunk.header)
        elif kind == "data":
            self.on_data(chunk.data)
        else:
            raise KVTransferError("header", "empty KVChunk (neither header nor data)")

    def finish(self) -> torch.Tensor:
        """The received KV, [num_layers, 2, num_tokens, num_kv_heads, head_dim]; raises if incomplete."""
        header, buf = self.header, self._buf
        if header is None:
            raise KVTransferError("truncated", "stream ended before the header")
        if not self._open:
            raise KVTransferError("order", f"push of request {header.request_id!r} was already finished")
        if self.num_chunks_received != header.num_chunks or self.kv_bytes != header.total_bytes:
            raise KVTransferError("truncated", f"stream ended after {self.num_chunks_received} of "
                                               f"{header.num_chunks} chunks ({self.kv_bytes} of "
                                               f"{header.total_bytes} bytes)")
        fp = self.expected_fingerprint
        self._open, self._buf = False, None  # the tensor now owns the bytes
        shape = (fp.num_layers, 2, header.num_tokens, fp.num_kv_heads, fp.head_dim)
        if self._kv is not None:
            kv, self._kv = self._kv, None
            if len(self._segments) > 1:
                return kv  # every segment was placed as it completed
            return kv.view(fp.torch_dtype).view(shape)  # the page-locked bytes, as K/V
        kv = torch.frombuffer(buf, dtype=fp.torch_dtype)  # zero-copy view of the received bytes
        return kv.view(shape)
