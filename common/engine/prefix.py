"""Names for prompt prefixes: a chained hash per full KV block, so equal prefixes find each other's K/V.

Block i's hash covers the hash of block i-1 and block i's token ids, so one hash names the whole prefix
up to the end of its block (nano-vllm's scheme). A seed ties the names to what the K/V depends on
besides the tokens: the weights, the dtype, the block size and the prefill chunk size (prefill runs in
fixed chunks, and K/V is only reused at chunk granularity, so a suffix is always computed with the
GEMM shapes a cold prefill would use: outputs do not depend on cache hits).
"""
from __future__ import annotations

import hashlib
from array import array

HASH_BYTES = 16


class PrefixHasher:
    def __init__(self, *, weights_id: str, dtype: str, block_size: int, chunk_tokens: int):
        if chunk_tokens <= 0 or chunk_tokens % block_size:
            raise ValueError(f"the prefill chunk ({chunk_tokens} tokens) must be a positive multiple of the "
                             f"KV block size ({block_size})")
        self.block_size = block_size
        self.chunk_tokens = chunk_tokens
        self.seed = hashlib.blake2b(f"{weights_id}|{dtype}|{block_size}|{chunk_tokens}".encode(),
                                    digest_size=HASH_BYTES).digest()

    @classmethod
    def from_seed(cls, seed: bytes, *, block_size: int, chunk_tokens: int) -> "PrefixHasher":
        """The hasher a worker publishes (WorkerInfo.prefix_seed), for a router that has no weights."""
        hasher = cls(weights_id="", dtype="", block_size=block_size, chunk_tokens=chunk_tokens)
        hasher.seed = seed
        return hasher

    def chunk_hashes(self, token_ids: list[int]) -> list[bytes]:
        """The hash naming each whole chunk prefix of a prompt that a cache could hold for it (the
        hash of the chunk's last block), for the chunks before its last token."""
        per_chunk = self.chunk_tokens // self.block_size
        blocks = self.block_hashes(token_ids, self.reusable_blocks(len(token_ids)))
        return blocks[per_chunk - 1::per_chunk]

    def block_hashes(self, token_ids: list[int], num_blocks: int | None = None) -> list[bytes]:
        """Chained hashes of the first num_blocks full blocks (default: every full block)."""
        bs = self.block_size
        n = len(token_ids) // bs if num_blocks is None else num_blocks
        out, prev = [], self.seed
        for i in range(n):
            prev = hashlib.blake2b(prev + array("i", token_ids[i * bs:(i + 1) * bs]).tobytes(),
                                   digest_size=HASH_BYTES).digest()
            out.append(prev)
        return out

    def chunk_blocks(self, prompt_len: int) -> int:
        """Blocks of the prompt that lie in full prefill chunks: the K/V a prompt can leave behind."""
        return prompt_len // self.chunk_tokens * self.chunk_tokens // self.block_size

    def reusable_blocks(self, prompt_len: int) -> int:
        """Blocks of full chunks before the prompt's last token: at most this much of a prompt can come
        from the cache (the last token is always computed, for its logits)."""
        return (prompt_len - 1) // self.chunk_tokens * self.chunk_tokens // self.block_size
