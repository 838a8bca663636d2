"""Every model family against HF transformers on the same random weights: a small HF folder per family,
with the feature that defines the family switched on (llama3 rotary scaling, Mistral's and Phi-3's
sliding window, Qwen 2's q/k/v biases, Qwen 3's q/k norms, Phi-3's fused tensors, Gemma 2's soft-caps,
GeGLU, post-sublayer norms and alternating windows, Gemma 3's q/k norms, window pattern and local rotary
base), loaded from the folder and run through prefill and decode; logits within 1e-4 of HF's in fp32."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from common.engine.weights import load_weights
from tests.support.checkpoints import our_logits

VOCAB = 300
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
GEMMA = dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=24, hidden_activation="gelu_pytorch_tanh")
# family -> (transformers config class, model class, config overrides); windows of 8-10 positions, so the
# 40-token sequences below cross them.
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


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_folder(request, tmp_path_factory):
    model = tiny_hf_family(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder, safe_serialization=True)
    return request.param, model, folder


def test_hf_folder_logits_match_hf(family_folder):
    family, model, folder = family_folder
    weights = load_weights(folder, progress=False)
    assert weights.config.family == {"llama3": "llama"}.get(family, family)
    ids = np.random.default_rng(1).integers(0, VOCAB, 40).tolist()
    num_decode = 6
    ours = our_logits(weights, [ids], num_decode)[0]
    with torch.inference_mode():
        ref = model(torch.tensor([ids])).logits[0, -num_decode - 1:]
    assert ref.std() > 0.1
    diff = (ours[0] - ref[0]).abs().max().item()
    assert diff <= 1e-4, f"{family}, prefill: max |logit diff| = {diff}"
    # A decode row's logits are exact for its best tokens (model.py: the int8 decode head, refined).
    top = ours[1:].topk(8, dim=-1).indices
    diff = (ours[1:].gather(1, top) - ref[1:].gather(1, top)).abs().max().item()
    assert diff <= 1e-4, f"{family}, decode: max |refined logit diff| = {diff}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3"])
def test_a_window_read_and_ignored_would_fail(family, tmp_path):
    """The windowed families' logits differ from the same weights' without windows: the comparison above
    would catch a window that is read but not applied."""
    model = tiny_hf_family(family)
    model.save_pretrained(tmp_path, safe_serialization=True)
    weights = load_weights(tmp_path, progress=False)
    assert weights.config.has_windows
    ids = np.random.default_rng(1).integers(0, VOCAB, 40).tolist()
    windowed = our_logits(weights, [ids], 1)[0]
    full = our_logits(replace(weights, config=replace(weights.config, layer_windows=())), [ids], 1)[0]
    assert (windowed - full).abs().max().item() > 1e-3
