"""Capture backends side by side: the same ShareGPT conversations with their dataset answers (`--answers dataset`),
their hidden states ("last" and the three EAGLE-3 layers) captured by each backend into a fresh store, in
teacher-forced tokens per second (backend start-up not timed), float32.

    python -m benchmarks capture                              # the documented table (16 conversations)
    .venv/bin/python -m benchmarks.capture                       # default target, 32 conversations
    .venv/bin/python -m benchmarks.capture --num-prompts 4 --backends engine,transformers   # smoke run
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from benchmarks.__main__ import machine
from serving.targets import DEFAULT_TARGET
from training.data.capture import find_vllm_python
from training.data.generate import GenerateConfig, generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=256, help="the dataset answers' cut")
    parser.add_argument("--backends", default="engine,transformers,vllm",
                        help="comma-separated; vllm is left out where no vLLM is found")
    args = parser.parse_args()
    backends = [b for b in args.backends.split(",") if b != "vllm" or find_vllm_python(None) is not None]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for backend in backends:
            summary = generate(GenerateConfig(prompts="sharegpt", num_prompts=args.num_prompts, target=args.target,
                                              out=str(Path(tmp) / backend), answers="dataset", capture=backend,
                                              max_new_tokens=args.max_new_tokens, max_num_batched_tokens=2048),
                               progress=False)
            rows.append({"backend": backend, "num_examples": summary["num_examples"],
                         "num_tokens": summary["num_tokens"], "elapsed_s": round(summary["elapsed_s"], 2),
                         "tokens_per_s": round(summary["num_tokens"] / summary["elapsed_s"], 1)})
    print(f"# capture backends, {args.target}, {args.num_prompts} ShareGPT conversations, float32, "
          f"{torch.get_num_threads()} threads, {machine()}")
    print("| backend | examples | tokens | s | tokens/s |\n|---|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['backend']} | {row['num_examples']} | {row['num_tokens']} | {row['elapsed_s']} | "
              f"{row['tokens_per_s']} |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
