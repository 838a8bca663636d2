"""Weight loading: every bad input gives a ModelLoadError / ModelNotFoundError naming the file and the
problem; a tiny random Llama saved as an HF folder and as a llama.cpp-style GGUF (Q/K rows permuted)
loads to the same tensors and runs to HF's logits; sharded safetensors."""
from __future__ import annotations

import json
from dataclasses import replace

import gguf
import numpy as np
import pytest
import torch

from common.engine.model_files import ModelNotFoundError
from common.engine.weights import ModelLoadError, load_weights, read_model_config, weights_id_of
from tests.support.checkpoints import TINY_LLAMA, llama_cpp_permute, save_hf_folder, tiny_hf_llama, write_json, write_llama_gguf
from tests.support.checkpoints import our_logits

# --------------------------------------------------------------------------- bad inputs


def test_missing_path(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelNotFoundError, match="no such file or folder") as err:
        load_weights(missing)
    assert str(missing) in str(err.value)


def test_unknown_file_kind(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"\0" * 64)
    with pytest.raises(ModelLoadError, match="not a .gguf file nor an HF checkpoint folder") as err:
        load_weights(path)
    assert str(path) in str(err.value)


def test_folder_without_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="no config.json") as err:
        load_weights(tmp_path)
    assert str(tmp_path) in str(err.value)


def test_garbage_gguf(tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    for load in (load_weights, read_model_config):
        with pytest.raises(ModelLoadError, match="not a readable GGUF file") as err:
            load(path)
        assert str(path) in str(err.value)


@pytest.mark.parametrize("cut", ["1MiB", "half"])
def test_truncated_gguf(tmp_path, smollm2_path, cut):
    size = smollm2_path.stat().st_size
    keep = 1 << 20 if cut == "1MiB" else size // 2
    path = tmp_path / f"truncated-{cut}.gguf"
    with open(smollm2_path, "rb") as src:
        path.write_bytes(src.read(keep))
    with pytest.raises(ModelLoadError) as err:
        load_weights(path, progress=False)
    message = str(err.value)
    assert str(path) in message
    assert "truncated" in message


def test_gguf_of_another_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for load in (load_weights, read_model_config):
        with pytest.raises(ModelLoadError, match="architecture 'gpt2' is not supported") as err:
            load(path)
        assert str(path) in str(err.value)


def test_hf_folder_of_another_model_type(tmp_path):
    write_json(tmp_path / "config.json", {"model_type": "gpt2", "vocab_size": 128, "n_embd": 64})
    from safetensors.torch import save_file
    save_file({"wte.weight": torch.zeros(128, 64)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="model_type 'gpt2' is not supported") as err:
        load_weights(tmp_path)
    assert str(tmp_path / "config.json") in str(err.value)


def test_hf_folder_with_bad_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON") as err:
        load_weights(tmp_path)
    assert str(tmp_path / "config.json") in str(err.value)


# --------------------------------------------------------------------------- tiny random Llama: HF folder and GGUF

@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def tiny(request, tmp_path_factory):
    """(HF model, HF folder, GGUF file) of the same random weights."""
    model = tiny_hf_llama(seed=3, tie_word_embeddings=request.param)
    root = tmp_path_factory.mktemp("tiny")
    folder = save_hf_folder(model, root / "hf")
    path = write_llama_gguf(model, root / "tiny.gguf")
    return model, folder, path


def test_permute_helper_is_llama_cpps():
    # Head 0 of a 1-head, head_dim 4 projection: HF rows [r0 r1 | r2 r3] (rotate_half halves) become
    # interleaved pairs (r0 r2) (r1 r3), the layout llama.cpp's rotary expects.
    w = np.arange(4, dtype=np.float32)[:, None]
    assert llama_cpp_permute(w, 1)[:, 0].tolist() == [0, 2, 1, 3]


def test_gguf_and_hf_folder_load_the_same_tensors(tiny):
    model, folder, path = tiny
    from_hf, from_gguf = load_weights(folder, progress=False), load_weights(path, progress=False)
    c = from_hf.config
    # GGUF stores eps as float32; everything else must agree exactly.
    assert from_gguf.config.rms_norm_eps == pytest.approx(c.rms_norm_eps, rel=1e-6)
    assert replace(from_gguf.config, rms_norm_eps=c.rms_norm_eps) == c
    assert (c.vocab_size, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (
        128, 64, 2, 4, 2, 16)
    assert c.rope_theta == TINY_LLAMA["rope_theta"]
    assert c.tie_embeddings == model.config.tie_word_embeddings
    assert set(from_hf.tensors) == set(from_gguf.tensors)
    reference = model.state_dict()
    for name, t in from_gguf.tensors.items():
        assert t.dtype == torch.float32
        assert torch.equal(t, from_hf.tensors[name]), name
        assert torch.equal(t, reference[name]), name
    # The GGUF really holds permuted Q rows: loading without the undo would differ.
    raw = {t.name: t for t in gguf.GGUFReader(path).tensors}
    q_raw = np.asarray(raw["blk.0.attn_q.weight"].data)
    assert not np.array_equal(q_raw, reference["model.layers.0.self_attn.q_proj.weight"].numpy())
    assert read_model_config(path) == from_gguf.config and read_model_config(folder) == c
    assert from_hf.weights_id == weights_id_of(folder) and from_gguf.weights_id == weights_id_of(path)
    assert from_hf.int4 == {} and from_gguf.int4 == {}  # F32 tensors: no 4-bit path


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_tiny_llama_logits_match_hf(tiny, source):
    model, folder, path = tiny
    weights = load_weights(folder if source == "hf" else path, progress=False)
    rng = np.random.default_rng(5)
    num_decode = 6
    sequences = [rng.integers(0, 128, n).tolist() for n in (1 + num_decode, 13, 30)]
    ours = our_logits(weights, sequences, num_decode)
    for ids, got in zip(sequences, ours):
        with torch.inference_mode():
            ref = model(torch.tensor([ids])).logits[0, len(ids) - num_decode - 1:]  # [num_decode + 1, V]
        assert ref.std() > 0.1  # random weights big enough that a wrong rotary or permutation shows
        # Prefill's logits are exact fp32; a decode row's are exact for its REFINE_TOP best tokens
        # and int8-close elsewhere (the batch-invariant decode LM head, model.py). Only the best 8
        # are compared: past them an unrefined logit may outrank a refined one.
        diff = (got[0] - ref[0]).abs().max().item()
        assert diff <= 1e-4, f"{source}, {len(ids)} tokens, prefill: max |logit diff| = {diff}"
        top = got[1:].topk(8, dim=-1).indices
        diff = (got[1:].gather(1, top) - ref[1:].gather(1, top)).abs().max().item()
        assert diff <= 1e-4, f"{source}, {len(ids)} tokens, decode: max |refined logit diff| = {diff}"
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
        diff = (got - ref).abs().max().item()
        assert diff <= 0.01 * ref.abs().max().item(), f"{source}, {len(ids)} tokens: max |logit diff| = {diff}"


# --------------------------------------------------------------------------- sharded safetensors

@pytest.fixture
def sharded(tmp_path):
    model = tiny_hf_llama(seed=4)
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3, shards
    return model, tmp_path, shards


def test_sharded_safetensors_load(sharded):
    model, folder, shards = sharded
    weights = load_weights(folder, progress=False)
    reference = model.state_dict()
    assert set(weights.tensors) == set(reference)
    for name, t in weights.tensors.items():
        assert torch.equal(t, reference[name]), name
    assert weights.weights_id == weights_id_of(folder)


def test_sharded_safetensors_missing_shard(sharded):
    _, folder, shards = sharded
    (folder / shards[1]).unlink()
    with pytest.raises(ModelLoadError, match="missing") as err:
        load_weights(folder, progress=False)
    message = str(err.value)
    assert shards[1] in message and "model.safetensors.index.json" in message
    assert shards[0] not in message


def test_sharded_safetensors_truncated_shard(sharded):
    _, folder, shards = sharded
    shard = folder / shards[0]
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="not a readable safetensors file") as err:
        load_weights(folder, progress=False)
    assert str(shard) in str(err.value)


def test_sharded_safetensors_bad_index(sharded):
    _, folder, _ = sharded
    index = folder / "model.safetensors.index.json"
    index.write_text("{\"weight_map\": ")
    with pytest.raises(ModelLoadError) as err:
        load_weights(folder, progress=False)
    assert str(index) in str(err.value)


def test_hf_folder_missing_tensor(tmp_path):
    model = tiny_hf_llama(seed=6)
    folder = save_hf_folder(model, tmp_path / "hf")
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="tensor model.layers.1.mlp.down_proj.weight is missing") as err:
        load_weights(folder, progress=False)
    assert str(folder) in str(err.value)


@pytest.mark.parametrize("rope_type", ["linear", "llama3", "yarn"])
def test_hf_folder_rope_scaling_matches_hf(tmp_path, rope_type):
    """A scaled rotary (transformers 5's `rope_parameters`) is read and applied: logits equal HF's, and
    differ from the same weights' logits with plain RoPE (so a scaling read and ignored would fail)."""
    rope = {"rope_theta": 500000.0, "rope_type": rope_type, "factor": 8.0, "original_max_position_embeddings": 64,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    model = tiny_hf_llama(seed=7, rope_parameters=rope)
    folder = save_hf_folder(model, tmp_path / "hf")
    weights = load_weights(folder, progress=False)
    assert weights.config.rope_scaling is not None and weights.config.rope_scaling.kind == rope_type
    ids = np.random.default_rng(8).integers(0, 128, 40).tolist()
    ours = our_logits(weights, [ids], 1)[0]
    with torch.inference_mode():
        ref = model(torch.tensor([ids])).logits[0, -2:]
    assert (ours[0] - ref[0]).abs().max().item() <= 1e-4
    plain = our_logits(replace(weights, config=replace(weights.config, rope_scaling=None)), [ids], 1)[0]
    assert (plain[0] - ref[0]).abs().max().item() > 1e-3


def test_the_gguf_reader_reads_what_gguf_s_own_reader_does(smollm2_path):
    """common/engine/gguf_file.py (a fast reader) against the gguf package's GGUFReader on the real file:
    every field's value, every tensor's name, type, dims and bytes."""
    from common.engine.gguf_file import GGUFFile

    ours, theirs = GGUFFile(smollm2_path), gguf.GGUFReader(smollm2_path)
    assert ours.fields.keys() == {k for k in theirs.fields if not k.startswith("GGUF.")}
    for key, value in ours.fields.items():
        assert value == theirs.fields[key].contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.tensor_type, a.shape, a.n_bytes) == (b.tensor_type, tuple(int(d) for d in b.shape), b.n_bytes), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape and np.array_equal(a.data, b.data), a.name


def test_blocks_dequantize_to_gguf_s_bits(smollm2_path):
    """gguf_weights.dequantize_blocks (whole tensors in torch) against the gguf package's dequantize: every
    quantized tensor of the real file (Q4_1, the Q8_0 embedding), and Q4_0 / Q4_1 / Q8_0 blocks the
    package quantizes from random values, including blocks of one value (d = 0)."""
    from common.engine.gguf_file import GGUFFile
    from common.engine.gguf_weights import dequantize_blocks as _dequantize_blocks

    def same_bits(raw, qtype):
        ours = _dequantize_blocks(raw, qtype.name)
        theirs = gguf.quants.dequantize(raw, qtype)
        assert ours is not None and tuple(ours.shape) == theirs.shape, qtype
        assert np.array_equal(ours.numpy().view(np.uint32), theirs.astype(np.float32).view(np.uint32)), qtype

    seen = set()
    for t in GGUFFile(smollm2_path).tensors:
        if t.tensor_type.name != "F32":
            same_bits(np.asarray(t.data), t.tensor_type)
            seen.add(t.tensor_type.name)
    assert seen == {"Q4_1", "Q8_0"}
    values = np.random.default_rng(0).standard_normal((8, 256)).astype(np.float32)
    values[3] = 0.5
    for qtype in (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0):
        same_bits(gguf.quants.quantize(values, qtype), qtype)
    assert _dequantize_blocks(np.zeros((2, 210), np.uint8), "Q6_K") is None  # the package's path
