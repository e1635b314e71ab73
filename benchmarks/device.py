"""The engine on a device (a GPU: `--device cuda`) against transformers' `generate` on the same device, in float32
and bfloat16: plain decoding, prompt lookup, suffix decoding, the target drafting for itself, and a new head of each
kind built from the target (untrained, so the target rejects most of its drafts: the check is that every path runs
on the device and greedy outputs stay plain decoding's), chains and trees. One `draftheads bench` table per dtype,
side by side in one run.

    python benchmarks/device.py --device cuda [--num-prompts 8] [--max-new-tokens 64] [--concurrency 1]
    python benchmarks/device.py --device cpu --num-prompts 1 --max-new-tokens 8      a smoke run on the CPU

`--random-weights DIR` writes a target with the architecture, sizes and tokenizer of `--target` and seeded random
weights to DIR (kept for other runs, e.g. `benchmarks/server_overhead.py --target DIR`) and measures it instead: for
a machine that holds the target's config and tokenizer but not its weights. Every step costs what the real target's
does; outputs and acceptance mean nothing beyond greedy identity.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

import heads
from heads.hf_folder import read_config
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
                "eagle3": heads.Eagle3.from_target(parts), "mtp": heads.Mtp.from_target(parts, depth=K),
                "peagle": heads.Peagle.from_target(parts, mask_token_id=0, num_depths=K),
                "dflash": heads.DFlash.from_target(parts, num_layers=1, block_size=K + 1, mask_token_id=0)}
    return {kind: heads.save(head, out / kind) for kind, head in made.items()}


def random_twin(folder: Path, out: Path) -> Path:
    """A seeded random model with `folder`'s architecture, sizes and tokenizer, written to `out`."""
    config = read_config(folder)
    fields = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "vocab_size", "max_position_embeddings", "rope_theta", "rms_norm_eps", "tie_word_embeddings",
              "bos_token_id", "eos_token_id", "pad_token_id")
    overrides = {key: config[key] for key in fields if config.get(key) is not None}
    return targets.build_tiny_model(out, config["model_type"], tokenizer_from=folder, **overrides)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=targets.DEFAULT_TARGET)
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--num-prompts", type=int, default=8, help="MT-bench first turns, one per category in turn")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--random-weights", metavar="DIR", type=Path, default=None,
                        help="write a seeded random model of the target's architecture and tokenizer to DIR and "
                             "measure it instead (the target's config and tokenizer suffice)")
    args = parser.parse_args()
    folder = targets.resolve(args.target)
    prompts = load_prompts("mt-bench", args.num_prompts)
    messages, categories = [first_turn(m) for m in prompts["messages"]], list(prompts["category"])
    with tempfile.TemporaryDirectory() as tmp:
        if args.random_weights is not None:
            folder = random_twin(folder, args.random_weights)
        made = new_heads(folder, Path(tmp))
        configs = [SpeculativeConfig(method="ngram", num_speculative_tokens=K),
                   SpeculativeConfig(method="suffix"),
                   SpeculativeConfig(method="draft_model", model=str(folder), num_speculative_tokens=K)]
        configs += [SpeculativeConfig(method=kind, model=str(path), num_speculative_tokens=K)
                    for kind, path in made.items()]
        configs += [SpeculativeConfig(method=kind, model=str(made[kind]), num_speculative_tokens=K, topk=4,
                                      num_draft_tokens=12) for kind in ("eagle3", "peagle", "dflash")]
        for dtype in args.dtypes.split(","):
            start = time.perf_counter()
            engine = Engine(EngineConfig(str(folder), dtype=dtype, max_num_seqs=args.concurrency, device=args.device))
            result = run_bench(engine, messages, categories, configs, args.max_new_tokens, args.concurrency,
                               baseline="hf")
            print(to_markdown(result))
            print(f"({time.perf_counter() - start:.0f} s)\n")
            del engine


if __name__ == "__main__":
    main()
