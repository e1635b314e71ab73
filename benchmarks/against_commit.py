"""Three step parts of this checkout against another commit's, side by side in one process: the linear layers'
packed products at 1, 5 and 12 rows (kernels.c of both built with this machine's flags and loaded together, the
weights packed by each one's `to_panels`; the default target's 120 linear layers, float32 and bfloat16 weights; the
outputs' largest difference), paged attention over the K/V of 30 layers in memory (decode queries of one sequence of
64 to 1,024 keys; decode and 5-row verify queries of 4 to 64 sequences of 256 keys; their blocks shuffled over the
pool; the two outputs' largest difference beside the times) and `PagedMetadata.build` (serving/attention.py of both,
with the arrays the C kernel reads where this checkout makes them apart) for decode and verify steps at 1 and 16
sequences of ~300 tokens. The two take turns, so that drift hits both alike.

    python benchmarks/against_commit.py --commit 1b2846c [--repeats 30]

A commit from before paged_attention took an attention_args struct is called with its positional arguments.
"""
from __future__ import annotations

import argparse
import ctypes
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from serving.attention import PagedMetadata
from serving.kernel_abi import AttentionArgs, AttentionBatch, Sequence
from serving.kernels import SIGNATURES, SOURCE, compile_flags, to_panels
from serving.model import ModelConfig
from serving.targets import DEFAULT_TARGET, resolve


def show(commit: str, path: str, out: Path) -> Path:
    out.write_text(subprocess.run(["git", "show", f"{commit}:{path}"], check=True, capture_output=True, text=True).stdout)
    return out


def load(commit: str, path: str, name: str, tmp: Path):
    """The module at `path` as of `commit`, imported under `name`."""
    spec = importlib.util.spec_from_file_location(name, show(commit, path, tmp / f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def build(source: Path, out: Path) -> ctypes.CDLL:
    subprocess.run(["cc", *compile_flags(), str(source), "-o", str(out), "-lm"], check=True, capture_output=True)
    lib = ctypes.CDLL(str(out))
    for name in ("gemm_panels", "gemm_panels_bf16", "paged_attention"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = SIGNATURES[name], None
    if not has_struct_calls(lib):
        _long, _ptr = ctypes.c_long, ctypes.c_void_p
        lib.paged_attention.argtypes = [_ptr, _long, _ptr, _ptr, _ptr, _ptr, _long, _ptr, _long, _ptr, _long, _ptr,
                                        _long, _ptr, _long, _ptr, _long, _long, _long, _long, ctypes.c_float]
    return lib


def has_struct_calls(lib: ctypes.CDLL) -> bool:
    """Whether `lib`'s larger calls take structs (serving/kernel_abi.py), which kernel_layouts came with."""
    try:
        lib.kernel_layouts
    except AttributeError:
        return False
    return True


def linear_shapes(c) -> list[tuple[int, int]]:
    """(in, out) of a decoder layer's four linear layers (qkv, o, gate_up, down), for a model's LayerConfig `c`."""
    return [(c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim), (c.num_heads * c.head_dim, c.hidden_size),
            (c.hidden_size, 2 * c.intermediate_size), (c.intermediate_size, c.hidden_size)]


def alternate(fns: dict, repeats: int) -> dict[str, float]:
    times = {name: [] for name in fns}
    for fn in fns.values():  # warm-up: the first call touches the weights' pages
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def paged_attention(libs: dict, num_seqs: int, rows: int, c, num_layers: int, repeats: int, context: int = 256,
                    block_size: int = 16) -> tuple[dict, float]:
    """Both kernels' attention of `rows` queries per sequence over `context` keys each (the last `rows` of them the
    queries' own), for every layer's pools in turn; the milliseconds per 30 layers and the outputs' largest difference."""
    blocks = context // block_size
    order = torch.randperm(num_seqs * blocks)
    slots = torch.stack([(order[b * blocks:(b + 1) * blocks, None] * block_size + torch.arange(block_size)).flatten()
                         for b in range(num_seqs)])
    pool_shape = (num_seqs * blocks * block_size, c.num_kv_heads, c.head_dim)
    pools = [(torch.randn(pool_shape), torch.randn(pool_shape)) for _ in range(num_layers)]
    seqs = torch.tensor([[b * rows, rows, context, 0, 0] for b in range(num_seqs)])  # Sequence's fields
    q = torch.randn(num_seqs * rows, c.num_heads, c.head_dim)
    outs = {which: torch.empty_like(q) for which in libs}
    paths = torch.zeros(1, 2, dtype=torch.long)

    batch = AttentionBatch(seqs=seqs.data_ptr(), num_seqs=num_seqs, slots=slots.data_ptr(),
                           slot_stride=slots.shape[1], paths=paths.data_ptr(), path_stride=2)
    assert ctypes.sizeof(Sequence) == seqs.shape[1] * seqs.element_size()

    def attend(which):
        lib = libs[which]
        for k, v in pools:
            if has_struct_calls(lib):
                lib.paged_attention(AttentionArgs(
                    q=q.data_ptr(), q_stride=c.num_heads * c.head_dim, out=outs[which].data_ptr(), k_pool=k.data_ptr(),
                    v_pool=v.data_ptr(), heads=c.num_heads, kv_heads=c.num_kv_heads, dim=c.head_dim,
                    scale=c.head_dim ** -0.5, batch=ctypes.pointer(batch)))
            else:
                lib.paged_attention(q.data_ptr(), c.num_heads * c.head_dim, outs[which].data_ptr(), k.data_ptr(),
                                    v.data_ptr(), None, 0, None, 0, None, 0, seqs.data_ptr(), num_seqs,
                                    slots.data_ptr(), slots.shape[1], paths.data_ptr(), 2, c.num_heads,
                                    c.num_kv_heads, c.head_dim, c.head_dim ** -0.5)
    ms = alternate({which: (lambda which=which: attend(which)) for which in libs}, repeats)
    return ms, (outs["before"] - outs["after"]).abs().max().item()


def kernel_metadata(*step):
    """This checkout's metadata of a step and the host arrays its C kernel reads."""
    meta = PagedMetadata.build(*step)
    return meta, meta.kernel_arrays


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", required=True)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp())
    libs = {"before": build(show(args.commit, "serving/kernels.c", tmp / "before.c"), tmp / "before.so"),
            "after": build(SOURCE, tmp / "after.so")}
    model_config = ModelConfig.from_folder(resolve(args.target))
    c, num_layers = model_config.layer, model_config.num_layers
    shapes = linear_shapes(c)
    weights = [(k, n, torch.randn(n, k)) for _ in range(num_layers) for k, n in shapes]
    print(f"{args.commit} against this checkout, median of {args.repeats}, {torch.get_num_threads()} threads\n")
    packers = {"before": load(args.commit, "serving/kernels.py", "kernels_before", tmp).to_panels,
               "after": to_panels}
    print("| rows through the target's linear layers | before ms | after ms | ratio | largest difference |\n"
          "|---|---|---|---|---|")
    for dtype, name in ((torch.float32, "gemm_panels"), (torch.bfloat16, "gemm_panels_bf16")):
        packed = {which: [(k, n, pack(w.to(dtype))) for k, n, w in weights] for which, pack in packers.items()}
        for rows in (1, 2, 3, 5, 12):
            xs = {k: torch.randn(rows, k) for k, _ in shapes}
            outs = {which: {n: torch.empty(rows, n) for _, n in shapes} for which in libs}

            def product(which, name=name, rows=rows, xs=xs):
                fn = getattr(libs[which], name)
                for k, n, p in packed[which]:
                    fn(xs[k].data_ptr(), rows, k, p.data_ptr(), k, n, None, outs[which][n].data_ptr(), n)
            ms = alternate({which: (lambda which=which: product(which)) for which in libs}, args.repeats)
            diff = max((outs["before"][n] - outs["after"][n]).abs().max().item() for _, n in shapes)
            print(f"| {rows} row{'s' if rows > 1 else ''}, {dtype} weights | {ms['before']:.2f} | {ms['after']:.2f} | "
                  f"{ms['before'] / ms['after']:.2f}x | {diff:.1e} |")

    print("\n| paged attention, 30 layers | before ms | after ms | ratio | largest difference |\n|---|---|---|---|---|")
    for num_seqs, rows, context in ((1, 1, 64), (1, 1, 256), (1, 1, 1024), (4, 1, 256), (16, 1, 256), (64, 1, 256),
                                    (4, 5, 256), (16, 5, 256)):
        ms, diff = paged_attention(libs, num_seqs, rows, c, num_layers, args.repeats, context)
        print(f"| {num_seqs} sequences x {rows} rows, {context} keys | {ms['before']:.2f} | {ms['after']:.2f} | "
              f"{ms['before'] / ms['after']:.2f}x | {diff:.1e} |")

    before = load(args.commit, "serving/attention.py", "attention_before", tmp)
    print("\n| PagedMetadata.build | before ms | after ms | ratio |\n|---|---|---|---|")
    for num_seqs, nodes in ((1, 0), (16, 0), (1, 4), (16, 4)):
        tables = [list(range(i * 30, i * 30 + 30)) for i in range(num_seqs)]
        contexts = [300 + i for i in range(num_seqs)]
        paths = [[[c + 1 + j for j in range(d + 1)] for d in range(nodes)] for c in contexts] if nodes else None
        step = ([1] * num_seqs, contexts, tables, 16, "cpu", paths)
        ms = alternate({"before": lambda: before.PagedMetadata.build(*step),
                        "after": lambda: kernel_metadata(*step)}, 10 * args.repeats)
        label = "decode" if not nodes else f"verify 1 + {nodes} nodes"
        print(f"| {num_seqs} sequences, {label} | {ms['before']:.3f} | {ms['after']:.3f} | "
              f"{ms['before'] / ms['after']:.1f}x |")


if __name__ == "__main__":
    main()
