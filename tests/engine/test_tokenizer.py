"""Tokenizer: ids, decode and chat template against HF transformers on the same GGUF; streaming decode;
the SentencePiece backend against sentencepiece itself; load errors."""
from __future__ import annotations

import io
import json
import logging

import gguf
import pytest
import sentencepiece
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import pre_tokenizers
from transformers import AutoTokenizer

from common.engine.model_files import resolve_model_path
from common.engine.tokenizer import (ByteBPETokenizer, SentencePieceTokenizer, StreamDecoder, TokenizerError,
                              load_tokenizer)

CORPUS = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. It's what they'd've done, isn't it?",
    "naïve café résumé Ångström façade Zürich",
    "中文分词测试：我们今天去公园。日本語のテキストもあります。한국어 문장입니다.",
    "مرحبا بالعالم، كيف حالك؟ שלום עולם",
    "e\u0301 n\u0303 a\u0308\u0304 Z\u0351\u0310\u0357 \u0915\u094d\u0937",  # combining marks, a Devanagari conjunct
    "emoji 😀🎉 👩\u200d👩\u200d👧\u200d👦 🏳️\u200d🌈 🇯🇵🇫🇷 👍🏽",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    '{"name": "handoff", "ids": [1, 22, 333], "nested": {"ok": true, "pi": 3.14159, "s": "a\\"b"}}',
    "spaces   between    words\t\ttabs\n\n\nnewlines \n \t mixed  \r\n\r\nend",
    "    leading and trailing    ",
    "digits 0 12 345 6789 3.14159 1,000,000 2024-06-01  42\n\n7\t\t8",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text <|im_end|><|im_start|><|im_start|> <file_sep>",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Say 'bye' in 中文 😀"}],
    [{"role": "user", "content": "  indented\n\tcode  "}, {"role": "assistant", "content": ""}],
]


@pytest.fixture(scope="module")
def gguf_path():
    return resolve_model_path("smollm2")


@pytest.fixture(scope="module")
def tok(gguf_path):
    return load_tokenizer(gguf_path)


@pytest.fixture(scope="module")
def hf_tok(gguf_path):
    hf = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    # transformers' GGUF loader has no entry for tokenizer.ggml.pre "smollm" and leaves digits unsplit;
    # SmolLM2's own tokenizer.json and llama.cpp isolate each digit first. Give the reference that split,
    # so it differs from us only where it should not; test_smollm_isolates_digits pins the split itself.
    hf.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    return hf


def stream(tokenizer, ids, skip_special):
    """Every push() result, then flush()'s."""
    decoder = StreamDecoder(tokenizer, skip_special=skip_special)
    return [decoder.push(i) for i in ids] + [decoder.flush()]


# --- byte-level BPE from the GGUF, against HF -------------------------------------------------------

@pytest.mark.parametrize("text", CORPUS)
def test_ids_match_hf(tok, hf_tok, text):
    assert tok.encode(text) == hf_tok.encode(text)


@pytest.mark.parametrize("text", CORPUS)
def test_decode_round_trips_and_matches_hf(tok, hf_tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode(ids) == hf_tok.decode(ids)
    assert tok.decode(ids, skip_special=True) == hf_tok.decode(ids, skip_special_tokens=True)


def test_smollm_isolates_digits(tok):
    # llama.cpp's "smollm" split: each \p{N} alone, then the GPT-2 regex, so the whitespace run before a
    # digit stays one token (plain GPT-2 splitting gives "Ġ", "Ġ", "1").
    pieces = [tok.id_to_piece(i) for i in tok.encode("x  12\n\n3")]
    assert pieces == ["x", "ĠĠ", "1", "2", "ĊĊ", "3"]


def test_special_ids_match_hf(tok, hf_tok):
    assert tok.vocab_size == len(hf_tok) == 49152
    assert (tok.bos_id, tok.eos_id) == (hf_tok.bos_token_id, hf_tok.eos_token_id) == (1, 2)
    assert tok.add_bos is False
    assert tok.encode("hi", add_bos=True) == [1] + tok.encode("hi")
    assert tok.encode("<|im_start|>hi", add_bos=True) == tok.encode("<|im_start|>hi")  # BOS never doubled
    for piece in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<file_sep>"):
        assert tok.encode(piece) == [hf_tok.convert_tokens_to_ids(piece)]
    assert tok.stop_ids == {tok.encode("<|im_end|>")[0], tok.encode("<|endoftext|>")[0]}
    assert tok.special_ids == set(range(17))  # the GGUF's 17 control tokens


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_hf(tok, hf_tok, messages, add_generation_prompt):
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert ours == hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def test_tokenizer_json_folder_matches_gguf(tok, hf_tok, tmp_path):
    hf_tok.save_pretrained(tmp_path)  # tokenizer.json, tokenizer_config.json, chat_template.jinja
    from_json = load_tokenizer(tmp_path)
    assert isinstance(from_json, ByteBPETokenizer)
    assert (from_json.vocab_size, from_json.bos_id, from_json.eos_id, from_json.add_bos) == \
           (tok.vocab_size, tok.bos_id, tok.eos_id, tok.add_bos)
    assert from_json.stop_ids == tok.stop_ids and from_json.special_ids == tok.special_ids
    for text in CORPUS:
        assert from_json.encode(text) == tok.encode(text), text
    assert from_json.apply_chat_template(CONVERSATIONS[1]) == tok.apply_chat_template(CONVERSATIONS[1])


# --- streaming ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("skip_special", [False, True])
@pytest.mark.parametrize("text", CORPUS)
def test_stream_equals_decode(tok, text, skip_special):
    ids = tok.encode(text)
    chunks = stream(tok, ids, skip_special)
    assert "".join(chunks) == tok.decode(ids, skip_special=skip_special)
    assert not any("\ufffd" in c for c in chunks)  # the corpus has none, so no chunk may


def test_stream_holds_back_split_characters(tok):
    text = " 😀 中文 👩\u200d👧"
    ids = tok.encode(text)
    split = [n for n in range(len(ids)) if tok.decode(ids[:n + 1]).endswith("\ufffd")]
    assert split, "no token ends inside a character: the test would prove nothing"
    chunks = stream(tok, ids, skip_special=True)
    for n in split:
        assert chunks[n] == "", f"token {n} ends inside a character but text came out: {chunks[n]!r}"
    assert "".join(chunks) == text
    assert " 😀" in chunks  # emitted whole, once its last byte arrived


# Ids 0..16 are the control tokens and 17..272 single bytes, so short lists of them are full of broken
# UTF-8 and specials: the invariant must hold for any id sequence, not only for encoded text.
@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.one_of(st.integers(0, 272), st.integers(0, 49151)), max_size=24),
       skip_special=st.booleans())
def test_stream_equals_decode_for_any_ids(tok, ids, skip_special):
    assert "".join(stream(tok, ids, skip_special)) == tok.decode(ids, skip_special=skip_special)


# --- SentencePiece ------------------------------------------------------------------------------------

SP_TRAIN = ["The quick brown fox jumps over the lazy dog.", "Hello world, this is a tiny corpus for a test.",
            "Streaming detokenization must never emit half a character.", "def add(a, b):\n    return a + b"] * 20
SP_CORPUS = ["", "hello  world the quick", "  leading spaces", "trailing  ", "a\n\tb\r\n",
             "中文 😀 naïve 👩\u200d👧", "<s>hi</s>", "x<|im_end|> y", "</s><s>", " <s> spaced </s> "]


@pytest.fixture(scope="module")
def sp_model_bytes():
    model = io.BytesIO()
    # Llama-2's settings: identity normalization, whitespace kept, byte fallback for unseen characters.
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(SP_TRAIN), model_writer=model, vocab_size=400, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        control_symbols=["<|im_end|>"], character_coverage=1.0, minloglevel=2)
    return model.getvalue()


@pytest.fixture(scope="module")
def sp_dir(sp_model_bytes, tmp_path_factory):
    folder = tmp_path_factory.mktemp("sp")
    (folder / "tokenizer.model").write_bytes(sp_model_bytes)
    return folder


@pytest.fixture(scope="module")
def sp_tok(sp_dir):
    return load_tokenizer(sp_dir)


@pytest.fixture(scope="module")
def sp_raw(sp_model_bytes):
    return sentencepiece.SentencePieceProcessor(model_proto=sp_model_bytes)


def test_sp_ids_match_sentencepiece(sp_tok, sp_raw):
    assert isinstance(sp_tok, SentencePieceTokenizer)
    assert (sp_tok.vocab_size, sp_tok.bos_id, sp_tok.eos_id) == (400, sp_raw.bos_id(), sp_raw.eos_id()) == (400, 1, 2)
    assert sp_tok.add_bos is True  # no tokenizer_config.json: Llama's default
    for text in SP_TRAIN[:4] + SP_CORPUS[:6]:
        assert sp_tok.encode(text, add_bos=False) == sp_raw.encode(text), text
        assert sp_tok.encode(text) == [1] + sp_raw.encode(text), text


def test_sp_special_pieces_in_text(sp_tok, sp_raw):
    im_end = sp_raw.piece_to_id("<|im_end|>")
    assert sp_tok.special_ids == {1, 2, im_end}
    assert sp_tok.stop_ids == {2, im_end}
    # Each chunk between specials is encoded on its own, dummy-prefix space included (llama.cpp, HF legacy).
    assert sp_tok.encode("<s>hi</s>", add_bos=False) == [1] + sp_raw.encode("hi") + [2]
    assert sp_tok.encode("<s>hi") == [1] + sp_raw.encode("hi")  # BOS never doubled
    assert sp_tok.encode("x<|im_end|>") == [1] + sp_raw.encode("x") + [im_end]
    assert sp_tok.decode(sp_tok.encode("<s>hi</s>"), skip_special=True) == "hi"


@pytest.mark.parametrize("text", SP_CORPUS)
def test_sp_round_trip_and_stream(sp_tok, text):
    ids = sp_tok.encode(text, add_bos=False)
    assert sp_tok.decode(ids) == text
    for skip_special in (False, True):
        chunks = stream(sp_tok, ids, skip_special)
        assert "".join(chunks) == sp_tok.decode(ids, skip_special=skip_special)
        assert not any("\ufffd" in c for c in chunks)


def test_sp_stream_keeps_spaces_the_first_piece_loses(sp_tok):
    ids = sp_tok.encode("the quick brown", add_bos=False)
    assert sp_tok.id_to_piece(ids[1]).startswith("\u2581")  # alone, this piece decodes without its space
    assert stream(sp_tok, ids, skip_special=True)[1].startswith(" ")


def test_sp_chatml_fallback(sp_tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert sp_tok.apply_chat_template(messages) == \
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert sp_tok.apply_chat_template(messages, add_generation_prompt=False).endswith("Hi<|im_end|>\n")


def test_sp_tokenizer_config(sp_model_bytes, tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(sp_model_bytes)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": False, "eos_token": {"content": "<|im_end|>"},
        "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}"
                         "{% endfor %}{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}",
    }))
    sp_tok = load_tokenizer(tmp_path / "tokenizer.model")  # the file itself: the config beside it still counts
    assert sp_tok.add_bos is False and sp_tok.encode("hi")[:1] != [1]
    assert sp_tok.eos_id == sp_tok.encode("<|im_end|>")[0]
    assert sp_tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>[user] hi<|im_end|>"
    with pytest.raises(TokenizerError, match="one message only"):
        sp_tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


# --- errors -------------------------------------------------------------------------------------------

def write_gguf(path, **tokenizer_kv):
    """A GGUF with no tensors and the given tokenizer.ggml.* string/int/array keys."""
    writer = gguf.GGUFWriter(str(path), arch="llama")
    for key, value in tokenizer_kv.items():
        if isinstance(value, str):
            writer.add_string(f"tokenizer.ggml.{key}", value)
        elif isinstance(value, int):
            writer.add_uint32(f"tokenizer.ggml.{key}", value)
        else:
            writer.add_array(f"tokenizer.ggml.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


TINY_BPE = dict(model="gpt2", eos_token_id=0, tokens=["<|endoftext|>", "a", "b", "Ġ", "1", "ab", "Ġa"],
                token_type=[3, 1, 1, 1, 1, 1, 1], merges=["a b", "Ġ a"])


def test_default_pre_tokenizer_warns_and_uses_gpt2_regex(tmp_path, caplog):
    path = write_gguf(tmp_path / "tiny.gguf", pre="default", **TINY_BPE)
    with caplog.at_level(logging.WARNING, logger="common.engine.tokenizer"):
        tiny = load_tokenizer(path)
    assert "'default'" in caplog.text
    assert tiny.encode("ab a<|endoftext|>") == [5, 6, 0]
    assert tiny.bos_id is None and tiny.encode("a", add_bos=True) == [1]


def test_unknown_pre_tokenizer_is_refused(tmp_path):
    # Splitting with some other family's regex would give the model wrong ids without a word; refuse instead.
    with pytest.raises(TokenizerError, match="'mystery'.*not supported.*tokenizer.json"):
        load_tokenizer(write_gguf(tmp_path / "tiny.gguf", pre="mystery", **TINY_BPE))


def test_missing_path(tmp_path):
    with pytest.raises(TokenizerError, match="no such file") as err:
        load_tokenizer(tmp_path / "nope.gguf")
    assert "nope.gguf" in str(err.value)
    assert issubclass(TokenizerError, ValueError)


def test_folder_without_tokenizer(tmp_path):
    with pytest.raises(TokenizerError, match="neither tokenizer.json nor tokenizer.model"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("content", [b"", b"not a gguf at all" * 64, "truncated"])
def test_damaged_gguf(gguf_path, tmp_path, content):
    if content == "truncated":
        with open(gguf_path, "rb") as f:
            content = f.read(1 << 20)  # the metadata alone runs past 1 MiB
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(TokenizerError, match="not a readable GGUF") as err:
        load_tokenizer(path)
    assert str(path) in str(err.value)


def test_gguf_with_unsupported_tokenizer(tmp_path):
    path = write_gguf(tmp_path / "bert.gguf", model="bert", tokens=["[UNK]", "[CLS]", "[SEP]"], eos_token_id=2)
    with pytest.raises(TokenizerError, match="'bert' is not supported.*tokenizer.model"):
        load_tokenizer(path)


def test_gguf_without_tokenizer(tmp_path):
    with pytest.raises(TokenizerError, match="carries no tokenizer"):
        load_tokenizer(write_gguf(tmp_path / "bare.gguf"))
