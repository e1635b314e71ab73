"""Heads fit on the demo's store and benched side by side: the runner benchmarks/recipes.py and benchmarks/losses.py
share. `run` fits every configuration a script names (in-process, in scratch folders under --out, a fit that ended
there with the same arguments reused), reads each best head's held-out metrics, runs one `draftheads bench` over the
heads for MT-bench tau, and writes <name>.json and <name>.md to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Callable

from lightning.pytorch import Callback

from heads.hf_folder import read_config
from training import demo

CONFIGS = demo.CONFIGS
NUM_DRAFTS = demo.NUM_SPECULATIVE_TOKENS


def add_arguments(p: argparse.ArgumentParser, name: str) -> None:
    """The options every sweep takes: the demo's store and token map, the target, --out, epochs, the bench's size,
    niceness and precision."""
    from serving.targets import DEFAULT_TARGET

    p.add_argument("--store", required=True, help="the demo's store (make demo: data/demo-<target>)")
    p.add_argument("--token-map", required=True, help="the demo's token map (runs/token_map-4096.pt)")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--out", required=True, help=f"scratch folder of the fits, and {name}.json / {name}.md")
    p.add_argument("--epochs", type=int, default=None,
                   help="epochs of every kind's fits (default: the demo's, configs/demo/<kind>.yaml)")
    p.add_argument("--bench-prompts", type=int, default=8, help="MT-bench first turns, one per category in turn")
    p.add_argument("--bench-new-tokens", type=int, default=64)
    p.add_argument("--nice", type=int, default=19, help="niceness of this process and its fits")
    p.add_argument("--precision", default=None, help="the fits' precision (default: the demo's, fit_precision)")


def our_overrides(kind: str, args) -> list[str]:
    """What the demo lays over configs/<kind>.yaml and configs/demo/<kind>.yaml: precision and the token map."""
    takes_map = "token_map" in demo.demo_config(kind)["model"]["init_args"]
    return (["--trainer.precision", args.precision]
            + (["--model.init_args.token_map", str(Path(args.token_map).resolve())] if takes_map else []))


def fit_args(kind: str, args, overrides: list[str]) -> list[str]:
    """LightningCLI arguments (no subcommand) of a fit in the current folder, without W&B."""
    return ["-c", str(CONFIGS / f"{kind}.yaml"), "-c", str(demo.DEMO_CONFIGS / f"{kind}.yaml"),
            "--model.init_args.target", args.target,
            "--data.store", str(Path(args.store).resolve()), "--trainer.logger", "false",
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false", *overrides]


class StepTimes(Callback):
    """The wall time and this process's CPU time (all its threads) at the end of every training batch."""

    def __init__(self):
        self.ends: list[float] = []
        self.cpu_ends: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.ends.append(time.perf_counter())
        self.cpu_ends.append(time.process_time())


def run_fit(kind: str, args, overrides: list[str], folder: Path) -> dict:
    """Fits in `folder` (the configs write under runs/<kind>/ there); returns steps and seconds. A fit that ended
    there with the same arguments before (fit.json) is not run again, so a killed run picks up at the next fit."""
    from training.fit import build_cli

    arguments = fit_args(kind, args, overrides)
    stamp = folder / "fit.json"
    if stamp.exists() and json.loads(stamp.read_text())["arguments"] == arguments:
        print(f"reusing the fit in {folder} (same arguments)", flush=True)
        return json.loads(stamp.read_text())["result"]
    folder.mkdir(parents=True, exist_ok=True)
    here = Path.cwd()
    os.chdir(folder)
    try:
        cli = build_cli(arguments, run=False)
        timer = StepTimes()
        cli.trainer.callbacks.append(timer)
        start = time.perf_counter()
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        seconds = time.perf_counter() - start
    finally:
        os.chdir(here)
    result = {"num_steps": cli.trainer.global_step, "seconds": seconds, "step_ends": timer.ends,
              "cpu_step_ends": timer.cpu_ends,
              "head": str(folder / "runs" / kind / "heads" / "best")}
    stamp.write_text(json.dumps({"arguments": arguments, "result": result}))
    return result


def head_metrics(head: str) -> dict:
    """The held-out metrics a fit wrote into its best head's config.json (the validation that chose it)."""
    training = read_config(head)["metadata"]["training"]
    metrics = training["metrics"]
    keys = [f"val/acc_{i}" for i in range(1, NUM_DRAFTS + 1)] + ["val/tau", "val/tau_walk"]
    return {**{key: metrics[key] for key in keys}, "best_step": training["global_step"]}


def bench(rows: list[dict], args, out: Path, keep_taus: bool) -> str:
    """`draftheads bench` over the rows' heads (plain decoding once): MT-bench tau per head, into the rows. With
    `keep_taus`, the taus are kept in out/bench-tau.json and a rerun benches only heads not benched before. Returns
    the command, for the report."""
    from training.cli import main as draftheads

    taus_path = out / "bench-tau.json"
    taus = json.loads(taus_path.read_text()) if keep_taus and taus_path.exists() else {}
    command = ["bench", "--target", args.target, "--prompts", "mt-bench", "--num-prompts", str(args.bench_prompts),
               "--max-new-tokens", str(args.bench_new_tokens), "--json", str(out / "bench.json")]
    new = [row for row in rows if row["head"] not in taus]
    if new:
        configs = []
        for row in new:
            configs += ["--speculative-config", json.dumps({"method": row["kind"], "model": row["head"],
                                                            "num_speculative_tokens": NUM_DRAFTS})]
        print(f"\n==> draftheads {' '.join(command + configs)}", flush=True)
        if draftheads(command + configs) != 0:
            raise RuntimeError("draftheads bench failed")
        result = json.loads((out / "bench.json").read_text())
        taus.update({r["config"]["model"]: r["tau"] for r in result["rows"] if r["config"]})
        if keep_taus:
            taus_path.write_text(json.dumps(taus, indent=2))
    for row in rows:
        row["mt_bench_tau"] = taus[row["head"]]
    return ("draftheads " + " ".join(command[:-2]) + " --speculative-config '{\"method\": KIND, \"model\": HEAD, "
            f"\"num_speculative_tokens\": {NUM_DRAFTS}}}' (one per head)")


Column = tuple[str, Callable[[dict], str]]  # a table's heading, and a row's cell under it


def to_markdown(rows: list[dict], columns: list[Column], tau_format: str) -> str:
    """The rows as a table: `columns` first, then each head's held-out val/acc_1..4 and val/tau_walk and its MT-bench
    tau (as `tau_format` writes it)."""
    headings = ([heading for heading, _ in columns] + [f"val/acc_{i}" for i in range(1, NUM_DRAFTS + 1)]
                + ["val/tau_walk", "MT-bench tau"])
    lines = ["| " + " | ".join(headings) + " |", "|" + "---|" * len(headings)]
    for row in rows:
        cells = ([cell(row) for _, cell in columns] + [f"{row[f'val/acc_{i}']:.3f}" for i in range(1, NUM_DRAFTS + 1)]
                 + [f"{row['val/tau_walk']:.3f}", format(row.get("mt_bench_tau", float("nan")), tau_format)])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def prepare(args) -> Path:
    """What every sweep starts with: this process at --nice, W&B off, the demo's precision unless --precision says
    otherwise; returns --out, made."""
    os.nice(max(0, args.nice - os.nice(0)))
    os.environ.setdefault("WANDB_MODE", "disabled")
    args.precision = args.precision or demo.fit_precision()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    return out


def run(name: str, args, fit: Callable[[Path], dict], columns: list[Column], tau_format: str = ".3f", *,
        benched: bool = True, keep_taus: bool = False) -> dict:
    """The sweep: at --nice, without W&B, at the demo's precision unless --precision says otherwise. `fit(out)` fits
    every configuration and returns {"rows": one dict per head (kind, head, its metrics, ...)} plus any fields the
    report keeps; unless `benched` is False (fits only: returns the rows), the heads are benched and the report
    written to out/<name>.json and, as a table of `columns` and the metrics (to_markdown), out/<name>.md."""
    out = prepare(args)
    start = time.perf_counter()
    fitted = fit(out)
    if not benched:
        return {"rows": fitted["rows"]}
    rows = fitted.pop("rows")
    command = bench(rows, args, out, keep_taus)
    report = {"store": str(Path(args.store).resolve()), "target": args.target, "precision": args.precision, **fitted,
              "bench": command, "rows": rows, "seconds": time.perf_counter() - start}
    (out / f"{name}.json").write_text(json.dumps(report, indent=2))
    markdown = to_markdown(rows, columns, tau_format)
    (out / f"{name}.md").write_text(markdown)
    print("\n" + markdown + f"\nwrote {out / f'{name}.json'} and {out / f'{name}.md'} in {report['seconds']:.0f} s")
    return report
