"""`draftheads fit` over two processes (DDP, gloo on the CPU): each rank trains its own share of every global batch,
the weights end where one process ends when it trains the same global batches, one rank's batch after the other's,
with their gradients averaged (accumulate_grad_batches: 2), and validation counts every held-out example once."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from batch_log import config_with_batch_log, fit_command, read, subprocess_env
from safetensors.torch import load_file

from training.data.datamodule import LengthBatches
from training.fit import main as fit_main


def test_two_processes_train_disjoint_shares_of_the_global_batches_and_end_with_one_process_s_weights(
        debug_store, tmp_path, monkeypatch):
    # 12 examples, 4 held out at 0.2 (2 per rank), 8 trained in batches of 2: per epoch 4 batches, 2 global steps.
    settings = ["--model.init_args.target=debug", f"--data.store={debug_store}", "--data.batch_size=2",
                "--data.heldout_fraction=0.2", "--trainer.max_epochs=3", "--model.init_args.warmup_steps=2",
                "--trainer.logger=false", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
    ddp, single = tmp_path / "ddp", tmp_path / "single"
    for folder in (ddp, single):
        folder.mkdir()
    config = config_with_batch_log("eagle", tmp_path / "eagle.yaml", Path("batches"))
    result = subprocess.run(fit_command("-c", str(config), *settings, "--trainer.strategy=ddp", "--trainer.devices=2",
                                        "--trainer.accelerator=cpu"),
                            cwd=ddp, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    monkeypatch.chdir(single)
    assert fit_main("fit", ["-c", str(config), *settings, "--trainer.accumulate_grad_batches=2"]) == 0

    ranks = [read(ddp / "batches" / f"rank{rank}.jsonl") for rank in (0, 1)]
    micro = read(single / "batches" / "rank0.jsonl")
    assert len(ranks[0]) == len(ranks[1]) == 6 and len(micro) == 12
    for epoch in range(3):
        shares = [{i for batch in log if batch["epoch"] == epoch for i in batch["ids"]} for log in ranks]
        assert not shares[0] & shares[1] and len(shares[0] | shares[1]) == 8, f"epoch {epoch}: ranks overlap"
    for rank, log in enumerate(ranks):
        # global step k: rank r trains the single process's micro-batch 2k + r of that step
        assert [batch["ids"] for batch in log] == [batch["ids"] for batch in micro[rank::2]]
        assert [batch["step"] for batch in log] == [batch["step"] for batch in micro[rank::2]] == list(range(6))

    # Exactly equal: a rank's forward and backward are the single process's over the same micro-batch (one thread
    # each, same noise, seeded by the global step); DDP averages the two gradients as (g0 + g1) / 2 and
    # accumulation as g0 / 2 + g1 / 2, and halving is exact in floating point; clipping and AdamW then see the
    # same numbers.
    heads = [folder / "runs" / "eagle" / "heads" / "last" for folder in (ddp, single)]
    trained = [load_file(head / "model.safetensors") for head in heads]
    assert trained[0].keys() == trained[1].keys()
    for name, tensor in trained[1].items():
        torch.testing.assert_close(trained[0][name], tensor, rtol=0, atol=0, msg=name)
    # The last validation's chain counts, summed over the ranks' halves of the held-out examples, are one process's.
    metrics = [json.loads((head / "config.json").read_text())["metadata"]["training"]["metrics"] for head in heads]
    for name in ("val/acc_1", "val/acc_4", "val/tau", "val/tau_walk"):
        assert metrics[0][name] == metrics[1][name], name


def test_each_rank_validates_its_share_of_the_held_out_examples():
    lengths = [5, 9, 3, 7, 4]
    shares = [list(LengthBatches(lengths, 2, shuffle=False, num_replicas=2, rank=rank)) for rank in (0, 1)]
    assert shares == [[[2, 4], [0]], [[3, 1]]]  # every other example, batched by length
    with pytest.raises(ValueError, match="1 held-out examples cannot be shared by 2 processes"):
        len(LengthBatches([5], 1, shuffle=False, num_replicas=2, rank=1))
