"""The engine benchmark's llama.cpp peer: without llama-cpp-python, one line says which figures were left
out and how to get them; with it, a tiny run emits those figures against the same token ids."""
from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import engine, llamacpp

ROOT = Path(__file__).resolve().parents[2]
LLAMA_CPP_MISSING = llamacpp.missing_reason()


def json_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def test_skip_line_names_the_figures_and_how_to_get_them(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` now raises ImportError
    figures = engine.llama_cpp_figures({"prefill", "decode", "memory"}, {128: 15, 512: 9, 2048: 5}, [1, 8, 32])
    assert engine.load_llama_cpp(figures, threads=2, n_ctx=512) is None
    out, err = capsys.readouterr()
    [rec] = json_lines(out)
    assert rec == {"name": "llama_cpp_peer", "skipped": rec["skipped"], "how": llamacpp.HOW_TO_GET,
                   "figures": ["prefill_tok_s_128_vs_llama_cpp", "prefill_tok_s_512_vs_llama_cpp",
                               "decode_tok_s_1seq_vs_llama_cpp"]}
    assert "llama_cpp is not importable" in rec["skipped"]
    assert "make bench-peers" in rec["how"] and "make bench-peers" in err


AMX_BUILD = "CPU : AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | AMX_INT8 = 1 | OPENMP = 1 | "
PLAIN_BUILD = AMX_BUILD.replace("AMX_INT8 = 1 | ", "")


def test_a_build_with_amx_kernels_is_refused_on_a_cpu_with_amx():
    """Its AMX matmul crashed the benchmark's process on the Intel VM; elsewhere those kernels never run."""
    amx_cpu = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"})
    why = llamacpp.amx_reason(AMX_BUILD, amx_cpu)
    assert why is not None and "AMX kernels" in why and "20824" in why
    assert llamacpp.amx_reason(PLAIN_BUILD, amx_cpu) is None
    assert llamacpp.amx_reason(AMX_BUILD, amx_cpu - {"amx_tile", "amx_int8", "amx_bf16"}) is None


def test_the_skip_line_for_a_refused_build_says_to_rebuild(monkeypatch, capsys):
    monkeypatch.setattr(llamacpp, "missing_reason",
                        lambda: llamacpp.amx_reason(AMX_BUILD, frozenset({"amx_tile"})))
    assert engine.load_llama_cpp(["decode_tok_s_1seq_vs_llama_cpp"], threads=2, n_ctx=512) is None
    [rec] = json_lines(capsys.readouterr().out)
    assert "AMX kernels" in rec["skipped"] and "rebuilds it" in rec["how"]


def test_the_long_context_figure_is_listed_only_where_it_runs():
    assert engine.llama_cpp_figures({"decode"}, {128: 5}, [1, 8], long_context=1024) == [
        "decode_tok_s_1seq_vs_llama_cpp", "decode_tok_s_1seq_ctx1024_vs_llama_cpp"]
    assert engine.llama_cpp_figures({"decode"}, {128: 5}, [8, 32], long_context=1024) == []


def test_one_stream_at_a_long_context_is_measured_against_hf(capsys, bench_systems):
    """bench_decode_long (llama.cpp absent here, or not): ours and HF step in turn after a longer prompt,
    and the figure names its context."""
    _, ours, hf = bench_systems
    capsys.readouterr()
    engine.bench_decode_long(ours, hf, 160, steps=3, warmup=1, llama=None)
    [rec] = json_lines(capsys.readouterr().out)
    assert rec["name"] == "decode_tok_s_1seq_ctx160" and rec["peer"] == engine.PEER and rec["context_len"] == 160
    assert rec["value"] > 0 and rec["peer_value"] > 0 and rec["steps"] == 3
    assert ours.runner.cache.pool.num_used_blocks == 0  # the loops freed their sequences


def test_no_llama_cpp_line_when_the_sections_need_no_peer(capsys):
    assert engine.llama_cpp_figures({"bandwidth", "memory"}, {128: 5}, [1, 8]) == []
    assert engine.llama_cpp_figures({"decode"}, {128: 5}, [8, 32]) == []  # llama.cpp decodes at 1 stream only
    assert engine.load_llama_cpp([], threads=2, n_ctx=512) is None
    assert capsys.readouterr().out == ""


def test_make_installs_a_pinned_llama_cpp_outside_the_requirements():
    dry = subprocess.run(["make", "-n", "bench-peers"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "pip install" in dry and "llama-cpp-python==0.3." in dry and "-DGGML_NATIVE=ON" in dry
    # An earlier build goes first, and on x86-64 the new one leaves out the AMX kernels that crashed.
    assert dry.index("pip uninstall -q -y llama-cpp-python") < dry.index("pip install")
    if platform.machine() == "x86_64":
        for flags in ("CMAKE_C_FLAGS", "CMAKE_CXX_FLAGS"):
            assert f"'-D{flags}=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'" in dry
    for req in ROOT.glob("requirements*.txt"):
        assert "llama" not in req.read_text().lower(), req


@pytest.mark.skipif(LLAMA_CPP_MISSING is not None,
                    reason=f"{LLAMA_CPP_MISSING}; {llamacpp.HOW_TO_GET}")
def test_tiny_run_emits_the_llama_cpp_figures(capsys, bench_systems):
    from bench.bandwidth import ReadBandwidth

    threads = torch.get_num_threads()
    figures = engine.llama_cpp_figures({"prefill", "decode"}, {128: 1}, [1], long_context=160)
    dtype, ours, hf = bench_systems
    llama = engine.load_llama_cpp(figures, threads, n_ctx=512)
    assert llama is not None and llama.llm.context_params.n_threads == threads

    # A prefill recomputes the whole prompt: the cache holds its positions once, not twice.
    _, ids = engine.chat_prompt(ours.tokenizer, 128)
    llama.prefill_s(ids)
    llama.prefill_s(ids)
    assert llama.num_cached() == 128 and llama.llm.n_tokens == 128

    bandwidth = ReadBandwidth(16 << 20)
    bandwidth.measure(1)
    capsys.readouterr()
    engine.bench_prefill(ours, hf, {128: 1}, llama)
    engine.bench_decode(ours, hf, [1], steps=3, warmup=1, bandwidth=bandwidth, dtype=dtype, llama=llama,
                        long_context=160)
    recs = {r["name"]: r for r in json_lines(capsys.readouterr().out)}

    assert [n for n in recs if n.endswith("_vs_llama_cpp")] == figures
    for name in figures:
        rec = recs[name]
        assert rec["peer"] == "llama.cpp" and rec["unit"].startswith("tok/s")
        assert rec["value"] > 0 and rec["peer_value"] > 0
        assert rec["ratio"] == pytest.approx(rec["value"] / rec["peer_value"], rel=1e-3)
    # One measurement of ours, compared with each peer.
    assert recs["prefill_tok_s_128_vs_llama_cpp"]["value"] == recs["prefill_tok_s_128"]["value"]
    assert recs["decode_tok_s_1seq_vs_llama_cpp"]["value"] == recs["decode_tok_s_1seq"]["value"]
    # The same prompt ids and greedy decoding: the first token at least agrees (Q4_1 kernels and our
    # dequantized weights may part later).
    match = recs["decode_greedy_prefix_match_llama_cpp_1seq"]
    assert match["value"] >= 1 and int(match["unit"].split()[2]) >= 4  # "tokens of N ..."
    assert llama.num_cached() == 0  # the decode loop left the context empty
