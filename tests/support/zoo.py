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
