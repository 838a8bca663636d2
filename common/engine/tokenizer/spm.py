"""SentencePiece BPE on the `sentencepiece` package: a tokenizer.model, or the model a GGUF's SentencePiece
vocabulary (tokenizer.ggml.model "llama": Llama-2, Mistral v0.1-0.3, Phi-3, Gemma 1-3) describes.

A GGUF keeps what the tokenizer.model held (pieces, scores, piece types, whether to add the dummy-prefix space),
so the model is rebuilt as a ModelProto and run by sentencepiece itself. Around it this does what llama.cpp
does and the sentencepiece model cannot: control and user-defined tokens are matched whole in the raw text
first, and each stretch of text between them is encoded on its own (dummy prefix included, as llama.cpp and
HF's legacy Llama tokenizer give it).
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import sentencepiece
from sentencepiece import sentencepiece_model_pb2 as sp_pb2

from common.engine.tokenizer.base import Tokenizer
from common.engine.tokenizer.errors import TokenizerError
from common.engine.tokenizer.gguf_vocab import BYTE, CONTROL, USER_DEFINED, GGUFVocab
from common.engine.tokenizer.hf_config import config_chat_template, config_token_text

_Piece = sp_pb2.ModelProto.SentencePiece

# Phi-3's tokenizer.json strips the whitespace after its chat tokens ("<|user|>\nHi" is <|user|>, "▁Hi"), all but
# these; llama.cpp does the same for a model it recognises as Phi-3 by name.
_PHI3_NO_RSTRIP = frozenset({"<unk>", "<s>", "<|endoftext|>"})


class SentencePieceTokenizer(Tokenizer):
    """split_ids: tokens matched whole in raw text before sentencepiece sees it; the special ones among them are
    dropped by decode(skip_special=True), the rest (user-defined) are text. rstrip_ids: split tokens that eat the
    whitespace after them."""

    def __init__(self, sp: sentencepiece.SentencePieceProcessor, *, split_ids: frozenset[int],
                 special_ids: frozenset[int], rstrip_ids: frozenset[int] = frozenset(), bos_id: int | None,
                 eos_id: int, add_bos: bool, chat_template: str | None, source: Path, **kwargs) -> None:
        self._sp = sp
        self._split_ids = split_ids
        self._rstrip_ids = rstrip_ids
        self._split_piece_ids = {sp.id_to_piece(i): i for i in split_ids}
        # Longest first, so a token is never matched as a shorter token that begins it.
        pieces = sorted(self._split_piece_ids, key=len, reverse=True)
        self._split_re = re.compile("(" + "|".join(map(re.escape, pieces)) + ")") if pieces else None
        super().__init__(vocab_size=sp.get_piece_size(), bos_id=bos_id, eos_id=eos_id, special_ids=special_ids,
                         added_ids=split_ids - special_ids, add_bos=add_bos, chat_template=chat_template,
                         source=source, **kwargs)

    @classmethod
    def from_model_file(cls, path: Path, config: Mapping) -> SentencePieceTokenizer:
        try:
            sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        except Exception as e:  # sentencepiece raises OSError or RuntimeError depending on the damage
            raise TokenizerError(f"{path}: not a SentencePiece model ({e})") from e

        def token_id(name: str, default: int) -> int | None:
            text = config_token_text(config.get(name))
            if text is None:
                return default if default >= 0 else None
            found = sp.piece_to_id(text)
            if sp.id_to_piece(found) != text:  # piece_to_id answers unk for a piece it lacks
                raise TokenizerError(f"{path}: tokenizer_config.json names {name} {text!r}, "
                                     f"which is not a piece of the SentencePiece model")
            return found

        bos_id, eos_id = token_id("bos_token", sp.bos_id()), token_id("eos_token", sp.eos_id())
        if eos_id is None:
            raise TokenizerError(f"{path}: the SentencePiece model has no eos piece and no tokenizer_config.json "
                                 f"names one; put the model's tokenizer_config.json next to it")
        # User-defined pieces stay with sentencepiece, which matches them itself; control pieces it never
        # produces from text, so a chat template's "<s>" is split out here.
        control_ids = frozenset(i for i in range(sp.get_piece_size()) if sp.is_control(i))
        return cls(sp, split_ids=control_ids, special_ids=control_ids, bos_id=bos_id, eos_id=eos_id,
                   # Llama-family SentencePiece models expect BOS unless the config says otherwise.
                   add_bos=config.get("add_bos_token", True), add_eos=config.get("add_eos_token", False),
                   chat_template=config_chat_template(config), source=path,
                   named_ids={"unk_token": sp.unk_id() if sp.unk_id() >= 0 else None,
                              "pad_token": sp.pad_id() if sp.pad_id() >= 0 else None})

    @classmethod
    def from_gguf(cls, vocab: GGUFVocab) -> SentencePieceTokenizer:
        try:
            sp = sentencepiece.SentencePieceProcessor(model_proto=_model_proto(vocab).SerializeToString())
        except Exception as e:  # sentencepiece's RuntimeError names the piece it rejects
            raise TokenizerError(f"{vocab.path}: the GGUF's SentencePiece vocabulary does not load ({e}); "
                                 f"the file is damaged, download it again") from e
        # What llama.cpp matches whole in text: control, user-defined and unknown tokens. The "unknown"-typed
        # fillers some converters append ("[PAD32011]") are left out: no tokenizer.json matches those.
        unk = frozenset() if vocab.unk_id is None else {vocab.unk_id}
        special_ids = vocab.ids_of_type(CONTROL) | unk
        split_ids = special_ids | vocab.ids_of_type(USER_DEFINED)
        rstrip_ids = frozenset()
        if vocab.architecture == "phi3":
            rstrip_ids = frozenset(i for i in split_ids if vocab.tokens[i] not in _PHI3_NO_RSTRIP)
        return cls(sp, split_ids=split_ids, special_ids=special_ids, rstrip_ids=rstrip_ids, bos_id=vocab.bos_id,
                   eos_id=vocab.eos_id, add_bos=True if vocab.add_bos is None else vocab.add_bos,
                   add_eos=vocab.add_eos, chat_template=vocab.chat_template, source=vocab.path,
                   end_of_turn_ids=vocab.end_of_turn_ids,
                   named_ids={"unk_token": vocab.unk_id, "pad_token": vocab.pad_id})

    def _encode_text(self, text: str) -> list[int]:
        if self._split_re is None:
            return self._sp.encode(text)
        ids = []
        strip = False
        # re.split with a group alternates text, split token, text, ...
        for n, chunk in enumerate(self._split_re.split(text)):
            if n % 2:
                ids.append(self._split_piece_ids[chunk])
                strip = ids[-1] in self._rstrip_ids
                continue
            if strip:
                chunk = chunk.lstrip()
            if chunk:
                ids.extend(self._sp.encode(chunk))
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        if skip_special:
            # As if the specials were never there, which is what StreamDecoder sees when it skips them.
            ids = [i for i in ids if i not in self.special_ids]
        # sentencepiece drops control ids; write split tokens out as they are spelled, and decode the run between
        # two of them on its own so the dummy-prefix space encode() put after one is taken off again.
        parts, run = [], []
        for token_id in ids:
            if token_id in self._split_ids:
                parts += [self._sp.decode(run), self._sp.id_to_piece(token_id)]
                run = []
            else:
                run.append(token_id)
        parts.append(self._sp.decode(run))
        return "".join(parts)

    def id_to_piece(self, token_id: int) -> str:
        return self._sp.id_to_piece(token_id)


def _model_proto(vocab: GGUFVocab) -> sp_pb2.ModelProto:
    """The SentencePiece BPE model a GGUF vocabulary came from, as llama.cpp runs it.

    Piece types follow llama.cpp rather than the original .model: user-defined tokens (matched in raw text
    beforehand) and any other non-special type become normal pieces that merges may reach, as llama.cpp's merge
    loop reaches any token by its text; control ones stay control, so merges never make them.
    """
    num_bytes = sum(kind == BYTE for kind in vocab.token_types)
    proto = sp_pb2.ModelProto()
    scores = vocab.scores or [0.0] * len(vocab.tokens)  # llama.cpp scores a vocabulary without scores 0
    for token_id, (token, kind, score) in enumerate(zip(vocab.tokens, vocab.token_types, scores)):
        if token_id == vocab.unk_id:
            piece_type = _Piece.UNKNOWN  # Phi-3's GGUF types its <unk> control; sentencepiece wants it unknown
        elif kind == CONTROL:
            piece_type = _Piece.CONTROL
        elif kind == BYTE and num_bytes == 256:
            piece_type = _Piece.BYTE
        else:
            piece_type = _Piece.NORMAL
        proto.pieces.add(piece=token, score=score, type=piece_type)
    proto.trainer_spec.model_type = sp_pb2.TrainerSpec.BPE
    proto.trainer_spec.byte_fallback = num_bytes == 256  # sentencepiece wants all 256 byte pieces or none
    proto.normalizer_spec.name = "identity"
    # llama.cpp's SentencePiece defaults: a dummy-prefix space unless the file says otherwise (Gemma's does; Llama-2's
    # and Phi-3's say nothing), whitespace kept as it is.
    proto.normalizer_spec.add_dummy_prefix = True if vocab.add_space_prefix is None else vocab.add_space_prefix
    proto.normalizer_spec.remove_extra_whitespaces = vocab.remove_extra_whitespaces
    proto.normalizer_spec.escape_whitespaces = True
    return proto
