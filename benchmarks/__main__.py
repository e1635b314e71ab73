"""`python -m benchmarks TABLE [ARGS...]`: rerun one documented table (docs/benchmarks/) and write its output to
results/benchmarks/TABLE.md, stamped with the commit, the date, the command and the machine (CPU model, cores, and
the flags that pick the kernels). ARGS are appended to the table's command, so they override its options.
`python -m benchmarks` lists the tables. Tables over the demo's heads and store need `make demo` first.
"""
from __future__ import annotations

import datetime
import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from serving.cpu_features import FLAGS, bf16_path, cpu_features

ROOT = Path(__file__).resolve().parents[1]
PYTHON = "python"  # as the stamp shows the command; it runs with this interpreter


@dataclass(frozen=True)
class Table:
    page: str  # under docs/benchmarks/
    what: str
    command: tuple[str, ...]


def spec(method: str, head: bool = True, **options) -> str:
    """A --speculative-config of the demo's head of that kind (or a method without one), 4 drafts."""
    config = {"method": method, **({"model": f"runs/{method}/heads/best"} if head else {}), "num_speculative_tokens": 4}
    return json.dumps({**config, **options})


def bench(*options: str, configs: tuple[str, ...] = ()) -> tuple[str, ...]:
    return ("-m", "training", "bench", *options, *(arg for c in configs for arg in ("--speculative-config", c)))


CUT = {"confidence_threshold": 0.1}
# Deterministic drafters (q one-hot: n-gram, suffix decoding, the demo's heads), and one that samples: the target
# drafting for itself at a higher temperature, a q spread out as a sampling drafter's, which is where block
# verification can accept more.
BLOCK_DRAFTERS = (json.dumps({"method": "ngram", "num_speculative_tokens": 4}), json.dumps({"method": "suffix"}),
                  json.dumps({"method": "draft_model", "model": "smollm2-135m-instruct", "draft_temperature": 1.5,
                              "num_speculative_tokens": 4}),
                  *(spec(kind) for kind in ("medusa", "eagle3", "peagle", "dflash")))
TABLES = {
    "demo": Table("demo.md", "the demo's bench: plain, n-gram, suffix, each head as chain, tree, after lookup",
                  ("-m", "training.demo")),
    "bench-full": Table("bench-full.md", "every method on the full sets, greedy and sampled, concurrency 1, 4, 16",
                        ("-m", "training.demo", "--full")),
    "trees": Table("trees.md", "each head's chain against its trees", bench(
        "--prompts", "mt-bench", "--num-prompts", "80", "--max-new-tokens", "96", configs=tuple(
            spec(kind, **tree) for kind in ("medusa", "eagle3", "peagle", "dflash")
            for tree in ({}, {"topk": 4, "num_draft_tokens": 8, **CUT}, {"topk": 8, "num_draft_tokens": 16})))),
    "adaptive": Table("adaptive.md", "the adaptive policy against plain decoding, rotated turns", (
        "-m", "benchmarks.step", "no-draft", "--as-chosen", "--prompts", "mt-bench", "--num-prompts", "16",
        "--max-new-tokens", "48", "--rounds", "6", "--speculative-config", spec("ngram", head=False),
        "--speculative-config", spec("eagle3", prompt_lookup_first=True, **CUT))),
    "parallel-drafters": Table("parallel-drafters.md", "P-EAGLE and DFlash against chain heads at 4 drafts", bench(
        "--prompts", "mt-bench", "--num-prompts", "80", "--max-new-tokens", "64", configs=tuple(
            spec(kind, **tree) for kind in ("medusa", "eagle3", "peagle", "dflash")
            for tree in ({}, {"topk": 4, "num_draft_tokens": 5}, {"prompt_lookup_first": True})))),
    "suffix": Table("suffix-lookahead.md", "suffix decoding against n-gram, suffix first against lookup first", bench(
        "--prompts", "humaneval-repeat", "--num-prompts", "16", "--max-new-tokens", "64", "--concurrency", "1", "4",
        "--temperature", "0", "0.7", configs=(spec("ngram", head=False), json.dumps({"method": "suffix"}),
                                              spec("eagle3", prompt_lookup_first=True, **CUT),
                                              spec("eagle3", suffix_first=True, **CUT)))),
    "lookahead": Table("suffix-lookahead.md", "lookahead decoding's settings against prompt lookup", bench(
        "--prompts", "mt-bench", "--num-prompts", "8", "--max-new-tokens", "64", configs=(
            spec("ngram", head=False),
            json.dumps({"method": "lookahead", "window": 3, "ngram": 3, "max_candidates": 2}),
            json.dumps({"method": "lookahead", "window": 2, "ngram": 3, "max_candidates": 1})))),
    "structured-outputs": Table("structured-outputs.md", "JSON under a schema with speculation", (
        "-m", "benchmarks.structured_output", "--num-prompts", "32", "--max-new-tokens", "80", "--head",
        "runs/eagle3/heads/best", "--disable-any-whitespace", "--temperature", "0", "--concurrency", "1")),
    "server-overhead": Table("serving.md", "draftheads serve against the same engine offline", (
        "-m", "benchmarks.server_overhead", "--rounds", "3", "--num-prompts", "8", "--max-new-tokens", "64",
        "--num-threads", "1")),
    "vllm": Table("serving.md", "draftheads serve against vllm serve (make vllm)", (
        "-m", "benchmarks.vllm_side_by_side", "--head", "eagle3=runs/eagle3/heads/best", "--num-prompts", "16",
        "--max-new-tokens", "48", "--concurrency", "1", "4", "16")),
    "block-verification": Table("trees.md", "standard against block verification, sampled, by drafter, with standard errors", (
        "-m", "benchmarks.block_verification", "--prompts", "mt-bench", "--num-prompts", "80", "--max-new-tokens", "64",
        "--temperature", "0.7", "1.0", "--concurrency", "8", *(arg for d in BLOCK_DRAFTERS for arg in ("--drafter", d)))),
    "engine-vs-transformers": Table("engine.md", "plain decoding against transformers' generate", bench(
        "--prompts", "mt-bench", "--num-prompts", "8", "--max-new-tokens", "64", "--concurrency", "1", "--baseline",
        "hf")),
    "llama-cpp": Table("engine.md", "plain decoding against llama.cpp, F32 and BF16 (make llama-cpp)",
                       ("-m", "benchmarks.llama_cpp", "--rounds", "5")),
    "kernels": Table("engine.md", "the C kernels against torch's operators",
                     ("-m", "benchmarks.kernel_speed", "--repeats", "10")),
    "compute-modes": Table("engine.md", "float32, bfloat16 weights and bfloat16 compute: products, steps, decoding",
                           ("-m", "benchmarks.compute_modes")),
    "step": Table("engine.md", "where a plain step's time goes, float32 and bfloat16 weights", (
        "-m", "benchmarks.step", "plain", "--concurrency", "1", "--weights", "float32", "bfloat16", "--rounds", "3")),
    "weights": Table("engine.md", "float32 against bfloat16 weights, every method on each",
                     ("-m", "benchmarks.modes")),
    "compute-speedups": Table("engine.md", "every method's speedup in float32 and in the bfloat16 compute mode", (
        "-m", "benchmarks.modes", "--modes", "float32", "bfloat16", "--prompts", "mt-bench", "--num-prompts", "80",
        "--max-new-tokens", "64", *(arg for c in (
            json.dumps({"method": "ngram", "num_speculative_tokens": 4}), json.dumps({"method": "suffix"}),
            spec("eagle3"), spec("dflash"), spec("eagle3", topk=8, num_draft_tokens=16),
            spec("eagle3", prompt_lookup_first=True, **CUT),
            spec("eagle3", suffix_first=True, **CUT), spec("eagle3", adaptive=True))
            for arg in ("--speculative-config", c)))),
    "generate": Table("training.md", "self-distillation throughput", ("-m", "benchmarks.generate")),
    "train": Table("training.md", "fit throughput by kind, offline against online", ("-m", "benchmarks.train")),
    "recipes": Table("training.md", "our configs against the published recipes", (
        "-m", "benchmarks.recipes", "--store", "data/demo-smollm2-135m-instruct", "--token-map",
        "runs/token_map-4096.pt", "--out", "runs/recipes/demo", "--epochs", "1")),
    "losses": Table("training.md", "the token losses side by side", (
        "-m", "benchmarks.losses", "--store", "data/demo-smollm2-135m-instruct", "--token-map",
        "runs/token_map-4096.pt", "--out", "runs/losses", "--epochs", "2")),
    "long-context": Table("training.md", "EAGLE-3 at ~4k-token prompts with and without a draft window", (
        "-m", "benchmarks.long_context", "--store", "data/long-context-store", "--out", "runs/long-context",
        "--window", "256")),
    "gpu": Table("gpu.md", "every method on a CUDA device against transformers", ("-m", "benchmarks.device")),
    "capture": Table("targets.md", "the capture backends side by side: engine, transformers, vLLM",
                     ("-m", "benchmarks.capture", "--num-prompts", "16")),
    "gemma3": Table("targets.md", "gemma3-270m's plain decoding against its bandwidth floor", (
        "-m", "benchmarks.modes", "--target", "gemma3-270m", "--num-prompts", "4", "--max-new-tokens", "64")),
    "sliding-window-memory": Table("targets.md", "K/V held by a 4k-token request on gemma3-270m, by KV cache group", (
        "-m", "benchmarks.sliding_window_memory", "--target", "gemma3-270m", "--prompt-tokens", "4096",
        "--max-new-tokens", "32")),
}


def machine() -> str:
    """The CPU model, its cores, the flags that decide which kernels run (serving/kernels.py) and the bfloat16
    compute mode's product path."""
    features = cpu_features()
    flags = " ".join(flag for flag in FLAGS if flag in features.flags) or "none of " + " ".join(FLAGS)
    return f"{features.model}, {os.cpu_count()} cores, flags: {flags}, bfloat16 products: {bf16_path()}"


def commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + (" (with uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else "")


def stamp(name: str, command: list[str]) -> str:
    return (f"# {name}\n\n- commit: {commit()}\n- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC\n"
            f"- machine: {machine()}\n- command: `{shlex.join(command)}`\n- page: docs/benchmarks/{TABLES[name].page}\n")


def listing() -> str:
    width = max(map(len, TABLES))
    return "\n".join(f"{name:<{width}}  {table.what}  (docs/benchmarks/{table.page})" for name, table in TABLES.items())


def main(argv: list[str] | None = None, out: Path = ROOT / "results" / "benchmarks") -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__ + "\n" + listing())
        return 0
    name, extra = argv[0], argv[1:]
    if name not in TABLES:
        print(f"python -m benchmarks: unknown table {name!r}; the tables:\n{listing()}", file=sys.stderr)
        return 2
    command = [*TABLES[name].command, *extra]
    header = stamp(name, [PYTHON, *command])
    print(header, flush=True)
    lines = []
    with subprocess.Popen([sys.executable, *command], cwd=ROOT, stdout=subprocess.PIPE, text=True) as run:
        for line in run.stdout:  # shown as it comes: some tables take hours
            print(line, end="", flush=True)
            lines.append(line)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.md"
    path.write_text(header + f"- exit status: {run.returncode}\n\n```\n{''.join(lines)}```\n")
    print(f"wrote {path}")
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
