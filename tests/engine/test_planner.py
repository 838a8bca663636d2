"""The KV memory planner: exact byte counts for known shapes, blocks for a budget, and the CLI."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from common.engine.planner import kv_bytes_per_token, plan

GIB = 1 << 30


def test_grok1_8k_sequence_is_2_gib():
    # Grok-1: 64 layers, 8 KV heads of 128, bf16 → 256 KiB per token.
    p = plan(64, 8, 128, 2, memory_bytes=80 * GIB, seq_len=8192)
    assert p.kv_bytes_per_token == 2 * 64 * 8 * 128 * 2 == 262_144
    assert p.seq_kv_bytes == 2_147_483_648
    assert p.kv_bytes_per_block == 16 * 262_144
    assert p.num_blocks == 80 * GIB // (16 * 262_144) == 20_480
    assert p.num_tokens == 327_680
    assert p.max_seqs == 40


def test_smollm2_bytes_per_token(smollm2_weights):
    config = smollm2_weights.config  # read from the GGUF's metadata
    assert (config.num_layers, config.num_kv_heads, config.head_dim) == (30, 3, 64)
    assert kv_bytes_per_token(30, 3, 64, 2) == config.kv_bytes_per_token(2) == 23_040
    assert config.kv_bytes_per_token(4) == 46_080


@pytest.mark.parametrize("memory_bytes, num_blocks", [
    (GIB, 2912),  # 1 GiB / 368,640 bytes per block = 2912.7
    (368_640 * 100, 100),  # an exact multiple
    (368_640 * 100 - 1, 99),  # one byte short of the 100th block
    (368_639, 0),
    (0, 0),
])
def test_num_blocks_for_a_budget(memory_bytes, num_blocks):
    p = plan(30, 3, 64, 2, memory_bytes, block_size=16, seq_len=2048)
    assert p.kv_bytes_per_block == 368_640
    assert p.num_blocks == num_blocks
    assert p.num_tokens == num_blocks * 16
    assert p.max_seqs == num_blocks // 128  # 2048 tokens = 128 blocks
    assert p.num_blocks * p.kv_bytes_per_block <= memory_bytes < (p.num_blocks + 1) * p.kv_bytes_per_block


def test_partial_block_rounds_up_per_sequence():
    # 100 tokens in blocks of 16 need 7 blocks: 63 blocks hold 9 such sequences, not 10.
    p = plan(1, 1, 2, 1, memory_bytes=63 * 16 * 4, block_size=16, seq_len=100)
    assert p.num_blocks == 63 and p.max_seqs == 9 and p.seq_kv_bytes == 400


@pytest.mark.parametrize("kw, message", [
    (dict(num_layers=0), "num_layers must be positive"),
    (dict(num_kv_heads=-1), "num_kv_heads must be positive"),
    (dict(head_dim=0), "head_dim must be positive"),
    (dict(block_size=0), "block_size must be positive"),
    (dict(seq_len=0), "seq_len must be positive"),
    (dict(memory_bytes=-1), "memory budget must be non-negative"),
])
def test_plan_rejects_bad_numbers(kw, message):
    args = dict(num_layers=30, num_kv_heads=3, head_dim=64, dtype_bytes=2, memory_bytes=GIB) | kw
    with pytest.raises(ValueError, match=message):
        plan(**args)


# --------------------------------------------------------------------------- the CLI

def planner(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "common.engine.planner", *args], capture_output=True, text=True,
                          timeout=120)


def test_cli_model_smollm2():
    out = planner("--model", "smollm2", "--memory-gib", "2")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1  # one JSON line, nothing else on stdout
    result = json.loads(lines[0])
    assert result["layers"] == 30 and result["kv_heads"] == 3 and result["head_dim"] == 64
    assert result["dtype"] == "bf16" and result["kv_bytes_per_token"] == 23_040
    assert result["num_blocks"] == 2 * GIB // 368_640 == 5825


def test_cli_numbers_grok1():
    out = planner("--layers", "64", "--kv-heads", "8", "--head-dim", "128", "--dtype", "bf16", "--tokens", "8192",
                  "--memory-gib", "16")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["seq_kv_bytes"] == 2_147_483_648 and result["seq_kv_gib"] == 2.0
    assert result["seq_len"] == 8192 and result["max_seqs"] == 8 and result["num_blocks"] == 4096


def test_cli_fp32_doubles_bytes():
    out = planner("--layers", "30", "--kv-heads", "3", "--head-dim", "64", "--dtype", "fp32")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["kv_bytes_per_token"] == 46_080


@pytest.mark.parametrize("args, message", [
    (["--layers", "0", "--kv-heads", "8", "--head-dim", "128"], "num_layers must be positive"),
    (["--layers", "64", "--kv-heads", "-8", "--head-dim", "128"], "num_kv_heads must be positive"),
    (["--layers", "64", "--kv-heads", "8", "--head-dim", "128", "--memory-gib", "-1"], "must be non-negative"),
    (["--layers", "64", "--kv-heads", "8", "--head-dim", "128", "--tokens", "0"], "seq_len must be positive"),
    (["--layers", "64", "--kv-heads", "8", "--head-dim", "128", "--block-size", "0"], "block_size must be positive"),
    (["--layers", "sixty", "--kv-heads", "8", "--head-dim", "128"], "invalid int value: 'sixty'"),
    (["--layers", "64", "--kv-heads", "8"], "give --model, or all of"),
    (["--layers", "64", "--kv-heads", "8", "--head-dim", "128", "--dtype", "int3"], "invalid choice: 'int3'"),
    (["--layers", "64", "--kv-heads", "8", "--head-dim", "128", "--memory-gib", "inf"], "inf"),
    (["--layers", "64", "--kv-heads", "8", "--head-dim", "128", "--memory-gib", "nan"], "nan"),
], ids=["layers0", "kv_heads_neg", "memory_neg", "tokens0", "block0", "not_int", "missing_dim", "dtype",
        "memory_inf", "memory_nan"])
def test_cli_bad_numbers(args, message):
    out = planner(*args)
    assert out.returncode != 0
    assert out.stdout == ""
    assert "Traceback" not in out.stderr, out.stderr
    errors = [line for line in out.stderr.splitlines() if ": error: " in line]  # argparse's, after the usage
    assert len(errors) == 1 and message.lower() in errors[0].lower(), out.stderr


def test_cli_missing_model(tmp_path):
    missing = tmp_path / "missing.gguf"
    out = planner("--model", str(missing))
    assert out.returncode != 0
    assert "Traceback" not in out.stderr, out.stderr
    assert str(missing) in out.stderr and "no such file" in out.stderr


# The benchmark shapes' KV sizes, from the models' published configs (bf16 K and V, every layer):
# Llama 3.2 1B 16 x 8 x 64, Qwen 2.5 3B 36 x 2 x 128, Llama 3.1 8B 32 x 8 x 128.
BIG_KV_BYTES_PER_TOKEN = {"llama-3.2-1b": 32_768, "qwen2.5-3b": 36_864, "llama-3.1-8b": 131_072}


@pytest.mark.parametrize("shape", sorted(BIG_KV_BYTES_PER_TOKEN))
def test_the_benchmark_shapes_files_are_planned_from_what_they_say(shape):
    """python -m common.engine.planner on a benchmark shape's GGUF (bench/zoo/big.py) reads its dimensions
    from the file; where the file is not built, from the shape's numbers (the same as the file writes)."""
    from bench.zoo.big import BIG_SHAPES, big_dir

    spec = BIG_SHAPES[shape]
    files = sorted(big_dir(shape).glob(f"{shape}.*.gguf")) if big_dir(shape).is_dir() else []
    args = (["--model", str(files[0])] if files else
            ["--layers", str(spec["layers"]), "--kv-heads", str(spec["kv_heads"]), "--head-dim", str(spec["head_dim"])])
    out = planner(*args, "--dtype", "bf16", "--memory-gib", "1", "--tokens", "8192")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    per_token = BIG_KV_BYTES_PER_TOKEN[shape]
    assert (result["layers"], result["kv_heads"], result["head_dim"]) == (spec["layers"], spec["kv_heads"],
                                                                         spec["head_dim"])
    assert result["kv_bytes_per_token"] == per_token
    assert result["seq_kv_bytes"] == 8192 * per_token and result["max_seqs"] == GIB // (8192 * per_token)
