"""AtomicCheckpointIO: a fit's Lightning checkpoints, each written whole or not at all.

Lightning's TorchCheckpointIO writes a local checkpoint to a temporary file in the system's temp folder and moves it
into place with shutil.move: a rename where that folder shares the checkpoint's filesystem, a copy where it does not
(a tmpfs /tmp, a separate data disk), and a process killed during the copy leaves a truncated last.ckpt, the file a
resume reads. This writes the temporary file beside the checkpoint, syncs it to disk and renames it into place
(os.replace), so a kill at any moment leaves the previous checkpoint or the new one. Remote paths (s3://, ...) keep
Lightning's writer.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        if storage_options is not None or not isinstance(get_filesystem(path), LocalFileSystem):
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.tmp")  # not *.ckpt, which --ckpt_path last and best look among
        with open(temporary, "wb") as file:
            torch.save(checkpoint, file)
            file.flush()
            os.fsync(file.fileno())  # else a machine crash after the rename can leave an empty file under the name
        os.replace(temporary, path)
