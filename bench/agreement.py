"""python -m bench.agreement: greedy tokens of ours against llama.cpp's on the same quantized file, every family.

    python -m bench.agreement                      # every family of the zoo, every file type (a few minutes)
    python -m bench.agreement --archs qwen3 gemma2 --qtypes Q4_K_M --tokens 64

For each small architecture of the model zoo (bench/zoo: random-weight models made with HF transformers and
converted and quantized by llama.cpp's own tools; `make llama-tools` first) and each of its GGUF files, both
systems decode greedily from the same prompt ids (a chat prompt, tokenized by transformers): ours as the
service runs it (the default dtype, packed decode), llama.cpp through its C API (bench/shapes.py's
LlamaCppBatched, its defaults). One JSON line a file: how many tokens agree before the first difference,
and at that difference the margin, in our logits, between our token and llama.cpp's (a small margin: a near
tie, which the two sides' different arithmetic decides differently; llama.cpp quantizes activations to 8
bits for these formats, ours to 16).

Random weights make flatter distributions than trained ones, so near ties come sooner than in a real model:
read the figures as a check that both read the same model, not as a rate of disagreement in service.
"""
from __future__ import annotations

import argparse
import json

import torch

from bench import llamacpp
from bench.harness import emit_machine, emit_skipped, log


def ours_greedy(path, ids: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """n greedy tokens and each step's logits, from ModelRunner as a worker loads the file."""
    from common.engine.runner import DecodeItem, ModelRunner, PrefillItem

    runner = ModelRunner.load(path, num_blocks=-(-(len(ids) + n + 1) // 16) + 1, progress=False)
    runner.cache.pool.allocate("a", len(ids) + n + 1)
    logits = runner.prefill([PrefillItem("a", ids)])[0]
    out, rows = [], []
    for i in range(n):
        rows.append(logits)
        out.append(int(logits.argmax()))
        logits = runner.decode([DecodeItem("a", out[-1], len(ids) + i)])[0]
    return out, rows


def llama_greedy(path, ids: list[int], n: int, threads: int) -> list[int]:
    from bench.shapes import LlamaCppBatched

    peer = LlamaCppBatched(path, threads, len(ids) + n + 16)
    try:
        out = [peer.prefill(ids)]
        for i in range(n - 1):
            peer._decode([out[-1]], [len(ids) + i], [0], [True])
            out.append(peer.argmax(-1))
        return out
    finally:
        peer.close()


def main(argv: list[str] | None = None) -> None:
    from bench import llama_tools, zoo

    p = argparse.ArgumentParser(prog="python -m bench.agreement", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--archs", nargs="+", default=list(zoo.ARCHS), choices=zoo.ARCHS)
    p.add_argument("--qtypes", nargs="+", default=[q for q in zoo.QTYPES], choices=zoo.QTYPES)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    for why, how in ((llamacpp.missing_reason(), llamacpp.HOW_TO_GET),
                     (llama_tools.missing(), "`make llama-tools` builds llama.cpp's converter and quantizer")):
        if why is not None:
            emit_skipped("agreement", why, how)
            return
    emit_machine(threads=args.threads)
    for arch in args.archs:
        files = zoo.build(arch)
        ids = zoo.sample_ids(files.hf_dir)
        for qtype in args.qtypes:
            path = files[qtype]
            log(f"{path.name}")
            ours, rows = ours_greedy(path, ids, args.tokens)
            theirs = llama_greedy(path, ids, args.tokens, args.threads)
            same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), args.tokens)
            rec = {"name": "greedy_agreement", "arch": arch, "file": qtype, "prompt_tokens": len(ids),
                   "tokens": args.tokens, "agree_before_first_difference": same}
            if same < args.tokens:
                row = rows[same]
                rec["margin_at_difference"] = round(float(row[ours[same]] - row[theirs[same]]), 5)
                rec["our_logit_spread"] = round(float(row.std()), 4)  # the scale the margin is small against
            print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
