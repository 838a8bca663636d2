"""What an HF checkpoint folder says about its tokenizer beside tokenizer.json / tokenizer.model:
tokenizer_config.json (BOS, EOS, add_bos_token, the chat template) and chat_template.jinja."""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from common.engine.tokenizer.errors import TokenizerError


def read_tokenizer_config(folder: Path) -> dict:
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


def config_token_text(value: object) -> str | None:
    """tokenizer_config.json writes a token as a string or as a serialized AddedToken."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


def config_chat_template(config: Mapping) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # several named templates: the plain chat one is "default"
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template
