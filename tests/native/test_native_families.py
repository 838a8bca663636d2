"""Every family's decode layer through the native kernels (common/engine/native): Mistral's and Phi-3's sliding
windows, Qwen 2's q/k/v biases, Qwen 3's q/k norms, Gemma 2's soft-capped attention, GeGLU and post norms,
Gemma 3's q/k norms and per-layer rotary tables, on the tiny random models of tests/support/families.py.

Against HF transformers and against the model's own torch path (fp32 within float tolerance, bf16 through
greedy tokens); the one-call layer stack (layers.c, packed weights) against the per-op path bit for bit; a
decode row's bits alone and inside a batch of other contexts (invariant 4, same prompt, parameters and seed give
the same tokens), windows crossed; the new ops themselves against torch, and the same bits in every build."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from common.engine.kv_cache import KVCache
from common.engine.model import Llama
from common.engine.runner import DecodeItem, ModelRunner, PrefillItem
from common.engine.weights import QuantRows, load_weights
from tests.support.native import native_kernels, other_build
from tests.support.families import FAMILIES, VOCAB, tiny_hf_family

BLOCK = 4  # cache blocks of 4 positions: the windows (8 and 10) start inside a block


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_case(request, tmp_path_factory):
    """(family, the HF model, our weights loaded from its saved folder)."""
    model = tiny_hf_family(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder, safe_serialization=True)
    return request.param, model, load_weights(folder, progress=False)


def _quantized(weights) -> tuple[dict[str, torch.Tensor], dict[str, QuantRows]]:
    """Every layer matrix in Q4_1 blocks of 32 (fp16 d and m, as a GGUF file holds them), and the tensors with
    those matrices replaced by their dequantized values: the dense weights the packed ones stand for."""
    tensors, packed = dict(weights.tensors), {}
    for name, t in weights.tensors.items():
        if ".layers." not in name or not name.endswith("proj.weight"):
            continue
        w = t.float().numpy().reshape(t.shape[0], -1, 32)
        low, high = w.min(-1), w.max(-1)
        d = np.maximum((high - low) / 15, 1e-4).astype(np.float16)
        m = low.astype(np.float16)
        codes = np.clip(np.rint((w - m[..., None].astype(np.float32)) / d[..., None].astype(np.float32)), 0, 15
                        ).astype(np.uint8)  # [rows, blocks, 32]
        # GGUF's Q4_1 block: fp16 d, fp16 m, then byte j holding input j (low nibble) and j + 16 (high one)
        blocks = np.concatenate([d[..., None].view(np.uint8), m[..., None].view(np.uint8),
                                 codes[..., :16] | (codes[..., 16:] << 4)], axis=-1)
        packed[name] = QuantRows("Q4_1", np.ascontiguousarray(blocks.reshape(t.shape[0], -1)), t.shape[1])
        values = codes * d[..., None].astype(np.float32) + m[..., None].astype(np.float32)
        tensors[name] = torch.from_numpy(values.reshape(t.shape).astype(np.float32))
    return tensors, packed


def _runner(config, tensors, dtype=torch.float32, packed=None, matmuls=None, num_blocks=128) -> ModelRunner:
    model = Llama(config, tensors, dtype=dtype, packed=packed, native_matmuls=matmuls)
    assert model.kernels is not None, "the native kernels do not take this family's layer"
    return ModelRunner(model, KVCache(config, num_blocks, BLOCK, dtype), packed_decode=packed is not None)


def _prefill(runner: ModelRunner, sequences: list[list[int]], num_decode: int) -> torch.Tensor:
    for i, ids in enumerate(sequences):
        runner.cache.pool.allocate(str(i), len(ids))
    return runner.prefill([PrefillItem(str(i), ids[:len(ids) - num_decode]) for i, ids in enumerate(sequences)])


def _decode_all(runner: ModelRunner, sequences: list[list[int]], num_decode: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill each sequence less its last num_decode tokens, then decode those (every sequence a row of each
    step). Returns the logits [sequences, num_decode, V] and the final hidden states of every decode row."""
    _prefill(runner, sequences, num_decode)
    logits, hidden = [], []
    for step in range(num_decode):
        items = [DecodeItem(str(i), ids[len(ids) - num_decode + step], len(ids) - num_decode + step)
                 for i, ids in enumerate(sequences)]
        logits.append(runner.decode(items))
        hidden.append(runner.last_hidden.clone())
    return torch.stack(logits, 1), torch.stack(hidden, 1)


def _sequences(seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, n).tolist() for n in (7, 13, 40)]  # the last crosses every window


def _top_diff(ours: torch.Tensor, ref: torch.Tensor, k: int = 8) -> float:
    """max |ours - ref| over ours's k best of every row (a decode row's logits are exact for its best only:
    the int8 head, refined)."""
    top = ours.topk(k, dim=-1).indices
    return (ours.gather(-1, top) - ref.gather(-1, top)).abs().max().item()


def test_native_decode_matches_hf_and_the_torch_path(family_case):
    """fp32: the native decode rows' best logits within 1e-4 of HF's, and the hidden states within float
    tolerance of the torch path's on the same model (which test_families checks against HF too)."""
    family, hf, weights = family_case
    sequences, num_decode = _sequences(), 6
    runner = _runner(weights.config, weights.tensors)
    native_logits, native_hidden = _decode_all(runner, sequences, num_decode)
    for ids, ours in zip(sequences, native_logits):
        with torch.inference_mode():
            ref = hf(torch.tensor([ids])).logits[0, -num_decode:]
        assert ref.std() > 0.1
        assert _top_diff(ours, ref) <= 1e-4, f"{family}: native decode against HF"
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    torch_runner = _runner(weights.config, weights.tensors)
    torch_runner.model.kernels = None  # the torch path: gather, SDPA or the soft-capped scores, torch ops
    torch_logits, torch_hidden = _decode_all(torch_runner, sequences, num_decode)
    torch.testing.assert_close(native_hidden, torch_hidden, rtol=1e-5, atol=1e-5)
    assert _top_diff(native_logits, torch_logits) <= 1e-4


def _greedy_logits(runner: ModelRunner, prompt: list[int], steps: int, tokens: list[int] | None = None) -> torch.Tensor:
    """The logits [steps, V] of a greedy run after prompt: of its own tokens, or of `tokens` (the same contexts
    as another run's)."""
    runner.cache.pool.allocate("g", len(prompt) + steps)
    out = [runner.prefill([PrefillItem("g", prompt)])[0]]
    for step in range(steps - 1):
        token = int(out[-1].argmax()) if tokens is None else tokens[step]
        out.append(runner.decode([DecodeItem("g", token, len(prompt) + step)])[0])
    return torch.stack(out)


# bf16 rounds the weights and the matmul inputs (8 bits): these tiny models' logits move by up to ~0.05, so a
# step whose two best fp32 logits are closer than this may turn either way, and is not compared.
BF16_MARGIN = 0.1


@pytest.mark.parametrize("int4", [False, True], ids=["dense", "int4"])
def test_bf16_native_decode_follows_fp32_greedy(family_case, int4):
    """bf16 through the native kernels (the per-op path on dense weights, the one-call stack on packed ones)
    picks fp32's greedy token at every step where fp32's top-2 margin leaves bf16's rounding no say (as
    test_model_numerics does for SmolLM2), over a run past the windows; bf16 decodes fp32's tokens, so that
    both see the same contexts after a step that could turn either way."""
    family, _, weights = family_case
    tensors, packed = _quantized(weights) if int4 else (weights.tensors, None)
    prompt = np.random.default_rng(2).integers(0, VOCAB, 5).tolist()
    steps = 24
    fp32 = _greedy_logits(_runner(weights.config, tensors, torch.float32, packed), prompt, steps)
    bf16_runner = _runner(weights.config, tensors, torch.bfloat16, packed)
    assert (bf16_runner.model.native_layers is not None) == int4
    bf16 = _greedy_logits(bf16_runner, prompt, steps, fp32.argmax(-1).tolist())
    top2 = fp32.topk(2, dim=-1).values
    decided = (top2[:, 0] - top2[:, 1] >= BF16_MARGIN).nonzero()[:, 0]
    assert len(decided) >= 6, f"{family}: fp32's margins leave too few steps to compare"
    assert torch.equal(bf16.argmax(-1)[decided], fp32.argmax(-1)[decided]), \
        f"{family}: bf16 {bf16.argmax(-1).tolist()} against fp32 {fp32.argmax(-1).tolist()} at steps {decided.tolist()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_one_call_stack_is_the_per_op_path_bit_for_bit(family_case, dtype):
    """layers.c runs every layer of a step from its hn_layer_t descriptor (bias, q/k norms, post norms, GeGLU,
    the layer's window and rotary tables, the soft-cap) and hn_matmul; the model's per-op path (one native call
    per kernel from Python) gives the same hidden states, logits and cache writes. In fp32 with the fp32 Q4
    kernel, the packed model's decode is also within float tolerance of the torch path on the dequantized
    weights."""
    family, _, weights = family_case
    tensors, int4 = _quantized(weights)
    runner = _runner(weights.config, tensors, dtype, int4)
    model = runner.model
    assert model.native_layers is not None, "the packed layers did not get the one-call path"
    sequences, num_decode = _sequences(3), 4
    _prefill(runner, sequences, num_decode)
    items = [DecodeItem(str(i), ids[-num_decode], len(ids) - num_decode) for i, ids in enumerate(sequences)]
    kv_before = runner.cache.kv.clone()
    one_call = runner.decode(items)
    hidden, kv_after = runner.last_hidden.clone(), runner.cache.kv.clone()
    runner.cache.kv.copy_(kv_before)
    layers, model.native_layers = model.native_layers, None
    try:
        per_op = runner.decode(items)
    finally:
        model.native_layers = layers
    assert torch.equal(runner.last_hidden, hidden) and torch.equal(per_op, one_call), family
    assert torch.equal(runner.cache.kv, kv_after), family
    if dtype == torch.float32:
        packed_logits, _ = _decode_all(_runner(weights.config, tensors, dtype, int4, "f32"), sequences, num_decode)
        dense = _runner(weights.config, tensors)
        dense.model.kernels = None
        dense_logits, _ = _decode_all(dense, sequences, num_decode)
        assert _top_diff(packed_logits, dense_logits) <= 1e-4, family


@pytest.mark.parametrize("dtype,int4", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True),
                                        (torch.bfloat16, True)], ids=["fp32", "bf16", "fp32-int4", "bf16-int4"])
def test_a_decode_row_is_the_same_alone_and_in_a_batch(family_case, dtype, int4):
    """Invariant 4 for every family: a decode row's logits and K/V do not depend on the batch's size or on the
    other rows' contexts, which lie inside, across and far past the windows (8 and 10 positions); some rows
    are consecutive positions of one sequence (replay)."""
    family, _, weights = family_case
    tensors, packed = _quantized(weights) if int4 else (weights.tensors, None)
    runner = _runner(weights.config, tensors, dtype, packed, num_blocks=256)
    gen = torch.Generator().manual_seed(0)
    lens = [1, 5, 9, 12, 17, 40, 130]
    for i, n in enumerate(lens):
        runner.cache.pool.allocate(f"s{i}", n + 8)
        runner.prefill([PrefillItem(f"s{i}", torch.randint(0, VOCAB, (n,), generator=gen).tolist())])
    rows = [DecodeItem(f"s{i}", 7 + i, n) for i, n in enumerate(lens)]
    rows += [DecodeItem("s6", 100 + k, lens[6] + 1 + k) for k in range(3)]
    alone = [runner.decode([it])[0].clone() for it in rows]
    kv_alone = runner.cache.kv.clone()
    for bsz in (2, 6, 10):
        order = torch.randperm(len(rows), generator=gen)[:bsz].tolist()
        batch = sorted(order, key=lambda k: (rows[k].seq_id, rows[k].position))
        got = runner.decode([rows[k] for k in batch])
        for r, k in enumerate(batch):
            assert torch.equal(got[r], alone[k]), f"{family}: row {rows[k]} differs at batch {bsz}"
    assert torch.equal(runner.cache.kv, kv_alone), f"{family}: a batch wrote other K/V"


# --------------------------------------------------------------------------- the new ops alone

HEADS, KV_HEADS, DIM = 8, 2, 64


def _attention_case(dtype, lens: list[int], seed: int = 0):
    """A layer cache with every row's blocks scattered, q as the view of a qkv row (as test_native_attention)."""
    gen = torch.Generator().manual_seed(seed)
    width = -(-max(lens) // 16)
    num_blocks = len(lens) * width + 2
    kv = (torch.randn(num_blocks * 16, 2, KV_HEADS, DIM, generator=gen) * 2).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[:len(lens) * width].view(len(lens), width).contiguous()
    qkv = (torch.randn(len(lens), (HEADS + 2 * KV_HEADS) * DIM, generator=gen) * 2).to(dtype)
    return qkv[:, :HEADS * DIM].view(len(lens), HEADS, DIM), kv, tables, torch.tensor(lens)


def _reference_attention(q, kv, tables, lens, scale, window, softcap):
    """softmax(softcap(q k^T * scale)) v over each row's window, in float64."""
    outs = []
    for r, n in enumerate(lens.tolist()):
        pos = torch.arange(max(0, n - window) if window else 0, n)
        slots = tables[r, pos // 16] * 16 + pos % 16
        k = kv[slots, 0].double().repeat_interleave(HEADS // KV_HEADS, 1)  # [S, H, D]
        v = kv[slots, 1].double().repeat_interleave(HEADS // KV_HEADS, 1)
        s = torch.einsum("hd,shd->hs", q[r].double(), k) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        outs.append(torch.einsum("hs,shd->hd", s.softmax(-1), v))
    return torch.stack(outs)


LENS = [1, 7, 8, 9, 15, 16, 17, 40, 129, 300, 1030]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_windowed_and_soft_capped_attention_computes_the_reference(dtype):
    """A row attends to positions max(0, len - window) .. len - 1 (the first block entered mid-way), scores
    soft-capped where asked, on one thread and split between two (one long row alone: by positions)."""
    k = native_kernels()
    q, kv, tables, lens = _attention_case(dtype, LENS)
    threads = torch.get_num_threads()
    try:
        for window, softcap in ((0, 5.0), (10, None), (8, 2.0), (200, 5.0)):
            want = _reference_attention(q, kv, tables, lens, 0.1, window, softcap)
            for n in (1, 2):
                torch.set_num_threads(n)
                got = k.attention(q, kv, tables, lens, max(LENS), 16, 0.1, window, softcap)
                alone = k.attention(q[-1:], kv, tables[-1:], lens[-1:], LENS[-1], 16, 0.1, window, softcap)
                tol = dict(rtol=0, atol=2e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-2)
                torch.testing.assert_close(got.double(), want, **tol, msg=f"window {window}, cap {softcap}, {n}")
                torch.testing.assert_close(alone[0].double(), want[-1], **tol)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rope_kv_write_adds_the_bias_and_norms_q_and_k_before_the_rotation(dtype):
    """rope_kv_write with a bias and q/k norms computes what the torch path does (bias add, F.rms_norm of each
    head, rotate_half), each step rounded to the dtype; K and V land in the cache."""
    k = native_kernels()
    gen = torch.Generator().manual_seed(6)
    rows, heads, kv_heads, dim, eps = 5, 4, 2, 32, 1e-6
    width = (heads + 2 * kv_heads) * dim
    qkv = (torch.randn(rows, width, generator=gen) * 3).to(dtype)
    bias = torch.randn(width, generator=gen).to(dtype)
    q_norm, k_norm = 1 + 0.3 * torch.randn(dim, generator=gen), 1 + 0.3 * torch.randn(dim, generator=gen)
    cos, sin = torch.randn(50, dim, generator=gen).to(dtype), torch.randn(50, dim, generator=gen).to(dtype)
    positions, slots = torch.tensor([0, 3, 49, 7, 7]), torch.tensor([4, 0, 2, 1, 3])
    got, kv = qkv.clone(), torch.zeros(5, 2, kv_heads, dim, dtype=dtype)
    k.rope_kv_write(got, cos, sin, positions, heads, kv_heads, dim, kv, slots, bias, q_norm, k_norm, eps)
    want = (qkv + bias).view(rows, -1, dim)
    want[:, :heads] = F.rms_norm(want[:, :heads].float(), (dim,), q_norm, eps).to(dtype)
    want[:, heads:heads + kv_heads] = F.rms_norm(want[:, heads:heads + kv_heads].float(), (dim,), k_norm, eps).to(dtype)
    qk = want[:, :heads + kv_heads]
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    qk.copy_(qk * c + torch.cat((-qk[..., dim // 2:], qk[..., :dim // 2]), -1) * s)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0, atol=0.1)
    torch.testing.assert_close(got.view(rows, -1, dim).float(), want.float(), **tol)
    assert torch.equal(kv[slots].view(rows, -1), got[:, heads * dim:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_geglu_and_the_post_norm_compute_what_torch_does(dtype):
    """act_mul("gelu_tanh") is F.gelu(gate, approximate="tanh") * up over the whole range of the tanh (both
    branches of tanh_portable, and where it saturates), rms_norm is F.rms_norm in fp32, each in the dtype."""
    k = native_kernels()
    gen = torch.Generator().manual_seed(2)
    gate = torch.cat([torch.linspace(-12, 12, 1024), torch.randn(1024, generator=gen) * 0.3]).view(4, 512)
    gate_up = torch.cat([gate, torch.randn(4, 512, generator=gen)], 1).to(dtype)
    got = k.act_mul(gate_up, "gelu_tanh")
    g, u = gate_up.chunk(2, dim=-1)
    want = F.gelu(g, approximate="tanh") * u
    # bf16: torch rounds the same two steps, but a tanh an ulp away from libm's may round gelu the other way
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    x = (torch.randn(3, 64, generator=gen) * 10).to(dtype)
    w = 1 + 0.2 * torch.randn(64, generator=gen)
    torch.testing.assert_close(k.rms_norm(x, w, 1e-6).float(), F.rms_norm(x.float(), (64,), w, 1e-6).to(dtype).float(),
                               rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("extra", [("-mno-avx2",), ()], ids=["plain-c", "portable-avx2"])
def test_other_builds_give_the_new_ops_the_same_bits(tmp_path, extra):
    """The plain C loops, the portable AVX2 build and this host's own (AVX-512 where it has it) give the
    windowed, soft-capped attention (one thread and two: one long row split by positions), the bias and q/k
    norms of rope_kv_write, GeGLU (its tanh) and the post norm the same bits. The plain loops are built with
    FMA (x86-64-v3 less AVX2), as test_native_attention's: a build without FMA rounds each product apart."""
    k = native_kernels()
    other = other_build(tmp_path, "x86-64-v3", extra)
    gen = torch.Generator().manual_seed(11)
    threads = torch.get_num_threads()
    try:
        for dtype in (torch.float32, torch.bfloat16):
            q, kv, tables, lens = _attention_case(dtype, LENS, seed=3)
            for window, softcap in ((10, None), (0, 5.0), (9, 2.0), (300, 30.0)):
                for n in (1, 2):
                    torch.set_num_threads(n)
                    for rows in (slice(None), slice(-1, None), slice(-2, -1)):
                        args = (q[rows], kv, tables[rows], lens[rows], max(LENS), 16, 0.125, window, softcap)
                        assert torch.equal(other.attention(*args), k.attention(*args)), (dtype, window, softcap, n)
            width, dim = (4 + 2 * 2) * 32, 32
            qkv = (torch.randn(3, width, generator=gen) * 3).to(dtype)
            bias = torch.randn(width, generator=gen).to(dtype)
            norms = (1 + 0.3 * torch.randn(dim, generator=gen), 1 + 0.3 * torch.randn(dim, generator=gen))
            cos, sin = torch.randn(20, dim, generator=gen).to(dtype), torch.randn(20, dim, generator=gen).to(dtype)
            outs = []
            for lib in (other, k):
                x, cache = qkv.clone(), torch.zeros(3, 2, 2, dim, dtype=dtype)
                lib.rope_kv_write(x, cos, sin, torch.tensor([1, 5, 19]), 4, 2, dim, cache, torch.tensor([2, 0, 1]),
                                  bias, *norms, 1e-6)
                gate_up = (torch.randn(3, 2 * 700, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
                outs.append((x, cache, lib.act_mul(gate_up, "gelu_tanh"), lib.rms_norm(qkv, bias.float(), 1e-6)))
            for a, b, what in zip(*outs, ("rope_kv_write", "its cache", "gelu_tanh_mul", "rms_norm")):
                assert torch.equal(a, b), (what, dtype)
    finally:
        torch.set_num_threads(threads)
