"""The self-distilled store: a frozen target's answers to prompts and its hidden states over them.

A store is a folder:

    meta.json                   format version, target fingerprint, layers, sampling, prompt source, where the
                                answers came from (the target in this process, an endpoint or the dataset), counts
    hidden-00000.safetensors    token-major hidden states of one shard of examples: "last" [num_tokens, hidden]
                                (final hidden state after the final norm) and "aux.{i}" [num_tokens, hidden]
                                (the input of layer i, i.e. Hugging Face hidden_states[i]) for each EAGLE-3 layer;
                                no tensors in a store of token ids only (layers none, for training online)
    rows-00000.arrow            that shard's rows: id, category, input_ids, loss_mask, length, shard, offset
    ...

Example rows live in shard `shard` at token rows [offset, offset + length). A shard is committed by
renaming its hidden file into place, then its rows file: rows without their hidden file, or a hidden file
without its rows, belong to an interrupted write that `StoreWriter` discards and redoes. Hidden states are
read through a memory map, one example's rows at a time, never a whole shard.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from collections import OrderedDict
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

FORMAT_VERSION = 1
LAYERS = ("last", "eagle3")
HIDDEN_DTYPE = torch.bfloat16
DEFAULT_HELDOUT_FRACTION = 0.05
ROWS = datasets.Features(
    {
        "id": datasets.Value("string"),
        "category": datasets.Value("string"),
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "loss_mask": datasets.Sequence(datasets.Value("int8")),
        "length": datasets.Value("int64"),
        "shard": datasets.Value("int32"),
        "offset": datasets.Value("int64"),
    }
)
# Settings that change what a store holds; a rerun into the same folder must repeat them.
IDENTITY_KEYS = ("format_version", "target", "layers", "aux_layers", "hidden_size", "hidden_dtype", "sampling",
                 "prompts", "answers")
# Settings that may change between runs of one store: the same target under another name, or served at another address.
UNCHECKED_SETTINGS = ("target.name:", "answers.endpoint:")
# Answers by the target in-process: what a store's meta says unless told otherwise, as stores written before
# their meta named the answers' source were.
TARGET_ANSWERS = {"source": "target"}
MAX_OPEN_SHARDS = 64
_UMASK = os.umask(0)
os.umask(_UMASK)
_ROWS_FILE = re.compile(r"rows-(\d{5})\.arrow")
_HIDDEN_FILE = re.compile(r"hidden-(\d{5})\.safetensors")


def hidden_file(index: int) -> str:
    return f"hidden-{index:05d}.safetensors"


def rows_file(index: int) -> str:
    return f"rows-{index:05d}.arrow"


def tensor_keys(layers, aux_layers) -> list[str]:
    """The safetensors keys of a shard; a layer listed twice among the aux layers is stored once."""
    keys = ["last"] if "last" in layers else []
    if "eagle3" in layers:
        keys += [f"aux.{i}" for i in dict.fromkeys(aux_layers)]
    return keys


def committed_shards(path: Path) -> list[int]:
    return sorted(int(m.group(1)) for m in map(_ROWS_FILE.fullmatch, os.listdir(path)) if m)


def read_meta(path: Path) -> dict:
    file = path / "meta.json"
    if not file.is_file():
        raise FileNotFoundError(f"{path} is no store: it has no meta.json (write one with `draftheads generate --out {path}`)")
    meta = json.loads(file.read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{file} has store format version {meta.get('format_version')}, this code reads version "
                         f"{FORMAT_VERSION}: regenerate the store with this version of draftheads")
    return meta


def write_atomic(file: Path, write) -> None:
    """Calls write(temporary path), syncs it, then renames it to `file`: readers see all of it or nothing."""
    tmp = file.with_name(file.name + ".tmp")
    write(tmp)
    os.chmod(tmp, 0o666 & ~_UMASK)  # as open() would create it; safetensors writes owner-only files
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, file)


def _differences(expected: dict, actual: dict, prefix: str = "") -> list[str]:
    found = []
    for key in sorted(set(expected) | set(actual)):
        a, b = expected.get(key), actual.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            found += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            found.append(f"{prefix}{key}: {a!r} vs {b!r}")
    return found


def _load_rows(path: Path, index: int) -> datasets.Dataset:
    file = path / rows_file(index)
    try:
        return datasets.Dataset.from_file(str(file))
    except (OSError, pa.ArrowInvalid) as error:
        raise ValueError(f"{file} is truncated or corrupted ({error}): delete it, then rerun the same "
                         "`draftheads generate` command to regenerate that shard's examples") from None


def check_shard(path: Path, index: int, keys: list[str], hidden_size: int, num_tokens: int) -> None:
    """Checks that a shard's hidden file is whole and holds [num_tokens, hidden_size] bf16 under every key."""
    file = path / hidden_file(index)
    redo = f"delete {file.name}, then rerun the same `draftheads generate` command to regenerate that shard's examples"
    if not file.is_file():
        raise ValueError(f"{file} is missing but {rows_file(index)} lists examples in it: {redo}")
    try:
        with safe_open(file, framework="pt") as tensors:
            shapes = {key: (tensors.get_slice(key).get_shape(), tensors.get_slice(key).get_dtype()) for key in tensors.keys()}
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{file} is truncated or corrupted ({error}): {redo}") from None
    expected = {key: ([num_tokens, hidden_size], "BF16") for key in keys}
    if shapes != expected:
        raise ValueError(f"{file} holds {shapes} but its rows expect {expected}: the shard is corrupted; {redo}")


class Store:
    """Examples of a self-distilled store: `store[i]` is a dict of
    id (str), input_ids [T] long, loss_mask [T] long (1 on the target's own answer tokens) and
    hidden: {"last": [T, hidden], "eagle3": [T, 3 * hidden] (aux layers concatenated low to high)} in bf16,
    holding the layers the store captured."""

    def __init__(self, path: str | os.PathLike, target_fingerprint: dict | str | None = None):
        self.path = Path(path)
        self.meta = read_meta(self.path)
        if target_fingerprint is not None:
            self._check_target(target_fingerprint)
        self.layers = tuple(self.meta["layers"])
        self.aux_layers = tuple(self.meta["aux_layers"])
        self.hidden_size = self.meta["hidden_size"]
        self.keys = tensor_keys(self.layers, self.aux_layers)
        shards = committed_shards(self.path)
        parts = []
        for index in shards:
            rows = _load_rows(self.path, index)
            check_shard(self.path, index, self.keys, self.hidden_size, sum(rows["length"]))
            parts.append(rows)
        self.table = datasets.concatenate_datasets(parts) if parts else datasets.Dataset.from_dict({}, features=ROWS)
        self._open: OrderedDict[int, object] = OrderedDict()

    def _check_target(self, fingerprint: dict | str) -> None:
        stored = self.meta["target"]["fingerprint"]
        if isinstance(fingerprint, str):
            if fingerprint != stored["id"]:
                raise ValueError(f"store {self.path} was generated by target {stored['id']}, not {fingerprint}: "
                                 "use a store generated by this target (draftheads generate --target ...)")
            return
        differences = _differences(stored, fingerprint)
        if differences:
            raise ValueError(f"store {self.path} was generated by another target (store vs given): "
                             f"{'; '.join(differences)}. Use a store generated by this target "
                             "(draftheads generate --target ...)")

    def __len__(self) -> int:
        return len(self.table)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __getitem__(self, index: int) -> dict:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} is out of range for a store of {len(self)} examples")
        row = self.table[int(index) % len(self)]
        tensors = self._tensors(row["shard"])
        start, end = row["offset"], row["offset"] + row["length"]
        read = {key: tensors.get_slice(key)[start:end] for key in self.keys}  # [T, hidden] each
        hidden = {}
        if "last" in self.layers:
            hidden["last"] = read["last"]
        if "eagle3" in self.layers:
            hidden["eagle3"] = torch.cat([read[f"aux.{i}"] for i in self.aux_layers], dim=-1)  # [T, 3 * hidden]
        return {
            "id": row["id"],
            "input_ids": torch.tensor(row["input_ids"], dtype=torch.long),
            "loss_mask": torch.tensor(row["loss_mask"], dtype=torch.long),
            "hidden": hidden,
        }

    def _tensors(self, shard: int):
        """The memory-mapped safetensors file of a shard; a bounded number stay open."""
        if shard in self._open:
            self._open.move_to_end(shard)
        else:
            self._open[shard] = safe_open(self.path / hidden_file(shard), framework="pt")
            if len(self._open) > MAX_OPEN_SHARDS:
                self._open.popitem(last=False)
        return self._open[shard]

    def __getstate__(self):
        # Memory maps do not travel to DataLoader workers; each worker opens its own.
        return {**self.__dict__, "_open": OrderedDict()}

    def select(self, indices) -> "Store":
        """The examples at `indices`, as a store over the same files."""
        subset = object.__new__(Store)
        subset.__dict__.update(self.__getstate__())
        subset.table = self.table.select(list(indices))
        return subset

    def split(self, heldout_fraction: float = DEFAULT_HELDOUT_FRACTION) -> tuple["Store", "Store"]:
        """(train, heldout), decided by a hash of each example's id: the same on every machine and run, and an
        example stays on its side as the store grows. Held out gets at least one example when there are two."""
        if not 0 <= heldout_fraction < 1:
            raise ValueError(f"heldout_fraction={heldout_fraction} must lie in [0, 1)")
        draws = np.array([int.from_bytes(hashlib.sha256(i.encode()).digest()[:8], "big") / 2**64 for i in self.table["id"]])
        is_heldout = draws < heldout_fraction
        if len(self) >= 2 and not is_heldout.any():
            is_heldout[draws.argmin()] = True
        if len(self) >= 2 and is_heldout.all():
            is_heldout[draws.argmax()] = False
        return self.select(np.flatnonzero(~is_heldout)), self.select(np.flatnonzero(is_heldout))


class StoreWriter:
    """Writes examples into a store folder a shard at a time, resuming an interrupted store with the same
    settings. Holds an exclusive lock on the folder while open."""

    def __init__(self, path: str | os.PathLike, meta: dict, shard_size: int = 64):
        if shard_size < 1:
            raise ValueError(f"shard_size={shard_size} must be >= 1 (examples per shard)")
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock = _lock(self.path)
        self.meta = {"format_version": FORMAT_VERSION, "answers": TARGET_ANSWERS, **meta}
        self.keys = tensor_keys(self.meta["layers"], self.meta["aux_layers"])
        self.shard_size = shard_size
        # The meta.json of the store being resumed; {} for a new store, or one that holds no example yet (it has
        # nothing to keep, so any settings go).
        self.stored: dict = {}
        if (self.path / "meta.json").is_file():
            if committed_shards(self.path):
                self.stored = read_meta(self.path)
                self._check_settings(self.stored)
        elif any(file.name != ".lock" for file in self.path.iterdir()):
            raise ValueError(f"{self.path} is not empty and holds no store (no meta.json): choose an empty or new --out folder")
        self._discard_uncommitted()
        self.shards = committed_shards(self.path)
        self.counts = {"num_examples": 0, "num_tokens": 0, "num_answer_tokens": 0}
        self.done_ids: set[str] = set()
        for index in self.shards:
            rows = _load_rows(self.path, index)
            check_shard(self.path, index, self.keys, self.meta["hidden_size"], sum(rows["length"]))
            self._count(rows["id"], rows["length"], [sum(mask) for mask in rows["loss_mask"]])
        self.pending: list[dict] = []
        self._write_meta(complete=False)

    def _check_settings(self, stored: dict) -> None:
        stored = {"answers": TARGET_ANSWERS, **stored}
        differences = _differences({k: stored.get(k) for k in IDENTITY_KEYS}, {k: self.meta.get(k) for k in IDENTITY_KEYS})
        differences = [d for d in differences if not d.startswith(UNCHECKED_SETTINGS)]
        if differences:
            raise ValueError(f"{self.path} holds a store written with other settings (store vs this run): "
                             f"{'; '.join(differences)}. Rerun with the store's settings (see {self.path / 'meta.json'}) "
                             "to resume it, or write to another --out folder")

    def _discard_uncommitted(self) -> None:
        committed = set(committed_shards(self.path))
        for file in self.path.iterdir():
            hidden = _HIDDEN_FILE.fullmatch(file.name)
            is_orphan = hidden is not None and int(hidden.group(1)) not in committed
            if file.name.endswith(".tmp") or is_orphan:
                file.unlink()
        for index in committed:
            if not (self.path / hidden_file(index)).is_file():
                (self.path / rows_file(index)).unlink()

    def _count(self, ids, lengths, num_answer_tokens) -> None:
        for id_ in ids:
            if id_ in self.done_ids:
                raise ValueError(f"{self.path} holds example {id_!r} twice: the store is corrupted; write a new one")
            self.done_ids.add(id_)
        self.counts["num_examples"] += len(ids)
        self.counts["num_tokens"] += int(sum(lengths))
        self.counts["num_answer_tokens"] += int(sum(num_answer_tokens))

    def add(self, example: dict) -> None:
        """example: id, category, input_ids [T], loss_mask [T], hidden {key: [T, hidden]} for every key of the store."""
        if example["id"] in self.done_ids or any(e["id"] == example["id"] for e in self.pending):
            raise ValueError(f"example {example['id']!r} is already in {self.path}")
        length = len(example["input_ids"])
        for key in self.keys:
            if tuple(example["hidden"][key].shape) != (length, self.meta["hidden_size"]):
                raise ValueError(f"example {example['id']!r}: hidden[{key!r}] has shape {tuple(example['hidden'][key].shape)}, "
                                 f"expected ({length}, {self.meta['hidden_size']})")
        self.pending.append(example)
        if len(self.pending) >= self.shard_size:
            self.flush()

    def flush(self) -> None:
        """Commits the pending examples as one shard."""
        if not self.pending:
            return
        index = self.shards[-1] + 1 if self.shards else 0
        lengths = [len(e["input_ids"]) for e in self.pending]
        offsets = np.cumsum([0] + lengths[:-1]).tolist()
        tensors = {key: torch.cat([e["hidden"][key] for e in self.pending]).to(HIDDEN_DTYPE).contiguous()  # [num_tokens, hidden]
                   for key in self.keys}
        rows = {
            "id": [e["id"] for e in self.pending],
            "category": [e["category"] for e in self.pending],
            "input_ids": [list(e["input_ids"]) for e in self.pending],
            "loss_mask": [list(e["loss_mask"]) for e in self.pending],
            "length": lengths,
            "shard": [index] * len(self.pending),
            "offset": offsets,
        }
        table = datasets.Dataset.from_dict(rows, features=ROWS).data.table
        write_atomic(self.path / hidden_file(index), lambda tmp: save_file(tensors, tmp))
        write_atomic(self.path / rows_file(index), lambda tmp: _write_arrow(table, tmp))
        self.shards.append(index)
        self._count(rows["id"], lengths, [sum(mask) for mask in rows["loss_mask"]])
        self.pending = []
        self._write_meta(complete=False)

    def note(self, key: str, value) -> None:
        """Records `value` under `key` in meta.json, written with the next commit: facts about the examples so far,
        which a rerun may change (so not among IDENTITY_KEYS)."""
        if key in IDENTITY_KEYS or key in ("counts", "complete", "format_version"):
            raise ValueError(f"{key!r} is a setting of the store, not a note")
        self.meta[key] = value

    def close(self, complete: bool) -> None:
        """Commits what is pending and records whether every requested prompt is answered."""
        self.flush()
        self._write_meta(complete)
        self._lock.close()

    def num_bytes(self, prefixes=("hidden-", "rows-")) -> int:
        return sum(f.stat().st_size for f in self.path.iterdir() if f.name.startswith(prefixes))

    def _write_meta(self, complete: bool) -> None:
        meta = {**self.meta, "counts": {**self.counts, "num_shards": len(self.shards), "num_bytes": self.num_bytes()},
                "complete": complete}
        write_atomic(self.path / "meta.json", lambda tmp: Path(tmp).write_text(json.dumps(meta, indent=2) + "\n"))


def _write_arrow(table: pa.Table, file) -> None:
    with pa.OSFile(str(file), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


def _lock(path: Path):
    import fcntl

    handle = open(path / ".lock", "w")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise RuntimeError(f"another process is writing the store {path}: wait for it to finish, or write elsewhere") from None
    return handle
