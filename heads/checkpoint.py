"""The head checkpoint: a folder with config.json (the head's config, its `kind` and `format_version`) and
model.safetensors (the head's own tensors only; the target's embedding, norm and LM head are never saved).

`save` writes a temporary sibling folder and renames it into place, so a folder under that name is always a
complete checkpoint. `load` returns the module of the recorded kind and explains every way a checkpoint can
fail to fit: malformed config, unknown kind, newer format, another target, missing, extra or misshapen tensors.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import torch
from safetensors.torch import save_file

from heads.config import FORMAT_VERSION
from heads.dflash import DFlash
from heads.draft_head import DraftHead
from heads.dspark import DSpark
from heads.eagle import Eagle
from heads.eagle3 import Eagle3
from heads.hf_folder import CONFIG_FILE, read_config, read_file
from heads.medusa import Medusa
from heads.mtp import Mtp
from heads.peagle import Peagle
from heads.target_parts import TargetParts
from heads.token_map import check_token_ids

HEADS: dict[str, type[DraftHead]] = {cls.config_class.kind: cls for cls in (Medusa, Eagle, Eagle3, Mtp, Peagle, DFlash, DSpark)}
WEIGHTS_FILE = "model.safetensors"


def save(module: DraftHead, path, metadata: dict | None = None) -> Path:
    """Write `module` to the folder `path`, replacing a checkpoint already there; `metadata` (JSON-able, e.g.
    training steps and data) is merged into the config's metadata."""
    if not isinstance(module, DraftHead):
        raise TypeError(f"save takes a draft head ({', '.join(cls.__name__ for cls in HEADS.values())}), "
                        f"got {type(module).__name__}")
    config = module.config.to_dict()
    config["metadata"] = {**config["metadata"], **(metadata or {})}
    tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in module.state_dict().items()}
    return write_folder(path, config, tensors, {"format": "pt", "kind": module.config.kind})


def write_folder(path, config: dict, tensors: dict[str, torch.Tensor], file_metadata: dict[str, str]) -> Path:
    """Write config.json and model.safetensors to the folder `path` through a temporary sibling renamed into
    place, replacing a folder that holds only those two files and refusing any other."""
    path = Path(path)
    try:
        config_text = json.dumps(config, indent=2)
    except TypeError as error:
        raise ValueError(f"head config or metadata is not JSON-serializable: {error}") from error
    if path.exists() and not _is_replaceable(path):
        raise ValueError(f"refusing to replace {path}: it is not a head checkpoint folder "
                         f"(a head checkpoint holds only {CONFIG_FILE} and {WEIGHTS_FILE}); choose another path")
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = _sibling(path, "partial")
    partial.mkdir()
    previous = None
    try:
        (partial / CONFIG_FILE).write_text(config_text + "\n")
        save_file(tensors, str(partial / WEIGHTS_FILE), metadata=file_metadata)
        if path.exists():
            previous = _sibling(path, "old")
            os.replace(path, previous)
        os.replace(partial, path)
    except BaseException:
        if previous is not None and not path.exists():
            os.replace(previous, path)
            previous = None
        raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)
    return path


def load(path, target_fingerprint: dict | None = None, *, target: TargetParts | None = None,
         dtype: torch.dtype | None = None) -> DraftHead:
    """The head saved in folder `path`. With `target_fingerprint` (serving.targets.fingerprint of the target
    to draft for) or `target` (its TargetParts, which the head is then bound to) a head made for another
    target is refused. `dtype` casts the floating-point tensors."""
    path = Path(path)
    data = _read_config(path)
    kind = data.get("kind")
    if kind not in HEADS:
        raise ValueError(f"{path / CONFIG_FILE}: unknown head kind {kind!r}; known kinds: {', '.join(HEADS)}")
    version = data.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise ValueError(f"{path / CONFIG_FILE}: format_version must be an integer, got {version!r}")
    if version > FORMAT_VERSION:
        raise ValueError(f"{path} has checkpoint format_version {version}, newer than the {FORMAT_VERSION} this "
                         "draftheads reads: upgrade draftheads to load it")
    cls = HEADS[kind]
    try:
        config = cls.config_class.from_dict(data)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path / CONFIG_FILE}: invalid {kind} config: {error}") from error
    against = {**(target_fingerprint or {}), **(target.describe() if target is not None else {})}
    mismatches = config.mismatches(against)
    if mismatches:
        made_for = config.target_fingerprint.get("id", "see target_fingerprint in its config.json")
        raise ValueError(f"head checkpoint {path} was made for another target ({made_for}): {'; '.join(mismatches)}. "
                         "Load it with the target it was trained on, or train a head for this target.")
    with torch.device("cpu"):  # read into host memory; the caller moves it
        module = cls(config)
    module.load_state_dict(_read_tensors(path, module.state_dict()))
    if module.token_map is not None:
        check_token_ids(module.token_map, config.vocab_size, f"{path / WEIGHTS_FILE}: token_map")
    if dtype is not None:
        module.to(dtype)
    if target is not None:
        module.bind_target(target)
    return module


def _sibling(path: Path, suffix: str) -> Path:
    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.{suffix}")


def _is_replaceable(path: Path) -> bool:
    return path.is_dir() and {entry.name for entry in path.iterdir()} <= {CONFIG_FILE, WEIGHTS_FILE}


def _read_config(path: Path) -> dict:
    if not path.is_dir():
        raise ValueError(f"no head checkpoint at {path}: expected a folder holding {CONFIG_FILE} and {WEIGHTS_FILE}")
    return read_config(path, "not a head checkpoint, or an incomplete copy of one")


def _read_tensors(path: Path, expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    weights_file = path / WEIGHTS_FILE
    if not weights_file.is_file():
        raise ValueError(f"{path} has no {WEIGHTS_FILE}: an incomplete copy of a head checkpoint")
    tensors = read_file(weights_file)
    missing = sorted(expected.keys() - tensors.keys())
    if missing:
        raise ValueError(f"{weights_file} is missing tensor(s) {missing} that its config.json needs: "
                         "the file does not belong to this config, or is damaged")
    unexpected = sorted(tensors.keys() - expected.keys())
    if unexpected:
        raise ValueError(f"{weights_file} has unexpected tensor(s) {unexpected}: a head checkpoint holds only the "
                         "head's own tensors (never the target's embedding, norm or LM head)")
    for name, tensor in tensors.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(f"{weights_file}: tensor {name} has shape {tuple(tensor.shape)}, but config.json implies "
                             f"{tuple(expected[name].shape)}: the weights and config disagree")
    return tensors
