"""A check of a benchmark shape's F16 file that needs no llama.cpp: a plain numpy forward pass over a few tokens
through every layer (RMSNorm, GQA causal attention without rotary -- which preserves norms, so it changes
nothing about finiteness --, SwiGLU), reading one tensor at a time with plain file reads (a memory map of the
whole file would hold every page it touched).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np


def sanity_forward(path: Path, n_tokens: int = 4, token_ids=(9906, 1917, 11, 1234)) -> dict:
    """The residual's RMS after each layer, its largest value, whether everything stayed finite, and the std of
    the logits over the first 32768 vocabulary rows."""
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    T = {t.name: (int(t.data_offset), t.tensor_type.name, [int(x) for x in reversed(t.shape)]) for t in r.tensors}
    fields = {k: r.fields[k].contents() for k in r.fields if not k.startswith("tokenizer.")}
    del r
    arch = fields["general.architecture"]
    L, nh, nkv = (fields[f"{arch}.block_count"], fields[f"{arch}.attention.head_count"],
                  fields[f"{arch}.attention.head_count_kv"])
    eps = fields[f"{arch}.attention.layer_norm_rms_epsilon"]

    def W(name: str, rows=None) -> np.ndarray:
        off, typ, shape = T[name]
        dt = np.float16 if typ == "F16" else np.float32
        row = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        if rows is None:
            a = np.fromfile(path, dtype=dt, count=int(np.prod(shape)), offset=off).reshape(shape)
        else:  # only these rows (embedding lookup / a vocab slice)
            a = np.stack([np.fromfile(path, dtype=dt, count=row, offset=off + i * row * np.dtype(dt).itemsize)
                          for i in rows]).reshape(len(rows), *shape[1:])
        return a.astype(np.float32)

    rms = lambda x, g: x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * g
    x = W("token_embd.weight", rows=token_ids[:n_tokens])
    per_layer, finite = [], True
    for i in range(L):
        b = f"blk.{i}."
        hN = rms(x, W(b + "attn_norm.weight"))
        q, k, v = hN @ W(b + "attn_q.weight").T, hN @ W(b + "attn_k.weight").T, hN @ W(b + "attn_v.weight").T
        if b + "attn_q.bias" in T:
            q, k, v = q + W(b + "attn_q.bias"), k + W(b + "attn_k.bias"), v + W(b + "attn_v.bias")
        hd = q.shape[1] // nh
        q = q.reshape(-1, nh, hd)
        k = np.repeat(k.reshape(-1, nkv, hd), nh // nkv, axis=1)
        v = np.repeat(v.reshape(-1, nkv, hd), nh // nkv, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        s = s + np.triu(np.full((len(x), len(x)), -np.inf), 1)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        a = np.einsum("hqk,khd->qhd", p, v).reshape(len(x), -1)
        x = x + a @ W(b + "attn_output.weight").T
        hN = rms(x, W(b + "ffn_norm.weight"))
        g_, u = hN @ W(b + "ffn_gate.weight").T, hN @ W(b + "ffn_up.weight").T
        x = x + (g_ / (1 + np.exp(-g_)) * u) @ W(b + "ffn_down.weight").T
        per_layer.append(float(np.sqrt(np.mean(x * x))))
        finite = finite and bool(np.isfinite(x).all())
    head_name = "output.weight" if "output.weight" in T else "token_embd.weight"
    off, typ, shape = T[head_name]
    head = np.fromfile(path, dtype=np.float16, count=32768 * shape[1], offset=off).reshape(32768, shape[1])
    logits = rms(x, W("output_norm.weight")) @ head.astype(np.float32).T  # a vocab slice
    return {"finite": finite and bool(np.isfinite(logits).all()), "residual_rms": [round(v, 2) for v in per_layer],
            "max_abs_residual": float(np.abs(x).max()), "logit_std": float(logits.std())}

