"""Every family's files as its users get them: an HF folder per family and the GGUFs llama.cpp's own converter
and quantizer make of it (bench/zoo, tests/support/zoo.py), read by our loaders, against HF transformers and
the gguf package on the same files (the tokenizers: test_family_tokenizers.py).

- logits: our engine (fp32, prefill then decode) on the folder and on its F32 GGUF within 1e-4 of HF's (fp32,
  eager attention) over a 96-token chat prompt, past every sliding window (32) and Llama 3's original
  context (64). Where the GGUF cannot say what the folder says, our loader takes the model as llama.cpp
  does, and the reference is HF with the config llama.cpp reads the file as (GGUF_READS_AS);
- config: the F32 GGUF's is the folder's but for what the file cannot say;
- weights: every tensor of the F32 GGUF is the folder's, bit for bit, after our loaders undo what the
  converter did; every quantized tensor comes out as gguf's dequantization of the file's bytes, bit for
  bit, and `packed` holds those bytes.

They skip where llama.cpp's tools are not built (`make llama-tools`).
"""
from __future__ import annotations

from dataclasses import fields

import numpy as np
import pytest
import torch

from bench.zoo.specs import ARCHS, QTYPES, SPECS
from common.engine.gguf_file import GGUFFile
from common.engine.weights import load_weights
from tests.support.checkpoints import llama_cpp_permute, our_logits
from tests.support.zoo import GGUF_READS_AS, family_files  # noqa: F401 (a fixture)

NUM_DECODE = 4
# Where the divergence the overrides make starts: Mistral's window (32) first leaves a key out at position
# 32; a score's scale cannot change the softmax over position 0's one key.
GGUF_SAME_UNTIL = {"mistral": 32, "gemma2": 1}


@pytest.fixture(scope="module")
def hf_logits(family_files):  # noqa: F811 (the fixture)
    """hf_logits(arch, **overrides) -> (prompt ids, HF's logits [96, V] as a tensor), each computed once."""
    from bench import zoo

    cache: dict = {}

    def get(arch: str, **overrides):
        key = (arch, tuple(sorted(overrides.items())))
        if key not in cache:
            files = family_files(arch)
            ids = zoo.sample_ids(files.hf_dir)
            assert len(ids) > 64, "the prompt must cross every window (32) and Llama 3's original context (64)"
            cache[key] = ids, torch.from_numpy(zoo.hf_forward(files.hf_dir, ids, **overrides))
        return cache[key]

    return get


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """ours [NUM_DECODE + 1, V] (the prefill's last row, then the decode steps') against HF's rows."""
    assert ref.std() > 1.0, f"{what}: HF's logits are nearly flat, a comparison of them proves little"
    diff = (ours[0] - ref[0]).abs().max().item()
    assert diff <= 1e-4, f"{what}, prefill: max |logit diff| = {diff}"
    # A decode row's logits are exact for its best tokens (model.py: the int8 decode head, refined).
    top = ours[1:].topk(8, dim=-1).indices
    diff = (ours[1:].gather(1, top) - ref[1:].gather(1, top)).abs().max().item()
    assert diff <= 1e-4, f"{what}, decode: max |refined logit diff| = {diff}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1)), f"{what}: another greedy token"


@pytest.mark.parametrize("source", ["hf", "F32"])
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_hf(arch, source, family_files, hf_logits):  # noqa: F811
    files = family_files(arch)
    overrides = GGUF_READS_AS.get(arch, {}) if source == "F32" else {}
    ids, ref = hf_logits(arch, **overrides)
    weights = load_weights(files.hf_dir if source == "hf" else files["F32"], progress=False)
    ours = our_logits(weights, [ids], NUM_DECODE)[0]
    what = f"{arch} {source}" + (f" read as {overrides}" if overrides else "")
    assert_logits_close(ours, ref[-NUM_DECODE - 1:], what)


@pytest.mark.parametrize("arch", sorted(GGUF_READS_AS))
def test_the_gguf_is_another_model_where_the_file_cannot_say(arch, family_files, hf_logits):  # noqa: F811
    """The model llama.cpp reads the GGUF as is the folder's up to where the missing setting first matters,
    and far from it after: the comparison above would catch a loader that took the folder's value."""
    _, folder = hf_logits(arch)
    _, as_read = hf_logits(arch, **GGUF_READS_AS[arch])
    per_position = (folder - as_read).abs().amax(-1)
    same_until = GGUF_SAME_UNTIL[arch]
    assert per_position[:same_until].max().item() <= 1e-4
    assert per_position[same_until:].min().item() > 1e-2
    assert per_position[-NUM_DECODE - 1:].min().item() > 0.1  # the rows test_logits_match_hf compares


# Fields a GGUF holds differently from config.json, and why.
GGUF_CONFIG_DIFFERS = {
    "rms_norm_eps": "stored as float32",
    "rope_scaling": "llama3 scaling is a rope_freqs tensor of divisors (kind 'factors'); the same frequencies",
    "family": "Mistral's GGUF is a 'llama' file",
    "layer_windows": "Mistral's window is dropped (GGUF_READS_AS)",
    "attn_scale": "Gemma 2's query_pre_attn_scalar is not written (GGUF_READS_AS)",
}


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_config_is_the_folders(arch, family_files):  # noqa: F811
    from common.engine.weights import read_model_config

    files = family_files(arch)
    folder, gguf = read_model_config(files.hf_dir), read_model_config(files["F32"])
    differ = {f.name for f in fields(folder) if getattr(folder, f.name) != getattr(gguf, f.name)}
    assert differ <= set(GGUF_CONFIG_DIFFERS), f"{arch}: {differ - set(GGUF_CONFIG_DIFFERS)} differ"
    assert gguf.rms_norm_eps == pytest.approx(folder.rms_norm_eps, rel=1e-6)
    want = ("llama", ()) if arch == "mistral" else (folder.family, folder.layer_windows)
    assert (gguf.family, gguf.layer_windows) == want
    assert gguf.scale == (folder.head_dim ** -0.5 if arch == "gemma2" else folder.scale)  # llama.cpp's, not 64 ** -0.5
    if folder.rope_scaling is not None:
        theta, dim = folder.rope_theta, folder.head_dim
        base = [theta ** (-2 * i / dim) for i in range(dim // 2)]
        np.testing.assert_allclose(gguf.rope_scaling.inv_freq(base, dim, theta),
                                   folder.rope_scaling.inv_freq(base, dim, theta), rtol=1e-6)


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_gguf_tensors_are_the_folders(arch, family_files):  # noqa: F811
    """Every tensor, bit for bit: our loaders undo the converter's Q/K permutation and fusing, and the folder's
    Gemma norms get the +1 the converter gave the GGUF's."""
    files = family_files(arch)
    folder, gguf = load_weights(files.hf_dir, progress=False), load_weights(files["F32"], progress=False)
    assert set(gguf.tensors) == set(folder.tensors)
    for name, want in folder.tensors.items():
        got = gguf.tensors[name]
        assert got.shape == want.shape and torch.equal(got.view(torch.int32), want.view(torch.int32)), name


def _file_parts(arch: str, tensor_name: str) -> list[tuple[str, slice, int | None]]:
    """(canonical name, its rows in the file's tensor, heads whose rows llama.cpp permuted) of one matrix of
    the file, by llama.cpp's naming: what our loader must make of it."""
    cfg = SPECS[arch]["config"]
    q, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // q
    permuted = arch in ("llama3", "mistral")  # the 'llama' GGUF architecture
    everything = slice(None)
    if tensor_name == "token_embd.weight":
        return [("model.embed_tokens.weight", everything, None)]
    if tensor_name == "output.weight":
        return [("lm_head.weight", everything, None)]
    _, layer, kind, _ = tensor_name.split(".")
    p = f"model.layers.{layer}."
    if kind == "attn_qkv":  # Phi-3's fused q|k|v
        return [(p + "self_attn.q_proj.weight", slice(0, q * head_dim), None),
                (p + "self_attn.k_proj.weight", slice(q * head_dim, (q + kv) * head_dim), None),
                (p + "self_attn.v_proj.weight", slice((q + kv) * head_dim, (q + 2 * kv) * head_dim), None)]
    if kind == "ffn_up" and arch == "phi3":  # gate|up
        f = cfg["intermediate_size"]
        return [(p + "mlp.gate_proj.weight", slice(0, f), None), (p + "mlp.up_proj.weight", slice(f, 2 * f), None)]
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}
    heads = {"attn_q": q, "attn_k": kv}.get(kind) if permuted else None
    return [(p + names[kind] + ".weight", everything, heads)]


@pytest.mark.parametrize("qtype", QTYPES[1:])
@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_tensors_are_the_files(arch, qtype, family_files):  # noqa: F811
    """load_weights(...).tensors[name] is gguf.quants.dequantize of the file's tensor, bit for bit, and
    .packed[name] its bytes, rows for rows, once llama.cpp's permutation is applied back to ours."""
    from gguf.quants import dequantize

    path = family_files(arch)[qtype]
    weights = load_weights(path, progress=False)
    quantized = [t for t in GGUFFile(path).tensors if t.tensor_type.name not in ("F32", "F16")]
    assert quantized, f"{path.name}: no quantized tensor"
    seen = set()
    for t in quantized:
        raw = np.asarray(t.data)  # uint8 [rows, bytes per row]
        want = dequantize(raw, t.tensor_type)  # fp32 [rows, cols]
        for name, rows, heads in _file_parts(arch, t.name):
            seen.add(name)
            permute = (lambda x: llama_cpp_permute(x, heads)) if heads else (lambda x: x)
            got = permute(weights.tensors[name].numpy())
            assert got.dtype == np.float32 and np.array_equal(got.view(np.int32), want[rows].view(np.int32)), \
                f"{path.name} {t.name} ({t.tensor_type.name}) -> {name}: values differ"
            packed = weights.packed[name]
            assert (packed.qtype, packed.cols) == (t.tensor_type.name, want.shape[1]), name
            assert np.array_equal(permute(packed.data), raw[rows]), f"{path.name} {t.name} -> {name}: bytes differ"
    assert set(weights.packed) == seen, f"{path.name}: packed holds {set(weights.packed) - seen} beyond the file's"
