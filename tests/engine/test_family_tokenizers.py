"""Every family's GGUF tokenizer (bench/zoo's files, as llama.cpp's converter writes them) against transformers'
tokenizer of the HF folder it was converted from: the same ids on texts of every kind, the chat template
rendered to the same text, and that text to the same ids (the prompt a server tokenizes).

One documented difference: SentencePiece with a dummy prefix (mistral, phi3 here; Llama 2, Mistral v0.1-0.3,
Phi-3 in the wild). llama.cpp gives every stretch of text between special tokens sentencepiece's dummy-prefix
space, text that starts with a space included ("[INST]Hi" -> [INST] "▁Hi", " Hi" -> "▁▁Hi"), and so does our
tokenizer; the tokenizer.json transformers 5 writes for the folder (Metaspace, prepend_scheme "first") adds
it to the first stretch only, and never to one that starts with a space. For those texts the ids must be
llama.cpp's, computed from the folder's own tokenizer.model (llama_cpp_spm_ids).

They skip where llama.cpp's tools are not built (`make llama-tools`).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench.zoo.specs import ARCHS, SPECS
from common.engine.tokenizer import TokenizerError, load_tokenizer
from tests.support.zoo import family_files  # noqa: F401 (a fixture)

TEXTS = ["Hello world", "The year 2024 had 366 days, or 8784 hours.", "naïve café — déjà vu 😀",
         "cafe\u0301 in NFD", "def f(x):\n    return x  # 42\n", "line one\n\nline three\t tab  ",
         "DON'T stop: we'll see, it's 3.14!"]
DUMMY_PREFIX_TEXTS = [" leading space", "  two spaces first"]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Why?"}],  # Gemma refuses a system turn
]
# The SentencePiece families whose tokenizer.model adds the dummy-prefix space (Gemma's does not).
DUMMY_PREFIX = tuple(a for a in ARCHS if SPECS[a]["tokenizer"].get("trainer", {}).get("add_dummy_prefix"))


@pytest.fixture(scope="module")
def tokenizers(family_files):  # noqa: F811 (the fixture)
    """tokenizers(arch) -> (ours from the F32 GGUF, transformers' AutoTokenizer of the folder, the folder)."""
    from transformers import AutoTokenizer

    cache: dict = {}

    def get(arch: str):
        if arch not in cache:
            files = family_files(arch)
            cache[arch] = (load_tokenizer(files["F32"]), AutoTokenizer.from_pretrained(str(files.hf_dir)),
                           files.hf_dir)
        return cache[arch]

    return get


def llama_cpp_spm_ids(hf, folder: Path, text: str) -> list[int]:
    """llama.cpp's SentencePiece tokenization (llama-vocab.cpp, tokenize): the folder's added tokens matched
    whole first, the whitespace after a token that strips it (Phi-3's) dropped, every stretch of text between
    them encoded on its own by the folder's tokenizer.model, dummy-prefix space and all."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    added = {t.content: (i, t.rstrip) for i, t in hf.added_tokens_decoder.items()}
    pattern = "(" + "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)) + ")"
    ids, strip = [], False
    for n, chunk in enumerate(re.split(pattern, text)):
        if n % 2:
            token_id, strip = added[chunk]
            ids.append(token_id)
            continue
        chunk = chunk.lstrip() if strip else chunk
        if chunk:
            ids += sp.encode(chunk)
    return ids


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_tokenizer_encodes_as_transformers(arch, tokenizers):
    ours, hf, folder = tokenizers(arch)
    for text in TEXTS:
        want = hf.encode(text)
        if arch == "llama3":
            # The zoo's Llama 3 folder has no post-processor (bench/zoo/specs.py says why), so transformers adds
            # no BOS; the GGUF says to add one, as real Llama 3 GGUFs and tokenizers do.
            want = [hf.bos_token_id] + want
        assert ours.encode(text) == want, f"{arch}: {text!r}"
        assert ours.decode(want, skip_special=True) == hf.decode(want, skip_special_tokens=True), f"{arch}: {text!r}"
    for text in DUMMY_PREFIX_TEXTS:
        want = hf.encode(text, add_special_tokens=False)
        if arch in DUMMY_PREFIX:
            assert want != llama_cpp_spm_ids(hf, folder, text), f"{arch}: transformers is llama.cpp on {text!r} now"
            want = llama_cpp_spm_ids(hf, folder, text)
        assert ours.encode(text, add_bos=False) == want, f"{arch}: {text!r}"


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_chat_template_renders_as_transformers(arch, tokenizers):
    from jinja2 import TemplateError

    ours, hf, folder = tokenizers(arch)
    rendered = 0
    for messages in CONVERSATIONS:
        try:
            want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except TemplateError:
            with pytest.raises(TokenizerError):
                ours.apply_chat_template(messages)
            continue
        assert ours.apply_chat_template(messages) == want, f"{arch}: {messages}"
        # As a server encodes a rendered prompt: the template writes BOS itself where the model wants one.
        if arch in DUMMY_PREFIX:
            want_ids = llama_cpp_spm_ids(hf, folder, want)
        else:
            want_ids = hf.encode(want, add_special_tokens=False)
        assert ours.encode(want) == want_ids, f"{arch}: {want!r}"
        rendered += 1
    assert rendered, f"{arch}: the template rendered no conversation"
