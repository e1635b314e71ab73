"""The engine on a device (a GPU: `--device cuda`) against transformers' `generate` on the same device, in float32
and bfloat16: plain decoding, prompt lookup, the target drafting for itself, and a new head of each kind built from
the target (untrained, so the target rejects most of its drafts: the check is that every path runs on the device
and greedy outputs stay plain decoding's). One `draftheads bench` table per dtype, side by side in one run.

    python benchmarks/device.py --device cuda [--num-prompts 8] [--max-new-tokens 64] [--concurrency 1]
    python benchmarks/device.py --device cpu --num-prompts 1 --max-new-tokens 8      a smoke run on the CPU
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

import heads
from serving import targets
from serving.bench.offline import run_bench
from serving.bench.report import to_markdown
from serving.config import EngineConfig
from serving.engine import Engine
from serving.bench.prompts import first_turn, load_prompts
from serving.spec_decode.config import SpeculativeConfig

K = 4


def new_heads(folder: Path, out: Path) -> dict[str, Path]:
    """A head of each kind for the target in `folder`, seeded, saved under `out`."""
    parts = heads.load_target_parts(folder, fingerprint=targets.fingerprint(folder))
    with torch.random.fork_rng():
        torch.manual_seed(0)
        made = {"medusa": heads.Medusa.from_target(parts, num_heads=K), "eagle": heads.Eagle.from_target(parts),
                "eagle3": heads.Eagle3.from_target(parts), "mtp": heads.Mtp.from_target(parts, depth=K)}
    return {kind: heads.save(head, out / kind) for kind, head in made.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=targets.DEFAULT_TARGET)
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--num-prompts", type=int, default=8, help="MT-bench first turns, one per category in turn")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=1)
    args = parser.parse_args()
    folder = targets.resolve(args.target)
    prompts = load_prompts("mt-bench", args.num_prompts)
    messages, categories = [first_turn(m) for m in prompts["messages"]], list(prompts["category"])
    with tempfile.TemporaryDirectory() as tmp:
        configs = [SpeculativeConfig(method="ngram", num_speculative_tokens=K),
                   SpeculativeConfig(method="draft_model", model=str(folder), num_speculative_tokens=K)]
        configs += [SpeculativeConfig(method=kind, model=str(path), num_speculative_tokens=K)
                    for kind, path in new_heads(folder, Path(tmp)).items()]
        for dtype in args.dtypes.split(","):
            start = time.perf_counter()
            engine = Engine(EngineConfig(args.target, dtype=dtype, max_num_seqs=args.concurrency, device=args.device))
            result = run_bench(engine, messages, categories, configs, args.max_new_tokens, args.concurrency,
                               baseline="hf")
            print(to_markdown(result))
            print(f"({time.perf_counter() - start:.0f} s)\n")
            del engine


if __name__ == "__main__":
    main()
