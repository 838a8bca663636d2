"""The paged KV cache: a pool of fixed-size blocks, block tables per sequence, and the tensors."""
from __future__ import annotations

import torch

from common.engine.config import ModelConfig


class OutOfBlocks(RuntimeError):
    """The pool has too few free blocks; callers check can_allocate() first to avoid it."""


class BlockPool:
    """Allocator of KV blocks; a sequence owns an ordered block table.

    Queries never mutate: `can_allocate()` answers, only then `allocate()` changes
    state, so a failure never leaves half an allocation behind.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Popping from the end hands out low block ids first (friendlier to read in dumps).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_seqs(self) -> int:
        return len(self._tables)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= len(self._free)

    def allocate(self, seq_id: str, num_tokens: int) -> list[int]:
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already holds blocks")
        n = self.blocks_for(num_tokens)
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} KV blocks for {num_tokens} tokens, {len(self._free)} free")
        table = [self._free.pop() for _ in range(n)]
        self._tables[seq_id] = table
        return table

    def can_grow(self, seq_id: str, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(self._tables[seq_id]) <= len(self._free)

    def grow(self, seq_id: str, num_tokens: int) -> list[int]:
        """Make the sequence's table hold `num_tokens` tokens; returns the table."""
        table = self._tables[seq_id]
        extra = self.blocks_for(num_tokens) - len(table)
        if extra > len(self._free):
            raise OutOfBlocks(f"sequence {seq_id!r} needs {extra} more KV blocks, {len(self._free)} free")
        for _ in range(extra):
            table.append(self._free.pop())
        return table

    def free(self, seq_id: str) -> int:
        """Return the sequence's blocks to the pool; freeing twice is a no-op. Returns blocks freed."""
        table = self._tables.pop(seq_id, None)
        if not table:
            return 0
        self._free.extend(reversed(table))
        return len(table)

    def block_table(self, seq_id: str) -> list[int]:
        return self._tables[seq_id]

    def holds(self, seq_id: str) -> bool:
        return seq_id in self._tables

    def check_integrity(self) -> None:
        """Free + used = total and no block owned twice; raises AssertionError otherwise."""
        owned = [b for table in self._tables.values() for b in table]
        every = owned + self._free
        assert len(every) == self.num_blocks, (
            f"KV pool: {len(self._free)} free + {len(owned)} used != {self.num_blocks} total")
        assert len(set(every)) == self.num_blocks, "KV pool: a block is owned twice or both owned and free"
        assert all(0 <= b < self.num_blocks for b in every), "KV pool: block id out of range"


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
        self.kv = torch.zeros(config.num_layers, num_blocks * block_size + 1, 2, config.num_kv_heads,
                              config.head_dim, dtype=dtype, device=device)

    @property
    def kv_bytes(self) -> int:
        """Bytes of the pool's blocks (the null slot, one token's worth, is not counted)."""
        return self.kv[:, :self.null_slot].numel() * self.kv.element_size()

    def slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        """Flat slot index of every token position in [start, end) of a sequence."""
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def export_seq(self, seq_id: str, num_tokens: int) -> torch.Tensor:
        """A copy of one sequence's K/V: [layers, 2, num_tokens, kv_heads, head_dim]."""
        idx = torch.tensor(self.slots(self.pool.block_table(seq_id), 0, num_tokens),
                           dtype=torch.long, device=self.kv.device)
        return self.kv.index_select(1, idx).transpose(1, 2).contiguous()

    def import_seq(self, seq_id: str, kv: torch.Tensor) -> None:
        """Write a sequence's K/V (already allocated in the pool) into its blocks."""
        num_tokens = kv.shape[2]
        idx = torch.tensor(self.slots(self.pool.block_table(seq_id), 0, num_tokens),
                           dtype=torch.long, device=self.kv.device)
        self.kv.index_copy_(1, idx, kv.to(self.kv.dtype).transpose(1, 2))
