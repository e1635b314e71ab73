"""The engine's CPU modes side by side in one run: by default the target's weights stored as float32 against
bfloat16 (EngineConfig.weights); `--modes float32 bfloat16` sets float32 against the bfloat16 compute mode
(EngineConfig.dtype). An engine of each mode, plain decoding and each speculative config on each, taking turns on
every group of prompts with the order rotated each group (the machine's speed drifts, and other work shares its
cores). Prints per engine its bandwidth floor, and per method tokens/s, plain's time per step against that floor,
speculation's speedup over plain on the same engine, tau, rows verified per step and whether greedy outputs equal
plain decoding's on that engine; with two modes, each method's speedup in the second against the first.

    python benchmarks/modes.py [--modes float32 bfloat16-weights] [--prompts mt-bench] [--num-prompts 8]
        [--max-new-tokens 96] [--concurrency 1] [--speculative-config JSON ...]
"""
from __future__ import annotations

import argparse
import time

import torch
from tqdm.auto import tqdm

from serving.bench.offline import bandwidth_floor
from serving.bench.prompts import first_turn, load_prompts
from serving.config import EngineConfig
from serving.engine import Engine
from serving.request import SamplingParams
from serving.spec_decode.config import SpeculativeConfig
from serving.spec_decode.metrics import AcceptanceStats
from serving.spec_decode.speculator import Speculator
from serving.targets import DEFAULT_TARGET

# mode -> its EngineConfig options
MODES = {"float32": {}, "bfloat16-weights": {"weights": "bfloat16"}, "bfloat16": {"dtype": "bfloat16"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--prompts", default="mt-bench")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--speculative-config", action="append", default=[], metavar="JSON")
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=["float32", "bfloat16-weights"])
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    configs = [SpeculativeConfig.from_json(c) for c in args.speculative_config]
    prompts = [first_turn(m) for m in load_prompts(args.prompts, args.num_prompts)["messages"]]
    params = SamplingParams(max_tokens=args.max_new_tokens)
    engines = {m: Engine(EngineConfig(args.target, device="cpu", max_num_seqs=args.concurrency, **MODES[m]))
               for m in args.modes}
    turns = []  # (mode, config or None, speculator)
    for w, engine in engines.items():
        for config in [None, *configs]:
            speculator = Speculator(engine, config) if config else None
            engine.use_speculator(speculator)
            engine.generate([engine.encode(prompts[0])[:32]], SamplingParams(max_tokens=4))  # warm-up
            turns.append((w, config, speculator))
    seconds, outputs = [0.0] * len(turns), [[] for _ in turns]
    # the table comes at the end (tens of minutes on the full sets): a bar on stderr meanwhile, each prompt counted
    # once every turn has answered it
    bar = tqdm(total=len(prompts), unit="prompt", desc=f"{len(turns)} turns")
    for first in range(0, len(prompts), args.concurrency):
        group = prompts[first:first + args.concurrency]
        shift = first // args.concurrency % len(turns)
        for t in [*range(shift, len(turns)), *range(shift)]:
            w, _, speculator = turns[t]
            engines[w].use_speculator(speculator)
            start = time.perf_counter()
            outputs[t] += engines[w].generate(group, params)
            seconds[t] += time.perf_counter() - start
        bar.update(len(group))
    bar.close()
    print(f"{args.target}, {args.prompts} x {len(prompts)}, {args.max_new_tokens} new tokens, concurrency "
          f"{args.concurrency}, {torch.get_num_threads()} threads, greedy")
    floors, plain, speedups = {}, {}, {}
    for w, engine in engines.items():
        engine.use_speculator(None)
        floors[w] = bandwidth_floor(engine, {"tokens_per_s": 0})
        print(f"{w}: {floors[w]['weight_bytes'] / 1e6:.0f} MB at {floors[w]['copy_bandwidth_gbs']:.1f} GB/s = "
              f"{floors[w]['step_floor_ms']:.1f} ms per step")
    print("\n| mode | method | tok/s | ms per step vs floor | speedup over plain (same mode) | tau | rows/step "
          "| identical to plain |\n|---|---|---|---|---|---|---|---|")
    for (w, config, _), elapsed, method_outputs in zip(turns, seconds, outputs):
        rate = sum(len(o.token_ids) for o in method_outputs) / elapsed
        if config is None:
            plain[w] = (rate, method_outputs)
            step_ms = 1e3 * args.concurrency / rate
            print(f"| {w} | plain | {rate:.1f} | {step_ms:.1f} / {floors[w]['step_floor_ms']:.1f} = "
                  f"{step_ms / floors[w]['step_floor_ms']:.2f}x | 1.00x | 1.00 | 1.00 | yes |")
            continue
        stats = AcceptanceStats()
        for o in method_outputs:
            if "spec" in o.metrics:
                stats.merge(AcceptanceStats.from_dict(o.metrics["spec"]))
        identical = all(a.token_ids == b.token_ids for a, b in zip(method_outputs, plain[w][1]))
        speedups[w, config.label()] = (rate / plain[w][0], stats.tau)
        print(f"| {w} | {config.label()} | {rate:.1f} | | {rate / plain[w][0]:.2f}x | {stats.tau:.2f} | "
              f"{stats.to_dict()['rows_per_step']:.2f} | {'yes' if identical else 'NO'} |")
    if len(args.modes) == 2:
        first, second = args.modes
        same = all(a.token_ids == b.token_ids for a, b in zip(plain[first][1], plain[second][1]))
        print(f"\n{second} / {first} plain tok/s: {plain[second][0] / plain[first][0]:.2f}x; greedy outputs of the two "
              f"{'equal' if same else 'differ (rounded weights or activations)'}")
        print(f"\n| method | speedup {first} (tau) | speedup {second} (tau) | difference |\n|---|---|---|---|")
        for config in configs:
            (a, tau_a), (b, tau_b) = speedups[first, config.label()], speedups[second, config.label()]
            print(f"| {config.label()} | {a:.2f}x ({tau_a:.2f}) | {b:.2f}x ({tau_b:.2f}) | {b - a:+.2f} |")


if __name__ == "__main__":
    main()
