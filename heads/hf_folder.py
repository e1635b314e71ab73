"""A Hugging Face model folder as every reader sees it (targets, target parts, head checkpoints, imports):
its config.json, and named tensors read across its *.safetensors files.

A sharded checkpoint's files (model-00001-of-00002.safetensors, ...) are read by listing the folder, not
through model.safetensors.index.json: every file is opened, and each tensor name is looked up in the files
that hold it. A file safetensors cannot read, like a config.json that is missing, not JSON or not an object,
is a ValueError that names it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import torch
from safetensors import SafetensorError, safe_open

CONFIG_FILE = "config.json"


def read_config(folder, why: str = "a Hugging Face model folder holds one") -> dict:
    """`folder`'s config.json as a dict; `why` completes the error when there is none."""
    config_file = Path(folder) / CONFIG_FILE
    if not config_file.is_file():
        raise ValueError(f"{folder} has no {CONFIG_FILE}: {why}")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{config_file} is malformed ({error})") from error
    if not isinstance(config, dict):
        raise ValueError(f"{config_file} is malformed: expected a JSON object, got {type(config).__name__}")
    return config


def weight_files(folder) -> list[Path]:
    """The folder's *.safetensors files in name order; an empty list when it has none."""
    return sorted(Path(folder).glob("*.safetensors"))


def read_tensors(folder, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors called `names` (every tensor when None) across the folder's *.safetensors files. A name no
    file holds is left out, for the caller to name in its own error; a folder without such files is an error."""
    files = weight_files(folder)
    if not files:
        raise ValueError(f"{folder} has no *.safetensors weights")
    found = {}
    for file in files:
        found.update(read_file(file, names))
    return found


def read_file(file, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors called `names` (every tensor when None) that the safetensors file `file` holds."""
    try:
        with safe_open(file, framework="pt") as weights:
            held = weights.keys()
            return {name: weights.get_tensor(name) for name in (held if names is None else set(names) & set(held))}
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{file} is unreadable ({error})") from error


def tensor_shapes(folder) -> dict[str, list[int]]:
    """Every tensor's shape across the folder's *.safetensors files, read from their headers alone."""
    shapes = {}
    for file in weight_files(folder):
        with safe_open(file, framework="pt") as weights:
            shapes.update({name: weights.get_slice(name).get_shape() for name in weights.keys()})
    return shapes
