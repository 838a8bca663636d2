"""Tokenizers on HF `tokenizers`: a GGUF's byte-level BPE (tokenizer.ggml.model "gpt2"), rebuilt as its family's
tokenizer.json builds it, and any tokenizer.json as it stands."""
from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import tokenizers
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers

from common.engine.tokenizer.base import Tokenizer
from common.engine.tokenizer.errors import TokenizerError
from common.engine.tokenizer.gguf_vocab import CONTROL, USER_DEFINED, GGUFVocab
from common.engine.tokenizer.hf_config import config_chat_template, config_token_text

log = logging.getLogger(__name__)

# The split regexes as the families' tokenizer.json files write them (llama.cpp's llama-vocab.cpp quotes each
# next to its own rewrite for an engine without (?i:...)).
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# DeepSeek-LLM's letter class holds six compatibility characters (U+1F7D ... U+212A) that NFC, and so many an
# editor, would rewrite into other code points: those are escaped.
_DEEPSEEK_LLM = (
    "[\r\n]",
    "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅ"
    "ὐ-ὗὙὛὝὟ-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\u2126ℨ\u212a-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄ"
    "Ⰰ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
    r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
    r"\s+$",
    r"[一-龥ࠀ-一가-퟿]+",
)
_DEEPSEEK_CODER = ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+")


@dataclass(frozen=True)
class _Family:
    """How one family's tokenizer.json turns text into pieces for BPE: its pre-tokenizer steps and settings."""
    steps: Callable[[], list[pre_tokenizers.PreTokenizer]]
    nfc: bool = False            # NFC-normalize first: Qwen2's tokenizer.json does (llama.cpp does not)
    ignore_merges: bool = False  # a piece that is a whole vocabulary entry is one token, merges or not
    add_bos: bool = False        # llama.cpp's default where the file has no tokenizer.ggml.add_bos_token


def _split(*patterns: str) -> list[pre_tokenizers.PreTokenizer]:
    return [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in patterns]


def _byte_level(gpt2_regex: bool = False) -> pre_tokenizers.PreTokenizer:
    # use_regex: ByteLevel's own split, GPT-2's regex; the families with their own regex split before it.
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=gpt2_regex)


def _digits(individual: bool = True) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Digits(individual_digits=individual)


_LLAMA3_FAMILY = _Family(lambda: [*_split(_LLAMA3), _byte_level()], ignore_merges=True, add_bos=True)
_QWEN2_FAMILY = _Family(lambda: [*_split(_QWEN2), _byte_level()], nfc=True)
_GPT2_FAMILY = _Family(lambda: [_byte_level(gpt2_regex=True)])
_DIGITS_GPT2_FAMILY = _Family(lambda: [_digits(), _byte_level(gpt2_regex=True)])

# tokenizer.ggml.pre -> family, grouped as llama.cpp groups the names. "default" is what a converter writes for
# a tokenizer it did not recognise: the file does not say how to split, so GPT-2's regex it is, with a warning.
_FAMILIES = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
                    _LLAMA3_FAMILY),
    "tekken": _Family(lambda: [*_split(_TEKKEN), _byte_level()], ignore_merges=True, add_bos=True),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_FAMILY),
    # Qwen3.5's tokenizer.json has no NFC normalizer: the golden ids keep a decomposed "é" as e + U+0301.
    "qwen35": _Family(lambda: [*_split(_QWEN35), _byte_level()]),
    # SmolLM2's tokenizer.json puts Digits(individual) before ByteLevel, and llama.cpp gives this whole group
    # that split. transformers' GGUF loader (5.24) leaves digits unsplit here, which differs from the model's own
    # tokenizer on whitespace before a digit ("  1": "ĠĠ","1", not "Ġ","Ġ","1").
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"), _DIGITS_GPT2_FAMILY),
    **dict.fromkeys(("gpt2", "gpt-2", "phi-2", "mpt", "olmo", "default"), _GPT2_FAMILY),
    "deepseek-llm": _Family(lambda: [*_split(*_DEEPSEEK_LLM), _digits(), _byte_level()]),
    "deepseek-coder": _Family(lambda: [*_split(*_DEEPSEEK_CODER), _digits(), _byte_level()]),
    "falcon": _Family(lambda: [pre_tokenizers.Punctuation("contiguous"), _byte_level(gpt2_regex=True),
                               _digits(individual=False), *_split("[0-9][0-9][0-9]")]),
}


class ByteBPETokenizer(Tokenizer):
    """GPT-2-style byte-level BPE on HF `tokenizers`, built from a GGUF's vocab and merges.

    From a tokenizer.json it runs whatever that file describes (byte-level BPE, or a SentencePiece-style
    BPE with byte fallback); `tokenizers` carries the whole pipeline, so nothing here depends on which.
    """

    def __init__(self, backend: tokenizers.Tokenizer, *, vocab_size: int, bos_id: int | None, eos_id: int,
                 add_bos: bool, chat_template: str | None, source: Path, **kwargs) -> None:
        self._backend = backend
        added = backend.get_added_tokens_decoder()
        super().__init__(vocab_size=vocab_size, bos_id=bos_id, eos_id=eos_id, add_bos=add_bos,
                         special_ids=frozenset(i for i, t in added.items() if t.special),
                         added_ids=frozenset(i for i, t in added.items() if not t.special),
                         chat_template=chat_template, source=source, **kwargs)

    @classmethod
    def from_gguf(cls, vocab: GGUFVocab) -> ByteBPETokenizer:
        if vocab.eos_id is None:
            raise TokenizerError(f"{vocab.path}: GGUF has no tokenizer.ggml.eos_token_id; "
                                 f"re-convert the model with a current llama.cpp convert_hf_to_gguf.py")
        family = _FAMILIES.get(vocab.pre)
        if family is None:
            # Refused rather than split with GPT-2's regex: the ids would be wrong for the model without any error,
            # and every answer it gives would be subtly worse. The tokenizer.json beside the weights has it all.
            known = ", ".join(sorted(_FAMILIES))
            raise TokenizerError(f"{vocab.path}: tokenizer.ggml.pre {vocab.pre!r} (how this byte-level BPE splits "
                                 f"text) is not supported; known: {known}. Point at the model's HF folder "
                                 f"(tokenizer.json) instead")
        if vocab.pre == "default":
            log.warning("%s: tokenizer.ggml.pre is 'default' (the converter did not know this tokenizer); splitting "
                        "text with the GPT-2 regex, so token ids may differ from the model's own tokenizer", vocab.path)
        merges = [tuple(m.split(" ", 1)) for m in vocab.merges]
        try:
            bpe = models.BPE({t: i for i, t in enumerate(vocab.tokens)}, merges, fuse_unk=False,
                             ignore_merges=family.ignore_merges)
        except Exception as e:  # tokenizers raises its own exception type for a merge of unknown tokens
            raise TokenizerError(f"{vocab.path}: GGUF vocab and merges do not fit together ({e}); "
                                 f"the file is damaged, download it again") from e
        backend = tokenizers.Tokenizer(bpe)
        if family.nfc:
            backend.normalizer = normalizers.NFC()
        backend.pre_tokenizer = pre_tokenizers.Sequence(family.steps())
        backend.decoder = decoders.ByteLevel()
        # Control tokens (<|im_start|>) and user-defined ones must match whole in raw text, before the
        # pre-tokenizer cuts them up; only control tokens are special (dropped by skip_special).
        backend.add_tokens([
            tokenizers.AddedToken(t, special=(kind == CONTROL), normalized=False)
            for t, kind in zip(vocab.tokens, vocab.token_types) if kind in (CONTROL, USER_DEFINED)])
        return cls(backend, vocab_size=len(vocab.tokens), bos_id=vocab.bos_id, eos_id=vocab.eos_id,
                   add_bos=family.add_bos if vocab.add_bos is None else vocab.add_bos, add_eos=vocab.add_eos,
                   chat_template=vocab.chat_template, source=vocab.path, end_of_turn_ids=vocab.end_of_turn_ids,
                   named_ids={"unk_token": vocab.unk_id, "pad_token": vocab.pad_id})

    @classmethod
    def from_tokenizer_json(cls, path: Path, config: Mapping) -> ByteBPETokenizer:
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
            raise TokenizerError(f"{path}: not a tokenizer.json that HF tokenizers can read ({e})") from e

        def token_id(name: str, required: bool = True) -> int | None:
            text = config_token_text(config.get(name))
            if text is None:
                return None
            found = backend.token_to_id(text)
            if found is None and required:
                raise TokenizerError(f"{path}: tokenizer_config.json names {name} {text!r}, "
                                     f"which is not in tokenizer.json's vocabulary")
            return found

        bos_id, eos_id = token_id("bos_token"), token_id("eos_token")
        if eos_id is None:
            raise TokenizerError(f"{path}: no eos_token; put the model's tokenizer_config.json next to it")
        add_bos = config.get("add_bos_token")
        if add_bos is None:
            # Without the flag, the file's own post-processor says whether BOS goes in front (Llama 3's does).
            add_bos = bos_id is not None and backend.encode("", add_special_tokens=True).ids[:1] == [bos_id]
        return cls(backend, vocab_size=backend.get_vocab_size(with_added_tokens=True), bos_id=bos_id,
                   eos_id=eos_id, add_bos=add_bos, add_eos=bool(config.get("add_eos_token", False)),
                   chat_template=config_chat_template(config), source=path,
                   named_ids={"unk_token": token_id("unk_token", required=False),
                              "pad_token": token_id("pad_token", required=False)})

    def _encode_text(self, text: str) -> list[int]:
        # BOS is ours to add, not the post-processor's.
        return self._backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special)

    def id_to_piece(self, token_id: int) -> str:
        return self._backend.id_to_token(token_id)

    def token_bytes(self) -> list[bytes]:
        """Byte-level pieces spell each byte as one printable character (GPT-2's table): map them back.
        A tokenizer.json of another kind (SentencePiece-style BPE with byte fallback) spells them as
        SentencePiece does."""
        if '"ByteLevel"' not in json.dumps(json.loads(self._backend.to_str()).get("decoder")):
            return super().token_bytes()
        byte_of = {c: b for b, c in _gpt2_byte_chars().items()}
        added = self.special_ids | self._added_ids
        out = []
        for i in range(self.vocab_size):
            piece = self.id_to_piece(i) or ""
            if i in added or any(c not in byte_of for c in piece):
                out.append(piece.encode())  # an added token is matched as its text
            else:
                out.append(bytes(byte_of[c] for c in piece))
        return out


def _gpt2_byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table (bytes_to_unicode in its encoder.py)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, n = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return table
