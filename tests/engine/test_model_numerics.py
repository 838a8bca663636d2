"""Our Llama against HF transformers on the same SmolLM2 GGUF: logits in fp32, greedy continuations through
the Engine (batched, paged decode), and bf16 (with and without the int4 path) against our own fp32."""
from __future__ import annotations

import pytest
import torch

from common.engine.kv_cache import KVCache
from common.engine.model import AttnContext, Llama
from common.engine.native.packing import Q4_RECORD
from common.engine.output import FinishReason
from common.engine.runner import PrefillItem
from common.engine.sampling import SamplingParams
from tests.support.engine import CHAT_QUESTION, Sinks, hf_greedy, run_until_done
from tests.support.native import skip_where_bf16_is_emulated
from tests.support.engine import first_greedy_tokens

GREEDY_32 = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=32)

LONG_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based inks and a wooden press adapted from those used for wine and olive oil. "
    "Before that, books in Europe were copied by hand, mostly in monasteries, and a single Bible could take "
    "a scribe more than a year. The new method made it possible to print hundreds of identical copies in "
    "the time it had taken to write one, and within fifty years presses were running in more than two "
    "hundred cities. Prices fell, literacy rose, and ideas spread faster than any authority could control "
    "them. Scholars could compare the same text across cities, errors could be corrected in a second "
    "edition, and scientific results could be checked by readers far away. Pamphlets carried arguments "
    "about religion and politics to people who had never owned a book. Some historians argue that the "
    "Reformation, the Scientific Revolution and the rise of the modern state would all have looked very "
    "different without it. Others point out that printing in East Asia, with woodblocks and later with "
    "movable type made of clay, wood or bronze, is centuries older, and that the European press succeeded "
    "because an alphabet of a few dozen letters suits movable type far better than thousands of characters. "
    "Summarise this passage in one sentence:"
)


def _logit_prompts(tok, chat_ids) -> dict[str, list[int]]:
    return {
        "one_token": tok.encode("Hello"),
        "short": tok.encode("The quick brown fox jumps over the lazy dog."),
        "chat": chat_ids(CHAT_QUESTION),
        "long": tok.encode(LONG_TEXT),
    }


def test_last_position_logits_match_hf(make_runner, hf_smollm2, smollm2_tokenizer, chat_ids):
    prompts = _logit_prompts(smollm2_tokenizer, chat_ids)
    lens = sorted(len(p) for p in prompts.values())
    assert lens[0] == 1 and 250 <= lens[-1] <= 400, lens
    runner = make_runner(num_blocks=64)
    pool = runner.cache.pool
    # All four prompts in one prefill batch: variable-length causal attention over flattened tokens.
    for name, ids in prompts.items():
        pool.allocate(name, len(ids))
    ours = runner.prefill([PrefillItem(name, ids) for name, ids in prompts.items()])  # [4, V]
    assert ours.dtype == torch.float32 and ours.shape == (4, runner.model.config.vocab_size)
    for row, (name, ids) in enumerate(prompts.items()):
        with torch.inference_mode():
            ref = hf_smollm2(torch.tensor([ids])).logits[0, -1].float()
        diff = (ours[row] - ref).abs().max().item()
        assert diff <= 1e-3, f"{name} ({len(ids)} tokens): max |logit diff| = {diff}"
        assert ours[row].argmax().item() == ref.argmax().item(), name


GREEDY_PROMPTS = [
    ("chat", CHAT_QUESTION),
    ("chat", "Write a haiku about the sea."),
    ("chat", "List three prime numbers and explain why they are prime."),
    ("chat", "Translate 'good morning' into French and Spanish."),
    ("text", "Once upon a time, in a small village by the river,"),
    ("text", "def fibonacci(n):\n    "),
    ("text", "1, 2, 3, 4, 5,"),
    ("text", "Paris is the capital of France. Berlin is the capital of"),
    ("text", "In 1969, the first humans landed on the Moon. The mission was called"),
    ("text", "Q"),
]


def test_greedy_continuations_match_hf_generate(make_engine, hf_smollm2, smollm2_tokenizer, chat_ids):
    tok = smollm2_tokenizer
    prompts = [chat_ids(p) if kind == "chat" else tok.encode(p) for kind, p in GREEDY_PROMPTS]
    assert len({len(p) for p in prompts}) >= 8  # lengths differ: decode pads and masks the batch
    engine = make_engine(num_blocks=128)
    sinks = Sinks()
    for i, ids in enumerate(prompts):
        engine.submit(f"s{i}", ids, GREEDY_32, sinks.sink(f"s{i}"))
    run_until_done(engine, sinks)
    # One prefill batch and then one shared decode batch: every prompt ran batched, none alone.
    assert engine.num_steps <= 33, engine.num_steps
    engine.check_integrity()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    for i, ids in enumerate(prompts):
        got = sinks[f"s{i}"]
        assert got.finish_reason == FinishReason.LENGTH
        expected = hf_greedy(hf_smollm2, ids, 32)
        assert got.token_ids == expected, (f"prompt {i} {GREEDY_PROMPTS[i]!r}: ours {tok.decode(got.token_ids)!r} "
                                           f"vs HF {tok.decode(expected)!r}")


@pytest.mark.parametrize("packed_decode", [False, True], ids=["bf16", "bf16+int4"])
def test_bf16_greedy_matches_fp32(make_engine, smollm2_tokenizer, chat_ids, packed_decode):
    ids = chat_ids(CHAT_QUESTION)
    fp32 = first_greedy_tokens(make_engine, ids, 8)
    assert smollm2_tokenizer.decode(fp32).startswith("The capital of France is Paris")
    bf16 = first_greedy_tokens(make_engine, ids, 8, dtype=torch.bfloat16, packed_decode=packed_decode)
    assert bf16 == fp32, f"bf16: {smollm2_tokenizer.decode(bf16)!r}, fp32: {smollm2_tokenizer.decode(fp32)!r}"


def test_bf16_logits_refine_the_top_candidates(smollm2_model, smollm2_tokenizer, chat_ids):
    """In bf16 the best logits of every row are the exact fp32 ones, so greedy never turns on bf16
    rounding: checked at every position of a long prompt (hundreds of rows, some near-ties). Only the
    best 8 are compared: past them an unrefined logit may outrank a refined one (REFINE_TOP is 64)."""
    model = smollm2_model(torch.bfloat16)
    ids = chat_ids(LONG_TEXT)
    n = len(ids)
    cache = KVCache(model.config, num_blocks=-(-n // 16), block_size=16, dtype=torch.bfloat16)
    cache.pool.allocate("x", n)
    ctx = AttnContext(slot_mapping=torch.tensor(cache.slots(cache.pool.block_table("x"), 0, n)), prefill_lens=[n])
    hidden = model(torch.tensor(ids), torch.arange(n), ctx, cache.kv)  # [N, dim] fp32
    assert hidden.dtype == torch.float32
    logits = model.logits(hidden)  # [N, V]
    exact = hidden @ model.lm_head_fp32.T  # [N, V]: the fp32 LM head on the same hidden states
    assert Llama.REFINE_TOP >= 8
    top = logits.topk(8, dim=-1).indices
    torch.testing.assert_close(logits.gather(1, top), exact.gather(1, top), rtol=0, atol=1e-4)
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))


@pytest.mark.parametrize("dtype,int4,paged,matmuls", [
    (None, True, True, "auto"), (torch.bfloat16, False, True, "auto"), (torch.float32, False, True, "auto"),
    (torch.bfloat16, True, False, "auto"), (torch.bfloat16, True, True, "int"), (torch.bfloat16, True, True, "torch"),
    (torch.float32, True, True, "f32"), (torch.bfloat16, True, True, "vnni"), (torch.bfloat16, True, True, "bf16dot"),
    (torch.float32, True, True, "avx2")],
    ids=["default-dtype+int4", "bf16", "fp32", "bf16+int4-eager-attention", "bf16+int4-integer-matmuls",
         "bf16+int4-torch-matmuls", "fp32+int4-fp32-matmuls", "bf16+int4-vnni-matmuls", "bf16+int4-bf16dot-matmuls",
         "fp32+int4-avx2-matmuls"])
def test_a_decode_row_is_the_same_whatever_the_other_rows(make_runner, smollm2_tokenizer, monkeypatch, dtype, int4,
                                                          paged, matmuls):
    """Invariant 4 at its root: the logits a decode row gives (and the K/V it writes) do not depend on
    the batch's size or on the other rows' context lengths (which set the eager path's attention span).
    Contexts from 1 to ~600 tokens; batches from 1 to 13 rows, some of them rows of one sequence
    (replay). In the defaults (the dtype this host serves, bf16 where the CPU has it natively and fp32 on
    AVX2 hosts, with int4 decode), and in the cases below. With the native paged-attention kernel (the default where it builds) and with the eager
    gather + SDPA path it falls back to. The packed weights' matmuls as this CPU picks them
    (HANDOFF_NATIVE_MATMUL unset: the native int8 digit kernel where the CPU has AVX512_VNNI, whose
    13-row batch crosses from its vector half to its tiles where it has AMX_INT8; its bf16 dot kernel where
    the CPU has AVX512_BF16 without VNNI; its AVX2 unit elsewhere), the others every host can run ("int",
    "torch", "f32"), the digit kernel's AVX-512 unit alone where the CPU has AVX512_VNNI, its AVX2 unit
    (in fp32, the dtype AVX2 hosts run), and the bf16 dot kernel where the CPU has AVX512_BF16."""
    from common.engine import native
    from common.engine.hardware import auto_dtype
    from common.engine.native.choice import auto_matmuls
    from common.engine.runner import DecodeItem
    if dtype is None:  # the defaults: the dtype this host serves (bf16 where native, else fp32), int4 decode
        dtype = auto_dtype()[0]
    if matmuls != "auto" and matmuls == auto_matmuls()[0]:
        pytest.skip(f"{matmuls} is this host's default: the auto case covers it")
    if dtype == torch.bfloat16 and not int4:
        skip_where_bf16_is_emulated("dense bf16 decode")
    if dtype == torch.bfloat16 and (matmuls != "auto" or not paged) and auto_dtype()[0] != torch.bfloat16:
        # Another kernel than the host's own, in the dtype this host serves: bf16 is emulated here (its
        # prefill 5-6x slower), the dtype the default case runs in here.
        dtype = torch.float32
    if matmuls == "vnni" and not (native.kernel() is not None and native.kernel().has_vnni):
        pytest.skip("no VNNI kernel here (the CPU has no AVX512_VNNI, or the compiler is not GCC 11+)")
    if matmuls == "bf16dot" and not (native.kernel() is not None and native.kernel().has_bf16dot):
        pytest.skip("no bf16 dot kernel here (the CPU has no AVX512_BF16, or the compiler is not GCC 10+)")
    if matmuls == "avx2" and not (native.kernel() is not None and native.kernel().has_avx2_digits):
        pytest.skip("no int8 digit kernels here (the compiler is not GCC 11+, or the build has no AVX2)")
    runner = make_runner(num_blocks=1024, dtype=dtype, packed_decode=int4,
                         native_matmuls=None if matmuls == "auto" else matmuls)
    if matmuls != "auto":
        layer = runner.model.layers[0]["wqkv_packed"]
        assert (layer.kernels is not None) == (matmuls != "torch") and layer.kernel == matmuls
    if paged:
        assert runner.model.kernels is not None, "the native kernels did not build: see the log"
    else:
        monkeypatch.setattr(runner.model, "kernels", None)
    pool = runner.cache.pool
    gen = torch.Generator().manual_seed(0)
    lens = [1, 5, 17, 63, 64, 65, 130, 333, 600]
    for i, n in enumerate(lens):
        ids = torch.randint(0, runner.model.config.vocab_size, (n,), generator=gen).tolist()
        pool.allocate(f"s{i}", n + 8)
        runner.prefill([PrefillItem(f"s{i}", ids)])
    # Each candidate row: (seq, position); the rows of one sequence write consecutive positions.
    rows = [DecodeItem(f"s{i}", 7 + i, n) for i, n in enumerate(lens)]
    rows += [DecodeItem("s8", 100 + k, lens[8] + 1 + k) for k in range(4)]
    alone = []
    for j, it in enumerate(rows):
        # A replay row needs the rows before it in place: run those first, alone too.
        alone.append(runner.decode([it])[0].clone())
    for bsz in (2, 7, 13):
        order = torch.randperm(len(rows), generator=gen)[:bsz].tolist()
        # Keep each sequence's rows in position order within the batch, as the engine does.
        batch = sorted(order, key=lambda k: (rows[k].seq_id, rows[k].position))
        got = runner.decode([rows[k] for k in batch])
        for r, k in enumerate(batch):
            assert torch.equal(got[r], alone[k]), f"row {rows[k]} differs at batch {bsz}"


def _runner_on(weights, matmuls: str):
    """An int4 runner on the session's weights in the dtype this host serves (bf16 where the CPU has it
    natively, fp32 on AVX2 hosts), built apart from the fixtures' cache."""
    from common.engine.hardware import auto_dtype
    from common.engine.runner import ModelRunner
    dtype = auto_dtype()[0]
    model = Llama(weights.config, weights.tensors, dtype=dtype, packed=weights.packed, native_matmuls=matmuls)
    return ModelRunner(model, KVCache(model.config, 256, 16, dtype), True)


def _decode_16_rows(runner) -> torch.Tensor:
    from common.engine.runner import DecodeItem
    gen = torch.Generator().manual_seed(5)
    for i in range(16):
        runner.cache.pool.allocate(f"s{i}", 40)
        runner.prefill([PrefillItem(f"s{i}", torch.randint(0, 49152, (5 + 2 * i,), generator=gen).tolist())])
    return runner.decode([DecodeItem(f"s{i}", 11 + i, 5 + 2 * i) for i in range(16)])


def test_a_node_without_amx_falls_back_to_its_vector_half_with_the_same_logits(smollm2_weights, monkeypatch,
                                                                                caplog):
    """Where the int8 digit kernel's tiles cannot run (no AMX_INT8, Linux before 5.16, a library from
    another compiler), a model asked for "amx" runs "vnni", which computes the same bits: a pool whose
    nodes differ in that still gives a request the same tokens. The library is this host's own, with
    its has_amx answer turned off as such a node's would be; 16 rows, so that the AMX model runs tiles."""
    from common.engine import native
    kernels = native.kernel()
    if kernels is None or not kernels.has_amx:
        pytest.skip("this host has no AMX kernel to fall back from")
    with_tiles = _decode_16_rows(_runner_on(smollm2_weights, "amx"))
    monkeypatch.setattr(kernels, "has_amx", False)
    caplog.clear()
    runner = _runner_on(smollm2_weights, "amx")
    assert runner.model.matmuls == "vnni" and "using its AVX512_VNNI half instead" in caplog.text
    assert torch.equal(_decode_16_rows(runner), with_tiles)


def test_a_node_without_vnni_runs_the_avx2_unit_with_the_same_logits_and_without_digits_another_kernel(
        smollm2_weights, monkeypatch, caplog):
    """"vnni" (auto's pick on AVX512_VNNI CPUs without AMX) where the CPU lacks AVX512_VNNI runs the same
    kernel's AVX2 unit, "avx2" (auto's pick on AVX2 CPUs), which computes the same bits: a pool of AMX,
    AVX512_VNNI and AVX2 nodes gives a request the same tokens. Where the library has no digit kernel at all
    (a compiler other than GCC 11+), "amx", "vnni" and "avx2" fall back to the bf16 dot kernel where it
    runs, else to the fp32 kernel (never to torch's int4 kernel, 10-20x slower on AVX2 hosts), repacked in
    that kernel's layout, with a warning. The library is this host's own with its answers turned off as
    such a node's would be; 16 rows."""
    from common.engine import native
    kernels = native.kernel()
    if kernels is None or not kernels.has_avx2_digits:
        pytest.skip("this host's library has no int8 digit kernels (GCC before 11, or no AVX2)")
    runner = _runner_on(smollm2_weights, "vnni" if kernels.has_vnni else "avx2")
    widest = _decode_16_rows(runner)
    monkeypatch.setattr(kernels, "has_amx", False)
    monkeypatch.setattr(kernels, "has_vnni", False)
    caplog.clear()
    runner = _runner_on(smollm2_weights, "vnni")
    assert runner.model.matmuls == "avx2" and "using its AVX2 unit instead (the same bits)" in caplog.text
    assert torch.equal(_decode_16_rows(runner), widest)
    monkeypatch.setattr(kernels, "has_avx2_digits", False)
    fallbacks = [("bf16dot", "using the bf16 dot kernel instead")] if kernels.has_bf16dot else []
    fallbacks.append(("f32", "using the fp32 kernel instead"))
    for want, message in fallbacks:
        for asked in ("avx2", "vnni", "amx"):
            caplog.clear()
            runner = _runner_on(smollm2_weights, asked)
            assert runner.model.matmuls == want and message in caplog.text, (asked, caplog.text)
        layer = runner.model.layers[0]["wqkv_packed"]
        assert layer.kernel == want and layer.packed.shape[-1] == Q4_RECORD
        other = _decode_16_rows(runner)
        assert (other.argmax(-1) == widest.argmax(-1)).float().mean() >= 0.9  # another kernel's bits
        monkeypatch.setattr(kernels, "has_bf16dot", False)


def test_decode_logits_are_exact_at_the_top_and_close_below(smollm2_model, chat_ids):
    """The decode LM head is int8 (batch-invariant) with the best REFINE_TOP logits recomputed in fp32:
    greedy stays exact, and the sampled distribution is within a small total-variation distance."""
    model = smollm2_model(torch.bfloat16)
    ids = chat_ids(LONG_TEXT)
    n = len(ids)
    cache = KVCache(model.config, num_blocks=-(-n // 16), block_size=16, dtype=torch.bfloat16)
    cache.pool.allocate("x", n)
    ctx = AttnContext(slot_mapping=torch.tensor(cache.slots(cache.pool.block_table("x"), 0, n)), prefill_lens=[n])
    hidden = model(torch.tensor(ids), torch.arange(n), ctx, cache.kv)
    exact = hidden @ model.lm_head_fp32.T
    logits = model.decode_logits(hidden)
    top = exact.topk(8, dim=-1).indices
    torch.testing.assert_close(logits.gather(1, top), exact.gather(1, top), rtol=0, atol=1e-4)
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))
    tv = 0.5 * (logits.softmax(-1) - exact.softmax(-1)).abs().sum(-1)  # [N]
    assert tv.max().item() < 0.03, tv.max().item()
