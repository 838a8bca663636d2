"""The KV wire format: bit-exact round trips, small overhead, and every malformed push rejected."""
from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch

from common.engine.config import ModelConfig
from common.kv_wire import (CHUNK_BYTES, KVReceiver, KVTransferError, ModelFingerprint, dtype_name,
                            encode_kv, encode_kv_segments)
from protos import internal_pb2

SMOL = ModelFingerprint(weights_id="sha256:5m0l", num_layers=30, num_kv_heads=3, head_dim=64, block_size=16,
                        dtype="bfloat16")
TINY = ModelFingerprint(weights_id="sha256:t1ny", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4,
                        dtype="float32")
TINY_CHUNK = 512  # TINY with 10 tokens is 2,560 bytes: 5 chunks
WORKER, EPOCH = "decode-0", "epoch-7"


def random_kv(fp: ModelFingerprint, num_tokens: int, seed: int = 0) -> torch.Tensor:
    """[L, 2, T, H, D] of random bit patterns (NaNs and infs included), so equality must be bit-exact."""
    g = torch.Generator().manual_seed(seed)
    itemsize = fp.torch_dtype.itemsize
    bits = {2: torch.int16, 4: torch.int32}[itemsize]
    lo, hi = -(2 ** (8 * itemsize - 1)), 2 ** (8 * itemsize - 1) - 1
    shape = (fp.num_layers, 2, num_tokens, fp.num_kv_heads, fp.head_dim)
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(bits).view(fp.torch_dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def encode(kv: torch.Tensor, fp: ModelFingerprint = TINY, *, worker: str = WORKER, epoch: str = EPOCH,
           chunk_bytes: int = TINY_CHUNK) -> list[internal_pb2.KVChunk]:
    """The push as the receiver sees it: every message serialized and parsed again."""
    chunks = encode_kv(kv, request_id="req-1", target_worker_id=worker, target_epoch=epoch, fingerprint=fp,
                       reservation_id="res-1", chunk_bytes=chunk_bytes)
    return [internal_pb2.KVChunk.FromString(c.SerializeToString()) for c in chunks]


def receiver(fp: ModelFingerprint = TINY, max_bytes: int = 1 << 30) -> KVReceiver:
    return KVReceiver(expected_fingerprint=fp, worker_id=WORKER, epoch=EPOCH, max_bytes=max_bytes)


def feed(rx: KVReceiver, chunks: list[internal_pb2.KVChunk]) -> torch.Tensor:
    for chunk in chunks:
        rx.on_chunk(chunk)
    return rx.finish()


def tiny_push(num_tokens: int = 10) -> list[internal_pb2.KVChunk]:
    return encode(random_kv(TINY, num_tokens))


# --- Round trips --------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("num_tokens", [1, 17, 100])  # 100 SmolLM2 tokens: 3 chunks in bf16, 5 in fp32
def test_round_trip_is_bit_exact(dtype, num_tokens):
    fp = dataclasses.replace(SMOL, dtype=dtype)
    kv = random_kv(fp, num_tokens, seed=num_tokens)
    chunks = encode(kv, fp, chunk_bytes=CHUNK_BYTES)
    header = chunks[0].header
    assert (header.num_tokens, header.total_bytes, header.layout) == (num_tokens, fp.kv_bytes(num_tokens), "L2THD")
    assert header.num_chunks == len(chunks) - 1 == -(-fp.kv_bytes(num_tokens) // CHUNK_BYTES)
    assert header.reservation_id == "res-1" and ModelFingerprint.from_pb(header.fingerprint) == fp
    rx = receiver(fp)
    out = feed(rx, chunks)
    assert same_bits(out, kv)
    assert (rx.request_id, rx.num_tokens, rx.kv_bytes) == ("req-1", num_tokens, fp.kv_bytes(num_tokens))


def test_round_trip_with_a_ragged_last_chunk():
    kv = random_kv(TINY, 7)  # 1,792 bytes in 300-byte chunks: the last holds 292
    chunks = encode(kv, chunk_bytes=300)
    assert [len(c.data.payload) for c in chunks[1:]] == [300] * 5 + [292]
    assert same_bits(feed(receiver(), chunks), kv)


def test_wire_bytes_are_close_to_the_kv_bytes():
    num_tokens = 1000
    kv = random_kv(SMOL, num_tokens)
    wire_bytes = sum(c.ByteSize() for c in encode_kv(kv, request_id="req-1", target_worker_id=WORKER,
                                                     target_epoch=EPOCH, fingerprint=SMOL))
    kv_bytes = 2 * 30 * num_tokens * 3 * 64 * 2  # 23 MB, as docs/architecture.md says
    assert SMOL.kv_bytes(num_tokens) == kv_bytes
    assert kv_bytes <= wire_bytes <= 1.05 * kv_bytes


def test_encode_does_not_copy_the_whole_tensor_up_front():
    kv = random_kv(TINY, 10)
    chunks = encode_kv(kv, request_id="r", target_worker_id=WORKER, target_epoch=EPOCH, fingerprint=TINY,
                       chunk_bytes=TINY_CHUNK)
    next(chunks)  # header
    kv.view(torch.uint8).view(-1)[0] ^= 0xFF  # chunks are sliced lazily from kv's own memory
    assert next(chunks).data.payload[0] == kv.view(torch.uint8).view(-1)[0].item()


def test_fingerprint_converts_to_and_from_protobuf():
    assert ModelFingerprint.from_pb(SMOL.to_pb()) == SMOL
    config = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                         num_kv_heads=3, head_dim=64, rope_theta=1e5, rms_norm_eps=1e-5, max_position=8192,
                         tie_embeddings=True)
    assert ModelFingerprint.for_model(config, weights_id="sha256:5m0l", block_size=16,
                                      dtype=torch.bfloat16) == SMOL
    assert dtype_name(torch.float16) == "float16"
    with pytest.raises(ValueError, match="dtype"):
        dataclasses.replace(SMOL, dtype="int8")
    with pytest.raises(ValueError, match="num_layers"):
        dataclasses.replace(SMOL, num_layers=0)


@pytest.mark.parametrize("bad, why", [
    (lambda: random_kv(TINY, 4).transpose(2, 3).contiguous(), "must be"),       # H and T swapped
    (lambda: random_kv(TINY, 4)[:1], "must be"),                                 # missing layers
    (lambda: torch.zeros(2, 2, 0, 2, 8), "num_tokens >= 1"),
    (lambda: random_kv(TINY, 4).to(torch.float16), "dtype"),
    (lambda: random_kv(TINY, 8)[:, :, ::2], "contiguous"),
])
def test_encode_rejects_a_tensor_that_does_not_match_the_fingerprint(bad, why):
    with pytest.raises(KVTransferError, match=why) as err:
        next(iter(encode_kv(bad(), request_id="r", target_worker_id=WORKER, target_epoch=EPOCH,
                            fingerprint=TINY)))
    assert err.value.code == "shape"


# --- Rejections -----------------------------------------------------------------------------------------

def rejected(chunks: list[internal_pb2.KVChunk], rx: KVReceiver | None = None) -> KVTransferError:
    with pytest.raises(KVTransferError) as err:
        feed(rx or receiver(), chunks)
    return err.value


def test_flipped_payload_byte_fails_the_checksum():
    chunks = tiny_push()
    payload = bytearray(chunks[3].data.payload)
    payload[100] ^= 0x01
    chunks[3].data.payload = bytes(payload)
    err = rejected(chunks)
    assert err.code == "checksum" and "chunk 2" in str(err) and "crc32" in str(err)


_OTHER_VALUES = {"weights_id": "sha256:0ther", "num_layers": 3, "num_kv_heads": 1, "head_dim": 16,
                 "block_size": 8, "dtype": "bfloat16"}


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(ModelFingerprint)])
def test_each_fingerprint_field_must_match(field):
    assert set(_OTHER_VALUES) == {f.name for f in dataclasses.fields(ModelFingerprint)}
    chunks = tiny_push()
    setattr(chunks[0].header.fingerprint, field, _OTHER_VALUES[field])
    rx = receiver()
    err = rejected(chunks, rx)
    assert err.code == "fingerprint"
    assert field in str(err)
    assert repr(getattr(TINY, field)) in str(err) and repr(_OTHER_VALUES[field]) in str(err)
    assert rx.kv_bytes == 0  # not one payload byte was kept


def test_push_from_a_sender_with_another_model_is_rejected_even_if_sizes_agree():
    # Same shapes and dtype, different weights: only the weights id tells them apart.
    other = dataclasses.replace(TINY, weights_id="sha256:finetuned")
    err = rejected(encode(random_kv(other, 10), other))
    assert err.code == "fingerprint" and "weights_id" in str(err)


def test_header_without_fingerprint_is_rejected():
    chunks = tiny_push()
    chunks[0].header.ClearField("fingerprint")
    assert rejected(chunks).code == "fingerprint"


def test_stale_epoch_is_rejected():
    err = rejected(encode(random_kv(TINY, 10), epoch="epoch-6"))
    assert err.code == "epoch" and "'epoch-6'" in str(err) and "'epoch-7'" in str(err)


def test_push_for_another_worker_is_rejected():
    err = rejected(encode(random_kv(TINY, 10), worker="decode-1"))
    assert err.code == "worker" and "'decode-1'" in str(err) and "'decode-0'" in str(err)


def test_truncated_stream_is_rejected_at_finish():
    chunks = tiny_push()
    rx = receiver()
    for chunk in chunks[:-1]:
        rx.on_chunk(chunk)
    with pytest.raises(KVTransferError, match="after 4 of 5 chunks") as err:
        rx.finish()
    assert err.value.code == "truncated"


def test_stream_without_header_is_truncated():
    with pytest.raises(KVTransferError) as err:
        receiver().finish()
    assert err.value.code == "truncated"


def test_duplicated_chunk_is_rejected():
    chunks = tiny_push()
    err = rejected(chunks[:3] + [chunks[2]] + chunks[3:])
    assert err.code == "duplicate" and "chunk 1" in str(err)


def test_reordered_chunks_are_rejected():
    chunks = tiny_push()
    chunks[2], chunks[3] = chunks[3], chunks[2]
    err = rejected(chunks)
    assert err.code == "order" and "expected chunk 1, got chunk 2" in str(err)


def test_oversized_push_is_rejected_before_allocating():
    chunks = tiny_push()
    total = chunks[0].header.total_bytes
    rx = receiver(max_bytes=total - 1)
    with pytest.raises(KVTransferError, match=f"{total} bytes.*limit of {total - 1}") as err:
        rx.on_header(chunks[0].header)
    assert err.value.code == "size"
    assert feed(receiver(max_bytes=total), chunks).shape[2] == 10  # the limit itself is allowed


@pytest.mark.parametrize("delta", [-4, 4])
def test_header_with_wrong_total_bytes_is_rejected(delta):
    chunks = tiny_push()
    chunks[0].header.total_bytes += delta
    err = rejected(chunks)
    assert err.code == "size" and "total_bytes must be 2560" in str(err)


def test_header_claiming_more_tokens_than_sent_is_rejected():
    chunks = tiny_push()
    chunks[0].header.num_tokens = 11
    assert rejected(chunks).code == "size"


def test_data_before_header_is_rejected():
    chunks = tiny_push()
    err = rejected(chunks[1:])
    assert err.code == "order" and "before the header" in str(err)


def test_second_header_is_rejected():
    chunks = tiny_push()
    assert rejected(chunks[:2] + [chunks[0]] + chunks[2:]).code == "order"


def test_chunk_at_the_wrong_offset_is_rejected():
    chunks = tiny_push()
    chunks[2].data.offset += 1
    assert rejected(chunks).code == "order"


def test_chunk_past_the_announced_count_is_rejected():
    chunks = tiny_push()
    extra = internal_pb2.KVChunk()
    extra.CopyFrom(chunks[-1])
    extra.data.index += 1
    extra.data.offset += len(extra.data.payload)
    err = rejected(chunks + [extra])
    assert err.code == "order" and "past the 5 chunks" in str(err)


@pytest.mark.parametrize("num_chunks", [4, 6, 0, 2561])
def test_header_with_inconsistent_chunk_count_is_rejected(num_chunks):
    chunks = tiny_push()
    chunks[0].header.num_chunks = num_chunks
    assert rejected(chunks).code == "size"


def test_oversized_chunk_is_rejected():
    # A chunk that runs past the end of the payload.
    chunks = encode(random_kv(TINY, 10), chunk_bytes=700)  # 700, 700, 700, 460
    chunks[-1].data.payload += b"\0" * 4
    err = rejected(chunks)
    assert err.code == "size" and "past total_bytes" in str(err)


def test_unknown_layout_is_rejected():
    chunks = tiny_push()
    chunks[0].header.layout = "LT2HD"
    assert rejected(chunks).code == "shape"


def test_empty_message_is_rejected():
    assert rejected(tiny_push()[:1] + [internal_pb2.KVChunk()]).code == "header"


def test_chunk_after_finish_is_rejected():
    chunks = tiny_push()
    rx = receiver()
    feed(rx, chunks)
    with pytest.raises(KVTransferError, match="after the push was finished"):
        rx.on_chunk(chunks[1])


# --- Streamed pushes: one segment per prefill chunk -----------------------------------------------------

def encode_segments(kv: torch.Tensor, bounds: list[int], fp: ModelFingerprint = TINY,
                    chunk_bytes: int = TINY_CHUNK) -> list[internal_pb2.KVChunk]:
    """kv sent as the segments bounds[k] .. bounds[k+1]-1, each handed over as its own tensor."""
    pieces = iter([kv[:, :, a:b].contiguous() for a, b in zip(bounds, bounds[1:])])
    tokens = [b - a for a, b in zip(bounds, bounds[1:])]
    chunks = encode_kv_segments(pieces, tokens, request_id="req-1", target_worker_id=WORKER, target_epoch=EPOCH,
                                fingerprint=fp, reservation_id="res-1", chunk_bytes=chunk_bytes)
    return [internal_pb2.KVChunk.FromString(c.SerializeToString()) for c in chunks]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("bounds", [[0, 4, 8, 10], [0, 3, 10], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])
def test_a_streamed_push_assembles_the_same_bits(dtype, bounds):
    fp = dataclasses.replace(TINY, dtype=dtype)
    kv = random_kv(fp, 10, seed=3)
    chunks = encode_segments(kv, bounds, fp)
    assert list(chunks[0].header.segment_tokens) == [b - a for a, b in zip(bounds, bounds[1:])]
    assert chunks[0].header.total_bytes == fp.kv_bytes(10)
    assert same_bits(feed(receiver(fp), chunks), kv)


def test_a_one_segment_push_is_the_plain_push():
    kv = random_kv(TINY, 10)
    assert encode_segments(kv, [0, 10]) == encode(kv)


def test_chunks_that_span_segments_are_placed_right():
    """The sender never spans two segments with one chunk; the format allows it, so the receiver must
    cope: the same payload re-cut into chunks of 700 bytes (segments are 1,024 and 1,536 bytes)."""
    kv = random_kv(TINY, 10, seed=5)
    header = encode_segments(kv, [0, 4, 10])[0].header
    payload = b"".join(kv[:, :, a:b].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                       for a, b in ((0, 4), (4, 10)))
    size = 700
    pieces = [payload[o:o + size] for o in range(0, len(payload), size)]
    header.num_chunks = len(pieces)
    chunks = [internal_pb2.KVChunk(header=header)] + [
        internal_pb2.KVChunk(data=internal_pb2.KVData(index=i, offset=i * size, payload=p, crc32=zlib.crc32(p)))
        for i, p in enumerate(pieces)]
    assert same_bits(feed(receiver(), chunks), kv)


@pytest.mark.parametrize("segments", [[4, 5], [4, 7], [0, 10], [10, 0]])
def test_segments_that_do_not_add_up_are_rejected(segments):
    chunks = encode_segments(random_kv(TINY, 10), [0, 4, 10])
    del chunks[0].header.segment_tokens[:]
    chunks[0].header.segment_tokens.extend(segments)
    with pytest.raises(KVTransferError) as err:
        receiver().on_chunk(chunks[0])
    assert err.value.code == "shape" and "segment_tokens" in str(err.value)


def test_a_streamed_push_cut_in_its_second_segment_is_truncated():
    rx = receiver()
    chunks = encode_segments(random_kv(TINY, 10), [0, 4, 8, 10])
    for chunk in chunks[:4]:  # the header, the first segment's 2 chunks, half of the second
        rx.on_chunk(chunk)
    with pytest.raises(KVTransferError) as err:
        rx.finish()
    assert err.value.code == "truncated"


def test_the_sender_stops_when_the_segments_stop():
    """An abandoned push (the prefill ended, the call is cancelled): the encoder ends where its
    segments do, and what it sent is a truncated push the receiver refuses."""
    kv = random_kv(TINY, 10)
    chunks = list(encode_kv_segments(iter([kv[:, :, :4].contiguous()]), [4, 6], request_id="r",
                                     target_worker_id=WORKER, target_epoch=EPOCH, fingerprint=TINY,
                                     chunk_bytes=TINY_CHUNK))
    assert len(chunks) == 1 + 2
    rx = receiver()
    with pytest.raises(KVTransferError) as err:
        feed(rx, chunks)
    assert err.value.code == "truncated"


def test_a_segment_of_the_wrong_size_is_not_sent():
    kv = random_kv(TINY, 10)
    with pytest.raises(ValueError, match="announced"):
        list(encode_kv_segments(iter([kv[:, :, :5].contiguous()]), [4, 6], request_id="r", target_worker_id=WORKER,
                                target_epoch=EPOCH, fingerprint=TINY))
