"""A small architecture's files, built once: an HF transformers folder (config.json in the hub's transformers 4
style, seeded random fp32 weights, the tokenizer files, generation_config.json) and the GGUFs llama.cpp's own
tools make of it: convert_hf_to_gguf.py to F32, llama-quantize from there to every other QTYPE.

    <zoo>/<arch>-<key>/hf/                  the transformers folder
    <zoo>/<arch>-<key>/<arch>.<QTYPE>.gguf
    <zoo>/<arch>-<key>/manifest.json        the key's payload, token ids, the HF forward's statistics, each
                                            GGUF's tensor types, build times

It is built under a temporary name and renamed into place, so a folder that exists is complete; of two
concurrent builders the second discards its copy. Weights come from numpy generators seeded by
sha256(seed:name), so neither torch nor the build order changes them.
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench import llama_tools
from bench.zoo import reference, tokenizer_files
from bench.zoo.cache import cache_key, gguf_summary, log, seeded_rng, versions, zoo_root
from bench.zoo.specs import ARCHS, INIT_DEFAULTS, QTYPES, SCHEMA, SPECS


@dataclass(frozen=True)
class ArchFiles:
    """One built small architecture: hf_dir (the transformers folder) and gguf[QTYPE] (also self[QTYPE])."""

    arch: str
    root: Path
    hf_dir: Path
    gguf: dict[str, Path]
    manifest: dict

    def __getitem__(self, qtype: str) -> Path:
        return self.gguf[qtype]

    @classmethod
    def load(cls, arch: str, root: Path) -> ArchFiles:
        manifest = json.loads((root / "manifest.json").read_text())
        return cls(arch, root, root / "hf", {q: root / f"{arch}.{q}.gguf" for q in QTYPES}, manifest)


def arch_key(arch: str) -> tuple[str, dict]:
    """The cache key of arch and the payload it hashes: the recipe, its tokenizer's and template's sources,
    the versions of what writes the files."""
    spec = SPECS[arch]
    src = llama_tools.ensure_src()
    tok_src = (tokenizer_files.smollm2_digest() if spec["tokenizer"]["kind"] == "bpe-smollm"
               else tokenizer_files.corpus_digest(src))
    template = tokenizer_files.chat_template(spec, src)
    payload = {"schema": SCHEMA, "arch": arch, "spec": copy.deepcopy(spec), "init": {**INIT_DEFAULTS, **spec["init"]},
               "qtypes": QTYPES, "tokenizer_source": tok_src,
               "template": hashlib.sha256(template.encode()).hexdigest()[:16], "versions": versions()}
    return cache_key(payload), payload


def build(arch: str) -> ArchFiles:
    """arch's files: built on first use, the folder of an earlier build after."""
    if arch not in SPECS:
        raise KeyError(f"unknown arch {arch!r}; one of {ARCHS}")
    key, payload = arch_key(arch)
    final = zoo_root() / f"{arch}-{key}"
    if (final / "manifest.json").is_file():
        return ArchFiles.load(arch, final)
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(f".{arch}-*"):  # left by a killed builder
        if time.time() - stale.stat().st_mtime > 6 * 3600:
            shutil.rmtree(stale, ignore_errors=True)
    log(f"building {final}")
    tmp = Path(tempfile.mkdtemp(prefix=f".{arch}-{key}-", dir=final.parent))
    try:
        manifest = _build_into(tmp, arch, payload)
        manifest["key"] = key
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, default=str))
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "manifest.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another builder got there first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ArchFiles.load(arch, final)


def _build_into(out: Path, arch: str, payload: dict) -> dict:
    spec = SPECS[arch]
    src = llama_tools.ensure_src()
    timings: dict[str, float] = {}
    t0 = time.time()
    hf = out / "hf"
    hf.mkdir()
    ids = tokenizer_files.write_tokenizer(hf, spec, src)
    cfg = _write_hf(arch, hf, ids)
    timings["hf_s"] = time.time() - t0
    # The folder loads in transformers and its logits are finite and far from uniform.
    logits = reference.hf_forward(hf, reference.sample_ids(hf))
    if not np.isfinite(logits).all():
        raise RuntimeError(f"{arch}: HF forward produced non-finite logits")
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    hf_stats = {"logit_std": float(logits.std(axis=-1).mean()),
                "top1_prob_mean": float((e.max(axis=-1) / e.sum(axis=-1)).mean())}
    pre_hashes = {}
    if spec.get("pre_hash_name"):
        from transformers import AutoTokenizer

        h = llama_tools.pre_tokenizer_hash(AutoTokenizer.from_pretrained(str(hf)), src)
        pre_hashes[h] = spec["pre_hash_name"]
    t0 = time.time()
    f32 = out / f"{arch}.F32.gguf"
    llama_tools.convert(hf, f32, "f32", ("--model-name", f"handoff-zoo-{arch}"), pre_hashes)
    timings["convert_s"] = time.time() - t0
    for q in QTYPES[1:]:
        t0 = time.time()
        llama_tools.quantize(f32, out / f"{arch}.{q}.gguf", q)
        timings[f"quantize_{q}_s"] = time.time() - t0
    files = {q: {"bytes": (out / f"{arch}.{q}.gguf").stat().st_size, **gguf_summary(out / f"{arch}.{q}.gguf")}
             for q in QTYPES}
    return {"arch": arch, "payload": payload, "hf_config": cfg, "token_ids": ids, "hf_forward": hf_stats,
            "gguf": files, "hf_bytes": sum(f.stat().st_size for f in hf.iterdir()),
            "timings": {k: round(v, 2) for k, v in timings.items()}, "built_at": time.strftime("%Y-%m-%d %H:%M:%S")}


def _write_hf(arch: str, hf: Path, ids: dict) -> dict:
    """config.json, model.safetensors and generation_config.json; returns the config."""
    import torch
    import transformers
    from safetensors.torch import save_file

    spec = SPECS[arch]
    init = {**INIT_DEFAULTS, **spec["init"]}
    cfg = _hub_config(spec, ids)
    cls = getattr(transformers, spec["hf_class"])
    # A deep copy: transformers' config classes edit rope dicts in place.
    config = cls.config_class(**copy.deepcopy({k: v for k, v in cfg.items() if k != "architectures"}))
    with torch.device("meta"):
        model = cls(config)
    tensors = {name: torch.from_numpy(_init_value(name, tuple(p.shape), spec["seed"], init))
               for name, p in model.named_parameters()}  # a tied lm_head is not a parameter of its own
    save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})
    (hf / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"], "_from_model_config": False}
    if "pad_token_id" in cfg:
        gen["pad_token_id"] = cfg["pad_token_id"]
    (hf / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return cfg


def _hub_config(spec: dict, ids: dict) -> dict:
    """config.json as the family's hub checkpoints write it (rope_theta, rope_scaling, ...), with the vocabulary
    size (padded as the family pads it) and the token ids."""
    cfg = {"architectures": [spec["hf_class"]], "model_type": spec["model_type"], **copy.deepcopy(spec["config"])}
    n = ids["n_tokens"]
    if spec.get("vocab_pad_to"):
        n = -(-n // spec["vocab_pad_to"]) * spec["vocab_pad_to"]
    cfg["vocab_size"] = n + spec.get("vocab_extra", 0)
    cfg["bos_token_id"] = ids["bos"]
    eos = ids["eos_ids"]
    cfg["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if ids["pad"] is not None:
        cfg["pad_token_id"] = ids["pad"]
    cfg.update(torch_dtype="float32", initializer_range=0.02, use_cache=True)
    return cfg


def _init_value(name: str, shape: tuple, seed: int, init: dict) -> np.ndarray:
    g = seeded_rng(seed, name)
    if name.endswith("norm.weight"):
        v = g.uniform(init["norm_lo"], init["norm_hi"], size=shape)
        if name == "model.norm.weight":
            v = v * init["final_norm_scale"]
        if init["norm_offset"]:  # Gemma stores the scale minus 1
            v = v - 1.0
    elif name.endswith(".bias"):
        v = g.standard_normal(shape) * init["bias_std"]
    elif name.endswith("embed_tokens.weight"):
        v = g.standard_normal(shape) * init["emb_std"]
    elif name.endswith("lm_head.weight"):
        v = g.standard_normal(shape) * init["head_std"]
    elif len(shape) == 2:
        gain = init["qk_gain"] if any(p in name for p in ("q_proj", "k_proj")) else 1.0
        v = g.standard_normal(shape) * (gain / math.sqrt(shape[1]))
    else:
        raise ValueError(f"no init rule for {name} {shape}")
    return v.astype(np.float32)
