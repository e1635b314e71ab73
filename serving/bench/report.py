"""Bench results as files: each setting's tables (bench.json, bench.md), one summary over every setting and method
(summary.json, summary.md), and pictures (acceptance.png, speedup_vs_concurrency.png), logged to a wandb run."""
from __future__ import annotations

import json
import os
from pathlib import Path

FILES = ("bench.json", "bench.md", "acceptance.png", "summary.json", "summary.md", "speedup_vs_concurrency.png")


def write_report(results: list[dict], out: str | Path, run_name: str) -> list[Path]:
    """results: one per setting (`serving.bench.sweep.run_settings`). Writes FILES in `out`, logs them to the wandb run
    `run_name` (offline unless WANDB_MODE says otherwise) and prints the summary."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(results, indent=2))
    (out / "bench.md").write_text("\n\n".join(f"### {r['name']}\n\n{to_markdown(r)}\n\n{per_category_markdown(r)}"
                                              for r in results) + "\n")
    plot_acceptance(results, out / "acceptance.png")
    rows = summary_rows(results)
    (out / "summary.json").write_text(json.dumps({"rows": rows}, indent=2))
    markdown = summary_markdown(results)
    (out / "summary.md").write_text(markdown + "\n")
    plot_speedup(rows, out / "speedup_vs_concurrency.png")
    log_to_wandb(results, rows, out, run_name)
    print(f"\n{markdown}\n\nwrote {', '.join(str(out / name) for name in FILES)}")
    return [out / name for name in FILES]


def summary_rows(results: list[dict]) -> list[dict]:
    """One row per setting and method; speedup is over plain decoding in the same setting (run_bench's)."""
    return [{"prompts": result["prompts"], "num_prompts": result["num_prompts"], "temperature": result["temperature"],
             "concurrency": result["concurrency"], "method": row["method"], "tau": row["tau"],
             "mean_acceptance_length": row.get("mean_acceptance_length"), "speedup": row["speedup"],
             "rows_per_step": row["rows_per_step"], "identical_to_plain": row["identical_to_plain"],
             "tokens_per_s": row["tokens_per_s"]}
            for result in results for row in result["rows"]]


def summary_markdown(results: list[dict]) -> str:
    lines = [f"target {r['target']} | {r['max_new_tokens']} new tokens | {r['dtype']} on {r['device']}, {r['threads']} "
             f"threads | products: {r.get('products', 'n/a')} | speedup: over plain decoding in the same setting | "
             "identical: greedy outputs equal plain "
             "decoding's" for r in results[:1]]
    lines += ["", "| prompts | temperature | concurrency | method | tau | MAL | speedup | rows/step | identical | tokens/s |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for row in summary_rows(results):
        identical = {True: "yes", False: "NO", None: "n/a"}[row["identical_to_plain"]]
        lines.append(f"| {row['prompts']} ({row['num_prompts']}) | {row['temperature']:g} | {row['concurrency']} | "
                     f"{row['method']} | {row['tau']:.2f} | {mal(row)} | {row['speedup']:.2f}x | {row['rows_per_step']:.2f} | "
                     f"{identical} | {row['tokens_per_s']:.1f} |")
    return "\n".join(lines)


def per_category_markdown(result: dict) -> str:
    rows = [r for r in result["rows"] if r.get("per_category")]
    if not rows:
        return ""
    categories = sorted({c for r in rows for c in r["per_category"]})
    lines = ["| tau per category | " + " | ".join(categories) + " |", "|---" * (len(categories) + 1) + "|"]
    for r in rows:
        lines.append(f"| {r['method']} | " + " | ".join(f"{r['per_category'].get(c, {}).get('tau', 0):.2f}" for c in categories) + " |")
    return "\n".join(lines)


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_speedup(rows: list[dict], path: str | Path) -> Path:
    """Per method, speedup over plain decoding against concurrency: one panel per prompt set (rows) and
    temperature (columns)."""
    plt = pyplot()
    prompt_sets = list(dict.fromkeys(row["prompts"] for row in rows))
    temperatures = sorted({row["temperature"] for row in rows})
    methods = list(dict.fromkeys(row["method"] for row in rows if row["method"] != "plain"))
    concurrencies = sorted({row["concurrency"] for row in rows})
    fig, axes = plt.subplots(len(prompt_sets), len(temperatures), squeeze=False, sharey=True, layout="constrained",
                             figsize=(1.5 + 5.5 * len(temperatures), 1 + 3.8 * len(prompt_sets)))
    colors = plt.get_cmap("tab20")
    for ax_row, prompts in zip(axes, prompt_sets):
        for ax, temperature in zip(ax_row, temperatures):
            for n, method in enumerate(methods):
                points = sorted((row["concurrency"], row["speedup"]) for row in rows
                                if (row["prompts"], row["temperature"], row["method"]) == (prompts, temperature, method))
                ax.plot(*zip(*points), marker="o", color=colors(n % 20), label=method)
            ax.axhline(1.0, color="gray", lw=0.8)  # plain decoding
            ax.set_xscale("log", base=2)
            ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
            ax.set(xlabel="concurrency", ylabel="speedup over plain",
                   title=f"{prompts}, " + ("greedy" if temperature == 0 else f"temperature {temperature:g}"))
            ax.grid(alpha=0.3)
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="outside right upper", fontsize=8)
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_acceptance(results: list[dict], path: str | Path) -> Path:
    """Per-position conditional acceptance per drafter and setting, and tau per prompt category (rows of the same
    method merge by label)."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    categories, taus = [], {}
    for result in results:
        for row in result["rows"]:
            if not row["per_position"]:
                continue
            reached = [p for p in row["per_position"] if p["reached"]]  # unreached positions have no rate
            left.plot([p["position"] for p in reached], [p["conditional"] for p in reached], marker="o",
                      label=f"{row['method']} ({result['name']})")
            for category, stats in row.get("per_category", {}).items():
                if category not in categories:
                    categories.append(category)
                taus.setdefault(row["method"], {})[category] = stats["tau"]
    left.set(xlabel="draft depth", ylabel="conditional acceptance", ylim=(0, 1.02), title="accepted_i / reached_i")
    left.set_xticks(range(1, 1 + max((len(r["per_position"]) for res in results for r in res["rows"]), default=1)))
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    width = 0.8 / max(len(taus), 1)
    for n, (method, per_category) in enumerate(taus.items()):
        right.bar([i + n * width for i in range(len(categories))], [per_category.get(c, 0) for c in categories],
                  width, label=method)
    right.set_xticks([i + width * (len(taus) - 1) / 2 for i in range(len(categories))], categories, rotation=30, ha="right")
    right.set(ylabel="tau (tokens per verify step)", title="mean acceptance length per category")
    right.axhline(1.0, color="gray", lw=0.8)
    right.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def log_to_wandb(results: list[dict], rows: list[dict], out: Path, run_name: str) -> None:
    import wandb

    os.environ.setdefault("WANDB_MODE", "offline")
    run = wandb.init(project="draftheads", name=run_name, dir=str(out), reinit=True)
    columns = ["prompts", "method", "k", "tau", "acceptance_rate", "rows_per_step", "tokens_per_s", "speedup",
               "speed_vs_generate", "identical_to_plain"]
    table = wandb.Table(columns=columns)
    for result in results:
        for r in result["rows"]:
            table.add_data(result["name"], r["method"], r["num_speculative_tokens"], r["tau"], r["acceptance_rate"],
                           r["rows_per_step"], r["tokens_per_s"], r["speedup"], r.get("speed_vs_hf"), r["identical_to_plain"])
    summary = wandb.Table(columns=list(rows[0]), data=[list(row.values()) for row in rows])
    run.log({"bench": table, "summary": summary, "acceptance": wandb.Image(str(out / "acceptance.png")),
             "speedup_vs_concurrency": wandb.Image(str(out / "speedup_vs_concurrency.png"))})
    for name in ("summary.json", "summary.md"):
        run.save(str(out / name), base_path=str(out), policy="now")
    run.finish()


def to_markdown(result: dict) -> str:
    has_hf = "hf_tokens_per_s" in result
    lines = [f"target {result['target']} | {result['num_prompts']} prompts x {result['max_new_tokens']} tokens | "
             f"concurrency {result['concurrency']} | temperature {result['temperature']} | {result['dtype']} on "
             f"{result.get('device', 'cpu')}, {result['threads']} threads | "
             f"products: {result.get('products', 'n/a')}", "",
             "| method | k | tau | MAL | accept rate | rows/step | per-depth conditional | tokens/s | speedup |"
             + (" vs generate |" if has_hf else "") + " identical |",
             "|---|---|---|---|---|---|---|---|---|" + ("---|" if has_hf else "") + "---|"]
    for row in result["rows"]:
        conditional = " ".join(f"{p['conditional']:.2f}" for p in row["per_position"]) or "-"
        rate = "-" if row["acceptance_rate"] is None else f"{row['acceptance_rate']:.2f}"
        identical = {True: "yes", False: "NO", None: "n/a"}[row["identical_to_plain"]]
        vs_hf = f" {row['speed_vs_hf']:.2f}x |" if has_hf else ""
        lines.append(f"| {row['method']} | {row['num_speculative_tokens'] or '-'} | {row['tau']:.2f} | {mal(row)} | {rate} | "
                     f"{row.get('rows_per_step', 1.0):.2f} | {conditional} | {row['tokens_per_s']:.1f} | {row['speedup']:.2f}x |{vs_hf} {identical} |")
    if has_hf:
        lines += ["", f"transformers generate: {result['hf_tokens_per_s']:.1f} tokens/s; engine plain / transformers = "
                  f"{result['speed_vs_hf']:.2f}x; identical to transformers: {result['identical_to_hf']}"]
    lines += ["", "tau: tokens per verify step; MAL: vLLM's mean acceptance length, 1 + accepted / drafts (steps that "
              "drafted)"]
    read = (f"; read alone at {result['read_bandwidth_gbs']:.1f} GB/s = {result['read_floor_ms']:.1f} ms"
            if "read_floor_ms" in result else "")
    lines += ["", f"bandwidth floor: {result['weight_bytes'] / 1e6:.0f} MB of weights at {result['copy_bandwidth_gbs']:.1f} GB/s "
              f"(copy: read + written) = {result['step_floor_ms']:.1f} ms per step{read}; plain decoding takes "
              f"{result['plain_step_ms']:.1f} ms per token per sequence; peak memory {result['peak_memory_gib']:.2f} GiB"]
    for row in result["rows"]:
        if "adaptive" in row:
            lines += ["", adaptive_markdown(row["method"], row["adaptive"])]
    return "\n".join(lines)


def mal(row: dict) -> str:
    """vLLM's mean acceptance length, 1 + accepted / drafts, beside tau (tokens per verify step); '-' in results
    written before it was recorded."""
    value = row.get("mean_acceptance_length")
    return "-" if value is None else f"{value:.2f}"


def adaptive_markdown(method: str, summary: dict) -> str:
    """What an adaptive row chose (depth: share of the choices, per number of running requests) and how far the
    step-cost model's predicted forward times were from the measured ones, per bucket of rows."""
    chosen = "; ".join(f"{n} running: " + " ".join(f"d{d} {c / sum(depths.values()):.0%}" for d, c in depths.items())
                       for n, depths in summary["chosen_depths"].items())
    timing = ", ".join(f"<={b['rows_at_most']} rows {b['predicted_ms']:.1f}/{b['measured_ms']:.1f} ms ({b['error']:+.0%})"
                       for b in summary["step_time"])
    return f"{method}: chose {chosen or 'nothing'}. Forward predicted/measured: {timing}"
