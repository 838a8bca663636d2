"""The K-quant and Q8_0 kernels on a decode step's matmuls: a step-like sequence (each layer's wqkv, wo, w13,
w2) at Llama-3.2-1B or Llama-3.1-8B shapes, per weight format, against a plain read of the same bytes and
against the Q4_0 digit kernel.

    python -m bench.kquant_step --model 8b --rows 1 8 32 --rounds 15

Weights are random but valid blocks (sane fp16 scales), packed as the decode worker packs a file's
(pack_quant; Q4_0 by pack_q4's digits layout), in enough layers to be several times the L3 cache, so each
pass streams them from memory. The formats and a plain read (bench/bandwidth.py's row sum over as many
bytes) alternate in one process, pass by pass, so that a shared host's load falls on all of them alike;
the figures are medians over the rounds, with the fastest and slowest pass.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from bench.bandwidth import ReadBandwidth
from common.engine import native
from common.engine.native.packing import pack_q4, pack_quant, quant_block
from common.engine.weights import QuantRows

# hidden, ffn, query heads, kv heads, head dim; layers enough to stream from memory (several x a 32 MiB L3)
SHAPES = {"1b": (2048, 8192, 32, 8, 64, 6), "8b": (4096, 14336, 32, 8, 128, 2)}
FORMATS = ("Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def random_rows(qtype: str, out_features: int, in_features: int, rng: np.random.Generator) -> QuantRows:
    """Random blocks of `qtype` whose fp16 scales are sane (random bytes elsewhere: any code, 6-bit scale...)."""
    inputs, nbytes = quant_block(qtype)
    blocks = rng.integers(0, 256, (out_features, in_features // inputs, nbytes), dtype=np.uint8)
    halves = {"Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}[qtype]
    for at in halves:
        d = rng.uniform(0.0, 0.002, blocks.shape[:2]).astype(np.float16)
        blocks[:, :, at:at + 2] = d.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return QuantRows(qtype, blocks.reshape(out_features, -1), in_features)


def step_weights(model: str, qtype: str, rng: np.random.Generator) -> list[tuple[torch.Tensor, int, int]]:
    """(packed, out, in) of every matmul of the model's step layers, in the order a step runs them."""
    hidden, ffn, heads, kv_heads, head_dim, layers = SHAPES[model]
    shapes = [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, heads * head_dim), (2 * ffn, hidden),
              (hidden, ffn)] * layers
    weights = []
    for out_features, in_features in shapes:
        if qtype == "Q4_0":
            codes = rng.integers(0, 16, (out_features, in_features), dtype=np.uint8)
            d = rng.uniform(0.0, 0.002, (out_features, in_features // 32)).astype(np.float16).astype(np.float32)
            weights.append((pack_q4(codes, d, -8 * d, layout="digits"), out_features, in_features))
        else:
            weights.append((pack_quant(random_rows(qtype, out_features, in_features, rng)), out_features, in_features))
    return weights


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kquant_step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=SHAPES, default="8b")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--unit", choices=("vnni", "avx2"), default="vnni")
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    parser.add_argument("--threads", type=int, default=None, help="torch's (and the kernels') threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    k = native.kernel()
    if k is None or not k.has_quant or (args.unit == "vnni" and not k.has_vnni):
        raise SystemExit(f"this library or CPU has no {args.unit} unit for the K-quants")
    rng = np.random.default_rng(0)
    weights = {qtype: step_weights(args.model, qtype, rng) for qtype in args.formats}
    nbytes = {qtype: sum(p.numel() for p, _, _ in ws) for qtype, ws in weights.items()}
    read = ReadBandwidth(max(nbytes.values()))
    sizes = ", ".join(f"{q} {b / 1e6:.0f}" for q, b in nbytes.items())
    print(f"{args.model}, {args.unit} unit, {torch.get_num_threads()} threads; weights a step (MB): {sizes}; "
          f"plain read of {read.num_bytes / 1e6:.0f} MB")

    def run(qtype: str, x: dict[int, torch.Tensor]) -> None:
        for packed, out_features, in_features in weights[qtype]:
            if qtype == "Q4_0":
                k.q4_matmul(x[in_features], packed, out_features, kernel=args.unit)
            else:
                k.quant_matmul(x[in_features], packed, qtype, out_features, args.unit)

    for rows in args.rows:
        gen = torch.Generator().manual_seed(rows)
        x = {n: torch.randn(rows, n, generator=gen).to(torch.bfloat16) for _, _, n in weights[args.formats[0]]}
        times: dict[str, list[float]] = {q: [] for q in args.formats}
        reads: list[float] = []
        for qtype in args.formats:  # one warm-up pass each
            run(qtype, x)
        for _ in range(args.rounds):
            for qtype in args.formats:
                t0 = time.perf_counter()
                run(qtype, x)
                times[qtype].append(time.perf_counter() - t0)
            if rows == 1:
                reads.append(read.one_pass())
        line = [f"rows {rows:2d}:"]
        for qtype in args.formats:
            t = times[qtype]
            med = statistics.median(t)
            line.append(f"{qtype} {med * 1e3:6.1f} ms [{min(t) * 1e3:.1f}-{max(t) * 1e3:.1f}] "
                        f"{nbytes[qtype] / med / 1e9:5.1f} GB/s")
        if reads:
            med = statistics.median(reads)
            line.append(f"read {read.num_bytes / med / 1e9:5.1f} GB/s [{read.num_bytes / max(reads) / 1e9:.1f}-"
                        f"{read.num_bytes / min(reads) / 1e9:.1f}]")
        print("  ".join(line), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
