"""Tiny random HF models of every family, each with the feature that defines it switched on (for the
tests that compare our engine with HF transformers without llama.cpp's tools)."""
from __future__ import annotations

import torch

VOCAB = 300


BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)


GEMMA = dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=24, hidden_activation="gelu_pytorch_tanh")


# family -> (transformers config class, model class, config overrides); windows of 8-10 positions, so the
# 40-token sequences the tests run cross them.
FAMILIES = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8, head_dim=16)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=10)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(**GEMMA, attn_logit_softcapping=5.0,
                                                          final_logit_softcapping=4.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(**GEMMA, num_hidden_layers=6, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}})),
}


def tiny_hf_family(family: str, seed: int = 0):
    """A random-weight transformers model of `family` (fp32, eval, eager attention), norms randomised too
    (Gemma's around 0: it multiplies by 1 + w)."""
    import transformers
    config_cls, model_cls, overrides = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**BASE, **overrides})
    config._attn_implementation = "eager"
    model = getattr(transformers, model_cls)(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((0.0 if family.startswith("gemma") else 1.0) + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))  # larger than the init's 0.02: logits far from uniform
    return model

