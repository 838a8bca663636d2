"""The KV memory planner: how many blocks and sequences fit in a memory budget.

    python -m common.engine.planner --model smollm2 --memory-gib 2
    python -m common.engine.planner --layers 64 --kv-heads 8 --head-dim 128 --dtype bf16 --tokens 8192
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}  # the KV dtypes a worker serves (--dtype, common/settings.py)


@dataclass(frozen=True)
class KVPlan:
    kv_bytes_per_token: int  # 2 (K and V) x layers x kv_heads x head_dim x bytes
    block_size: int
    kv_bytes_per_block: int
    num_blocks: int  # blocks that fit in the budget
    num_tokens: int  # tokens those blocks hold
    seq_len: int  # the sequence length the next figures are for
    seq_kv_bytes: int  # one sequence of seq_len tokens
    max_seqs: int  # sequences of seq_len tokens that fit at once


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def plan(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int, memory_bytes: int,
         block_size: int = 16, seq_len: int = 2048) -> KVPlan:
    for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                    ("dtype_bytes", dtype_bytes), ("block_size", block_size), ("seq_len", seq_len)):
        if v <= 0:
            raise ValueError(f"{name} must be positive, got {v}")
    if memory_bytes < 0:
        raise ValueError(f"memory budget must be non-negative, got {memory_bytes}")
    per_token = kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype_bytes)
    per_block = per_token * block_size
    num_blocks = memory_bytes // per_block
    blocks_per_seq = -(-seq_len // block_size)
    return KVPlan(per_token, block_size, per_block, num_blocks, num_blocks * block_size, seq_len,
                  per_token * seq_len, num_blocks // blocks_per_seq)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a .gguf file, HF folder or short name; its shape is read from it")
    p.add_argument("--layers", type=int)
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--head-dim", type=int)
    p.add_argument("--dtype", default="bf16", choices=tuple(DTYPE_BYTES),
                   help="the KV dtype: what --dtype auto gives on a GPU or a CPU with native bf16 (default bf16)")
    p.add_argument("--memory-gib", type=float, default=1.0, help="KV memory budget (a decode worker's --kv-memory-gib)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--tokens", type=int, default=2048, help="sequence length for the per-sequence figures")
    args = p.parse_args(argv)
    if not math.isfinite(args.memory_gib):
        p.error(f"--memory-gib must be a finite number, got {args.memory_gib}")
    if args.model:
        from common.engine.model_files import ModelNotFoundError
        from common.engine.weights import ModelLoadError, read_model_config
        try:
            cfg = read_model_config(args.model)
        except (ModelNotFoundError, ModelLoadError) as exc:
            p.error(str(exc))
        shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    elif None in (args.layers, args.kv_heads, args.head_dim):
        p.error("give --model, or all of --layers, --kv-heads and --head-dim")
    else:
        shape = (args.layers, args.kv_heads, args.head_dim)
    try:
        result = plan(*shape, DTYPE_BYTES[args.dtype], int(args.memory_gib * (1 << 30)),
                      args.block_size, args.tokens)
    except (ValueError, OverflowError) as exc:  # OverflowError: --memory-gib inf
        p.error(str(exc))
    out = {"layers": shape[0], "kv_heads": shape[1], "head_dim": shape[2], "dtype": args.dtype,
           "memory_gib": args.memory_gib, **asdict(result),
           "seq_kv_gib": round(result.seq_kv_bytes / (1 << 30), 4)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
