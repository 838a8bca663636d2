"""The model zoo's small architectures (bench/zoo) for the tests: each family as an HF folder and the GGUFs
llama.cpp's own converter and quantizer make of it.

`make test` does not build llama.cpp's tools: without them a test that asks for the files skips and names
the command that builds them. With them, the first session that asks builds the files it lacks (`make zoo`
builds them all ahead); later sessions load them from the cache.
"""
from __future__ import annotations

import pytest

from bench import llama_tools

SKIP_REASON = "llama.cpp's tools are not built: run `make llama-tools`"


def skip_without_tools() -> None:
    if llama_tools.missing() is not None:
        pytest.skip(SKIP_REASON)


@pytest.fixture(scope="session")
def family_files():
    """family_files(arch) -> bench.zoo.ArchFiles (hf_dir, [QTYPE] -> GGUF path), built once per cache."""
    skip_without_tools()
    from bench import zoo

    built: dict[str, zoo.ArchFiles] = {}

    def get(arch: str) -> zoo.ArchFiles:
        if arch not in built:
            built[arch] = zoo.build(arch)
        return built[arch]

    return get


# What a GGUF cannot say, so what llama.cpp, and our loader with it, takes the model to be: HF config overrides
# that make HF that model.
GGUF_READS_AS = {
    # The 'llama' architecture has no sliding window: the converter drops Mistral's.
    "mistral": {"sliding_window": None},
    # query_pre_attn_scalar is never written: llama.cpp scales scores by 1/sqrt(head_dim) (here 128, not 64)
    # unless the model has the 27B's 46 layers.
    "gemma2": {"query_pre_attn_scalar": 128},
}


def hf_reading_the_gguf(files):
    """HF transformers (fp32, eager) on an architecture's HF folder, as its GGUF files are read (GGUF_READS_AS)."""
    from bench import zoo

    return zoo.hf_model(files.hf_dir, **GGUF_READS_AS.get(files.arch, {}))
