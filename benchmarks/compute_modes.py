"""The engine's three CPU compute modes side by side in one run, on the default target: float32; bfloat16 weights
(EngineConfig.weights, float32 products); and bfloat16 compute (EngineConfig.dtype = bfloat16: bfloat16 weights
times activations rounded to bfloat16, float32 sums, on vdpbf16ps where the CPU has AVX512-BF16). For each mode:
the linear layers' products alone (every layer's weights once, as a forward streams them) in GFLOP/s, and the same
products over one layer's weights as many times (in cache: what the arithmetic alone gives); a target step
of 1, 5 and 17 rows (the newest token and a 4-ary draft tree) against the one-row step; and plain greedy decoding in
tokens/s. The modes take turns within every repeat (this machine's speed drifts, and other work shares its cores);
each number is the median over the repeats.

    python -m benchmarks.compute_modes [--target smollm2-135m-instruct] [--repeats 15] [--rows 1,5,17]
        [--context 300] [--tokens 64] [--num-threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from benchmarks.__main__ import machine
from serving.attention import KVCache, PagedAttention, PagedMetadata
from serving.config import EngineConfig
from serving.engine import Engine
from serving.kernels import PackedLinear, product_path
from serving.request import SamplingParams
from serving.spec_decode.tree import DraftTree
from serving.targets import DEFAULT_TARGET

# label -> (EngineConfig options, PackedLinear's weight dtype and compute dtype)
MODES = {
    "float32": ({}, (torch.float32, torch.float32)),
    "bfloat16 weights": ({"weights": "bfloat16"}, (torch.bfloat16, torch.float32)),
    "bfloat16 compute": ({"dtype": "bfloat16"}, (torch.bfloat16, torch.bfloat16)),
}


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rows", default="1,5,17", help="rows per step; the first is the step the others compare with")
    parser.add_argument("--context", type=int, default=300, help="tokens in the K/V cache before the timed steps")
    parser.add_argument("--tokens", type=int, default=64, help="tokens decoded per plain decoding measurement")
    parser.add_argument("--num-threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.num_threads)
    sizes = [int(n) for n in args.rows.split(",")]
    engines = {label: Engine(EngineConfig(args.target, device="cpu", max_num_seqs=1, **options))
               for label, (options, _) in MODES.items()}
    c = engines["float32"].model.config
    layer = c.layer

    # the products alone: one set of layers as large as the model's, so the weights come from memory
    shapes = [(layer.hidden_size, (layer.num_heads + 2 * layer.num_kv_heads) * layer.head_dim),
              (layer.num_heads * layer.head_dim, layer.hidden_size), (layer.hidden_size, 2 * layer.intermediate_size),
              (layer.intermediate_size, layer.hidden_size)]
    linears = [nn.Linear(i, o, bias=False).requires_grad_(False) for _ in range(c.num_layers) for i, o in shapes]
    packed = {label: [PackedLinear(lin, *dtypes) for lin in linears] for label, (_, dtypes) in MODES.items()}
    flops_per_row = 2 * sum(lin.in_features * lin.out_features for lin in linears)
    xs = {n: {lin.in_features: torch.randn(n, lin.in_features) for lin in linears[:4]} for n in sizes}

    # the steps: each engine's model over its own K/V of `context` tokens, then a tree of rows - 1 nodes
    num_blocks = (args.context + max(sizes)) // 16 + 2
    table = list(range(num_blocks))
    ids = torch.randint(0, c.vocab_size, (args.context + max(sizes),))
    caches = {}
    for label, engine in engines.items():
        caches[label] = KVCache(c.num_layers, num_blocks, 16, layer.num_kv_heads, layer.head_dim, torch.float32, "cpu")
        engine.model(ids[:args.context], torch.arange(args.context), PagedAttention(
            caches[label], PagedMetadata.build([args.context], [args.context], [table], 16, "cpu")))

    def step(label: str, rows: int) -> None:
        tree = DraftTree(tuple(range(rows - 1)), tuple(i // 4 - 1 for i in range(rows - 1)))
        paths = [[args.context + 1 + n for n in tree.path(i)] for i in range(len(tree))]
        meta = PagedMetadata.build([1], [args.context + 1], [table], 16, "cpu", [paths])
        positions = torch.tensor([args.context] + [args.context + d for d in tree.depths])
        engines[label].model(ids[args.context:args.context + rows], positions, PagedAttention(caches[label], meta),
                             torch.arange(rows))

    prompt = engines["float32"].encode("Hello")[:1]
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    gemm = {(m, n): [] for m in MODES for n in sizes}  # seconds of each mode's products at n rows
    cached = {(m, n): [] for m in MODES for n in sizes}  # of one layer's products, as many times, from cache
    steps = {(m, n): [] for m in MODES for n in sizes}  # of its steps of n rows
    rates = {m: [] for m in MODES}  # its plain decoding's tokens/s
    for label in MODES:  # warm-up
        step(label, max(sizes))
        engines[label].generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))
    for _ in range(args.repeats):
        for label in MODES:
            for n in sizes:
                gemm[label, n].append(seconds(lambda: [p(xs[n][p.in_features]) for p in packed[label]]))
                cached[label, n].append(seconds(lambda: [p(xs[n][p.in_features]) for _ in range(c.num_layers)
                                                         for p in packed[label][:4]]))
                steps[label, n].append(seconds(lambda: step(label, n)))
            rates[label].append(args.tokens / seconds(lambda: engines[label].generate([prompt], params)))

    print(f"target {args.target}, {args.num_threads} threads, median of {args.repeats} repeats, modes taking turns\n"
          f"machine: {machine()}")
    for label, (_, dtypes) in MODES.items():
        print(f"- {label}: {product_path(*dtypes)}")
    print("\n| mode | rows | products ms | GFLOP/s | GFLOP/s in cache | step ms | step vs 1 row | plain decoding tok/s |\n"
          "|---|---|---|---|---|---|---|---|")
    for label in MODES:
        base = statistics.median(steps[label, sizes[0]])
        for n in sizes:
            product_s, step_s = statistics.median(gemm[label, n]), statistics.median(steps[label, n])
            in_cache = flops_per_row * n / statistics.median(cached[label, n]) / 1e9
            rate = f"{statistics.median(rates[label]):.1f}" if n == sizes[0] else ""
            print(f"| {label} | {n} | {product_s * 1e3:.2f} | {flops_per_row * n / product_s / 1e9:.1f} | {in_cache:.1f} | "
                  f"{step_s * 1e3:.1f} | {step_s / base:.2f}x | {rate} |")


if __name__ == "__main__":
    main()
