"""The paged KV cache: a pool of fixed-size blocks, block tables per sequence, and the tensors."""
from __future__ import annotations

import collections
import math

import torch

from common.engine import pages
from common.engine.config import ModelConfig


class OutOfBlocks(RuntimeError):
    """The pool has too few free blocks; callers check can_allocate() first to avoid it."""


class BlockPool:
    """Allocator of KV blocks; a sequence owns an ordered block table. Full blocks whose K/V a prefill
    chunk computed may carry a prefix hash (`common/engine/prefix.py`) and outlive their sequence.

    Queries never mutate: `can_allocate()` answers, only then `allocate()` changes state, so a failure
    never leaves half an allocation behind. A block is in exactly one of three places: owned (by one
    or more block tables: a shared prefix), cached (no owner, but its hash still names its K/V; taken
    back by a new prompt with that prefix, or evicted least-recently-used when the pool needs room),
    or free. Cached blocks count as free: `num_free_blocks` is what an allocation can get.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Popping from the end hands out low block ids first (friendlier to read in dumps).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[str, list[int]] = {}
        self._refs: list[int] = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}  # block -> prefix hash of its content
        self._block_of: dict[bytes, int] = {}  # prefix hash -> block
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # unowned, LRU first

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks no sequence owns whose K/V is kept for a prefix that comes again."""
        return len(self._cached)

    @property
    def num_seqs(self) -> int:
        return len(self._tables)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def holds_hash(self, block_hash: bytes) -> bool:
        return block_hash in self._block_of

    def match_prefix(self, hashes: list[bytes]) -> list[int]:
        """The blocks holding the longest leading run of `hashes` (chained: each names its whole prefix)."""
        blocks = []
        for h in hashes:
            block = self._block_of.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def can_allocate(self, num_tokens: int, prefix: list[int] = ()) -> bool:
        # Cached prefix blocks are taken, not spent: they leave the evictable set without leaving it short.
        reused_cached = sum(1 for b in prefix if b in self._cached)
        return self.blocks_for(num_tokens) - len(prefix) <= self.num_free_blocks - reused_cached

    def allocate(self, seq_id: str, num_tokens: int, prefix: list[int] = ()) -> list[int]:
        """A table for num_tokens tokens whose leading blocks are `prefix` (from match_prefix), shared."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already holds blocks")
        if not self.can_allocate(num_tokens, prefix):
            raise OutOfBlocks(f"need {self.blocks_for(num_tokens) - len(prefix)} KV blocks for {num_tokens} "
                              f"tokens ({len(prefix)} cached), {self.num_free_blocks} free")
        table = []
        for block in prefix:
            self._cached.pop(block, None)
            self._refs[block] += 1
            table.append(block)
        for _ in range(self.blocks_for(num_tokens) - len(prefix)):
            table.append(self._take())
        self._tables[seq_id] = table
        return table

    def _take(self) -> int:
        """A free block, else the least recently used cached one (its hash forgotten)."""
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._cached.popitem(last=False)
            del self._block_of[self._hash_of.pop(block)]
        self._refs[block] = 1
        return block

    def can_grow(self, seq_id: str, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(self._tables[seq_id]) <= self.num_free_blocks

    def grow(self, seq_id: str, num_tokens: int) -> list[int]:
        """Make the sequence's table hold `num_tokens` tokens; returns the table."""
        table = self._tables[seq_id]
        extra = self.blocks_for(num_tokens) - len(table)
        if extra > self.num_free_blocks:
            raise OutOfBlocks(f"sequence {seq_id!r} needs {extra} more KV blocks, {self.num_free_blocks} free")
        for _ in range(extra):
            table.append(self._take())
        return table

    def register(self, block: int, block_hash: bytes) -> None:
        """The block (owned, full, computed by a prefill chunk) holds the K/V that block_hash names."""
        if block_hash in self._block_of or block in self._hash_of:
            return  # the same content computed twice at once, or already named: keep the first
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block

    def free(self, seq_id: str) -> int:
        """Give up the sequence's blocks: a block nobody owns any more is cached if it has a hash, else
        free. Freeing twice is a no-op. Returns the blocks given up."""
        table = self._tables.pop(seq_id, None)
        if not table:
            return 0
        for block in reversed(table):
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            if block in self._hash_of:
                self._cached[block] = None  # most recently used last
            else:
                self._free.append(block)
        return len(table)

    def block_table(self, seq_id: str) -> list[int]:
        return self._tables[seq_id]

    def holds(self, seq_id: str) -> bool:
        return seq_id in self._tables

    def check_integrity(self) -> None:
        """Owned + cached + free = total, every block in one place, reference counts right."""
        owners = collections.Counter(b for table in self._tables.values() for b in table)
        owned, cached, free = set(owners), set(self._cached), set(self._free)
        assert len(free) == len(self._free), "KV pool: a block is free twice"
        assert len(owned) + len(cached) + len(free) == self.num_blocks, (
            f"KV pool: {len(free)} free + {len(cached)} cached + {len(owned)} owned != {self.num_blocks} total")
        assert not (owned & cached or owned & free or cached & free), "KV pool: a block is in two places"
        assert all(0 <= b < self.num_blocks for b in owned | cached | free), "KV pool: block id out of range"
        assert all(self._refs[b] == n for b, n in owners.items()), "KV pool: a reference count is wrong"
        assert all(b in self._hash_of for b in cached), "KV pool: a cached block has no hash"
        assert all(self._block_of[h] == b for b, h in self._hash_of.items()), "KV pool: hash maps disagree"


class KVCache:
    """The K/V tensors behind a BlockPool: [layers, num_blocks * block_size + 1, 2, kv_heads, head_dim].

    K and V of a slot sit side by side, so a layer writes a step's K/V in one op and a decode
    step gathers a context's K/V in one op. The wire layout is [layers, 2, tokens, ...].
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        # One slot past the last block, never written: attention pads a row's context with it. A
        # masked slot weighs 0, but 0 * inf and 0 * NaN are NaN, so padding over blocks holding
        # non-finite K/V (a bad push, a previous owner's) would poison the row; zeros add nothing.
        self.null_slot = num_blocks * block_size
        shape = (config.num_layers, num_blocks * block_size + 1, 2, config.num_kv_heads, config.head_dim)
        # On the CPU in huge pages (common/engine/pages.py): a long context's decode reads its K/V every step.
        try:
            self.kv = pages.zeros(shape, dtype) if torch.device(device).type == "cpu" else torch.zeros(
                shape, dtype=dtype, device=device)
        except (MemoryError, RuntimeError) as exc:  # RuntimeError: torch's allocator, off the CPU
            gib = math.prod(shape) * dtype.itemsize / 2 ** 30
            raise MemoryError(
                f"the KV pool ({num_blocks} blocks of {block_size} tokens, {gib:.2f} GiB) does not fit in memory "
                f"({exc}); give the worker a smaller KV budget (decode: --kv-memory-gib, HANDOFF_KV_MEMORY_GIB) "
                "or more memory") from exc

    @property
    def kv_bytes(self) -> int:
        """Bytes of the pool's blocks (the null slot, one token's worth, is not counted)."""
        return self.kv[:, :self.null_slot].numel() * self.kv.element_size()

    def slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        """Flat slot index of every token position in [start, end) of a sequence."""
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def _slot_index(self, seq_id: str, start: int, end: int) -> torch.Tensor:
        """The flat slots of positions start .. end-1 of a sequence, as an index on the pool's device."""
        return torch.tensor(self.slots(self.pool.block_table(seq_id), start, end), dtype=torch.long,
                            device=self.kv.device)

    def export_seq(self, seq_id: str, num_tokens: int, start: int = 0) -> torch.Tensor:
        """A host copy of one sequence's K/V of positions start .. num_tokens-1: [layers, 2, tokens, kv_heads,
        head_dim], on the CPU wherever the pool is. What a push sends: the thread that encodes it makes no
        device call, and a copy the engine has synchronized cannot be overwritten by a later step."""
        kv = self.kv.index_select(1, self._slot_index(seq_id, start, num_tokens)).transpose(1, 2)
        return kv.contiguous() if kv.device.type == "cpu" else to_host(kv)

    def import_seq(self, seq_id: str, kv: torch.Tensor, start: int = 0) -> None:
        """Write K/V of positions start .. start+tokens-1 of a sequence (already allocated) into its blocks.
        kv may be anywhere (the wire's host buffer, a caller's tensor): it is copied to the pool's device
        and dtype first, so that a K/V that cannot go there fails here, before the pool is written."""
        idx = self._slot_index(seq_id, start, start + kv.shape[2])
        self.kv.index_copy_(1, idx, to_device(kv, self.kv.device, self.kv.dtype).transpose(1, 2))


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of a device tensor, ready to read when this returns. From CUDA it lands in page-locked
    memory (a direct DMA, no staging through a pageable bounce buffer), and only the copy's stream is waited
    for, not the whole device."""
    if t.device.type != "cuda":
        return t.to("cpu")
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    torch.cuda.current_stream(t.device).synchronize()
    return host


def to_device(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """t on `device` in `dtype`, copied explicitly. A page-locked host tensor goes to CUDA asynchronously
    (torch's pinned allocator keeps its block until the copy is done); a pageable one synchronously."""
    non_blocking = device.type == "cuda" and t.device.type == "cpu" and t.is_pinned()
    return t.to(device=device, dtype=dtype, non_blocking=non_blocking)
