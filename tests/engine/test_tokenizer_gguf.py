"""Tokenizers read from GGUF files, family by family: ids against llama.cpp's golden files (made with HF
tokenizers from each model's own tokenizer files), BOS/EOS and the end-of-turn tokens each family stops on,
Phi-3's whitespace-eating chat tokens, and Gemma's SentencePiece GGUF (written here from a model trained here)
against transformers' GemmaTokenizer and sentencepiece on the same .model."""
from __future__ import annotations

import io
import json

import gguf
import pytest
import sentencepiece
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import GemmaTokenizer, Qwen2Tokenizer

from common.engine.tokenizer import ByteBPETokenizer, SentencePieceTokenizer, StreamDecoder, load_tokenizer
from common.engine.tokenizer.gguf_vocab import GGUFVocab
from tests.support.llama_cpp_files import golden_pairs, load_vocab, vocab_path

# tokenizer.ggml.pre / model -> what llama.cpp's golden files cover: Llama 3 (llama-bpe), Qwen 2.5 / 3 (qwen2),
# Qwen 3.5, GPT-2, the digits-first group SmolLM belongs to (starcoder, refact), MPT, Falcon, DeepSeek;
# SentencePiece: Llama-2 / Mistral v0.1-0.3 (llama-spm) and Phi-3.
# (command-r's file, in the digits-first group too, passes as well but takes seconds to load: left out.)
BYTE_BPE = ["llama-bpe", "qwen2", "qwen35", "gpt-2", "starcoder", "refact", "mpt", "falcon", "deepseek-llm",
            "deepseek-coder"]
SENTENCEPIECE = ["llama-spm", "phi-3"]


@pytest.mark.parametrize("name", BYTE_BPE + SENTENCEPIECE)
def test_golden_ids(name):
    tok = load_vocab(name)
    assert isinstance(tok, SentencePieceTokenizer if name in SENTENCEPIECE else ByteBPETokenizer)
    pairs = golden_pairs(name)
    wrong = [(text, got, ids) for text, ids in pairs if (got := tok.encode(text, add_bos=False)) != ids]
    assert not wrong, f"{len(wrong)}/{len(pairs)} texts differ, first (text, ours, golden): {wrong[0]}"


@pytest.mark.parametrize("name", ["llama-bpe", "gpt-2", "llama-spm", "phi-3"])
def test_golden_texts_round_trip(name):
    tok = load_vocab(name)
    for text, ids in golden_pairs(name):
        assert tok.decode(ids) == text


def test_qwen2_normalizes_to_nfc_as_transformers_does():
    # The golden texts are all NFC already; transformers' Qwen2Tokenizer (and Qwen2's tokenizer.json) normalize,
    # llama.cpp does not. Qwen3.5's golden ids show its tokenizer does not normalize: "e" + U+0301 stays two.
    tok = load_vocab("qwen2")
    merges = [tuple(m.split(" ", 1)) for m in GGUFVocab.read(vocab_path("qwen2")).merges]
    hf = Qwen2Tokenizer(vocab={tok.id_to_piece(i): i for i in range(tok.vocab_size)}, merges=merges)
    for text in ["e\u0301te\u0301", "A\u030a and \u212b", "\ufb01ne \u2126", "caf\u00e9 na\u0308ive"]:
        assert tok.encode(text) == hf.encode(text, add_special_tokens=False), text
    assert tok.encode("e\u0301") == tok.encode("\u00e9")
    assert load_vocab("qwen35").encode("e\u0301") != load_vocab("qwen35").encode("\u00e9")


# bos, eos, whether text gets BOS, and what ends a turn: eos and the family's end-of-turn tokens, as llama.cpp's
# end-of-generation list has them.
@pytest.mark.parametrize("name, bos, eos, add_bos, stops", [
    ("llama-bpe", "<|begin_of_text|>", "<|end_of_text|>", True, {"<|end_of_text|>", "<|eot_id|>"}),
    ("qwen2", "<|endoftext|>", "<|endoftext|>", False, {"<|endoftext|>", "<|im_end|>"}),
    ("gpt-2", "<|endoftext|>", "<|endoftext|>", False, {"<|endoftext|>"}),
    ("starcoder", "<|endoftext|>", "<|endoftext|>", False, {"<|endoftext|>"}),
    ("llama-spm", "<s>", "</s>", True, {"</s>"}),
    ("phi-3", "<s>", "<|endoftext|>", True, {"<|endoftext|>", "<|end|>", "</s>"}),
])
def test_special_tokens_and_stops(name, bos, eos, add_bos, stops):
    tok = load_vocab(name)
    assert (tok.id_to_piece(tok.bos_id), tok.id_to_piece(tok.eos_id), tok.add_bos) == (bos, eos, add_bos)
    stop_ids = {tok.id_to_piece(i): i for i in tok.stop_ids}
    assert stop_ids.keys() == stops
    for piece, token_id in stop_ids.items():
        assert tok.encode(piece, add_bos=False) == [token_id]  # written in text, each is its one token
    assert tok.encode("hi", add_bos=True)[0] == tok.bos_id
    assert tok.encode(f"{bos}hi", add_bos=True).count(tok.bos_id) == 1  # never doubled


def test_phi3_chat_tokens_eat_the_whitespace_after_them():
    tok = load_vocab("phi-3")
    user, end, assistant, endoftext = (tok.encode(p, add_bos=False)[0]
                                       for p in ("<|user|>", "<|end|>", "<|assistant|>", "<|endoftext|>"))
    assert (user, end, assistant, endoftext) == (32010, 32007, 32001, 32000)
    # Phi-3's tokenizer.json: rstrip on its chat tokens, so the template's newlines never reach the model.
    assert tok.encode("<|user|>\nHi<|end|>\n<|assistant|>\n", add_bos=False) == \
        [user] + tok.encode("Hi", add_bos=False) + [end, assistant]
    # ... but not on <s> and <|endoftext|>, and each stretch of text gets its dummy-prefix space.
    assert tok.encode("<s> x<|endoftext|> y", add_bos=False) == \
        [1] + tok.encode(" x", add_bos=False) + [endoftext] + tok.encode(" y", add_bos=False)
    assert tok.decode(tok.encode("<|user|>\nHi<|end|>")) == "<s><|user|>Hi<|end|>"
    assert tok.decode(tok.encode("<|user|>\nHi<|end|>"), skip_special=True) == "Hi"


@settings(max_examples=100, deadline=None)
@given(ids=st.lists(st.one_of(st.integers(0, 300), st.integers(0, 32063)), max_size=24), skip_special=st.booleans())
def test_sentencepiece_stream_equals_decode_for_any_ids(ids, skip_special):
    tok = load_vocab("phi-3")  # control, user-defined (</s>) and byte tokens all in the low ids
    decoder = StreamDecoder(tok, skip_special=skip_special)
    assert "".join(decoder.push(i) for i in ids) + decoder.flush() == tok.decode(ids, skip_special=skip_special)


# --- tokens a GGUF names, and flags ---------------------------------------------------------------------------

def write_gguf(path, arch="llama", **kv):
    """A GGUF with no tensors: tokenizer keys through GGUFWriter's own add_<key> methods."""
    writer = gguf.GGUFWriter(str(path), arch=arch)
    for key, value in kv.items():
        getattr(writer, f"add_{key}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


LLAMA31_TOKENS = ["a", "b", "ab", "Ġ", "<|begin_of_text|>", "<|end_of_text|>", "<|eom_id|>", "<|eot_id|>",
                  "<|python_tag|>"]


def test_llama31_stops_on_eom_and_eot(tmp_path):
    path = write_gguf(tmp_path / "llama31.gguf", tokenizer_model="gpt2", tokenizer_pre="llama-bpe",
                      token_list=LLAMA31_TOKENS, token_types=[1, 1, 1, 1, 3, 3, 3, 3, 3], token_merges=["a b"],
                      bos_token_id=4, eos_token_id=7)
    tok = load_tokenizer(path)
    # A tool call ends with <|eom_id|>, a turn with <|eot_id|>, the base model's text with <|end_of_text|>.
    assert tok.stop_ids == {5, 6, 7}
    assert tok.add_bos is True  # llama.cpp's default for this family when the file has no add_bos_token
    assert tok.encode("ab<|python_tag|>") == [4, 2, 8]


def test_stop_ids_and_flags_the_file_names(tmp_path):
    path = write_gguf(tmp_path / "named.gguf", tokenizer_model="gpt2", tokenizer_pre="qwen2",
                      token_list=["a", "b", "<s>", "</s>", "<turn_done>", "<tool_done>"],
                      token_types=[1, 1, 3, 3, 3, 3],
                      token_merges=[], bos_token_id=2, eos_token_id=3, eot_token_id=4, eom_token_id=5,
                      add_bos_token=True, add_eos_token=True)
    tok = load_tokenizer(path)
    assert tok.stop_ids == {3, 4, 5}  # texts no list knows, but the file says so
    assert tok.encode("ab") == [2, 0, 1, 3]
    assert tok.encode("ab</s>") == [2, 0, 1, 3]  # EOS never doubled either
    assert tok.encode("ab", add_bos=False, add_eos=False) == [0, 1]


# --- Gemma: SentencePiece without the dummy-prefix space ----------------------------------------------------------

GEMMA_TRAIN = ["The quick brown fox jumps over the lazy dog.", "Hello world, this is a tiny corpus for a test.",
               "Streaming detokenization must never emit half a character.", "def add(a, b):\n    return a + b",
               "1234 5678 in 2024, then 99."] * 20
GEMMA_WHITESPACE = ["▁▁", "▁▁▁", "▁▁▁▁"]  # Gemma's .model has user-defined runs of spaces, up to 31
GEMMA_CORPUS = ["", "Hello world", " Hello world", "Hello  world", "a   b    c", "  leading", "trailing  ",
                "x\n\ny\t z", "def add(a, b):\n    return a + b", "1234 56789", "naïve café 中文 😀",
                "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
                "<bos><start_of_turn>user\n  hi  <end_of_turn>", "text<eos>more", "<unk> <pad>"]


@pytest.fixture(scope="module")
def gemma_files(tmp_path_factory):
    """A Gemma-shaped tokenizer.model (ids 0-3 <pad> <eos> <bos> <unk>, byte fallback, no dummy prefix) and the
    GGUF llama.cpp's converter makes of it with Gemma's tokenizer_config.json: added special tokens become
    control, added plain ones user-defined with their "▁" written as spaces, both scored -1000."""
    folder = tmp_path_factory.mktemp("gemma")
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(GEMMA_TRAIN), model_writer=model, vocab_size=400, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=False, split_digits=True, pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>",
        eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>", *GEMMA_WHITESPACE],
        character_coverage=1.0, minloglevel=2)
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    sp = sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())
    special = {"<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"}
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        piece, score = sp.id_to_piece(i), sp.get_score(i)
        kind = 2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1
        if piece in special:
            kind, score = 3, -1000.0
        elif piece in GEMMA_WHITESPACE:
            kind, score, piece = 4, -1000.0, piece.replace("▁", " ")
        tokens.append(piece)
        scores.append(score)
        types.append(kind)
    write_gguf(folder / "gemma.gguf", arch="gemma2", tokenizer_model="llama", tokenizer_pre="default",
               token_list=tokens, token_scores=scores, token_types=types, bos_token_id=2, eos_token_id=1,
               unk_token_id=3, pad_token_id=0, eot_token_id=tokens.index("<end_of_turn>"), add_bos_token=True,
               add_eos_token=False, add_space_prefix=False)
    (folder / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True, "added_tokens_decoder": {
        str(tokens.index(t)): {"content": t, "special": True, "normalized": False, "lstrip": False, "rstrip": False,
                               "single_word": False} for t in ("<start_of_turn>", "<end_of_turn>")}}))
    return folder, sp


def test_gemma_gguf_matches_transformers(gemma_files):
    folder, _ = gemma_files
    ours = load_tokenizer(folder / "gemma.gguf")
    hf = GemmaTokenizer.from_pretrained(str(folder))
    assert isinstance(ours, SentencePieceTokenizer)
    for text in GEMMA_CORPUS:
        assert ours.encode(text, add_bos=False) == hf.encode(text, add_special_tokens=False), text
        if not text.startswith("<bos>"):  # where transformers gives two BOS, we give one
            assert ours.encode(text) == hf.encode(text), text  # BOS in front, as Gemma's add_bos_token says
        assert ours.decode(ours.encode(text, add_bos=False)) == text
    assert ours.id_to_piece(ours.encode("Hello")[1]) == "Hello"  # no dummy-prefix space
    assert (ours.bos_id, ours.eos_id) == (hf.bos_token_id, hf.eos_token_id) == (2, 1)
    assert {ours.id_to_piece(i) for i in ours.stop_ids} == {"<eos>", "<end_of_turn>"}


def test_gemma_gguf_matches_sentencepiece_on_long_space_runs(gemma_files):
    # A run of spaces longer than the longest user-defined one: llama.cpp matches the user-defined run whole and
    # sentencepiece does the same, while transformers' BPE built from the .model merges the run its own way
    # ("c     d": ▁▁▁▁ ▁ d here and in sentencepiece, ▁▁ ▁▁▁ d in transformers). We follow the model's own.
    folder, sp = gemma_files
    ours = load_tokenizer(folder / "gemma.gguf")
    for text in ["c     d", "x" + " " * 11 + "y", "     ", *GEMMA_TRAIN[:5]]:
        assert ours.encode(text, add_bos=False) == sp.encode(text), text
