"""Text <-> token ids for a model: one small interface, a backend per tokenizer kind, and streaming decode.

    tok = load_tokenizer(path)          # a .gguf, a tokenizer.json / tokenizer.model, or a folder with one
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    ids = tok.encode(prompt)
    stream = StreamDecoder(tok)
    text = "".join(stream.push(i) for i in generated_ids) + stream.flush()
"""
from __future__ import annotations

import abc
import json
import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import jinja2
import jinja2.ext
import sentencepiece
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import decoders, models, pre_tokenizers

from common.engine.gguf_file import GGUFFile

log = logging.getLogger(__name__)

# HF's old default: the template for a model that ships none.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Special tokens that end a turn in common chat formats. A model that has one should stop on it by
# default even when its eos is another token (llama.cpp's end-of-generation list does the same).
_END_OF_TURN_PIECES = frozenset({"<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>"})

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
_GGUF_CONTROL = 3
_GGUF_USER_DEFINED = 4

# tokenizer.ggml.pre -> how text is split before BPE. SmolLM2's tokenizer.json puts Digits(individual)
# before ByteLevel; llama.cpp gives the same split (each digit alone, then the GPT-2 regex) to this whole
# group. transformers' GGUF loader (5.24) knows none of these names and leaves digits unsplit, which differs
# from the model's own tokenizer on whitespace before a digit ("  1": "ĠĠ","1", not "Ġ","Ġ","1").
_DIGITS_THEN_GPT2 = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"})
_GPT2 = frozenset({"gpt2", "default", "mpt", "olmo"})


class TokenizerError(ValueError):
    """A tokenizer cannot be loaded, or rejects its input; the message names the file and what to do."""


class Tokenizer(abc.ABC):
    """Text <-> token ids for one model. A backend implements _encode_text, decode and id_to_piece."""

    vocab_size: int
    bos_id: int | None
    eos_id: int
    stop_ids: frozenset[int]     # ids that end generation by default: eos and the chat end-of-turn token
    special_ids: frozenset[int]  # ids that decode(..., skip_special=True) leaves out
    add_bos: bool                # encode()'s default: whether the model wants BOS in front of text

    def __init__(self, *, vocab_size: int, bos_id: int | None, eos_id: int, special_ids: frozenset[int],
                 add_bos: bool, chat_template: str | None, source: Path) -> None:
        for name, token_id in (("bos", bos_id), ("eos", eos_id)):
            if token_id is not None and not 0 <= token_id < vocab_size:
                raise TokenizerError(f"{source}: {name} id {token_id} is outside the vocabulary "
                                     f"(size {vocab_size}); the tokenizer files disagree with each other")
        self.vocab_size = vocab_size
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.special_ids = special_ids
        self.add_bos = add_bos and bos_id is not None
        self.stop_ids = frozenset({eos_id} | {i for i in special_ids if self.id_to_piece(i) in _END_OF_TURN_PIECES})
        self._bos_text = self.id_to_piece(bos_id) if bos_id is not None else ""
        self._eos_text = self.id_to_piece(eos_id)
        self._chat_template = _compile_chat_template(chat_template or CHATML_TEMPLATE, source)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of text. Special tokens written in the text (`<|im_start|>`) become their ids.

        add_bos=None follows the model. BOS is never doubled: a chat template that writes the BOS
        text itself (Llama-2) would otherwise give the model two.
        """
        ids = self._encode_text(text)
        want_bos = self.add_bos if add_bos is None else add_bos
        if want_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)
        return ids

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt text for a conversation, rendered with the model's own jinja template."""
        try:
            return self._chat_template.render(
                messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                bos_token=self._bos_text, eos_token=self._eos_text)
        except jinja2.TemplateError as e:
            raise TokenizerError(f"the chat template rejected the messages: {e}") from e

    @abc.abstractmethod
    def _encode_text(self, text: str) -> list[int]:
        """Token ids of text, special tokens in it included, without BOS."""

    @abc.abstractmethod
    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of ids; skip_special leaves out the ids in special_ids."""

    @abc.abstractmethod
    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary entry of one id, as the tokenizer spells it ("Ġthe", "▁the", "<|im_end|>")."""


class ByteBPETokenizer(Tokenizer):
    """GPT-2-style byte-level BPE on HF `tokenizers`, built from a GGUF's vocab and merges.

    From a tokenizer.json it runs whatever that file describes (byte-level BPE, or a SentencePiece-style
    BPE with byte fallback); `tokenizers` carries the whole pipeline, so nothing here depends on which.
    """

    def __init__(self, backend: tokenizers.Tokenizer, *, vocab_size: int, bos_id: int | None, eos_id: int,
                 add_bos: bool, chat_template: str | None, source: Path) -> None:
        self._backend = backend
        special_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        super().__init__(vocab_size=vocab_size, bos_id=bos_id, eos_id=eos_id, special_ids=special_ids,
                         add_bos=add_bos, chat_template=chat_template, source=source)

    @classmethod
    def from_gguf(cls, path: Path) -> ByteBPETokenizer:
        meta = _read_gguf_tokenizer(path)
        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise TokenizerError(
                f"{path}: GGUF tokenizer model {model!r} is not supported, only 'gpt2' (byte-level BPE); "
                f"use the model's tokenizer.json or tokenizer.model instead")
        if "tokenizer.ggml.eos_token_id" not in meta:
            raise TokenizerError(f"{path}: GGUF has no tokenizer.ggml.eos_token_id; "
                                 f"re-convert the model with a current llama.cpp convert_hf_to_gguf.py")
        tokens = meta["tokenizer.ggml.tokens"]
        token_types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        try:
            bpe = models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False)
        except Exception as e:  # tokenizers raises its own exception type for a merge of unknown tokens
            raise TokenizerError(f"{path}: GGUF vocab and merges do not fit together ({e}); "
                                 f"the file is damaged, download it again") from e
        backend = tokenizers.Tokenizer(bpe)
        backend.pre_tokenizer = _gguf_pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"), path)
        backend.decoder = decoders.ByteLevel()
        # Control tokens (<|im_start|>) and user-defined ones must match whole in raw text, before the
        # pre-tokenizer cuts them up; only control tokens are special (dropped by skip_special).
        backend.add_tokens([
            tokenizers.AddedToken(t, special=(kind == _GGUF_CONTROL), normalized=False)
            for t, kind in zip(tokens, token_types) if kind in (_GGUF_CONTROL, _GGUF_USER_DEFINED)])
        return cls(backend, vocab_size=len(tokens), bos_id=meta.get("tokenizer.ggml.bos_token_id"),
                   eos_id=meta["tokenizer.ggml.eos_token_id"],
                   add_bos=meta.get("tokenizer.ggml.add_bos_token", False),
                   chat_template=meta.get("tokenizer.chat_template"), source=path)

    @classmethod
    def from_tokenizer_json(cls, path: Path, config: Mapping) -> ByteBPETokenizer:
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
            raise TokenizerError(f"{path}: not a tokenizer.json that HF tokenizers can read ({e})") from e

        def token_id(name: str) -> int | None:
            text = _config_token_text(config.get(name))
            if text is None:
                return None
            found = backend.token_to_id(text)
            if found is None:
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
                   eos_id=eos_id, add_bos=add_bos, chat_template=_config_chat_template(config), source=path)

    def _encode_text(self, text: str) -> list[int]:
        # BOS is ours to add, not the post-processor's.
        return self._backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special)

    def id_to_piece(self, token_id: int) -> str:
        return self._backend.id_to_token(token_id)


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece tokenizer.model (Llama-2 / Mistral family), via the `sentencepiece` package."""

    def __init__(self, path: Path, config: Mapping) -> None:
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        except Exception as e:  # sentencepiece raises OSError or RuntimeError depending on the damage
            raise TokenizerError(f"{path}: not a SentencePiece model ({e})") from e
        self._path = path
        specials = [i for i in range(self._sp.get_piece_size()) if self._sp.is_control(i)]
        # sentencepiece reads "<s>" in text as three characters; split on control pieces first so a
        # special token written in the text (a chat template's BOS) becomes its id, as HF and llama.cpp do.
        # Longest first, so a piece is never matched as a shorter piece that begins it.
        pieces = sorted(filter(None, map(self._sp.id_to_piece, specials)), key=len, reverse=True)
        self._special_re = re.compile("(" + "|".join(map(re.escape, pieces)) + ")") if pieces else None
        bos_id = self._token_id(config, "bos_token", self._sp.bos_id())
        eos_id = self._token_id(config, "eos_token", self._sp.eos_id())
        if eos_id is None:
            raise TokenizerError(f"{path}: the SentencePiece model has no eos piece and no tokenizer_config.json "
                                 f"names one; put the model's tokenizer_config.json next to it")
        super().__init__(vocab_size=self._sp.get_piece_size(), bos_id=bos_id, eos_id=eos_id,
                         special_ids=frozenset(specials),
                         # Llama-family SentencePiece models expect BOS unless the config says otherwise.
                         add_bos=config.get("add_bos_token", True),
                         chat_template=_config_chat_template(config), source=path)

    def _token_id(self, config: Mapping, name: str, default: int) -> int | None:
        text = _config_token_text(config.get(name))
        if text is None:
            return default if default >= 0 else None
        token_id = self._sp.piece_to_id(text)
        if self._sp.id_to_piece(token_id) != text:  # piece_to_id answers unk for a piece it lacks
            raise TokenizerError(f"{self._path}: tokenizer_config.json names {name} {text!r}, "
                                 f"which is not a piece of the SentencePiece model")
        return token_id

    def _encode_text(self, text: str) -> list[int]:
        if self._special_re is None:
            return self._sp.encode(text)
        ids = []
        # re.split with a group alternates text, special, text, ...; every text chunk gets
        # SentencePiece's dummy-prefix space, which is what llama.cpp and HF (legacy) do after a special.
        for n, chunk in enumerate(self._special_re.split(text)):
            if n % 2:
                ids.append(self._sp.piece_to_id(chunk))
            elif chunk:
                ids.extend(self._sp.encode(chunk))
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        if skip_special:
            return self._sp.decode([i for i in ids if i not in self.special_ids])
        # sentencepiece drops control ids; write them out, and decode the run between two of them on its
        # own so the dummy-prefix space encode() put after a special is taken off again.
        parts, run = [], []
        for token_id in ids:
            if token_id in self.special_ids:
                parts += [self._sp.decode(run), self._sp.id_to_piece(token_id)]
                run = []
            else:
                run.append(token_id)
        parts.append(self._sp.decode(run))
        return "".join(parts)

    def id_to_piece(self, token_id: int) -> str:
        return self._sp.id_to_piece(token_id)


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
        return ByteBPETokenizer.from_gguf(path)
    if path.suffix == ".json":
        return ByteBPETokenizer.from_tokenizer_json(path, _read_tokenizer_config(path.parent))
    if path.suffix == ".model":
        return SentencePieceTokenizer(path, _read_tokenizer_config(path.parent))
    raise TokenizerError(f"{path}: unknown tokenizer file; give a .gguf, a tokenizer.json or a tokenizer.model")


def _read_gguf_tokenizer(path: Path) -> dict:
    """The tokenizer.* metadata of a GGUF file, as plain Python values."""
    try:
        fields = GGUFFile(path).fields
    except Exception as e:  # GGUFFormatError, or numpy's own on an empty file
        raise TokenizerError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e}); "
                             f"it may be truncated or not a GGUF at all, download it again") from e
    meta = {key: value for key, value in fields.items() if key.startswith("tokenizer.")}
    if "tokenizer.ggml.tokens" not in meta:
        raise TokenizerError(f"{path}: GGUF file carries no tokenizer (no tokenizer.ggml.tokens); "
                             f"point at the model's tokenizer.json or tokenizer.model instead")
    return meta


def _gguf_pre_tokenizer(pre: str, path: Path) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # the GPT-2 regex
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre not in _GPT2:
        log.warning("%s: unknown tokenizer.ggml.pre %r; splitting text with the GPT-2 regex, "
                    "so token ids may differ from the model's own tokenizer", path, pre)
    return byte_level


def _read_tokenizer_config(folder: Path) -> dict:
    config_path = folder / "tokenizer_config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{config_path}: not valid JSON ({e})") from e
    # Newer HF checkpoints keep the template in its own file, which wins over the config's copy.
    template_path = folder / "chat_template.jinja"
    if template_path.is_file():
        config["chat_template"] = template_path.read_text(encoding="utf-8")
    return config


def _config_token_text(value: object) -> str | None:
    """tokenizer_config.json writes a token as a string or as a serialized AddedToken."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


def _config_chat_template(config: Mapping) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # several named templates: the plain chat one is "default"
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def _compile_chat_template(source: str, origin: Path) -> jinja2.Template:
    # The sandbox because chat templates come with downloaded models; the rest is what HF's renderer
    # sets up, so templates written for it render the same here.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        # jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = tojson
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"{origin}: the chat template does not compile ({e})") from e
