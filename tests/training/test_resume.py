"""Resuming a fit where a checkpoint left it: from one written mid-epoch at validation, and from a step checkpoint
(last.ckpt every N optimizer steps) after `draftheads fit` was SIGKILLed, the run trains the rest of that epoch's
batches, each once, and ends with an uninterrupted run's weights; checkpoints are written atomically."""
from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest
import torch
from batch_log import BatchLog, config_with_batch_log, fit_command, read, subprocess_env
from lightning.pytorch import Callback
from safetensors.torch import load_file
from test_fit import fit_args

from training.checkpoint_io import AtomicCheckpointIO
from training.fit import build_cli
from training.fit import main as fit_main

pytestmark = pytest.mark.usefixtures("in_tmp_path")


class Interrupted(Exception):
    pass


class Interrupt(Callback):
    """Raises Interrupted as the batch of global step `step` is about to train: the run ends there, keeping only
    the checkpoints written before."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            raise Interrupted


def fit(args: list[str], log: Path, *callbacks: Callback, ckpt_path: str | None = None):
    cli = build_cli(args, run=False)
    cli.trainer.callbacks[:0] = [BatchLog(str(log)), *callbacks]
    cli.trainer.fit(cli.model, cli.datamodule, ckpt_path=ckpt_path)
    return cli


def test_a_run_resumed_from_a_validation_checkpoint_mid_epoch_trains_the_rest_of_that_epoch(debug_store):
    # 11 training examples in batches of 1: validation (and last.ckpt) after batches 4 and 8 of each epoch.
    args = fit_args("eagle", "debug", debug_store, "--data.batch_size=1", "--trainer.max_epochs=2",
                    "--trainer.val_check_interval=4", "--model.init_args.warmup_steps=2")
    with pytest.raises(Interrupted):
        fit(args, Path("interrupted"), Interrupt(step=6))
    assert torch.load("runs/eagle/checkpoints/last.ckpt", weights_only=False)["global_step"] == 4
    resumed = fit(args, Path("resumed"), ckpt_path="runs/eagle/checkpoints/last.ckpt")
    whole = fit(args, Path("whole"))
    before = [batch for batch in read(Path("interrupted/rank0.jsonl")) if batch["step"] < 4]
    trained = before + read(Path("resumed/rank0.jsonl"))
    assert trained == read(Path("whole/rank0.jsonl"))
    for name, tensor in whole.model.head.state_dict().items():
        torch.testing.assert_close(resumed.model.head.state_dict()[name], tensor, rtol=0, atol=0, msg=name)


def test_a_fit_killed_after_a_step_checkpoint_resumes_from_last_as_if_never_killed(debug_store, tmp_path, monkeypatch):
    # 11 training examples in batches of 2: 6 steps per epoch, 3 epochs. last.ckpt at each epoch's validation
    # (steps 6, 12, 18) and every 4 steps; the process is SIGKILLed as step 10's batch is about to train, so it
    # resumes from step 8, the third batch of epoch 1.
    settings = ["--model.init_args.target=debug", f"--data.store={debug_store}", "--data.batch_size=2",
                "--trainer.max_epochs=3", "--model.init_args.warmup_steps=2", "--trainer.logger=false",
                "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    for folder in (whole, killed):
        folder.mkdir()
    config = config_with_batch_log("eagle", tmp_path / "killed.yaml", killed / "before", kill_at_step=10,
                                   every_n_train_steps=4)
    result = subprocess.run(fit_command("-c", str(config), *settings), cwd=killed, env=subprocess_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    assert torch.load(killed / "runs/eagle/checkpoints/last.ckpt", weights_only=False)["global_step"] == 8

    monkeypatch.chdir(killed)
    config = config_with_batch_log("eagle", tmp_path / "resumed.yaml", killed / "after", every_n_train_steps=4)
    assert fit_main("fit", ["-c", str(config), *settings, "--ckpt_path=last"]) == 0
    monkeypatch.chdir(whole)
    config = config_with_batch_log("eagle", tmp_path / "whole.yaml", whole / "batches", every_n_train_steps=4)
    assert fit_main("fit", ["-c", str(config), *settings]) == 0

    before = [batch for batch in read(killed / "before" / "rank0.jsonl") if batch["step"] < 8]
    assert before + read(killed / "after" / "rank0.jsonl") == read(whole / "batches" / "rank0.jsonl")
    # Exactly: the same arithmetic on one thread in both processes, and everything a step depends on (weights,
    # AdamW moments, the schedule's step, the noise seeded by the global step, the data position) in the checkpoint.
    trained = [load_file(folder / "runs/eagle/heads/last/model.safetensors") for folder in (killed, whole)]
    assert trained[0].keys() == trained[1].keys()
    for name, tensor in trained[1].items():
        torch.testing.assert_close(trained[0][name], tensor, rtol=0, atol=0, msg=name)


def test_a_checkpoint_write_cut_short_leaves_the_previous_checkpoint_whole(debug_store, tmp_path, monkeypatch):
    cli = build_cli(fit_args("eagle", "debug", debug_store), run=False)
    assert isinstance(cli.trainer.strategy.checkpoint_io, AtomicCheckpointIO), "the configs write through it"
    io, path = AtomicCheckpointIO(), tmp_path / "last.ckpt"
    io.save_checkpoint({"global_step": 1}, path)

    def killed_while_writing(checkpoint, file):
        file.write(b"half a checkpoint")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", killed_while_writing)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({"global_step": 2}, path)
    assert io.load_checkpoint(path) == {"global_step": 1}


def test_a_checkpoint_that_names_k_num_draft_tokens_resumes(debug_store):
    """Checkpoints written before k was named num_speculative_tokens call it num_draft_tokens; LightningCLI
    reads a resumed checkpoint's module settings, and takes that name as the new one."""
    args = fit_args("eagle", "debug", debug_store, "--model.init_args.num_speculative_tokens=3")
    assert fit_main("fit", [*args, "--trainer.max_steps=1"]) == 0
    path = Path("runs/eagle/checkpoints/last.ckpt")
    checkpoint = torch.load(path, weights_only=False)
    checkpoint["hyper_parameters"]["num_draft_tokens"] = checkpoint["hyper_parameters"].pop("num_speculative_tokens")
    torch.save(checkpoint, path)
    cli = build_cli(["fit", *fit_args("eagle", "debug", debug_store), "--trainer.max_steps=2", f"--ckpt_path={path}"])
    assert cli.model.hparams.num_speculative_tokens == 3 and cli.trainer.global_step == 2
