"""Tiny random checkpoints: Llama as an HF folder and as a llama.cpp-style GGUF, a tiny ModelConfig, and
our logits of a loaded checkpoint at every prefill and decode position."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from common.engine.config import ModelConfig
from common.engine.kv_cache import KVCache
from common.engine.model import Llama
from common.engine.runner import DecodeItem, ModelRunner, PrefillItem

TINY_LLAMA = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False)  # not the 1e4 default


def tiny_hf_llama(seed: int = 0, **overrides):
    """A random-weight transformers LlamaForCausalLM (fp32, eval), norms randomised too."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY_LLAMA, **overrides})
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():  # norm weights start at 1; random ones catch a norm read from the wrong tensor
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))  # larger than the init's 0.02: logits far from uniform
    return model


def save_hf_folder(model, folder: Path) -> Path:
    """config.json + model.safetensors (one shard) through save_pretrained."""
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute (HF rotate_half rows → interleaved pairs)."""
    return (w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


_HF_TO_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def write_llama_gguf(model, path: Path, arch: str = "llama") -> Path:
    """The HF model's weights as an F32 GGUF, named and permuted the way llama.cpp's converter writes them."""
    import gguf
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: llama.cpp writes no output.weight, the embedding serves as the LM head
        w = t.detach().float().numpy().copy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            _, _, idx, rest = name.split(".", 3)
            gname = f"blk.{idx}.{_HF_TO_GGUF_LAYER[rest]}"
            if rest == "self_attn.q_proj.weight":
                w = llama_cpp_permute(w, cfg.num_attention_heads)
            elif rest == "self_attn.k_proj.weight":
                w = llama_cpp_permute(w, cfg.num_key_value_heads)
        # numpy's [out, in] is written as GGUF dims (in, out): the writer reverses the order itself.
        writer.add_tensor(gname, np.ascontiguousarray(w, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_json(path: Path, obj) -> Path:
    path.write_text(json.dumps(obj))
    return path



TINY = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=3, num_heads=4,
                   num_kv_heads=2, head_dim=4, rope_theta=10000.0, rms_norm_eps=1e-5, max_position=64,
                   tie_embeddings=True)



def our_logits(weights, sequences: list[list[int]], num_decode: int) -> list[torch.Tensor]:
    """Prefill each sequence minus its last num_decode tokens (batched), then decode those one by one
    (batched): the logits at every position from len - num_decode - 1 on. Returns [num_decode + 1, V] each."""
    model = Llama(weights.config, weights.tensors, dtype=torch.float32)
    runner = ModelRunner(model, KVCache(weights.config, num_blocks=32, block_size=4, dtype=torch.float32), 0)
    pool = runner.cache.pool
    out = [[] for _ in sequences]
    for i, ids in enumerate(sequences):
        pool.allocate(str(i), len(ids))
    logits = runner.prefill([PrefillItem(str(i), ids[:len(ids) - num_decode]) for i, ids in enumerate(sequences)])
    for i in range(len(sequences)):
        out[i].append(logits[i])
    for step in range(num_decode):
        items = [DecodeItem(str(i), ids[len(ids) - num_decode + step], len(ids) - num_decode + step)
                 for i, ids in enumerate(sequences)]
        logits = runner.decode(items)
        for i in range(len(sequences)):
            out[i].append(logits[i])
    return [torch.stack(o) for o in out]

