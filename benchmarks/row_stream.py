"""One-row products (a decode step at concurrency 1) against reading the same bytes alone, side by side in one
process: serving/kernels.c's `gemm_panels` / `gemm_panels_bf16` at one row over a set of packed matrices, and a C
loop that only reads those matrices' bytes (eight vector sums, each thread one contiguous half, one OpenMP region
per matrix as the products have). The read is what streaming can reach at that minute on the same buffers and
calls, whatever the floor's copy says; the products' GB/s over it is how close they come.

Sets: the default target's 120 linear layers (float32 and bfloat16), bfloat16 matrices of ~1.8 MB each at
several depths k (the panels' length: a thread starts ROW_GROUP new streams every k * 32 bytes of bfloat16), and
bfloat16 matrices of several sizes at the target's k, ~240 MB of them in each set (every matrix is its own phase:
its threads start new streams together, and a phase of a few hundred KB per thread ends before those run at speed).

    python -m benchmarks.row_stream [--repeats 20] [--ks 288 576 1152 2304] [--sizes 0.66 1.8 3.5 14 56]
"""
from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
from pathlib import Path

import torch

from benchmarks.against_commit import alternate, linear_shapes
from serving.kernels import compile_flags, library, to_panels
from serving.model import ModelConfig
from serving.targets import DEFAULT_TARGET, resolve

READ = r"""
#include <immintrin.h>
#include <omp.h>
float sink;
void read_bytes(const char *p, long n) {
    #pragma omp parallel
    {
        long t = omp_get_thread_num(), threads = omp_get_num_threads();
        long a = n * t / threads / 256 * 256, b = n * (t + 1) / threads / 256 * 256;
        __m256 acc[8];
        for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
        for (long o = a; o < b; o += 256)
            for (int j = 0; j < 8; j++) acc[j] = _mm256_add_ps(acc[j], _mm256_loadu_ps((const float *)(p + o) + 8 * j));
        for (int j = 1; j < 8; j++) acc[0] = _mm256_add_ps(acc[0], acc[j]);
        float lanes[8];
        _mm256_storeu_ps(lanes, acc[0]);
        #pragma omp atomic
        sink += lanes[0];
    }
}
"""


def reader() -> ctypes.CDLL:
    tmp = Path(tempfile.mkdtemp())
    (tmp / "read.c").write_text(READ)
    subprocess.run(["cc", *compile_flags(), str(tmp / "read.c"), "-o", str(tmp / "read.so")], check=True,
                   capture_output=True)
    lib = ctypes.CDLL(str(tmp / "read.so"))
    lib.read_bytes.argtypes, lib.read_bytes.restype = [ctypes.c_void_p, ctypes.c_long], None
    return lib


def compare(name: str, matrices: list[tuple[int, int, torch.Tensor]], read, repeats: int) -> None:
    """matrices: (k, n, packed panels); one row through each, against reading each one's bytes."""
    lib = library()
    gemm = lib.gemm_panels_bf16 if matrices[0][2].dtype == torch.bfloat16 else lib.gemm_panels
    xs = {k: torch.randn(1, k) for k, _, _ in matrices}
    outs = {n: torch.empty(1, n) for _, n, _ in matrices}

    def product():
        for k, n, p in matrices:
            gemm(xs[k].data_ptr(), 1, k, p.data_ptr(), k, n, None, outs[n].data_ptr(), n)

    def reading():
        for _, _, p in matrices:
            read.read_bytes(p.data_ptr(), p.nbytes)
    ms = alternate({"product": product, "read": reading}, repeats)
    size = sum(p.nbytes for _, _, p in matrices)
    rate = {which: size / t / 1e6 for which, t in ms.items()}
    print(f"| {name} | {size / 1e6:.0f} | {ms['product']:.2f} | {rate['product']:.1f} | {ms['read']:.2f} | "
          f"{rate['read']:.1f} | {rate['product'] / rate['read']:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--ks", type=int, nargs="+", default=[288, 576, 1152, 2304])
    parser.add_argument("--sizes", type=float, nargs="+", default=[0.66, 1.8, 3.5, 14, 56], metavar="MB",
                        help="sizes of the bfloat16 matrices at the target's k, in MB")
    args = parser.parse_args()
    if library() is None:
        raise SystemExit("serving/kernels.c does not run here (no C compiler or no AVX2): nothing to compare")
    read = reader()
    c = ModelConfig.from_folder(resolve(args.target))
    shapes = linear_shapes(c.layer)
    print(f"one row, median of {args.repeats}, {torch.get_num_threads()} threads\n")
    print("| matrices | MB | product ms | GB/s | read ms | GB/s | product / read |\n|---|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        matrices = [(k, n, to_panels(torch.randn(n, k).to(dtype))) for _ in range(c.num_layers) for k, n in shapes]
        compare(f"the target's {len(matrices)} linear layers, {str(dtype).replace('torch.', '')}", matrices, read,
                args.repeats)
    for k in args.ks:
        n = int(1.8e6 / 2 / k) // 16 * 16
        matrices = [(k, n, to_panels(torch.randn(n, k).to(torch.bfloat16))) for _ in range(120)]
        compare(f"120 x [{k}, {n}] bfloat16", matrices, read, args.repeats)
    k = c.layer.hidden_size
    for size in args.sizes:
        n = int(size * 1e6 / 2 / k) // 16 * 16
        count = max(1, int(240e6 // (2 * k * n)))
        matrices = [(k, n, to_panels(torch.randn(n, k).to(torch.bfloat16))) for _ in range(count)]
        compare(f"{count} x [{k}, {n}] bfloat16", matrices, read, args.repeats)


if __name__ == "__main__":
    main()
