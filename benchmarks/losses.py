"""The token losses (training/modules/losses.py) side by side, and EAGLE 3.1's norms on and off: each head kind fit on
the demo's store with the demo's recipe (configs/<kind>.yaml plus the demo's RECIPE, KIND_RECIPE, token map and
precision) once per loss and seed, everything else equal (same data, epochs and batches); held-out val/acc_1..4 and
val/tau_walk of the best head by val/tau (the one the demo benches), the fit's seconds, and MT-bench tau.

A seed sets both the head's initialisation (seed_everything) and the batch order (data.seed): the spread between
seeds is the noise a difference between losses must clear. Fits run in-process in scratch folders under --out, one
per (kind, loss, seed, norms); one that ended there with the same arguments is reused, so the sweep can be run in
parts (e.g. one kind or one seed per call) and picks up where it stopped. `--bench` then runs `draftheads bench`
over every fitted head of the given kinds, seeds and losses (plain decoding once) and writes the table:

    .venv/bin/python -m benchmarks.losses --store data/demo-smollm2-135m-instruct --token-map runs/token_map-4096.pt \\
        --out runs/losses --kinds eagle3,medusa --losses ce,kl,tv,lk_hybrid --seeds 0,1 [--norms] [--bench]

writes losses.json and losses.md to --out and prints the table. A loss is a name or a JSON mix ('{"kl":0.5,"tv":0.5}').
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks import head_fits
from benchmarks.head_fits import head_metrics, our_overrides, run_fit
from training import demo

NORMS = ["--model.init_args.norm_before_fc", "true", "--model.init_args.norm_output", "true"]  # speculators' EAGLE 3.1


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.losses", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    head_fits.add_arguments(p, "losses")
    p.add_argument("--kinds", default="eagle3,medusa")
    p.add_argument("--losses", default="ce,kl,tv,lk_hybrid",
                   help="comma-separated names; a mix as JSON after a semicolon: 'kl,tv;{\"kl\":0.5,\"tv\":0.5}'")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--norms", action="store_true",
                   help="also fit EAGLE-3 with EAGLE 3.1's norm_before_fc and norm_output, at its default loss")
    p.add_argument("--bench", action="store_true", help="bench the fitted heads and write the table (no new fits)")
    return p.parse_args(argv)


def loss_specs(text: str) -> list:
    names, _, mixes = text.partition(";")
    return [name for name in names.split(",") if name] + ([json.loads(mixes)] if mixes else [])


def label(loss) -> str:
    return loss if isinstance(loss, str) else "+".join(f"{w:g}{name}" for name, w in loss.items())


def runs(args) -> list[dict]:
    """Every (kind, loss, seed, norms) the arguments name, with its overrides and folder."""
    out = Path(args.out).resolve()
    rows = []
    for kind in args.kinds.split(","):
        epochs = args.epochs or demo.demo_epochs(kind)
        variants = [(loss, False) for loss in loss_specs(args.losses)]
        if args.norms and kind == "eagle3":
            variants.append(("kl", True))
        for seed in map(int, args.seeds.split(",")):
            for loss, norms in variants:
                name = f"{kind}-{label(loss)}{'-norms' if norms else ''}-s{seed}"
                overrides = (our_overrides(kind, args)
                             + ["--trainer.max_epochs", str(epochs), "--seed_everything", str(seed), "--data.seed",
                                str(seed), "--model.init_args.loss", loss if isinstance(loss, str) else json.dumps(loss)]
                             + (NORMS if norms else []))
                rows.append({"kind": kind, "loss": label(loss), "norms": norms, "seed": seed, "epochs": epochs,
                             "name": name, "overrides": overrides, "folder": out / name})
    return rows


COLUMNS = [("kind", lambda row: row["kind"]), ("loss", lambda row: row["loss"]),
           ("EAGLE 3.1 norms", lambda row: "on" if row["norms"] else "off"), ("seed", lambda row: str(row["seed"])),
           ("fit s", lambda row: f"{row['seconds']:.0f}")]


def main(argv=None) -> dict:
    args = parse_args(argv)

    def fit(out: Path) -> dict:
        rows = runs(args)
        for row in rows:
            if args.bench and not (row["folder"] / "fit.json").exists():
                raise SystemExit(f"{row['name']} is not fitted yet: run without --bench first")
            print(f"\n==> {row['name']}", flush=True)
            result = run_fit(row["kind"], args, row.pop("overrides"), row.pop("folder"))
            row.update(num_steps=result["num_steps"], seconds=result["seconds"], head=result["head"],
                       **head_metrics(result["head"]))
        return {"rows": rows}

    return head_fits.run("losses", args, fit, COLUMNS, benched=args.bench, keep_taus=True)


if __name__ == "__main__":
    main()
