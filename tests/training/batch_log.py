"""BatchLog, a test callback: the store ids of every training batch, one JSON line per batch in rank<r>.jsonl,
written before the batch trains and flushed, so a killed process leaves what it trained; and configs/<kind>.yaml
with one among its callbacks, which a `draftheads fit` subprocess reads with tests/training on PYTHONPATH."""
from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import yaml
from lightning.pytorch import Callback

ROOT = Path(__file__).resolve().parents[2]


class BatchLog(Callback):
    def __init__(self, folder: str, kill_at_step: int | None = None):
        """folder: where rank<r>.jsonl goes (appended to); kill_at_step: SIGKILL this process as the batch of that
        global step is about to train."""
        self.folder, self.kill_at_step = Path(folder), kill_at_step

    def on_train_start(self, trainer, pl_module) -> None:
        examples = trainer.datamodule.train_set
        table = examples.store.table
        self.ids = {tuple(ids[:examples.max_length]): id_ for id_, ids in zip(table["id"], table["input_ids"])}
        self.folder.mkdir(parents=True, exist_ok=True)
        self.file = open(self.folder / f"rank{trainer.global_rank}.jsonl", "a")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
        rows = [tuple(ids[mask].tolist()) for ids, mask in zip(batch["input_ids"], batch["padding_mask"])]
        self.file.write(json.dumps({"epoch": trainer.current_epoch, "batch_idx": batch_idx, "step": trainer.global_step,
                                    "ids": [self.ids[row] for row in rows]}) + "\n")
        self.file.flush()

    def on_train_end(self, trainer, pl_module) -> None:
        self.file.close()


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def config_with_batch_log(kind: str, path: Path, log: Path, kill_at_step: int | None = None,
                          every_n_train_steps: int | None = None) -> Path:
    """Writes configs/<kind>.yaml to `path` with a BatchLog into `log` among its callbacks, and its step checkpoints
    every_n_train_steps apart if given."""
    config = yaml.safe_load((ROOT / "configs" / f"{kind}.yaml").read_text())
    callbacks = config["trainer"]["callbacks"]
    if every_n_train_steps is not None:
        [steps] = [c["init_args"] for c in callbacks if "every_n_train_steps" in c.get("init_args", {})]
        steps["every_n_train_steps"] = every_n_train_steps
    callbacks.append({"class_path": "batch_log.BatchLog",
                      "init_args": {"folder": str(log), "kill_at_step": kill_at_step}})
    path.write_text(yaml.safe_dump(config))
    return path


def subprocess_env() -> dict:
    """For `python -m training fit` subprocesses: batch_log importable, and one thread per process as the test
    process runs (conftest.one_thread), so their float arithmetic is the test process's."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline",
            "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "training"), str(ROOT)])}


def fit_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "training", "fit", *args]
