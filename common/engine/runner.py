"""ModelRunner: turns a batch of sequences into model inputs over the paged cache, and back into logits."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from common.engine.hardware import auto_dtype
from common.engine.kv_cache import KVCache
from common.engine.model import ATTN_SPAN_MULTIPLE, AttnContext, Llama
from common.engine.weights import load_weights, trim_memory

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def parse_dtype(name: str, device: str | torch.device = "cpu") -> torch.dtype:
    """A dtype name; "auto" is the one that suits the hardware (common/engine/hardware.py)."""
    if name.lower() == "auto":
        dtype, why = auto_dtype(device)
        log.info("dtype auto: %s, because %s", DTYPE_NAMES[dtype], why)
        return dtype
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"dtype must be one of auto, fp32, bf16, fp16; got {name!r}") from None


@dataclass
class PrefillItem:
    seq_id: str
    token_ids: list[int]  # the tokens to run: a whole prompt, or one chunk of it
    start: int = 0  # position of token_ids[0]; the K/V of positions before it is in the cache


@dataclass
class DecodeItem:
    seq_id: str
    token_id: int  # the token whose K/V is written at `position`
    position: int
    # False for a replayed token (a resumed sequence recomputing the K/V of tokens it already has):
    # its row runs for the K/V only, no logits.
    sample: bool = True


class ModelRunner:
    """Owns the model and its KV cache; callers own allocation through `cache.pool`."""

    def __init__(self, model: Llama, cache: KVCache, packed_decode: bool = True):
        self.model = model
        self.cache = cache
        self.device = model.device
        # Decode reads packed 4-bit weights (a quarter of bf16's bytes) at every batch size, never
        # only at some: bf16 and int4 matmuls each give a row the same bits whatever else is in the
        # batch, but switching between them by batch size would make a request's tokens depend on
        # its company. bf16 decode (False) has more throughput at 32+ sequences, less at 1-8.
        self.packed_decode = packed_decode
        self._offsets = torch.arange(max(model.config.max_position + ATTN_SPAN_MULTIPLE, cache.block_size),
                                     device=self.device)
        # The fp32 final hidden states [R, dim] of the rows the last prefill() or decode() returned logits
        # for, in the same order: the engine computes exact logprobs from them (Llama.log_probs), only
        # for the rows whose request asks. Engine thread only, like the rest of the runner.
        self.last_hidden: torch.Tensor | None = None

    @classmethod
    def load(cls, model_name: str | Path, *, dtype: str = "auto", num_blocks: int,
             block_size: int = 16, device: str = "cpu", progress: bool = True,
             packed_decode: bool = True, keep_dense: bool = True) -> "ModelRunner":
        weights = load_weights(model_name, progress=progress)
        torch_dtype = parse_dtype(dtype, device)
        model = Llama(weights.config, weights.tensors, dtype=torch_dtype, device=device,
                      packed=weights.packed, pack_layers=packed_decode, keep_dense=keep_dense)
        model.weights_id = weights.weights_id
        del weights
        trim_memory()
        cache = KVCache(model.config, num_blocks, block_size, torch_dtype, device)
        return cls(model, cache, packed_decode)

    def _tensor(self, values) -> torch.Tensor:
        """An int64 index tensor of a step on the model's device. To CUDA through page-locked memory: a copy
        from pageable memory waits for the stream to drain first, so each of a step's index tensors would
        stall the host until the GPU finished the work queued before it."""
        t = torch.tensor(values, dtype=torch.long)
        if self.device.type != "cuda":
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    def prefill(self, items: list[PrefillItem]) -> torch.Tensor:
        """Run whole prompts (blocks already allocated); returns last-position logits [B, V] fp32.

        One forward per prompt: a 16-bit GEMM rounds a row differently once more rows share it
        (oneDNN re-blocks past ~64 rows), so batching prompts together would let a request's K/V,
        and so its tokens, depend on what else arrived with it (invariant 4: same inputs, same tokens). A prompt of ≥ 64
        tokens already fills the matrix units on its own.
        """
        rows = [self._prefill_one(it) for it in items]
        self.last_hidden = torch.cat(rows)
        return torch.cat([self.model.logits(row) for row in rows])

    def _prefill_one(self, it: PrefillItem) -> torch.Tensor:
        """The last hidden state [1, dim] fp32 of the chunk it.token_ids (positions it.start onwards)."""
        n, start = len(it.token_ids), it.start
        end = start + n
        table = self.cache.pool.block_table(it.seq_id)
        ctx = AttnContext(slot_mapping=self._tensor(self.cache.slots(table, start, end)), prefill_lens=[n],
                          prefill_start=start)
        if start:
            ctx.context_slots = self._tensor(self.cache.slots(table, 0, end))
            # Query i (position start + i) sees keys 0 .. start + i.
            ctx.attn_mask = self._offsets[:end][None, :] <= self._offsets[start:end][:, None]  # [n, end]
        hidden = self.model(self._tensor(it.token_ids), self._offsets[start:end], ctx, self.cache.kv)
        return hidden[-1:]

    def _block_tables(self, tables: list[list[int]], width: int) -> torch.Tensor:
        """[rows, width] int64: each table's first `width` blocks, padded with block 0 (never read)."""
        return self._tensor([t[:width] + [0] * (width - len(t[:width])) for t in tables])

    def decode(self, items: list[DecodeItem]) -> torch.Tensor:
        """One row per item (blocks already grown to hold `position`); returns logits [R, V] of the
        items with `sample`, in order.

        A sequence may have several rows at consecutive positions (replayed tokens, then its newest):
        each layer writes every row's K/V before any row attends, so row p sees rows < p. Every row is
        computed the same way whatever the other rows are (model.py: DENSE_ROW_BLOCK, and the native
        attention kernels or ATTN_SPAN_MULTIPLE), so replaying tokens reproduces the K/V their original
        steps wrote.
        """
        bs = self.cache.block_size
        pool = self.cache.pool
        tables = [pool.block_table(it.seq_id) for it in items]
        ctx_lens = [it.position + 1 for it in items]
        slots = [t[it.position // bs] * bs + it.position % bs for t, it in zip(tables, items)]
        ctx = AttnContext(slot_mapping=self._tensor(slots), use_packed=self.model.has_packed and self.packed_decode)
        if self.model.kernels is not None:
            # The kernel reads each row's own blocks, up to its own length: no padding, no mask.
            ctx.block_tables = self._block_tables(tables, -(-max(ctx_lens) // bs))
            ctx.lens = self._tensor(ctx_lens)
            ctx.longest, ctx.block_size = max(ctx_lens), bs
        else:
            span = -(-max(ctx_lens) // ATTN_SPAN_MULTIPLE) * ATTN_SPAN_MULTIPLE
            max_blocks = -(-span // bs)
            bt = self._block_tables(tables, max_blocks)
            # Slots of positions 0..span-1 of every row; past a row's own length they are masked (the mask
            # is always there: SDPA without one takes another path, whose bits differ) and read the
            # all-zero null slot, whatever the blocks there hold.
            context_slots = (bt[:, :, None] * bs + self._offsets[:bs]).view(len(items), -1)[:, :span]
            lens = self._tensor(ctx_lens)
            attend = self._offsets[:span][None, :] < lens[:, None]  # [B, S]
            ctx.context_slots = context_slots.masked_fill(~attend, self.cache.null_slot).reshape(-1)
            ctx.attn_mask = attend[:, None, None, :]
        hidden = self.model(self._tensor([it.token_id for it in items]),
                            self._tensor([it.position for it in items]), ctx, self.cache.kv)
        rows = [i for i, it in enumerate(items) if it.sample]
        if not rows:
            self.last_hidden = hidden[:0]
            return hidden.new_empty(0, self.model.config.vocab_size)
        if len(rows) != len(items):
            hidden = hidden[self._tensor(rows)]
        self.last_hidden = hidden
        return self.model.decode_logits(hidden)
