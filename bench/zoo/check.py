"""`python -m bench.zoo --check`: builds every small architecture and reports on its files, for a person
reading what llama.cpp's converter and quantizer did (the tests, tests/engine/test_family_files.py, assert
what our engine makes of them):

- weights: which HF tensor every F32 GGUF tensor is, and by which exact transform (identity, llama.cpp's Q/K
  row permutation, Gemma's +1 on norms, rows truncated);
- quantization: each quantized file's relative RMS error against the F32 file, and its tensor types;
- features: how far the logits move when the family's defining feature is switched off in HF (a feature that
  moves nothing would make a test of it pointless);
- tokenizers: AutoTokenizer against the folder's tokenizer.json and tokenizer.model, the GGUF's tokens
  against HF's vocabulary.

A problem is counted and printed; the exit status is 1 when there is one.
"""
from __future__ import annotations

import re
from collections import Counter

import numpy as np

from bench.zoo.reference import hf_forward, sample_ids
from bench.zoo.small import ArchFiles, build
from bench.zoo.specs import QTYPES

# GGUF name pattern -> the HF names it may come from ("|": alternatives, Gemma's and Phi-3's first).
_GGUF_TO_HF = [
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight|model.embed_tokens.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", "model.layers.{0}.input_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", "model.layers.{0}.pre_feedforward_layernorm.weight|"
                                      "model.layers.{0}.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.post_attention_norm\.weight", "model.layers.{0}.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.post_ffw_norm\.weight", "model.layers.{0}.post_feedforward_layernorm.weight"),
    (r"blk\.(\d+)\.attn_([qkv])\.(weight|bias)", "model.layers.{0}.self_attn.{1}_proj.{2}"),
    (r"blk\.(\d+)\.attn_qkv\.weight", "model.layers.{0}.self_attn.qkv_proj.weight"),
    (r"blk\.(\d+)\.attn_output\.weight", "model.layers.{0}.self_attn.o_proj.weight"),
    (r"blk\.(\d+)\.attn_([qk])_norm\.weight", "model.layers.{0}.self_attn.{1}_norm.weight"),
    (r"blk\.(\d+)\.ffn_gate\.weight", "model.layers.{0}.mlp.gate_proj.weight"),
    (r"blk\.(\d+)\.ffn_up\.weight", "model.layers.{0}.mlp.gate_up_proj.weight|model.layers.{0}.mlp.up_proj.weight"),
    (r"blk\.(\d+)\.ffn_down\.weight", "model.layers.{0}.mlp.down_proj.weight"),
]
# arch -> (label, HF config overrides that switch the feature off)
FEATURE_PROBES = {
    "llama3": [("rope_scaling llama3 -> none", {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}})],
    "mistral": [("sliding_window 32 -> none", {"sliding_window": None})],
    "gemma2": [("attn softcap -> none", {"attn_logit_softcapping": None}),
               ("final softcap -> none", {"final_logit_softcapping": None}),
               ("query_pre_attn_scalar 64 -> head_dim 128", {"query_pre_attn_scalar": 128}),
               ("sliding_window 32 -> 8192", {"sliding_window": 8192})],
    "gemma3": [("sliding_window 32 -> 32768", {"sliding_window": 32768}),
               ("global rope linear x8 -> none", {"rope_parameters": {
                   "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}),
               ("rope_local_base_freq 10k -> 1M", {"rope_parameters": {
                   "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                   "sliding_attention": {"rope_type": "default", "rope_theta": 1000000.0}}})],
}
TOKENIZER_SAMPLES = ["Hello world", "The year 2024 had 366 days.", "naïve café — déjà vu 😀",
                     "def f(x):\n    return x  # 42\n", "line one\n\nline three\t tab", " leading space",
                     "<tool_call>{\"a\": 1}</tool_call>", "[INST] hi [/INST]", "<start_of_turn>user\nhi<end_of_turn>"]


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's two rotary halves interleaved."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def weight_transforms(af: ArchFiles) -> tuple[dict[str, str], list[str]]:
    """({GGUF tensor kind: "HF name transform"}, problems)."""
    from safetensors.numpy import load_file

    from common.engine.gguf_file import GGUFFile

    hf = load_file(str(af.hf_dir / "model.safetensors"))
    cfg = af.manifest["hf_config"]
    found, problems, used = {}, [], set()
    for t in GGUFFile(af["F32"]).tensors:
        if t.name == "rope_freqs.weight":
            found[t.name] = "generated (llama3 rotary factors)"
            continue
        g = np.asarray(t.data)
        match = next((m for m in (re.fullmatch(p, t.name) for p, _ in _GGUF_TO_HF) if m), None)
        if match is None:
            problems.append(f"{t.name}: no HF counterpart known")
            continue
        template = next(tm for p, tm in _GGUF_TO_HF if re.fullmatch(p, t.name))
        hits = []
        for name in (c.format(*match.groups()) for c in template.split("|")):
            if name not in hf:
                continue
            h = hf[name]
            tries = {"identity": h, "+1": h + 1, "rows truncated": h[:g.shape[0]]}
            if ".attn_q." in t.name or ".attn_k." in t.name:
                heads = cfg["num_attention_heads"] if ".attn_q." in t.name else cfg["num_key_value_heads"]
                tries[f"llama.cpp permute ({heads} heads)"] = llama_cpp_permute(h, heads)
            hits += [(name, k) for k, v in tries.items() if v.shape == g.shape and np.array_equal(v, g)]
            if hits:
                break
        if not hits:
            problems.append(f"{t.name}: no transform of {template} matches")
            continue
        used.add(hits[0][0])
        kind = re.sub(r"blk\.\d+\.", "blk.N.", t.name)
        label = re.sub(r"model\.layers\.\d+\.", "model.layers.N.", " ".join(hits[0]))
        if found.get(kind, label) != label:
            problems.append(f"{kind}: a different transform in another layer ({found[kind]} / {label})")
        found[kind] = label
    unused = set(hf) - used - ({"lm_head.weight"} if af.arch.startswith("gemma") else set())  # llama.cpp skips it
    return found, problems + [f"HF tensor {n} is in no GGUF tensor" for n in sorted(unused)]


def quant_error(af: ArchFiles) -> dict[str, float]:
    """Each quantized file's relative RMS error against the F32 file, weighted by size over its quantized
    tensors (dequantized with the gguf package)."""
    from gguf.quants import dequantize

    from common.engine.gguf_file import GGUFFile

    ref = {t.name: np.asarray(t.data, dtype=np.float32) for t in GGUFFile(af["F32"]).tensors}
    out = {}
    for q in QTYPES[1:]:
        sq_err = sq_ref = 0.0
        for t in GGUFFile(af[q]).tensors:
            if t.tensor_type.name != "F32":
                x = ref[t.name]
                d = dequantize(np.asarray(t.data), t.tensor_type).reshape(x.shape)
                sq_err += float(np.sum((d - x) ** 2))
                sq_ref += float(np.sum(x ** 2))
        out[q] = (sq_err / sq_ref) ** 0.5
    return out


def feature_effects(af: ArchFiles) -> dict[str, float]:
    """Max |logit difference| over a sample prompt between the model and the model without each feature."""
    ids = sample_ids(af.hf_dir)
    base = hf_forward(af.hf_dir, ids)
    return {label: float(np.abs(hf_forward(af.hf_dir, ids, **ov) - base).max())
            for label, ov in FEATURE_PROBES.get(af.arch, [])}


def tokenizer_report(af: ArchFiles) -> tuple[str, list[str]]:
    """(a summary line, problems): AutoTokenizer against tokenizer.json (must agree) and tokenizer.model
    (may differ: see tests/engine/test_family_files.py), GGUF tokens against HF's vocabulary."""
    import tokenizers
    from transformers import AutoTokenizer

    from common.engine.gguf_file import GGUFFile

    auto = AutoTokenizer.from_pretrained(str(af.hf_dir))
    raw = tokenizers.Tokenizer.from_file(str(af.hf_dir / "tokenizer.json"))
    sp = None
    if (af.hf_dir / "tokenizer.model").is_file():
        import sentencepiece

        sp = sentencepiece.SentencePieceProcessor(model_file=str(af.hf_dir / "tokenizer.model"))
    problems, spm_diffs = [], []
    for s in TOKENIZER_SAMPLES:
        ids = auto.encode(s, add_special_tokens=False)
        if raw.encode(s, add_special_tokens=False).ids != ids:
            problems.append(f"AutoTokenizer != tokenizer.json on {s!r}")
        if sp is not None and sp.encode(s) != ids:
            spm_diffs.append(s)
    fields = GGUFFile(af["F32"]).fields
    tokens = fields["tokenizer.ggml.tokens"]
    vocab = {i: t for t, i in auto.get_vocab().items()}
    wrong = [i for i in range(len(tokens)) if i in vocab and vocab[i] != tokens[i]]
    if wrong:
        problems.append(f"GGUF tokens != HF vocabulary at {len(wrong)} ids, e.g. {wrong[:3]}")
    names = {1: "NORMAL", 2: "UNKNOWN", 3: "CONTROL", 4: "USER_DEFINED", 5: "UNUSED", 6: "BYTE"}
    types = Counter(names.get(t, str(t)) for t in fields["tokenizer.ggml.token_type"])
    line = (f"{type(auto).__name__}, GGUF {fields['tokenizer.ggml.model']}/{fields.get('tokenizer.ggml.pre')}, "
            f"types {dict(types)}")
    if sp is not None:
        line += f"; tokenizer.model differs from AutoTokenizer on {spm_diffs or 'none'}"
    return line, problems


def check(archs) -> int:
    """Print the report of every arch in archs; returns the number of problems."""
    n_problems = 0
    for arch in archs:
        af = build(arch)
        m = af.manifest
        print(f"== {arch}  {af.root}  (HF {m['hf_bytes'] / 1e6:.1f} MB, {m['gguf']['F32']['architecture']} GGUF)")
        transforms, problems = weight_transforms(af)
        print("  weights (F32 GGUF <- HF):\n" + "\n".join(f"    {k} <- {v}" for k, v in transforms.items()))
        errors = quant_error(af)
        for q in QTYPES:
            g = m["gguf"][q]
            err = f", rel. RMS error {errors[q]:.4f}" if q in errors else ""
            print(f"  {q:7s} {g['bytes'] / 1e6:6.1f} MB  {g['types']}{err}")
        effects = feature_effects(af)
        if effects:
            print("  feature effect, max |dlogit|: " + ", ".join(f"{k}: {v:.3f}" for k, v in effects.items()))
        problems += [f"feature moves nothing: {k}" for k, v in effects.items() if v < 1e-3]
        line, tok_problems = tokenizer_report(af)
        print("  tokenizer: " + line)
        for p in problems + tok_problems:
            print("  PROBLEM: " + p)
        n_problems += len(problems) + len(tok_problems)
    return n_problems
