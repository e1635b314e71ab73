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
import os
import time
from pathlib import Path

from benchmarks import recipes
from training import demo

NORMS = ["--model.init_args.norm_before_fc", "true", "--model.init_args.norm_output", "true"]  # speculators' EAGLE 3.1


def parse_args(argv=None):
    from serving.targets import DEFAULT_TARGET

    p = argparse.ArgumentParser(prog="python -m benchmarks.losses", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", required=True, help="the demo's store (make demo: data/demo-<target>)")
    p.add_argument("--token-map", required=True, help="the demo's token map (runs/token_map-4096.pt)")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--out", required=True, help="scratch folder of the fits, and losses.json / losses.md")
    p.add_argument("--kinds", default="eagle3,medusa")
    p.add_argument("--losses", default="ce,kl,tv,lk_hybrid",
                   help="comma-separated names; a mix as JSON after a semicolon: 'kl,tv;{\"kl\":0.5,\"tv\":0.5}'")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--norms", action="store_true",
                   help="also fit EAGLE-3 with EAGLE 3.1's norm_before_fc and norm_output, at its default loss")
    p.add_argument("--epochs", type=int, default=None,
                   help="epochs for every kind (default: the demo's, " +
                        ", ".join(f"{k} {n}" for k, n in demo.EPOCHS.items()) + ")")
    p.add_argument("--bench", action="store_true", help="bench the fitted heads and write the table (no new fits)")
    p.add_argument("--bench-prompts", type=int, default=8, help="MT-bench first turns, one per category in turn")
    p.add_argument("--bench-new-tokens", type=int, default=64)
    p.add_argument("--nice", type=int, default=19, help="niceness of this process and its fits")
    p.add_argument("--precision", default=None, help="the fits' precision (default: the demo's, fit_precision)")
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
        epochs = args.epochs or demo.EPOCHS[kind]
        variants = [(loss, False) for loss in loss_specs(args.losses)]
        if args.norms and kind == "eagle3":
            variants.append(("kl", True))
        for seed in map(int, args.seeds.split(",")):
            for loss, norms in variants:
                name = f"{kind}-{label(loss)}{'-norms' if norms else ''}-s{seed}"
                overrides = (recipes.our_overrides(kind, args)
                             + ["--trainer.max_epochs", str(epochs), "--seed_everything", str(seed), "--data.seed",
                                str(seed), "--model.init_args.loss", loss if isinstance(loss, str) else json.dumps(loss)]
                             + (NORMS if norms else []))
                rows.append({"kind": kind, "loss": label(loss), "norms": norms, "seed": seed, "epochs": epochs,
                             "name": name, "overrides": overrides, "folder": out / name})
    return rows


def bench(rows: list[dict], args, out: Path) -> str:
    """`draftheads bench` over the heads not benched before (plain decoding once): MT-bench tau per head, kept in
    out/bench-tau.json (a rerun benches only new heads) and put into the rows."""
    from training.cli import main as draftheads

    taus_path = out / "bench-tau.json"
    taus = json.loads(taus_path.read_text()) if taus_path.exists() else {}
    command = ["bench", "--target", args.target, "--prompts", "mt-bench", "--num-prompts", str(args.bench_prompts),
               "--max-new-tokens", str(args.bench_new_tokens), "--json", str(out / "bench.json")]
    new = [row for row in rows if row["head"] not in taus]
    if new:
        configs = []
        for row in new:
            configs += ["--speculative-config", json.dumps({"method": row["kind"], "model": row["head"],
                                                            "num_speculative_tokens": recipes.NUM_DRAFTS})]
        print(f"\n==> draftheads {' '.join(command + configs)}", flush=True)
        if draftheads(command + configs) != 0:
            raise RuntimeError("draftheads bench failed")
        result = json.loads((out / "bench.json").read_text())
        taus.update({r["config"]["model"]: r["tau"] for r in result["rows"] if r["config"]})
        taus_path.write_text(json.dumps(taus, indent=2))
    for row in rows:
        row["mt_bench_tau"] = taus[row["head"]]
    return ("draftheads " + " ".join(command[:-2])
            + " --speculative-config '{\"method\": KIND, \"model\": HEAD, \"num_speculative_tokens\": 4}' (one per head)")


def to_markdown(report: dict) -> str:
    lines = ["| kind | loss | EAGLE 3.1 norms | seed | fit s | "
             + " | ".join(f"val/acc_{i}" for i in range(1, recipes.NUM_DRAFTS + 1)) + " | val/tau_walk | MT-bench tau |",
             "|---|---|---|---|---|" + "---|" * (recipes.NUM_DRAFTS + 2)]
    for row in report["rows"]:
        lines.append(f"| {row['kind']} | {row['loss']} | {'on' if row['norms'] else 'off'} | {row['seed']} | "
                     f"{row['seconds']:.0f} | "
                     + " | ".join(f"{row[f'val/acc_{i}']:.3f}" for i in range(1, recipes.NUM_DRAFTS + 1))
                     + f" | {row['val/tau_walk']:.3f} | {row.get('mt_bench_tau', float('nan')):.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.nice(max(0, args.nice - os.nice(0)))
    os.environ.setdefault("WANDB_MODE", "disabled")
    args.precision = args.precision or demo.fit_precision()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    rows = runs(args)
    for row in rows:
        if args.bench and not (row["folder"] / "fit.json").exists():
            raise SystemExit(f"{row['name']} is not fitted yet: run without --bench first")
        print(f"\n==> {row['name']}", flush=True)
        result = recipes.run_fit(row["kind"], args, row.pop("overrides"), row.pop("folder"))
        row.update(num_steps=result["num_steps"], seconds=result["seconds"], head=result["head"],
                   **recipes.head_metrics(result["head"]))
    if not args.bench:
        return {"rows": rows}
    command = bench(rows, args, out)
    report = {"store": str(Path(args.store).resolve()), "target": args.target, "precision": args.precision,
              "bench": command, "rows": rows, "seconds": time.perf_counter() - start}
    (out / "losses.json").write_text(json.dumps(report, indent=2))
    markdown = to_markdown(report)
    (out / "losses.md").write_text(markdown)
    print("\n" + markdown + f"\nwrote {out / 'losses.json'} and {out / 'losses.md'}")
    return report


if __name__ == "__main__":
    main()
