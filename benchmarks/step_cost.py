"""What a verify step costs against a plain decode step: one target forward over the newest token and a draft
tree of n - 1 nodes (rows = n) at a given context, through the engine's model and paged tree attention, timed side
by side in one run. The tree is 4-ary (node i hangs off node i // 4 - 1), the shape EAGLE-2 trees take; a chain
of the same rows costs the same in the linear layers, which dominate. With --weights float32,bfloat16, the target
with each (EngineConfig.weights) takes turns, one table each.

    python benchmarks/step_cost.py [--target smollm2-135m-instruct] [--context 300] [--repeats 20] [--rows 1,5,8,16,32,64]
        [--weights float32]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from serving.attention import KVCache, PagedAttention, PagedMetadata
from serving.config import WEIGHTS
from serving.model import Model
from serving.spec_decode.tree import DraftTree
from serving.targets import DEFAULT_TARGET, resolve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--context", type=int, default=300, help="tokens already in the K/V cache")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--rows", default="1,5,8,16,32,64", help="rows per step: the newest token and rows - 1 nodes")
    parser.add_argument("--weights", default="float32", help="comma-separated: float32, bfloat16")
    args = parser.parse_args()
    sizes = [int(n) for n in args.rows.split(",")]
    weights = args.weights.split(",")
    models = {w: Model.from_folder(resolve(args.target), weights=WEIGHTS[w]) for w in weights}
    c = models[weights[0]].config
    num_blocks = (args.context + max(sizes)) // args.block_size + 2
    caches = {w: KVCache(c.num_layers, num_blocks, args.block_size, c.layer.num_kv_heads, c.layer.head_dim, torch.float32,
                         "cpu") for w in weights}  # each model's own keys
    table = list(range(num_blocks))
    ids = torch.randint(0, c.vocab_size, (args.context + max(sizes),))
    for w in weights:
        models[w](ids[:args.context], torch.arange(args.context), PagedAttention(
            caches[w], PagedMetadata.build([args.context], [args.context], [table], args.block_size, "cpu")))
    newest = args.context  # position of the newest token, computed in the step

    def forward(w: str, num_rows: int) -> float:
        tree = DraftTree(tuple(range(num_rows - 1)), tuple(i // 4 - 1 for i in range(num_rows - 1)))
        slot = lambda node: newest + 1 + node  # the table is the identity
        paths = [[slot(n) for n in tree.path(i)] for i in range(len(tree))]
        meta = PagedMetadata.build([1], [newest + 1], [table], args.block_size, "cpu", [paths])
        positions = torch.tensor([newest] + [newest + d for d in tree.depths])
        start = time.perf_counter()
        models[w](ids[newest:newest + num_rows], positions, PagedAttention(caches[w], meta), torch.arange(num_rows))
        return time.perf_counter() - start

    times = {(w, n): [] for w in weights for n in sizes}
    for _ in range(args.repeats):  # interleaved, so drift hits every size and model alike
        for w in weights:
            for n in sizes:
                times[w, n].append(forward(w, n))
    print(f"target {args.target}, context {args.context}, {torch.get_num_threads()} threads, median of {args.repeats}")
    for w in weights:
        base = statistics.median(times[w, 1])
        print(f"\n{w} weights\n| rows in the step | draft nodes | ms | vs 1 row |")
        print("|---|---|---|---|")
        for n in sizes:
            ms = statistics.median(times[w, n]) * 1e3
            print(f"| {n} | {n - 1} | {ms:.1f} | {ms / (base * 1e3):.2f}x |")


if __name__ == "__main__":
    main()
