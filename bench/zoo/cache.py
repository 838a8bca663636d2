"""Where the zoo keeps its files and how a build is named: content-hash keys, so that a changed recipe, source
or library version builds anew beside the old files instead of being mistaken for them; and the seeded
generators that make a build the same on every machine.

    <root>/<arch>-<key>/          a small architecture (small.py)
    <root>/big/<shape>-<key>/     a benchmark shape (big.py)

root is $HANDOFF_ZOO_DIR or ~/.cache/handoff/zoo.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from collections import Counter
from pathlib import Path

from bench import llama_tools


def zoo_root() -> Path:
    return Path(os.environ.get("HANDOFF_ZOO_DIR") or "~/.cache/handoff/zoo").expanduser()


def cache_key(payload: dict) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:12]


def seeded_rng(seed: int, name: str):
    """A numpy generator for one tensor, seeded by sha256(seed:name): values that depend on neither torch nor
    the order tensors are made in."""
    import numpy as np

    h = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return np.random.default_rng(int.from_bytes(h[:8], "little"))


def versions() -> dict:
    """The versions of what writes the small architectures' files."""
    import numpy as np
    import safetensors
    import sentencepiece
    import tokenizers
    import transformers

    return {"llama-cpp-python": llama_tools.LLAMA_CPP_PYTHON_VERSION,
            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
            "sentencepiece": sentencepiece.__version__, "safetensors": safetensors.__version__,
            "numpy_major": np.__version__.split(".")[0]}


def gguf_summary(path: Path) -> dict:
    """A GGUF's tensor types (all of them, and per kind of tensor) and its headline metadata."""
    from common.engine.gguf_file import GGUFFile

    f = GGUFFile(path)
    by_kind: dict[str, Counter] = {}
    for t in f.tensors:
        kind = t.name.split(".", 2)[-1] if t.name.startswith("blk.") else t.name
        by_kind.setdefault(kind, Counter())[t.tensor_type.name] += 1
    return {"n_tensors": len(f.tensors), "types": dict(sorted(Counter(t.tensor_type.name for t in f.tensors).items())),
            "by_tensor": {k: dict(v) for k, v in sorted(by_kind.items())},
            "architecture": f.fields.get("general.architecture"), "file_type": f.fields.get("general.file_type"),
            "tokenizer_model": f.fields.get("tokenizer.ggml.model"),
            "tokenizer_pre": f.fields.get("tokenizer.ggml.pre"),
            "n_kv": len(f.fields)}


def log(msg: str) -> None:
    print(f"[zoo] {msg}", file=sys.stderr, flush=True)
