"""A GGUF file's tokenizer metadata (the tokenizer.* keys), read once, with llama.cpp's defaults filled in."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from common.engine.gguf_file import GGUFFile
from common.engine.tokenizer.errors import TokenizerError

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


@dataclass(frozen=True)
class GGUFVocab:
    path: Path
    model: str                   # tokenizer.ggml.model: "gpt2" is byte-level BPE, "llama" SentencePiece
    pre: str                     # tokenizer.ggml.pre: how a byte-level BPE splits text before merging
    architecture: str            # general.architecture
    tokens: list[str]
    token_types: list[int]       # NORMAL, CONTROL, ... per token
    scores: list[float] | None   # SentencePiece merge priorities
    merges: list[str]            # byte-level BPE merges, "a b", best first
    bos_id: int | None           # absent ids take llama.cpp's SentencePiece defaults (1, 2, 0) or stay None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    end_of_turn_ids: tuple[int, ...]  # tokenizer.ggml.eot_token_id and eom_token_id, where the file has them
    add_bos: bool | None         # None: the file does not say, and the tokenizer kind decides
    add_eos: bool
    add_space_prefix: bool | None
    remove_extra_whitespaces: bool
    chat_template: str | None

    @classmethod
    def read(cls, path: Path) -> GGUFVocab:
        try:
            fields = GGUFFile(path).fields
        except Exception as e:  # GGUFFormatError, or numpy's own on an empty file
            raise TokenizerError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e}); "
                                 f"it may be truncated or not a GGUF at all, download it again") from e
        if "tokenizer.ggml.tokens" not in fields:
            raise TokenizerError(f"{path}: GGUF file carries no tokenizer (no tokenizer.ggml.tokens); "
                                 f"point at the model's tokenizer.json or tokenizer.model instead")
        meta = {key.removeprefix("tokenizer.ggml."): value for key, value in fields.items()
                if key.startswith("tokenizer.ggml.")}
        model = meta.get("model", "")
        spm = model == "llama"
        tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(meta["tokens"])]  # llama.cpp's name for an empty one
        return cls(
            path=path, model=model, pre=meta.get("pre", "default"),
            architecture=fields.get("general.architecture", ""), tokens=tokens,
            token_types=meta.get("token_type") or [NORMAL] * len(tokens), scores=meta.get("scores"),
            merges=meta.get("merges", []),
            bos_id=meta.get("bos_token_id", 1 if spm else None), eos_id=meta.get("eos_token_id", 2 if spm else None),
            unk_id=meta.get("unknown_token_id", 0 if spm else None), pad_id=meta.get("padding_token_id"),
            end_of_turn_ids=tuple(meta[k] for k in ("eot_token_id", "eom_token_id") if k in meta),
            add_bos=meta.get("add_bos_token"), add_eos=meta.get("add_eos_token", False),
            add_space_prefix=meta.get("add_space_prefix"),
            remove_extra_whitespaces=meta.get("remove_extra_whitespaces", False),
            chat_template=fields.get("tokenizer.chat_template"))

    def ids_of_type(self, *kinds: int) -> frozenset[int]:
        return frozenset(i for i, kind in enumerate(self.token_types) if kind in kinds)
