"""Benchmark shapes: random-weight GGUFs of real models' shapes (Llama 3.2 1B, Qwen 2.5 3B, Llama 3.1 8B), with
their real tokenizers and chat templates, quantized by llama-quantize; built on first use.

    big(shape, qtype) -> Path     <zoo>/big/<shape>-<key>/<shape>.<QTYPE>.gguf

The F16 file is written tensor by tensor (gguf_writer.py), checked by a numpy forward pass (sanity.py),
quantized to each asked type, then deleted. `<shape>.json` beside the files records their sizes, types and
build times. The shapes are the real config.json files' numbers; parameter counts come out as the real ones.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np

from bench import llama_tools
from bench.zoo.cache import cache_key, gguf_summary, log, zoo_root
from bench.zoo.specs import SCHEMA

BIG_SHAPES: dict[str, dict] = {
    # meta-llama/Llama-3.2-1B(-Instruct) config.json
    "llama-3.2-1b": {"arch": "llama", "vocab": "ggml-vocab-llama-bpe.gguf", "name": "Llama 3.2 1B",
                     "hidden": 2048, "layers": 16, "heads": 32, "kv_heads": 8, "head_dim": 64,
                     "ffn": 8192, "vocab_size": 128256, "tied": True, "qkv_bias": False,
                     "rope_theta": 500000.0, "ctx": 131072, "rms_eps": 1e-5, "write_head_dim": True,
                     "llama3_rope": {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 8192},
                     "template": "meta-llama-Llama-3.2-3B-Instruct", "eos": 128009, "add_bos": True},
    # Qwen/Qwen2.5-3B(-Instruct) config.json
    "qwen2.5-3b": {"arch": "qwen2", "vocab": "ggml-vocab-qwen2.gguf", "name": "Qwen2.5 3B",
                   "hidden": 2048, "layers": 36, "heads": 16, "kv_heads": 2, "head_dim": 128,
                   "ffn": 11008, "vocab_size": 151936, "tied": True, "qkv_bias": True,
                   "rope_theta": 1000000.0, "ctx": 32768, "rms_eps": 1e-6, "write_head_dim": False,
                   "llama3_rope": None, "template": "Qwen-Qwen2.5-7B-Instruct", "eos": 151645,
                   "add_bos": False},
    # meta-llama/Llama-3.1-8B(-Instruct) config.json
    "llama-3.1-8b": {"arch": "llama", "vocab": "ggml-vocab-llama-bpe.gguf", "name": "Llama 3.1 8B",
                     "hidden": 4096, "layers": 32, "heads": 32, "kv_heads": 8, "head_dim": 128,
                     "ffn": 14336, "vocab_size": 128256, "tied": False, "qkv_bias": False,
                     "rope_theta": 500000.0, "ctx": 131072, "rms_eps": 1e-5, "write_head_dim": False,
                     "llama3_rope": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 8192},
                     "template": "meta-llama-Llama-3.1-8B-Instruct", "eos": 128009, "add_bos": True},
}
BIG_INIT = {"emb_std": 0.02, "bias_std": 0.1, "norm_lo": 0.8, "norm_hi": 1.2}  # W ~ N(0, 1/sqrt(fan_in))


def big_key(shape: str) -> str:
    """The shape, the weights' scales, the vocabulary file's digest, llama.cpp's version."""
    sh = BIG_SHAPES[shape]
    vocab = llama_tools.ensure_src() / "models" / sh["vocab"]
    return cache_key({"schema": SCHEMA, "shape": shape, "spec": sh, "init": BIG_INIT,
                      "vocab": hashlib.sha256(vocab.read_bytes()).hexdigest()[:16],
                      "llama-cpp-python": llama_tools.LLAMA_CPP_PYTHON_VERSION,
                      "numpy_major": np.__version__.split(".")[0]})


def big_dir(shape: str) -> Path:
    return zoo_root() / "big" / f"{shape}-{big_key(shape)}"


def big(shape: str, qtype: str) -> Path:
    """The benchmark GGUF of shape in qtype (Q4_K_M, Q8_0, ... or F16), built on first use."""
    return big_all(shape, [qtype])[qtype.upper()]


def big_all(shape: str, qtypes=("Q4_K_M", "Q8_0"), keep_f16: bool = False, sanity: bool = True) -> dict[str, Path]:
    """shape's files in each of qtypes, from one F16 file (kept if asked for or keep_f16)."""
    from bench.zoo.gguf_writer import write_f16
    from bench.zoo.sanity import sanity_forward

    if shape not in BIG_SHAPES:
        raise KeyError(f"unknown shape {shape!r}; one of {tuple(BIG_SHAPES)}")
    qtypes = [q.upper() for q in qtypes]
    d = big_dir(shape)
    d.mkdir(parents=True, exist_ok=True)
    paths = {q: d / f"{shape}.{q}.gguf" for q in qtypes}
    todo = [q for q, p in paths.items() if not p.is_file()]
    if not todo:
        return paths
    rec_path = d / f"{shape}.json"
    rec = json.loads(rec_path.read_text()) if rec_path.is_file() else {"shape": shape, "spec": BIG_SHAPES[shape]}
    f16 = d / f"{shape}.F16.gguf"
    if not f16.is_file():
        llama_tools.ensure_quantize()  # before an F16 file that could not be quantized is written
        part = f16.with_name(f16.name + ".part")
        log(f"writing {f16}")
        t0 = time.time()
        info = write_f16(BIG_SHAPES[shape], BIG_INIT, part)
        os.replace(part, f16)
        rec["f16"] = {**info, "seconds": round(time.time() - t0, 1), "bytes": f16.stat().st_size}
        if sanity:
            t0 = time.time()
            rec["sanity"] = {**sanity_forward(f16), "seconds": round(time.time() - t0, 1)}
            log(f"sanity forward: {rec['sanity']}")
            if not rec["sanity"]["finite"]:
                raise RuntimeError(f"{shape}: non-finite activations in the numpy forward pass; {rec['sanity']}")
    for q in todo:
        if q == "F16":
            continue
        log(f"quantizing {shape} to {q}")
        t0 = time.time()
        llama_tools.quantize(f16, paths[q], q)
        rec.setdefault("quantized", {})[q] = {"seconds": round(time.time() - t0, 1), "bytes": paths[q].stat().st_size,
                                               "types": gguf_summary(paths[q])["types"]}
        rec_path.write_text(json.dumps(rec, indent=1))
    rec_path.write_text(json.dumps(rec, indent=1))
    if not keep_f16 and "F16" not in qtypes:
        f16.unlink()
    return paths
