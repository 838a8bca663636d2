"""`--dtype auto`: bf16 only where the hardware multiplies it natively, fp32 elsewhere; and the packed
int4 decode path works over either."""
from __future__ import annotations

import pytest
import torch

from common.engine.hardware import auto_dtype, cpu_flags
from common.engine.runner import parse_dtype


@pytest.mark.parametrize("flags,expected", [
    ({"avx2", "fma"}, torch.float32),                              # AVX2-only: bf16 emulated
    ({"avx2", "avx512f", "avx512_vnni"}, torch.float32),           # AVX-512 without BF16 (this kind of VM)
    ({"avx2", "avx512f", "avx512_bf16"}, torch.bfloat16),          # Cooper Lake and later
    ({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, torch.bfloat16),  # Sapphire Rapids
])
def test_auto_picks_bf16_only_with_native_bf16(flags, expected):
    dtype, why = auto_dtype("cpu", frozenset(flags))
    assert dtype == expected, why
    assert ("natively" in why) == (expected == torch.bfloat16)


@pytest.mark.parametrize("flags,mode", [
    ({"avx2", "fma"}, "avx2"),                         # int8 digits by vpmaddubsw (torch's int4: 10-20x slower)
    ({"avx2", "avx512f", "avx512_vnni"}, "vnni"),      # int8 digits by vpdpbusd (Ice Lake, Cascade Lake)
    ({"avx2", "avx512f", "avx512_bf16", "avx512_vnni"}, "vnni"),  # AMD Zen 4/5: 0.57x bf16dot's time at 32 rows
    ({"sse4_2"}, "int"),                               # the plain C loops
    ({"avx2", "avx512f", "avx512_bf16"}, "bf16dot"),   # the bf16 dot instruction: a tile dequantized once
    ({"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "amx_int8"}, "amx"),  # int8 digits
    ({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, "bf16dot"),  # the digits need AMX_INT8 and VNNI
    ({"avx2", "avx512f", "amx_bf16", "amx_tile"}, "avx2"),  # the bf16 dot kernel needs AVX512_BF16, not AMX
])
def test_decode_matmuls_follow_the_cpu_unless_asked(monkeypatch, flags, mode):
    from common.engine.native.choice import ENV_MATMUL, auto_matmuls, matmuls_mode
    picked, why = auto_matmuls(frozenset(flags))
    assert picked == mode and why
    monkeypatch.delenv(ENV_MATMUL, raising=False)
    assert matmuls_mode()[0] == auto_matmuls()[0]
    for value, expected in (("1", "int"), ("on", "int"), ("int", "int"), ("bf16", "bf16dot"), ("f32", "f32"),
                            ("amx", "amx"), ("vnni", "vnni"), ("avx2", "avx2"), ("0", "torch"), ("off", "torch"),
                            ("auto", auto_matmuls()[0])):
        monkeypatch.setenv(ENV_MATMUL, value)
        assert matmuls_mode()[0] == expected, value
    monkeypatch.setenv(ENV_MATMUL, "fast")
    with pytest.raises(ValueError, match="HANDOFF_NATIVE_MATMUL='fast': use 1"):
        matmuls_mode()


def test_auto_on_this_machine_follows_its_flags_and_says_why(caplog):
    native = {"avx512_bf16", "amx_bf16"} & cpu_flags()
    with caplog.at_level("INFO", logger="common.engine.runner"):
        dtype = parse_dtype("auto")
    assert dtype == (torch.bfloat16 if native else torch.float32)
    assert "dtype auto" in caplog.text


def test_packed_decode_over_fp32_gives_the_greedy_answer_of_fp32(make_engine, chat_ids, smollm2_tokenizer):
    """On hosts without native bf16 the default is fp32 weights with packed int4 decode (the kernel
    converts activations to bf16): the answer must stay right."""
    from tests.support.engine import CHAT_QUESTION, first_greedy_tokens
    ids = chat_ids(CHAT_QUESTION)
    fp32 = first_greedy_tokens(make_engine, ids, 8)
    int4 = first_greedy_tokens(make_engine, ids, 8, dtype=torch.float32, packed_decode=True)
    assert smollm2_tokenizer.decode(int4).startswith("The capital of France is Paris")
    assert int4 == fp32
