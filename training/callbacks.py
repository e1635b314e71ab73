"""Lightning callbacks of a draft-head fit: the engine's head folders (ExportHeads), training throughput in tokens
per second (TokenThroughput) and the per-position accuracy chart at the end (AccuracyChart)."""
from __future__ import annotations

import json
import time
from itertools import accumulate
from operator import mul
from datetime import datetime, timezone
from pathlib import Path

from lightning.pytorch import Callback
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.trainer.states import TrainerFn

import heads


def _log_dir(trainer) -> Path:
    """The run's folder. Under several processes trainer.log_dir broadcasts rank 0's: every rank must ask."""
    return Path(trainer.log_dir or trainer.default_root_dir)


class ExportHeads(Callback):
    """Writes the head as the engine loads it (heads.save: config.json with the target fingerprint and training
    metadata, model.safetensors with the head's tensors only): `best` whenever validation in a fit improves `monitor`,
    and `last` when training ends; a validate run writes nothing. The best score travels in checkpoints, so a
    resumed run keeps comparing with it."""

    def __init__(self, dirpath: str | None = None, monitor: str = "val/tau", mode: str = "max"):
        """Exports the head as a head folder.

        Args:
            dirpath: Folder of `best` and `last` (null: <log dir>/heads).
            monitor: The logged metric that picks the best head.
            mode: max or min.
        """
        if mode not in ("max", "min"):
            raise ValueError(f"mode={mode!r} must be max or min")
        self.dirpath, self.monitor, self.mode = dirpath, monitor, mode
        self.best_score: float | None = None
        self.best_step: int | None = None

    def folder(self, trainer) -> Path:
        return Path(self.dirpath) if self.dirpath else _log_dir(trainer) / "heads"

    def metadata(self, trainer, pl_module) -> dict:
        datamodule = trainer.datamodule
        store = getattr(datamodule, "store", None)
        metrics = {name: float(value) for name, value in trainer.callback_metrics.items()
                   if name.startswith("val/") and value.numel() == 1}
        return {"training": {
            "kind": pl_module.kind,
            "global_step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "store": str(store.path) if store is not None else None,
            "num_train_examples": len(datamodule.train_set) if store is not None else None,
            "data_mode": getattr(datamodule, "mode", None),
            "metrics": metrics,
            "hparams": json.loads(json.dumps(dict(pl_module.hparams), default=str)),
            "written_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }}

    def _save(self, trainer, pl_module, name: str) -> None:
        folder = self.folder(trainer)
        if trainer.is_global_zero:
            heads.save(pl_module.head, folder / name, self.metadata(trainer, pl_module))

    def on_validation_end(self, trainer, pl_module) -> None:
        score = trainer.callback_metrics.get(self.monitor)
        # `draftheads validate` scores a checkpoint: it must not replace the head folders a fit wrote.
        if trainer.state.fn != TrainerFn.FITTING or trainer.sanity_checking or score is None:
            return
        score = float(score)
        if self.best_score is None or (score > self.best_score if self.mode == "max" else score < self.best_score):
            self.best_score, self.best_step = score, trainer.global_step
            self._save(trainer, pl_module, "best")

    def on_train_end(self, trainer, pl_module) -> None:
        self._save(trainer, pl_module, "last")

    def state_dict(self) -> dict:
        return {"best_score": self.best_score, "best_step": self.best_step}

    def load_state_dict(self, state_dict: dict) -> None:
        self.best_score, self.best_step = state_dict["best_score"], state_dict["best_step"]


class TokenThroughput(Callback):
    """Logs train/tokens_per_s: real (unpadded) tokens per second of wall time between optimizer-step ends,
    data loading included."""

    def __init__(self):
        self.last_time: float | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.last_time = time.perf_counter()

    def on_train_epoch_start(self, trainer, pl_module) -> None:  # a resumed run starts mid-epoch without it
        self.last_time = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        num_tokens = int(batch["padding_mask"].sum())
        pl_module.log("train/tokens_per_s", num_tokens / max(now - self.last_time, 1e-9), batch_size=len(batch["input_ids"]))
        self.last_time = now


class AccuracyChart(Callback):
    """At the end of fit, charts the last validation's conditional accuracy per draft position: a bar chart in
    Weights & Biases when it logs there, and accuracy_by_position.png in the log folder always."""

    def on_fit_end(self, trainer, pl_module) -> None:
        accuracy = pl_module.val_accuracy
        if not accuracy:
            return
        folder = _log_dir(trainer)
        if not trainer.is_global_zero:
            return
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt

        positions = list(range(1, len(accuracy) + 1))
        tau = 1 + sum(accumulate(accuracy, mul))
        figure, axes = plt.subplots(figsize=(5, 3))
        axes.bar(positions, accuracy)
        axes.set(xlabel="draft position", ylabel="conditional accuracy", ylim=(0, 1), xticks=positions,
                 title=f"{pl_module.kind}: simulated tau {tau:.2f} at k={len(accuracy)}")
        figure.tight_layout()
        folder.mkdir(parents=True, exist_ok=True)
        figure.savefig(folder / "accuracy_by_position.png", dpi=100)
        plt.close(figure)
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                import wandb

                table = wandb.Table(data=[[p, a] for p, a in zip(positions, accuracy)], columns=["position", "accuracy"])
                logger.experiment.log({"val/accuracy_by_position": wandb.plot.bar(
                    table, "position", "accuracy", title=f"{pl_module.kind}: conditional accuracy per draft position")})

