"""Training throughput of every head kind on a store of the default target, offline (hidden states read from the
store) against online (the frozen target computes them for every batch), in one run.

Each row trains the head of configs/<kind>.yaml (its model settings, the given batch size and precision) for
`--num-steps` optimizer steps without validation, logging or checkpoints, and times the steps after the first
`--num-warmup-steps`: tokens/s counts every real (unpadded) token of the timed batches, answer tok/s the tokens the
loss is taken on. Without --store, a store of `--num-prompts` ShareGPT first turns is generated first (not timed).

    .venv/bin/python -m benchmarks.train --store data/smollm2-135m-instruct-sharegpt     # 20 steps per row
    .venv/bin/python -m benchmarks.train --num-prompts 8 --max-new-tokens 16 --num-steps 3 --batch-size 2   # smoke run
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import torch
import yaml
from lightning.pytorch import Callback, Trainer

from serving.targets import DEFAULT_TARGET
from training.data.datamodule import DraftDataModule
from training.data.generate import GenerateConfig, generate
from training.modules import MODULES

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


class StepTimer(Callback):
    """Wall time and tokens of the optimizer steps after the first `num_warmup_steps`."""

    def __init__(self, num_warmup_steps: int):
        self.num_warmup_steps = num_warmup_steps
        self.start = None
        self.num_tokens = self.num_answer_tokens = self.num_steps = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.num_warmup_steps:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.start = time.perf_counter()
        elif trainer.global_step > self.num_warmup_steps:
            self.num_tokens += int(batch["padding_mask"].sum())
            self.num_answer_tokens += int(batch["loss_mask"].sum())
            self.num_steps += 1

    def seconds(self) -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - self.start


def model_settings(kind: str) -> dict:
    """configs/<kind>.yaml's model init_args, less the target (the benchmark's)."""
    init_args = dict(yaml.safe_load((CONFIGS / f"{kind}.yaml").read_text())["model"]["init_args"])
    init_args.pop("target")
    return init_args


def measure(kind: str, mode: str, store: str, args) -> dict:
    torch.manual_seed(0)
    module = MODULES[kind](target=DEFAULT_TARGET, **{**model_settings(kind), "warmup_steps": 1})
    data = DraftDataModule(store, target=DEFAULT_TARGET, mode=mode, batch_size=args.batch_size,
                           max_length=args.max_length, num_workers=args.num_workers)
    timer = StepTimer(args.num_warmup_steps)
    trainer = Trainer(max_steps=args.num_warmup_steps + args.num_steps, max_epochs=-1, precision=args.precision,
                      accelerator=args.accelerator, devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                      num_sanity_val_steps=0, gradient_clip_val=1.0, use_distributed_sampler=False, callbacks=[timer])
    trainer.fit(module, data)
    seconds = timer.seconds()
    return {"kind": kind, "mode": mode, "num_steps": timer.num_steps, "seconds": seconds,
            "tokens_per_s": timer.num_tokens / seconds, "answer_tokens_per_s": timer.num_answer_tokens / seconds,
            "seconds_per_step": seconds / timer.num_steps}


def make_store(folder: str, args) -> str:
    out = str(Path(folder) / "store")
    summary = generate(GenerateConfig(prompts="sharegpt", out=out, num_prompts=args.num_prompts,
                                      max_new_tokens=args.max_new_tokens, concurrency=min(16, args.num_prompts)),
                       progress=False)
    print(f"generated a store of {summary['num_examples']} examples, {summary['num_tokens']} tokens in "
          f"{summary['elapsed_s']:.1f} s")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", help="a store of the default target (default: generate one)")
    parser.add_argument("--num-prompts", type=int, default=64, help="ShareGPT prompts of a generated store")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="answer length of a generated store")
    parser.add_argument("--kinds", default=",".join(MODULES), help="comma-separated head kinds")
    parser.add_argument("--modes", default="offline,online", help="comma-separated data modes")
    parser.add_argument("--num-steps", type=int, default=20, help="timed optimizer steps per row")
    parser.add_argument("--num-warmup-steps", type=int, default=2, help="untimed steps first")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--precision", default="32-true", help="32-true, bf16-mixed, ...")
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)

    with tempfile.TemporaryDirectory() as folder:
        store = args.store or make_store(folder, args)
        rows = [measure(kind, mode, store, args) for kind in args.kinds.split(",") for mode in args.modes.split(",")]
    print(f"\n{DEFAULT_TARGET}, batch {args.batch_size}, {args.precision}, {args.num_steps} timed steps per row, "
          f"{os.cpu_count()} CPUs{', ' + torch.cuda.get_device_name() if torch.cuda.is_available() else ''}\n")
    print(f"{'kind':<8}{'mode':<9}{'tokens/s':>10}{'answer tok/s':>14}{'s/step':>8}{'vs offline':>12}")
    offline = {row["kind"]: row["tokens_per_s"] for row in rows if row["mode"] == "offline"}
    for row in rows:
        ratio = f"{row['tokens_per_s'] / offline[row['kind']]:.2f}x" if row["kind"] in offline else ""
        print(f"{row['kind']:<8}{row['mode']:<9}{row['tokens_per_s']:>10.0f}{row['answer_tokens_per_s']:>14.0f}"
              f"{row['seconds_per_step']:>8.2f}{ratio:>12}")
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
