"""What a verify step costs against a plain decode step: one target forward over 1 + k tokens at a given
context, through the engine's model and paged attention, timed side by side in one run.

    python benchmarks/step_cost.py [--target smollm2-135m-instruct] [--context 300] [--repeats 20]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from serving.attention import KVCache, PagedAttention, PagedMetadata
from serving.model import Model
from serving.targets import DEFAULT_TARGET, resolve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--context", type=int, default=300, help="tokens already in the K/V cache")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    model = Model.from_folder(resolve(args.target))
    c = model.config
    num_blocks = (args.context + 64) // args.block_size + 1
    cache = KVCache(c.num_layers, num_blocks, args.block_size, c.layer.num_kv_heads, c.layer.head_dim, torch.float32, "cpu")
    table = list(range(num_blocks))
    ids = torch.randint(0, c.vocab_size, (args.context + 32,))
    model(ids[:args.context], torch.arange(args.context),
          PagedAttention(cache, PagedMetadata.build([args.context], [args.context], [table], args.block_size, "cpu")))

    def forward(num_tokens: int) -> float:
        meta = PagedMetadata.build([num_tokens], [args.context + num_tokens], [table], args.block_size, "cpu")
        start = time.perf_counter()
        model(ids[args.context:args.context + num_tokens], torch.arange(args.context, args.context + num_tokens),
              PagedAttention(cache, meta), torch.arange(num_tokens))
        return time.perf_counter() - start

    sizes = (1, 2, 3, 5, 9, 17)
    times = {n: [] for n in sizes}
    for _ in range(args.repeats):  # interleaved, so drift hits every size alike
        for n in sizes:
            times[n].append(forward(n))
    base = statistics.median(times[1])
    print(f"target {args.target}, context {args.context}, {torch.get_num_threads()} threads, median of {args.repeats}")
    print("| tokens in the step | k (drafts) | ms | vs 1 token |")
    print("|---|---|---|---|")
    for n in sizes:
        ms = statistics.median(times[n]) * 1e3
        print(f"| {n} | {n - 1} | {ms:.1f} | {ms / (base * 1e3):.2f}x |")


if __name__ == "__main__":
    main()
