"""K/V memory held by one long request on a target with sliding windows, by KV cache group, against one pool of every
layer that keeps every block (the engine before its layers were grouped by window). Runs one greedy request of
--prompt-tokens random prompt tokens and --max-new-tokens more, and after every decode step reads the blocks its
tables hold in each group; prints per group the layers, window, blocks and bytes held at the end (the most held
after any decode step beside it), then the 4k-token requests a pool of --kv-cache-memory-gib holds at once, as the
engine sizes its groups (serving/kv_groups.py), against a pool of every layer.

--tiny runs a seeded random copy of the target's attention (its layers, windows, K/V heads, head_dim, dtype: the K/V
bytes are the real model's) with a small hidden size and vocabulary, in seconds.

    python -m benchmarks.sliding_window_memory [--target gemma3-270m] [--prompt-tokens 4096] [--max-new-tokens 32]
        [--block-size 16] [--tiny]

Example: python -m benchmarks.sliding_window_memory --tiny --prompt-tokens 1024 --max-new-tokens 8
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from serving import kv_groups, targets
from serving.attention import KVCache
from serving.blocks import SlidingWindowBlockManager
from serving.config import EngineConfig
from serving.engine import Engine
from serving.request import SamplingParams


def tiny_copy(folder: Path, out: Path) -> Path:
    """A random model of the target's family with its attention's shape and a small hidden size and vocabulary."""
    config = json.loads((folder / "config.json").read_text())
    config = config.get("text_config", config)
    keep = ("num_hidden_layers", "num_key_value_heads", "head_dim", "sliding_window", "layer_types",
            "num_attention_heads", "query_pre_attn_scalar", "max_position_embeddings", "use_sliding_window")
    return targets.build_tiny_model(out, config["model_type"], vocab_size=256, hidden_size=64, intermediate_size=128,
                                    **{key: config[key] for key in keep if key in config})


def held(table: list[int], windowed: bool) -> int:
    return sum(block != SlidingWindowBlockManager.NULL for block in table) if windowed else len(table)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=targets.GEMMA3_TARGET)
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory-gib", type=float, default=1.0)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--tiny", action="store_true", help="a random copy of the target's attention, not its weights")
    parser.add_argument("--num-threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.num_threads)
    folder = targets.resolve(args.target)
    with tempfile.TemporaryDirectory() as scratch:
        if args.tiny:
            folder = tiny_copy(folder, Path(scratch) / "tiny")
        run(folder, args)


def run(folder: Path, args) -> None:
    length = args.prompt_tokens + args.max_new_tokens
    engine = Engine(EngineConfig(str(folder), block_size=args.block_size, max_model_len=length + 1,
                                 kv_cache_memory_gib=args.kv_cache_memory_gib, max_num_seqs=args.max_num_seqs))
    config, bs = engine.model.config, args.block_size
    windows = config.windows or (0,) * config.num_layers
    groups = kv_groups.kv_cache_groups(windows)
    layer_block = KVCache.bytes_per_block(1, bs, config.layer.num_kv_heads, config.layer.head_dim, engine.dtype)
    prompt = torch.randint(0, config.vocab_size, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0))
    request_id = engine.add_request(prompt.tolist(), SamplingParams(max_tokens=args.max_new_tokens, ignore_eos=True))
    request, most = engine.requests[request_id], [0] * len(groups)
    start = time.perf_counter()
    last = []
    while engine.has_unfinished():
        engine.step()
        if request.num_output_tokens >= 2 and not request.is_finished:  # after a decode step
            last = [held(table, bool(w)) for table, (w, _) in zip(request.block_tables, groups)]
            most = [max(m, n) for m, n in zip(most, last)]
    seconds = time.perf_counter() - start
    before_blocks = last[0]  # the full group holds every position's block, as one pool of every layer did
    print(f"target {args.target}{' (tiny copy: its attention shape, random weights)' if args.tiny else ''}: "
          f"{config.num_layers} layers, {config.layer.num_kv_heads} K/V heads of {config.layer.head_dim}, "
          f"{engine.dtype}; one request of {args.prompt_tokens} + {args.max_new_tokens} tokens, blocks of {bs} "
          f"({seconds:.1f} s)\n")
    print("| pool | layers | window | blocks held (most after a decode step) | K/V MiB held |")
    print("|---|---:|---:|---:|---:|")
    print(f"| before: one pool of every layer | {config.num_layers} | - | {before_blocks} | "
          f"{before_blocks * layer_block * config.num_layers / 2**20:.1f} |")
    total = 0
    for (window, layers), blocks, peak in zip(groups, last, most):
        if not layers:
            continue
        total += blocks * layer_block * len(layers)
        print(f"| after: {'full attention' if not window else f'window {window}'} group | {len(layers)} | "
              f"{window or '-'} | {blocks} ({peak}) | {blocks * layer_block * len(layers) / 2**20:.1f} |")
    print(f"| after: every group | {config.num_layers} | | | {total / 2**20:.1f} |\n")
    per_request = -(-4096 // bs)
    budget = int(args.kv_cache_memory_gib * 2**30)
    plan = kv_groups.plan(windows, num_blocks=None, memory_bytes=budget, layer_block_bytes=layer_block, block_size=bs,
                          max_model_len=4097, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=512)
    after = min(g.num_blocks // (per_request if not g.window else -(-g.window // bs) + 2) for g in plan if g.layers)
    after = min(after, args.max_num_seqs)
    before = budget // (layer_block * config.num_layers) // per_request
    print(f"4k-token requests a {args.kv_cache_memory_gib:g} GiB pool holds at once: before {before}, after {after} "
          f"(full group {plan[0].num_blocks} blocks, " + ", ".join(f"window {g.window}: {g.num_blocks}"
                                                                  for g in plan[1:]) + ")")


if __name__ == "__main__":
    main()
