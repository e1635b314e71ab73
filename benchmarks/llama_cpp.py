"""Plain decoding at concurrency 1 against llama.cpp at the same precision, side by side in one run: the target's
weights as float32 and as bfloat16 in this engine (EngineConfig.weights), its bfloat16 compute mode
(EngineConfig.dtype: activations rounded to bfloat16 too, as llama.cpp's BF16 path rounds them), and llama.cpp's
llama-bench on an F32 and a BF16 GGUF written from the same safetensors by llama.cpp's own converter, all on the same
threads. Each round
runs every engine once in a rotated order (this machine's memory bandwidth drifts); the table gives each engine's
median tokens/s over the rounds and its time per token against its weights' bandwidth floors, measured just before
each run (serving.bench.offline.bandwidth_floor: a copy's rate and reading alone), and the ratio of the two engines
at each precision round by round (the memory's rate moves by minutes: a round's runs share a minute).

Both generate --tokens tokens from an (almost) empty context: llama-bench's tg test, and here a one-token prompt,
greedy, EOS ignored.

    make llama-cpp   # builds llama-bench from the llama.cpp inside llama-cpp-python's sdist into .llama-cpp/
    python benchmarks/llama_cpp.py [--llama-cpp .llama-cpp] [--tokens 64] [--rounds 5] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from serving.bench.offline import bandwidth_floor
from serving.config import EngineConfig
from serving.engine import Engine
from serving.request import SamplingParams
from serving.targets import DEFAULT_TARGET, resolve

# this engine's modes: label -> (EngineConfig options, the llama.cpp GGUF type it is compared with)
MODES = {"float32": ({"weights": "float32"}, "f32"), "bfloat16 weights": ({"weights": "bfloat16"}, "bf16"),
         "bfloat16 compute": ({"dtype": "bfloat16"}, "bf16")}
# llama.cpp's GGUF types -> the mode of this engine whose weights have their bytes (the floors of its runs)
OUTTYPES = {"f32": "float32", "bf16": "bfloat16 weights"}


def llama_tree(root: Path) -> tuple[Path, Path, Path]:
    """(llama-bench, convert_hf_to_gguf.py, sentencepiece's folder) of `make llama-cpp`'s tree, or a clear error."""
    bench = root / "build" / "bin" / "llama-bench"
    sources = sorted(root.glob("llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    if not bench.exists() or not sources:
        raise SystemExit(f"no llama.cpp build under {root}: run `make llama-cpp` first (or pass --llama-cpp DIR)")
    return bench, sources[-1], root / "site"


def write_gguf(converter: Path, site: Path, folder: Path, outtype: str, out: Path) -> Path:
    if not out.exists():
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(converter.parent / "gguf-py"), str(site)])}
        subprocess.run([sys.executable, str(converter), str(folder), "--outtype", outtype, "--outfile", str(out)],
                       check=True, env=env, capture_output=True, text=True)
    return out


def llama_bench(bench: Path, gguf: Path, tokens: int, threads: int) -> float:
    """llama-bench's tokens/s generating `tokens` tokens (one repetition after its own warm-up)."""
    env = {**os.environ, "LD_LIBRARY_PATH": str(bench.parent)}
    run = subprocess.run([str(bench), "-m", str(gguf), "-t", str(threads), "-p", "0", "-n", str(tokens), "-r", "1",
                          "-o", "json"], check=True, env=env, capture_output=True, text=True)
    return json.loads(run.stdout)[0]["avg_ts"]


def ours(engine: Engine, tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    out = engine.generate([engine.encode("Hello")[:1]], params)
    return len(out[0].token_ids) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--llama-cpp", type=Path, default=Path(".llama-cpp"), help="the folder `make llama-cpp` built")
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per measurement")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bench, converter, site = llama_tree(args.llama_cpp)
    folder = Path(resolve(args.target))
    runs, engines = {}, {}  # run name -> (the mode whose weights give its floors, what it measures)
    for mode, (options, _) in MODES.items():
        engine = engines[mode] = Engine(EngineConfig(args.target, device="cpu", max_num_seqs=1, **options))
        ours(engine, 4)  # warm-up
        runs[f"draftheads {mode}"] = (mode, lambda e=engine: ours(e, args.tokens))
    for outtype, mode in OUTTYPES.items():
        gguf = write_gguf(converter, site, folder, outtype, args.llama_cpp / f"{folder.name}-{outtype}.gguf")
        runs[f"llama.cpp {outtype.upper()}"] = (mode, lambda g=gguf: llama_bench(bench, g, args.tokens, args.threads))
    rates = {name: [] for name in runs}
    floors = {name: {"copy": [], "read": []} for name in runs}
    names = list(runs)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            floor = bandwidth_floor(engines[runs[name][0]], {"tokens_per_s": 0})  # measured beside each run: it drifts
            rate = runs[name][1]()
            rates[name].append(rate)
            floors[name]["copy"].append(1e3 / rate / floor["step_floor_ms"])
            floors[name]["read"].append(1e3 / rate / floor["read_floor_ms"])
    print(f"{args.target}: {args.tokens} tokens from an empty context, concurrency 1, {args.threads} threads, "
          f"median of {args.rounds} rounds; each run against the floors measured just before it (its weights' bytes "
          "over a copy's rate, read + written, and over reading alone)")
    print("\n| engine | tok/s | ms per token | vs copy floor | vs read floor |\n|---|---|---|---|---|")
    for name in names:
        rate = statistics.median(rates[name])
        print(f"| {name} | {rate:.1f} | {1e3 / rate:.1f} | {statistics.median(floors[name]['copy']):.2f}x | "
              f"{statistics.median(floors[name]['read']):.2f}x |")
    for mode, (_, outtype) in MODES.items():
        ours_rates, theirs = rates[f"draftheads {mode}"], rates[f"llama.cpp {outtype.upper()}"]
        ratio = statistics.median(ours_rates) / statistics.median(theirs)
        by_round = sorted(a / b for a, b in zip(ours_rates, theirs))  # the same round: minutes apart at most
        print(f"\ndraftheads {mode} / llama.cpp {outtype.upper()}: {ratio:.2f}x; round by round "
              f"{' '.join(f'{r:.2f}' for r in by_round)} (median {statistics.median(by_round):.2f}x)", end="")
    print()


if __name__ == "__main__":
    main()
