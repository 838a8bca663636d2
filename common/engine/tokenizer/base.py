"""The tokenizer interface every backend implements, and streaming decode."""
from __future__ import annotations

import abc
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from common.engine.tokenizer.chat_template import ChatTemplate
from common.engine.tokenizer.errors import TokenizerError

# Special tokens that end a turn in common chat formats: Llama 3 (<|eot_id|>, <|eom_id|> after a tool call,
# <|end_of_text|>), ChatML (<|im_end|>), Phi-3 (<|end|>), Gemma (<end_of_turn>), and the ends of text that
# Qwen, SmolLM and Llama-2 / Mistral use. A model that has one should stop on it by default even when its eos
# is another token: llama.cpp's end-of-generation list, which matches on these same texts, does the same.
# SentencePiece's byte-fallback pieces: one raw byte each.
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")

_END_OF_TURN_PIECES = frozenset({"<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|im_end|>", "<|end|>",
                                 "<end_of_turn>", "<|endoftext|>", "</s>"})


class Tokenizer(abc.ABC):
    """Text <-> token ids for one model. A backend implements _encode_text, decode and id_to_piece."""

    vocab_size: int
    bos_id: int | None
    eos_id: int
    stop_ids: frozenset[int]     # ids that end generation by default: eos and the chat end-of-turn tokens
    special_ids: frozenset[int]  # ids that decode(..., skip_special=True) leaves out
    add_bos: bool                # encode()'s default: whether the model wants BOS in front of text
    add_eos: bool                # encode()'s default: whether the model wants EOS after text (rare)
    chat_template: ChatTemplate

    def __init__(self, *, vocab_size: int, bos_id: int | None, eos_id: int, special_ids: frozenset[int],
                 add_bos: bool, chat_template: str | None, source: Path, add_eos: bool = False,
                 added_ids: frozenset[int] = frozenset(), end_of_turn_ids: Sequence[int] = (),
                 named_ids: Mapping[str, int | None] | None = None) -> None:
        """added_ids: tokens matched whole in text that are not special (user-defined); end_of_turn_ids: ones the
        file names as such (a GGUF's eot/eom); named_ids: further named tokens the chat template may use
        ("unk_token", "pad_token")."""
        named = {"bos_token": bos_id, "eos_token": eos_id, **(named_ids or {})}
        for name, token_id in [*named.items(), *(("end-of-turn token", i) for i in end_of_turn_ids)]:
            if token_id is not None and not 0 <= token_id < vocab_size:
                raise TokenizerError(f"{source}: {name} id {token_id} is outside the vocabulary "
                                     f"(size {vocab_size}); the tokenizer files disagree with each other")
        self.vocab_size = vocab_size
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.special_ids = special_ids
        self.add_bos = add_bos and bos_id is not None
        self.add_eos = add_eos
        self._added_ids = added_ids
        self.stop_ids = frozenset({eos_id, *end_of_turn_ids} | {
            i for i in special_ids | added_ids if self.id_to_piece(i) in _END_OF_TURN_PIECES})
        # What transformers passes a template: the named special tokens the tokenizer has, as text.
        self.chat_template = ChatTemplate(chat_template, {
            name: self.id_to_piece(token_id) for name, token_id in named.items() if token_id is not None}, source)

    def encode(self, text: str, add_bos: bool | None = None, add_eos: bool | None = None) -> list[int]:
        """Token ids of text. Special tokens written in the text (`<|im_start|>`) become their ids.

        None follows the model. BOS and EOS are never doubled: a chat template that writes the BOS text
        itself (Llama-2, Llama 3, Gemma) would otherwise give the model two.
        """
        ids = self._encode_text(text)
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)
        if (self.add_eos if add_eos is None else add_eos) and ids[-1:] != [self.eos_id]:
            ids.append(self.eos_id)
        return ids

    def apply_chat_template(self, messages: Sequence[Mapping[str, object]], add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, object]] | None = None) -> str:
        """The prompt text for a conversation, rendered with the model's own jinja template as transformers
        renders it (tools as transformers passes them: OpenAI's {"type": "function", "function": {...}});
        TokenizerError with the template's message when the template rejects the conversation."""
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools)

    @abc.abstractmethod
    def _encode_text(self, text: str) -> list[int]:
        """Token ids of text, special tokens in it included, without BOS."""

    @abc.abstractmethod
    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of ids; skip_special leaves out the ids in special_ids."""

    @abc.abstractmethod
    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary entry of one id, as the tokenizer spells it ("Ġthe", "▁the", "<|im_end|>")."""

    def token_bytes(self) -> list[bytes]:
        """Every id's bytes as it adds them to the text (a grammar engine matches tokens by these): the
        SentencePiece spelling by default ("▁the" is b" the", "<0x0A>" is b"\\n"); special and added tokens
        their text. A byte-level BPE overrides it. Computed once per call: callers keep the list."""
        added = self.special_ids | self._added_ids
        out = []
        for i in range(self.vocab_size):
            piece = self.id_to_piece(i)
            if i not in added and _BYTE_PIECE.fullmatch(piece):
                out.append(bytes([int(piece[3:5], 16)]))
            else:
                out.append((piece if i in added else piece.replace("\u2581", " ")).encode())
        return out


class StreamDecoder:
    """Text of one sequence's tokens as they arrive: the prefix/read offset scheme of TGI and vLLM.

    Decoding each token alone is wrong twice over: a byte-level token can hold half a UTF-8 character,
    and SentencePiece drops the leading space of whichever piece starts the text. So each push decodes a
    short window (the tokens emitted last time, then the unread ones) with and without the unread ones
    and emits the difference, holding it back while the decoded tail ends in U+FFFD (half a character).
    Invariant: "".join(push(i) for i in ids) + flush() == tokenizer.decode(ids, skip_special).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._ids: list[int] = []  # the window: context tokens, then tokens not yet emitted
        self._read_len = 0         # how many of _ids are context (already emitted)

    def push(self, token_id: int) -> str:
        """The text token_id completes; "" while a character is still incomplete."""
        if self.skip_special and token_id in self.tokenizer.special_ids:
            return ""  # decode(skip_special=True) drops these before decoding, so leaving them out matches it
        self._ids.append(token_id)
        context_text = self.tokenizer.decode(self._ids[:self._read_len])
        text = self.tokenizer.decode(self._ids)
        if len(text) <= len(context_text) or text.endswith("\ufffd"):
            return ""
        self._ids = self._ids[self._read_len:]
        self._read_len = len(self._ids)
        return text[len(context_text):]

    def flush(self) -> str:
        """What is still held back (an incomplete character at the end comes out as U+FFFD, as decode gives it)."""
        context_text = self.tokenizer.decode(self._ids[:self._read_len])
        text = self.tokenizer.decode(self._ids)
        self._ids = self._ids[self._read_len:]
        self._read_len = len(self._ids)
        return text[len(context_text):]
