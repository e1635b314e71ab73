"""serving/kernels.c against torch's operators, side by side in one run: the linear layers of the default target
at the row counts of decode (1), verify (2-17), concurrency 16 and prefill chunks, RMSNorm, and paged attention of
decode and verify queries; and the same layers with weights stored as bfloat16 (drafters' `draft_weights`). Each
case streams its weights from memory, as a forward through 30 layers does.

    python benchmarks/kernel_speed.py [--target smollm2-135m-instruct] [--repeats 20]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from heads.layer import RMSNorm
from serving import kernels
from serving.attention import KVCache, PagedAttention, PagedMetadata
from serving.model import ModelConfig
from serving.targets import DEFAULT_TARGET, resolve


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if kernels.library() is None:
        raise SystemExit("serving/kernels.c does not build or run on this machine (see the warning above)")
    c = ModelConfig.from_folder(resolve(args.target))
    layer = c.layer
    shapes = {"qkv": (layer.hidden_size, layer.num_heads * layer.head_dim + 2 * layer.num_kv_heads * layer.head_dim),
              "o": (layer.num_heads * layer.head_dim, layer.hidden_size),
              "gate_up": (layer.hidden_size, 2 * layer.intermediate_size),
              "down": (layer.intermediate_size, layer.hidden_size)}
    # One set of layers as large as the model's, so weights come from memory, not cache.
    linears = [(nn.Linear(i, o, bias=False).requires_grad_(False), name) for _ in range(c.num_layers)
               for name, (i, o) in shapes.items()]
    packed = [kernels.PackedLinear(lin) for lin, _ in linears]
    halved = [kernels.PackedLinear(lin, torch.bfloat16) for lin, _ in linears]
    transposed = [lin.weight.t().contiguous() for lin, _ in linears]
    print(f"target {args.target}: {c.num_layers} layers' linear weights, {torch.get_num_threads()} threads, "
          f"median of {args.repeats}")
    print("\n| rows | torch x @ W^T ms | kernels.c ms | speedup | bfloat16 weights ms | vs float32 weights |\n"
          "|---|---|---|---|---|---|")
    for rows in (1, 2, 5, 9, 17, 32, 128, 512):
        xs = {name: torch.randn(rows, lin.in_features) for lin, name in linears[:4]}
        torch_s = timed(lambda: [xs[name] @ w for (_, name), w in zip(linears, transposed)], args.repeats)
        ours_s = timed(lambda: [p(xs[name]) for (_, name), p in zip(linears, packed)], args.repeats)
        half_s = timed(lambda: [p(xs[name]) for (_, name), p in zip(linears, halved)], args.repeats)
        print(f"| {rows} | {torch_s * 1e3:.2f} | {ours_s * 1e3:.2f} | {torch_s / ours_s:.2f}x | {half_s * 1e3:.2f} | "
              f"{ours_s / half_s:.2f}x |")

    norm = RMSNorm(layer.hidden_size, layer.rms_norm_eps)
    fused = kernels.FusedRMSNorm(norm)
    print("\n| RMSNorm rows | torch us | kernels.c us | speedup |\n|---|---|---|---|")
    for rows in (1, 16, 512):
        x = torch.randn(rows, layer.hidden_size)
        torch_s = timed(lambda: [F.rms_norm(x, (x.shape[-1],), norm.weight, norm.eps) for _ in range(100)], args.repeats)
        ours_s = timed(lambda: [fused(x) for _ in range(100)], args.repeats)
        print(f"| {rows} | {torch_s * 1e4:.1f} | {ours_s * 1e4:.1f} | {torch_s / ours_s:.2f}x |")

    print("\n| attention (context 300) | torch ms | kernels.c ms | speedup |\n|---|---|---|---|")
    block_size, context = 16, 300
    for label, num_seqs, query_len in (("decode, 1 sequence", 1, 1), ("verify 5, 1 sequence", 1, 5),
                                       ("decode, 16 sequences", 16, 1), ("verify 5, 16 sequences", 16, 5)):
        blocks = -(-(context + query_len) // block_size)
        cache = KVCache(c.num_layers, num_seqs * blocks, block_size, layer.num_kv_heads, layer.head_dim, torch.float32, "cpu")
        order = torch.randperm(num_seqs * blocks).tolist()  # the blocks of a pool that has seen many requests
        tables = [order[i * blocks:(i + 1) * blocks] for i in range(num_seqs)]
        meta = PagedMetadata.build([query_len] * num_seqs, [context + query_len] * num_seqs, tables, block_size, "cpu")
        tokens = num_seqs * query_len
        q = torch.randn(tokens, layer.num_heads, layer.head_dim)
        k, v = torch.randn(tokens, layer.num_kv_heads, layer.head_dim), torch.randn(tokens, layer.num_kv_heads, layer.head_dim)
        fast, reference = PagedAttention(cache, meta), PagedAttention(cache, meta, use_kernel=False)
        torch_s = timed(lambda: [reference(i, q, k, v) for i in range(c.num_layers)], args.repeats)
        ours_s = timed(lambda: [fast(i, q, k, v) for i in range(c.num_layers)], args.repeats)
        print(f"| {label}, {c.num_layers} layers | {torch_s * 1e3:.2f} | {ours_s * 1e3:.2f} | {torch_s / ours_s:.2f}x |")


if __name__ == "__main__":
    main()
