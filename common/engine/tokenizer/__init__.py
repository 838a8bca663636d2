"""Text <-> token ids for a model: one small interface, a backend per tokenizer kind, streaming decode, and the
model's chat template rendered as transformers renders it.

    tok = load_tokenizer(path)          # a .gguf, a tokenizer.json / tokenizer.model, or a folder with one
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    ids = tok.encode(prompt)
    stream = StreamDecoder(tok)
    text = "".join(stream.push(i) for i in generated_ids) + stream.flush()

base: the interface and streaming decode; byte_bpe: HF `tokenizers` (a GGUF's byte-level BPE, any
tokenizer.json); spm: `sentencepiece` (a tokenizer.model, a GGUF's SentencePiece vocabulary); chat_template:
the jinja rendering; gguf_vocab and hf_config: what the files say about their tokenizer.
"""
from __future__ import annotations

from pathlib import Path

from common.engine.tokenizer.base import StreamDecoder, Tokenizer
from common.engine.tokenizer.byte_bpe import ByteBPETokenizer
from common.engine.tokenizer.chat_template import ChatTemplate
from common.engine.tokenizer.errors import TokenizerError
from common.engine.tokenizer.gguf_vocab import GGUFVocab
from common.engine.tokenizer.hf_config import read_tokenizer_config
from common.engine.tokenizer.spm import SentencePieceTokenizer

__all__ = ["ByteBPETokenizer", "ChatTemplate", "SentencePieceTokenizer", "StreamDecoder", "Tokenizer",
           "TokenizerError", "load_tokenizer"]


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer in a .gguf file, a tokenizer.json / tokenizer.model file, or a folder holding one.

    Beside a tokenizer.json or tokenizer.model, tokenizer_config.json (and chat_template.jinja) give the
    BOS/EOS tokens and the chat template.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise TokenizerError(f"{path}: no such file or folder; give a .gguf file, a tokenizer.json or "
                             f"tokenizer.model, or a folder holding one")
    if path.is_dir():
        found = [path / name for name in ("tokenizer.json", "tokenizer.model") if (path / name).is_file()]
        if not found:
            raise TokenizerError(f"{path}: folder holds neither tokenizer.json nor tokenizer.model; "
                                 f"give the model's .gguf file or its HF checkpoint folder")
        path = found[0]  # tokenizer.json first: it carries the whole pipeline, added tokens included
    if path.suffix == ".gguf":
        vocab = GGUFVocab.read(path)
        if vocab.model == "gpt2":
            return ByteBPETokenizer.from_gguf(vocab)
        if vocab.model == "llama":
            return SentencePieceTokenizer.from_gguf(vocab)
        raise TokenizerError(
            f"{path}: GGUF tokenizer model {vocab.model!r} is not supported, only 'gpt2' (byte-level BPE) and "
            f"'llama' (SentencePiece); use the model's tokenizer.json or tokenizer.model instead")
    if path.suffix == ".json":
        return ByteBPETokenizer.from_tokenizer_json(path, read_tokenizer_config(path.parent))
    if path.suffix == ".model":
        return SentencePieceTokenizer.from_model_file(path, read_tokenizer_config(path.parent))
    raise TokenizerError(f"{path}: unknown tokenizer file; give a .gguf, a tokenizer.json or a tokenizer.model")
