"""Reference data from llama.cpp's source tree, for the tokenizer tests: vocabulary-only GGUFs of real
tokenizers with their golden ids (models/ggml-vocab-*.gguf, .inp, .out; the ids made with HF tokenizers) and
real chat templates (models/templates/*.jinja).

The tree is `$HANDOFF_LLAMA_CPP_DIR/src` (default ~/.cache/handoff/llama.cpp/src); `make llama-tools` puts it
there. Without it the tests that need it skip.
"""
from __future__ import annotations

import functools
from pathlib import Path

import pytest

from bench import llama_tools
from common.engine.tokenizer import Tokenizer, load_tokenizer

_SEPARATOR = "\n__ggml_vocab_test__\n"


def source_dir() -> Path:
    root = llama_tools.source_dir()
    if not (root / "models").is_dir():
        pytest.skip("llama.cpp's source is not here: run `make llama-tools`")
    return root


def vocab_path(name: str) -> Path:
    return source_dir() / "models" / f"ggml-vocab-{name}.gguf"


def golden_pairs(name: str) -> list[tuple[str, list[int]]]:
    """(text, ids) as llama.cpp's test-tokenizer-0 reads them: texts end with the separator line, one line of
    ids per text."""
    path = vocab_path(name)
    # Bytes, not read_text: universal newlines would turn a "\r\n" in a test text into "\n".
    texts = path.with_suffix(".gguf.inp").read_bytes().decode().removesuffix(_SEPARATOR).split(_SEPARATOR)
    lines = path.with_suffix(".gguf.out").read_text(encoding="utf-8").splitlines()
    assert len(texts) == len(lines), f"{path}: {len(texts)} texts but {len(lines)} lines of ids"
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, lines)]


@functools.cache
def load_vocab(name: str) -> Tokenizer:
    """Our tokenizer for one vocabulary GGUF, loaded once per session (the big ones take a second or two)."""
    return load_tokenizer(vocab_path(name))


def template(name: str) -> str:
    return (source_dir() / "models" / "templates" / f"{name}.jinja").read_text(encoding="utf-8")
