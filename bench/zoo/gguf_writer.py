"""A benchmark shape's F16 GGUF, written directly with the gguf package, tensor by tensor (at most one tensor
in memory: the largest is the 8B's 128256 x 4096 embedding), with the metadata llama.cpp's converter writes
for the architecture and the real tokenizer copied from llama.cpp's models/ggml-vocab-*.gguf.

Weights: matrices N(0, 1/sqrt(fan_in)) in F16, embeddings N(0, 0.02), norms U(0.8, 1.2), biases N(0, 0.1), 1-D
tensors in F32; so the residual stream stays finite through every layer. Q and K are random, so llama.cpp's
row permutation of them is moot.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from bench import llama_tools
from bench.zoo.cache import seeded_rng


def write_f16(sh: dict, init: dict, out: Path, seed: int = 7) -> dict:
    """Write the F16 GGUF of shape sh (big.BIG_SHAPES) to out; returns its tensor and parameter counts."""
    import gguf

    src = llama_tools.ensure_src()
    arch = sh["arch"]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_type("model")
    w.add_name(f"{sh['name']} (handoff zoo, random weights)")
    w.add_block_count(sh["layers"])
    w.add_context_length(sh["ctx"])
    w.add_embedding_length(sh["hidden"])
    w.add_feed_forward_length(sh["ffn"])
    w.add_head_count(sh["heads"])
    w.add_head_count_kv(sh["kv_heads"])
    w.add_rope_freq_base(sh["rope_theta"])
    w.add_layer_norm_rms_eps(sh["rms_eps"])
    if sh["write_head_dim"]:
        w.add_key_length(sh["head_dim"])
        w.add_value_length(sh["head_dim"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    if arch == "llama":
        w.add_vocab_size(sh["vocab_size"])
        w.add_rope_dimension_count(sh["head_dim"])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _copy_tokenizer(w, src / "models" / sh["vocab"], sh, src)
    tensors = _tensors(sh)
    for name, shape, kind in tensors:
        dtype = np.dtype(np.float16 if kind in ("w", "emb") else np.float32)
        w.add_tensor_info(name, shape, dtype, int(np.prod(shape)) * dtype.itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, kind in tensors:
        w.write_tensor_data(_value(name, shape, kind, sh, init, seed))
    w.close()
    return {"n_tensors": len(tensors), "params": int(sum(np.prod(s) for _, s, _ in tensors))}


def llama3_rope_factors(head_dim: int, theta: float, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_max_position_embeddings: int) -> np.ndarray:
    """rope_freqs.weight exactly as convert_hf_to_gguf.py LlamaModel.generate_extra_tensors makes it
    (llama.cpp divides each rotary frequency by its factor)."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    lo_wl = original_max_position_embeddings / low_freq_factor
    hi_wl = original_max_position_embeddings / high_freq_factor
    out = []
    for f in freqs:
        wl = 2 * math.pi / f
        if wl < hi_wl:
            out.append(1.0)
        elif wl > lo_wl:
            out.append(factor)
        else:
            smooth = (original_max_position_embeddings / wl - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)




def _tensors(sh: dict) -> list[tuple[str, tuple, str]]:
    """(name, numpy shape [rows, cols], kind) in writing order; kind picks dtype and init."""
    h, f, hd = sh["hidden"], sh["ffn"], sh["head_dim"]
    q, kv = sh["heads"] * hd, sh["kv_heads"] * hd
    t = [("token_embd.weight", (sh["vocab_size"], h), "emb")]
    if sh["llama3_rope"]:
        t.append(("rope_freqs.weight", (hd // 2,), "rope"))
    for i in range(sh["layers"]):
        b = f"blk.{i}."
        t += [(b + "attn_norm.weight", (h,), "norm"), (b + "attn_q.weight", (q, h), "w"),
              (b + "attn_k.weight", (kv, h), "w"), (b + "attn_v.weight", (kv, h), "w")]
        if sh["qkv_bias"]:
            t += [(b + "attn_q.bias", (q,), "bias"), (b + "attn_k.bias", (kv,), "bias"),
                  (b + "attn_v.bias", (kv,), "bias")]
        t += [(b + "attn_output.weight", (h, q), "w"), (b + "ffn_norm.weight", (h,), "norm"),
              (b + "ffn_gate.weight", (f, h), "w"), (b + "ffn_up.weight", (f, h), "w"),
              (b + "ffn_down.weight", (h, f), "w")]
    t.append(("output_norm.weight", (h,), "norm"))
    if not sh["tied"]:
        t.append(("output.weight", (sh["vocab_size"], h), "emb"))
    return t


def _value(name: str, shape: tuple, kind: str, sh: dict, init: dict, seed: int) -> np.ndarray:
    g = seeded_rng(seed, name)
    if kind == "rope":
        return llama3_rope_factors(sh["head_dim"], sh["rope_theta"], **sh["llama3_rope"])
    if kind == "norm":
        return g.uniform(init["norm_lo"], init["norm_hi"], size=shape).astype(np.float32)
    if kind == "bias":
        return (g.standard_normal(shape, dtype=np.float32) * init["bias_std"]).astype(np.float32)
    std = init["emb_std"] if kind == "emb" else 1.0 / math.sqrt(shape[1])
    out = np.empty(shape, dtype=np.float16)
    rows = max(1, (16 << 20) // shape[1])  # a bounded fp32 chunk at a time
    for r0 in range(0, shape[0], rows):
        chunk = g.standard_normal((min(rows, shape[0] - r0), shape[1]), dtype=np.float32)
        chunk *= std
        out[r0:r0 + chunk.shape[0]] = chunk
    return out


def _copy_tokenizer(w, vocab_path: Path, sh: dict, src: Path) -> None:
    from gguf import GGUFReader, GGUFValueType
    r = GGUFReader(str(vocab_path))
    for k, fld in r.fields.items():
        if not k.startswith("tokenizer.") or k == "tokenizer.chat_template":
            continue  # the template is the Instruct model's, added below
        v = fld.contents()
        if k == "tokenizer.ggml.eos_token_id":
            v = sh["eos"]  # the Instruct models' end-of-turn token
        t = fld.types[0]
        if t == GGUFValueType.ARRAY:
            w.add_key_value(k, v, GGUFValueType.ARRAY, sub_type=fld.types[-1])
        else:
            w.add_key_value(k, v, t)
    w.add_bool("tokenizer.ggml.add_bos_token", sh["add_bos"])
    w.add_bool("tokenizer.ggml.add_eos_token", False)
    w.add_string("tokenizer.chat_template",
                 (src / "models" / "templates" / f"{sh['template']}.jinja").read_text(encoding="utf-8"))
