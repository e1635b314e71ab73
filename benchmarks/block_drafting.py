"""Block drafters against a chain head, side by side: tau, drafting time per drafting step and tokens/s of each
speculative config on the same prompts (serving.bench.offline.run_bench, plain decoding included), greedy.

Drafting time is the time the speculator spends proposing (a pooled head's catch-up, its draft forwards and the
tree search) summed over the steps that drafted, divided by their number: an EAGLE-3 chain runs its head once per
depth, P-EAGLE once per step.

    python benchmarks/block_drafting.py --config '{"method": "eagle3", "model": "DIR", "num_speculative_tokens": 4}' \
        --config '{"method": "peagle", "model": "DIR", "num_speculative_tokens": 4}' --num-prompts 8 [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import json
import time

from serving.bench.offline import run_bench
from serving.bench.prompts import first_turn, load_prompts
from serving.config import EngineConfig
from serving.engine import Engine
from serving.spec_decode.config import SpeculativeConfig
from serving.spec_decode.speculator import Speculator
from serving.targets import DEFAULT_TARGET


def timed_proposals(timings: dict):
    """Speculator.propose, adding (seconds, 1) to timings[id(its config)] whenever some request got drafts."""
    propose = Speculator.propose

    def timed(self, step):
        start = time.perf_counter()
        propose(self, step)
        if any(len(r.spec.tree) for r in self.scheduler.running):
            seconds, steps = timings.get(id(self.config), (0.0, 0))
            timings[id(self.config)] = (seconds + time.perf_counter() - start, steps + 1)
    return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--config", action="append", required=True, metavar="JSON", help="a speculative config")
    parser.add_argument("--prompts", default="mt-bench")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the target's compute dtype (the drafters compute in the same mode)")
    parser.add_argument("--json", default=None, metavar="FILE")
    args = parser.parse_args()
    engine = Engine(EngineConfig(args.target, max_num_seqs=1, dtype=args.dtype))
    configs = [SpeculativeConfig.from_json(text) for text in args.config]
    loaded = load_prompts(args.prompts, args.num_prompts)
    prompts = [first_turn(m) for m in loaded["messages"]]
    timings = {}
    Speculator.propose = timed_proposals(timings)
    result = run_bench(engine, prompts, ["all"] * len(prompts), configs, args.max_new_tokens, 1)
    print("| method | head | tau | drafting ms / step | tokens/s | speedup | identical |")
    print("|---|---|---|---|---|---|---|")
    for config, row in zip([None, *configs], result["rows"]):
        seconds, steps = timings.get(id(config), (0.0, 0))
        row["drafting_ms_per_step"] = 1e3 * seconds / steps if steps else None
        drafting = f"{row['drafting_ms_per_step']:.2f}" if steps else "-"
        print(f"| {row['method']} | {config.model if config else '-'} | {row['tau']:.3f} | {drafting} | "
              f"{row['tokens_per_s']:.1f} | {row['speedup']:.2f} | {row['identical_to_plain']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)


if __name__ == "__main__":
    main()
