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
from tests.support.families import FAMILIES, VOCAB, tiny_hf_family

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
