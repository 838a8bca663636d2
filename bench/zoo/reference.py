"""HF transformers on a small architecture's folder: the reference its GGUFs and our engine are compared with.

A prompt (sample_ids) is the family's chat template around a user message, then that message again and
again: 96 tokens by default, past every window (32) and Llama 3's original context (64) of the recipes.
"""
from __future__ import annotations

import copy
from pathlib import Path

import numpy as np

SAMPLE_USER = ("Explain, in two short paragraphs, why the sky is blue at noon but red at sunset; "
               "mention Rayleigh scattering, the 4th power of frequency, and one number like 1.5 or 42.")


def sample_ids(hf_dir: Path, n: int = 96) -> list[int]:
    """n token ids of a chat prompt, tokenized by transformers."""
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(str(hf_dir))
    text = t.apply_chat_template([{"role": "user", "content": SAMPLE_USER}], tokenize=False,
                                 add_generation_prompt=True)
    ids = t.encode(text, add_special_tokens=False)
    more = t.encode(" " + SAMPLE_USER, add_special_tokens=False)
    while len(ids) < n:
        ids = ids + more
    return ids[:n]


def hf_model(hf_dir: Path, **config_overrides):
    """The folder's model in fp32 with eager attention (transformers refuses sdpa for Gemma 2), eval mode;
    config fields overridden where given (what another reader of the file takes the model to be)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(hf_dir))
    for k, v in config_overrides.items():
        setattr(cfg, k, copy.deepcopy(v))  # transformers edits rope dicts in place
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), config=cfg, dtype=torch.float32,
                                                 attn_implementation="eager")
    return model.eval()


def hf_forward(hf_dir: Path, ids: list[int], **config_overrides) -> np.ndarray:
    """Logits [len(ids), vocab] of one forward pass over ids."""
    import torch

    with torch.no_grad():
        return hf_model(hf_dir, **config_overrides)(torch.tensor([ids])).logits[0].float().numpy()
