"""The model zoo: model files made here, from nothing downloaded but llama.cpp's source, for the tests and the
benchmarks. Every file is built on first use and cached under $HANDOFF_ZOO_DIR (~/.cache/handoff/zoo) by a
key that hashes everything that makes it (cache.py).

Small architectures (tests): one per family our engine serves -- llama3, mistral, qwen2, qwen3, phi3,
gemma2, gemma3 (specs.py) -- as an HF transformers folder and the GGUFs llama.cpp's own converter and
quantizer make of it (small.py, with bench/llama_tools.py), in QTYPES: F32, Q8_0, Q4_0, Q4_K_M, Q5_K_M,
Q6_K. Real-format tokenizers and chat templates (tokenizer_files.py), HF's logits as the reference
(reference.py).

    files = build("gemma2")       # ArchFiles: files.hf_dir, files["Q4_K_M"], files.manifest

Benchmark shapes: random-weight GGUFs of Llama 3.2 1B, Qwen 2.5 3B and Llama 3.1 8B (big.py).

    path = big("llama-3.2-1b", "Q4_K_M")

`python -m bench.zoo --build` (`make zoo`) builds the small architectures, `--check` reports on them
(check.py), `--big SHAPE --qtypes Q4_K_M,Q8_0` builds a benchmark shape.

What llama.cpp's converter does that a GGUF reader must know, as these files show it: only the 'llama'
architecture (Llama, Mistral) has its Q/K rows permuted per head; Llama 3's rotary scaling becomes a
rope_freqs tensor; Mistral's sliding window is dropped (the 'llama' architecture has none); Phi-3 keeps qkv
and gate|up fused; Gemma's norm weights get their +1 at conversion, q/k norms included; Gemma 2's
query_pre_attn_scalar and rotary base are never written, nor which layers slide (llama.cpp hardcodes a
pattern per architecture); a tied model has no output.weight.
"""
from bench.zoo.big import BIG_SHAPES, big
from bench.zoo.reference import hf_forward, hf_model, sample_ids
from bench.zoo.small import ArchFiles, build
from bench.zoo.specs import ARCHS, QTYPES

__all__ = ["ARCHS", "ArchFiles", "BIG_SHAPES", "QTYPES", "big", "build", "hf_forward", "hf_model", "sample_ids"]
