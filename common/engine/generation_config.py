"""The sampling settings a model's files carry, which fill a request's unset fields (vLLM's --generation-config auto).

An HF folder's `generation_config.json` (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens)
and a GGUF's `general.sampling.*` keys (llama.cpp's converter writes them from that same file: temp, top_k,
top_p, min_p, penalty_repeat). A value outside what a request may set is left out, with a warning: the
file then does not change that field's default.
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

log = logging.getLogger(__name__)

# file key -> the request field it fills
HF_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
             "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
             "general.sampling.penalty_repeat": "repetition_penalty"}
_VALID = {"temperature": lambda v: v >= 0, "top_p": lambda v: 0 < v <= 1, "top_k": lambda v: v >= 0,
          "min_p": lambda v: 0 <= v <= 1, "repetition_penalty": lambda v: 0 < v <= 10,
          "max_tokens": lambda v: v >= 1}
_INTS = ("top_k", "max_tokens")


def sampling_defaults(path: Path) -> dict[str, float | int]:
    """The request fields `path` (a resolved .gguf file or HF folder) sets defaults for; {} when none."""
    if path.is_dir():
        file = path / "generation_config.json"
        if not file.is_file():
            return {}
        try:
            raw = json.loads(file.read_text())
        except (OSError, ValueError) as exc:
            log.warning("%s: not readable as JSON (%s): its sampling settings are ignored", file, exc)
            return {}
        found = {field: raw[key] for key, field in HF_KEYS.items() if raw.get(key) is not None}
        return _checked(found, file)
    from common.engine.gguf_weights import open_gguf

    fields = open_gguf(path).fields
    return _checked({field: fields[key] for key, field in GGUF_KEYS.items() if key in fields}, path)


def _checked(found: dict, source: Path) -> dict[str, float | int]:
    out = {}
    for field, value in found.items():
        try:
            number = int(value) if field in _INTS else float(value)
            ok = (field not in _INTS or number == value) and math.isfinite(number) and _VALID[field](number)
        except (TypeError, ValueError):
            ok = False
        if ok:
            out[field] = number
        else:
            log.warning("%s: %s = %r is not a valid %s: left out of the request defaults", source, field, value,
                        field)
    return out
