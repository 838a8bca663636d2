"""The paged KV pool under random operations (a hypothesis state machine against a plain model of it),
check_integrity() on corrupted pools, and the K/V export/import round trip."""
from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from common.engine.kv_cache import BlockPool, KVCache, OutOfBlocks
from tests.support.checkpoints import TINY

NUM_BLOCKS, BLOCK = 12, 4


class PoolMachine(RuleBasedStateMachine):
    """Every operation on the pool, checked against `held`: seq_id -> blocks it must hold."""

    seqs = Bundle("seqs")

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS, BLOCK)
        self.held: dict[str, int] = {}
        self.counter = 0

    def _blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // BLOCK)

    @rule(target=seqs, num_tokens=st.integers(0, NUM_BLOCKS * BLOCK + 5))
    def allocate(self, num_tokens):
        seq_id = f"s{self.counter}"
        self.counter += 1
        free_before = self.pool.num_free_blocks
        answer = self.pool.can_allocate(num_tokens)
        assert self.pool.num_free_blocks == free_before  # a query never mutates
        assert answer == (self._blocks(num_tokens) <= free_before)
        if answer:
            table = self.pool.allocate(seq_id, num_tokens)
            assert len(table) == self._blocks(num_tokens)
            self.held[seq_id] = len(table)
        else:  # can_allocate said no: allocate must refuse too, and leave nothing behind
            with pytest.raises(OutOfBlocks):
                self.pool.allocate(seq_id, num_tokens)
            assert not self.pool.holds(seq_id) and self.pool.num_free_blocks == free_before
        return seq_id

    @rule(seq_id=seqs, num_tokens=st.integers(0, NUM_BLOCKS * BLOCK + 5))
    def grow(self, seq_id, num_tokens):
        if seq_id not in self.held:
            return
        free_before = self.pool.num_free_blocks
        answer = self.pool.can_grow(seq_id, num_tokens)
        assert answer == (self._blocks(num_tokens) - self.held[seq_id] <= free_before)
        old = list(self.pool.block_table(seq_id))
        if answer:
            table = self.pool.grow(seq_id, num_tokens)
            assert table[:len(old)] == old  # growing never moves the blocks already written
            self.held[seq_id] = max(self.held[seq_id], self._blocks(num_tokens))
            assert len(table) == self.held[seq_id]
        else:
            with pytest.raises(OutOfBlocks):
                self.pool.grow(seq_id, num_tokens)
            assert self.pool.block_table(seq_id) == old and self.pool.num_free_blocks == free_before

    @rule(seq_id=consumes(seqs))
    def free(self, seq_id):
        expected = self.held.pop(seq_id, 0)
        assert self.pool.free(seq_id) == expected
        assert self.pool.free(seq_id) == 0  # twice: a no-op
        assert not self.pool.holds(seq_id)

    @rule()
    def free_unknown(self):
        free_before = self.pool.num_free_blocks
        assert self.pool.free("never-allocated") == 0
        assert self.pool.num_free_blocks == free_before

    @invariant()
    def consistent(self):
        self.pool.check_integrity()
        assert self.pool.num_used_blocks == sum(self.held.values())
        assert self.pool.num_free_blocks == NUM_BLOCKS - sum(self.held.values())
        assert self.pool.num_seqs == len(self.held)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_everything_freed_returns_to_full_pool():
    pool = BlockPool(NUM_BLOCKS, BLOCK)
    pool.allocate("a", 9)
    pool.allocate("b", 1)
    pool.grow("a", 17)
    assert pool.num_free_blocks == NUM_BLOCKS - 6
    assert pool.free("a") == 5 and pool.free("b") == 1 and pool.free("a") == 0
    assert pool.num_free_blocks == NUM_BLOCKS
    pool.check_integrity()
    pool.allocate("c", 1)
    with pytest.raises(ValueError, match="already holds"):
        pool.allocate("c", 1)


@pytest.mark.parametrize("bad", [(0, 4), (4, 0), (-1, 4)])
def test_pool_rejects_non_positive_sizes(bad):
    with pytest.raises(ValueError, match="must be positive"):
        BlockPool(*bad)


# --------------------------------------------------------------------------- check_integrity detects damage

def _busy_pool() -> BlockPool:
    pool = BlockPool(NUM_BLOCKS, BLOCK)
    pool.allocate("a", 9)
    pool.allocate("b", 5)
    pool.check_integrity()
    return pool


def test_integrity_detects_block_freed_twice():
    pool = _busy_pool()
    pool._free.append(pool._free[-1])  # a free block pushed a second time
    with pytest.raises(AssertionError, match="free twice"):
        pool.check_integrity()


def test_integrity_detects_block_owned_and_free():
    pool = _busy_pool()
    pool._free[0] = pool.block_table("a")[0]  # count still adds up, but one block is in two places
    with pytest.raises(AssertionError, match="in two places"):
        pool.check_integrity()


def test_integrity_detects_block_owned_by_two_sequences():
    pool = _busy_pool()
    pool.block_table("b").append(pool.block_table("a")[0])  # shared without counting the second owner
    pool._free.pop()
    with pytest.raises(AssertionError, match="reference count is wrong|free .* owned != 12 total"):
        pool.check_integrity()


def test_integrity_detects_out_of_range_block_id():
    pool = _busy_pool()
    pool._free[0] = NUM_BLOCKS + 3
    with pytest.raises(AssertionError, match="out of range"):
        pool.check_integrity()


def test_integrity_detects_lost_block():
    pool = _busy_pool()
    pool._free.pop()  # leaked: neither free nor owned
    with pytest.raises(AssertionError, match="free .* owned != 12 total"):
        pool.check_integrity()


# --------------------------------------------------------------------------- export / import


def _fragmented_cache(dtype=torch.float32) -> KVCache:
    """A cache whose next allocations get non-contiguous, out-of-order blocks."""
    cache = KVCache(TINY, num_blocks=10, block_size=BLOCK, dtype=dtype)
    pool = cache.pool
    for name in ("w", "x", "y", "z"):
        pool.allocate(name, BLOCK)
    pool.free("w")
    pool.free("y")
    return cache


def test_export_import_round_trip():
    """Through the public API only, so the test holds for any internal layout of `kv`."""
    torch.manual_seed(0)
    src = _fragmented_cache()
    src.kv.normal_()
    num_tokens = 11  # three blocks, the last one partly used
    table = src.pool.allocate("s", num_tokens + 1)
    assert table != list(range(table[0], table[0] + len(table)))  # scattered, as a busy pool hands them out
    kv = src.export_seq("s", num_tokens)
    assert kv.shape == (TINY.num_layers, 2, num_tokens, TINY.num_kv_heads, TINY.head_dim)
    assert torch.equal(src.export_seq("s", 5), kv[:, :, :5])  # position p is the same slot however many
    kv_copy = kv.clone()
    src.kv.zero_()  # export is a copy, not a view of the cache
    assert torch.equal(kv, kv_copy)

    dst = KVCache(TINY, num_blocks=10, block_size=BLOCK, dtype=torch.float32)
    other = torch.randn(TINY.num_layers, 2, 6, TINY.num_kv_heads, TINY.head_dim)
    dst.pool.allocate("other", 6)
    dst.import_seq("other", other)
    dst.pool.allocate("s", num_tokens + 1)
    assert dst.pool.block_table("s") != table
    dst.import_seq("s", kv)
    assert torch.equal(dst.export_seq("s", num_tokens), kv)
    assert torch.equal(dst.export_seq("other", 6), other)  # a neighbour's K/V is untouched
    # Nothing but the two sequences' tokens was written (random values are nonzero).
    assert torch.count_nonzero(dst.kv) == kv.numel() + other.numel()


def test_import_converts_dtype():
    torch.manual_seed(1)
    kv = torch.randn(TINY.num_layers, 2, 5, TINY.num_kv_heads, TINY.head_dim)
    dst = _fragmented_cache(torch.bfloat16)
    dst.pool.allocate("s", 5)
    dst.import_seq("s", kv)
    out = dst.export_seq("s", 5)
    assert out.dtype == torch.bfloat16 and torch.equal(out, kv.to(torch.bfloat16))


def test_kv_bytes():
    cache = KVCache(TINY, num_blocks=10, block_size=BLOCK, dtype=torch.bfloat16)
    assert cache.kv_bytes == 10 * BLOCK * TINY.kv_bytes_per_token(2) == 10 * 4 * 2 * 3 * 2 * 4 * 2
