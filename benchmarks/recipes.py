"""Our recipes against the published ones: each head kind fit on the same store twice, with our config (configs/<kind>.yaml
plus the demo's RECIPE, KIND_RECIPE and token map, for the demo's EPOCHS) and with the settings its reference
publishes, at equal data and equal fit cost; held-out val/acc_1..4 and val/tau_walk (of the best head by val/tau, the
one the demo benches) and MT-bench tau side by side.

The published settings (PUBLISHED), as our modules' options:

- EAGLE-1, SafeAILab/EAGLE eagle/train/main.py: SmoothL1 weight v_w 1.0 + soft cross-entropy p_w 0.1, the first draft
  only (num_unroll_steps 1), lr 3e-5, AdamW betas (0.9, 0.95) and torch's default weight decay 0.01, gradients clipped
  by value at 0.5 (`clip_grad_value_`), uniform noise (U - 0.5) * 0.2 * 512 / T on the features (noise 0.1,
  noise_length 512). Its schedule warms up over 2,000 steps and decays linearly to 0 at step 800,000, far past its 20
  epochs: here constant after the demo's 10 warmup steps (2,000 is more than this whole fit).
- EAGLE-3, sgl-project/SpecForge scripts/train_eagle3.py with specforge/optimizer.py (BF16Optimizer) and
  lr_scheduler.py: training-time test 7 steps, step s weighted 0.8^s, lr 1e-4, AdamW betas (0.9, 0.999), weight decay
  0, gradient norm clipped at 0.5, linear warmup over 1.5% of the steps then cosine to 0.
- Medusa-1, FasterDecoding/Medusa medusa/train/train.py and scripts/train_vicuna_7b.sh: a trainable LM head per
  Medusa head, initialised from the target's (own_lm_head), one residual block, the heads' cross-entropies summed
  unweighted (decay 1.0), lr 1e-3, weight decay 0, warmup 10% of the steps then cosine to 0 (the Hugging Face Trainer's),
  and that Trainer's defaults: AdamW betas (0.9, 0.999), gradient norm clipped at 1.0.

Both recipes of a kind keep the demo's data settings (batch 2, 1,024 tokens, the store's 4,096 most frequent answer
tokens as token map or draft vocabulary, 4 drafts validated) and precision, so that only the training recipe differs:
the published batch sizes (4, 1 and 8 x 4 x 4 sequences of 2,048 tokens) are meant for stores of 68k conversations,
where a step of 128 would leave ours 4 steps an epoch. MTP has no published recipe for a small dense target
(DeepSeek-V3's trains the MTP module with the whole model in pre-training): its row is our config alone.

Equal fit cost: a short calibration fits each recipe of a kind `--calibration-steps` steps after
`--calibration-warmup` (both recipes read the same batches, in the same order, since the data settings and seed are
equal), in turns, `--calibration-rounds` times, and takes each recipe's fastest turn in CPU seconds per optimizer
step (this process's, all threads; wall time is printed beside it); the published recipe then gets our steps x our
seconds per step / its seconds per step, validated as often as ours (once per epoch's worth of its steps). Where the
two costs are within 5%, both get the same epochs. The machine's cores are shared with other benchmarks, so the fits'
wall times are reported but not used to scale. Fits run in-process at `--nice` (19: others' timings on the same
cores are not distorted) in scratch folders under --out; a fit that ended there with the same arguments is reused.

    nice -n 19 .venv/bin/python -m benchmarks.recipes --store data/demo-smollm2-135m-instruct \\
        --token-map runs/token_map-4096.pt --out runs/recipes

writes recipes.json and recipes.md to --out and prints the table.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import head_fits
from benchmarks.head_fits import head_metrics, our_overrides, run_fit
from training import demo

COST_TOLERANCE = 0.05  # per-step costs this close count as equal: equal epochs


@dataclass
class Recipe:
    """A published recipe: where it comes from, and our modules' and Trainer's options that reproduce it."""
    source: str
    model: dict
    trainer: dict = field(default_factory=dict)
    warmup_ratio: float | None = None  # warmup as a fraction of the fit's steps (else the demo's 10 steps)

    def overrides(self) -> list[str]:
        return ([f"--model.init_args.{key}={value if isinstance(value, str) else json.dumps(value)}"
                 for key, value in self.model.items()]
                + [f"--trainer.{key}={value}" for key, value in self.trainer.items()])


PUBLISHED = {
    "medusa": Recipe("Medusa-1 (FasterDecoding/Medusa medusa/train/train.py, scripts/train_vicuna_7b.sh)",
                     dict(own_lm_head=True, num_layers=1, decay=1.0, learning_rate=1e-3, weight_decay=0.0,
                          betas=[0.9, 0.999], schedule="cosine", min_lr_ratio=0.0),
                     dict(gradient_clip_val=1.0, gradient_clip_algorithm="norm"), warmup_ratio=0.1),
    "eagle": Recipe("EAGLE-1 (SafeAILab/EAGLE eagle/train/main.py)",
                    dict(feature_weight=1.0, token_weight=0.1, noise=0.1, noise_length=512, num_unroll_steps=1,
                         learning_rate=3e-5, weight_decay=0.01, betas=[0.9, 0.95], schedule="constant"),
                    dict(gradient_clip_val=0.5, gradient_clip_algorithm="value")),
    "eagle3": Recipe("EAGLE-3 (sgl-project/SpecForge scripts/train_eagle3.py, specforge/optimizer.py)",
                     dict(num_steps=7, decay=0.8, learning_rate=1e-4, weight_decay=0.0, betas=[0.9, 0.999],
                          schedule="cosine", min_lr_ratio=0.0),
                     dict(gradient_clip_val=0.5, gradient_clip_algorithm="norm"), warmup_ratio=0.015),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.recipes", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    head_fits.add_arguments(p, "recipes")
    p.add_argument("--kinds", default="medusa,eagle,eagle3,mtp",
                   help="head kinds to fit (P-EAGLE and DFlash get only our recipe: PUBLISHED holds none for them)")
    p.add_argument("--calibration-warmup", type=int, default=3, help="untimed steps before the timed ones")
    p.add_argument("--calibration-steps", type=int, default=12, help="timed optimizer steps per calibration turn")
    p.add_argument("--calibration-rounds", type=int, default=2, help="turns per recipe (the fastest counts)")
    return p.parse_args(argv)


def published_overrides(kind: str, args, num_steps: int) -> list[str]:
    """The published recipe over the same data settings: ours, then the recipe's options (and warmup) on top."""
    recipe = PUBLISHED[kind]
    warmup = [] if recipe.warmup_ratio is None else [
        "--model.init_args.warmup_steps", str(max(1, round(recipe.warmup_ratio * num_steps)))]
    return our_overrides(kind, args) + recipe.overrides() + warmup


def steps_per_epoch(args, kind: str) -> int:
    """Optimizer steps per epoch at the demo's batch size and length for the kind (one per batch)."""
    from training.data.datamodule import DraftDataModule

    settings = demo.demo_config(kind)["data"]
    data = DraftDataModule(str(Path(args.store).resolve()), target=args.target,
                           batch_size=settings["batch_size"], max_length=settings["max_length"])
    data.setup("fit")
    return len(data.train_dataloader())


def calibrate(kind: str, args, out: Path) -> dict[str, float]:
    """CPU seconds per optimizer step of each recipe (this process's, all threads: other processes on the same cores
    slow a step's wall time far more than its CPU time): the same first batches, recipes in turns, the fastest
    turn."""
    num_steps = args.calibration_warmup + args.calibration_steps
    limits = ["--trainer.max_steps", str(num_steps), "--trainer.limit_val_batches", "0"]
    recipes = {"ours": our_overrides(kind, args), "published": published_overrides(kind, args, num_steps)}
    best: dict[str, float] = {}
    for turn in range(args.calibration_rounds):
        for name, overrides in recipes.items():
            fit = run_fit(kind, args, overrides + limits, out / "calibration-cpu" / f"{kind}-{name}-{turn + 1}")
            per_step = {key: (ends[-1] - ends[args.calibration_warmup - 1]) / args.calibration_steps
                        for key, ends in (("cpu", fit["cpu_step_ends"]), ("wall", fit["step_ends"]))}
            best[name] = min(best.get(name, math.inf), per_step["cpu"])
            print(f"calibration {kind} {name} turn {turn + 1}: {per_step['cpu'] * 1000:.0f} ms/step CPU, "
                  f"{per_step['wall'] * 1000:.0f} ms wall", flush=True)
    return best


def fit_kind(kind: str, args, out: Path, num_batches: int) -> list[dict]:
    """Our recipe, then (where one is published) the published one at our fit cost."""
    epochs = args.epochs or demo.demo_epochs(kind)
    our_steps = epochs * num_batches
    rows = []
    print(f"\n==> {kind}: ours, {epochs} epochs ({our_steps} steps)", flush=True)
    ours = run_fit(kind, args, our_overrides(kind, args) + ["--trainer.max_epochs", str(epochs)], out / f"{kind}-ours")
    rows.append({"kind": kind, "recipe": "ours", "source": f"configs/{kind}.yaml + configs/demo/{kind}.yaml", "epochs": epochs,
                 **ours, **head_metrics(ours["head"])})
    if kind not in PUBLISHED:
        return rows
    cost = calibrate(kind, args, out)
    ratio = cost["published"] / cost["ours"]
    if abs(ratio - 1) <= COST_TOLERANCE:
        num_steps, scaling = our_steps, "equal epochs"
        limits = ["--trainer.max_epochs", str(epochs)]
    else:  # validated `epochs` times, as ours, every `interval` steps
        interval = max(1, round(our_steps / ratio / epochs))
        num_steps, scaling = interval * epochs, "steps x cost"
        limits = ["--trainer.max_steps", str(num_steps), "--trainer.max_epochs", str(math.ceil(num_steps / num_batches) + 1),
                  "--trainer.check_val_every_n_epoch", "null", "--trainer.val_check_interval", str(interval)]
    print(f"\n==> {kind}: published, {num_steps} steps ({num_steps / num_batches:.2f} epochs; its step costs "
          f"{ratio:.2f}x ours)", flush=True)
    published = run_fit(kind, args, published_overrides(kind, args, num_steps) + limits, out / f"{kind}-published")
    for row in rows:
        row.update(step_ms=cost["ours"] * 1000, scaling=scaling)
    rows.append({"kind": kind, "recipe": "published", "source": PUBLISHED[kind].source,
                 "epochs": round(num_steps / num_batches, 2), "step_ms": cost["published"] * 1000, "scaling": scaling,
                 **published, **head_metrics(published["head"])})
    return rows


COLUMNS = [("kind", lambda row: row["kind"]), ("recipe", lambda row: row["recipe"]),
           ("epochs", lambda row: f"{row['epochs']:g}"), ("steps", lambda row: str(row["num_steps"])),
           ("CPU ms/step (calibration)", lambda row: f"{row['step_ms']:.0f}" if "step_ms" in row else "-"),
           ("fit s", lambda row: f"{row['seconds']:.0f}")]


def main(argv=None) -> dict:
    args = parse_args(argv)

    def fit(out: Path) -> dict:
        num_batches = {kind: steps_per_epoch(args, kind) for kind in args.kinds.split(",")}
        rows = [row for kind, batches in num_batches.items() for row in fit_kind(kind, args, out, batches)]
        for row in rows:
            row.pop("step_ends"), row.pop("cpu_step_ends", None)
        return {"steps_per_epoch": num_batches, "rows": rows}

    return head_fits.run("recipes", args, fit, COLUMNS, ".2f")


if __name__ == "__main__":
    main()
