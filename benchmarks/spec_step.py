"""Where a speculative step's time goes at concurrency 1: the target's forward (verify), the drafter (catch-up
and drafting) and the rest of the engine step, per method, measured side by side in one run (methods take turns
prompt by prompt).

    python benchmarks/spec_step.py --speculative-config '{"method": "eagle", "model": "runs/eagle/heads/best"}' \
        [--speculative-config ...] [--num-prompts 3] [--max-new-tokens 64]
"""
from __future__ import annotations

import argparse
import time

import torch

from serving.config import EngineConfig
from serving.engine import Engine
from serving.bench.prompts import first_turn, load_prompts
from serving.request import SamplingParams
from serving.spec_decode.config import SpeculativeConfig
from serving.spec_decode.metrics import AcceptanceStats
from serving.spec_decode.speculator import Speculator
from serving.targets import DEFAULT_TARGET


class Timer:
    """Wraps methods of an object and adds up the seconds spent in them."""

    def __init__(self):
        self.seconds = 0.0

    def wrap(self, owner, name: str) -> None:
        method = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        setattr(owner, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--speculative-config", action="append", default=[], metavar="JSON")
    parser.add_argument("--num-prompts", type=int, default=3, help="MT-bench first turns, one at a time")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    prompts = [first_turn(m) for m in load_prompts("mt-bench", args.num_prompts)["messages"]]
    engine = Engine(EngineConfig(args.target, max_num_seqs=1))
    params = SamplingParams(max_tokens=args.max_new_tokens, ignore_eos=True)
    target = Timer()
    target.wrap(engine.model, "forward")
    print(f"target {args.target}, {len(prompts)} prompts one at a time x {args.max_new_tokens} tokens, "
          f"{torch.get_num_threads()} threads; milliseconds per engine step")
    print("| method | tau | step | target forward | drafter | rest | tok/s |")
    print("|---|---|---|---|---|---|---|")
    configs = [None, *(SpeculativeConfig.from_json(text) for text in args.speculative_config)]
    totals = [{"elapsed": 0.0, "target": 0.0, "drafter": 0.0, "steps": 0, "emitted": 0, "stats": AcceptanceStats()}
              for _ in configs]
    speculators = [Speculator(engine, config) if config else None for config in configs]
    drafters = [Timer() for _ in configs]
    for speculator, drafter in zip(speculators, drafters):
        if speculator:
            for name in ("observe", "catch_up", "propose"):  # the catch-up runs before propose
                drafter.wrap(speculator.drafter, name)
        engine.use_speculator(speculator)
        engine.generate(prompts[:1], SamplingParams(max_tokens=8))  # warm-up
    # Methods take turns prompt by prompt, so that a shared machine's drift falls on all of them alike.
    for prompt in prompts:
        for speculator, drafter, total in zip(speculators, drafters, totals):
            engine.use_speculator(speculator)
            drafter.seconds = target.seconds = 0.0
            num_steps_before = engine.num_steps
            start = time.perf_counter()
            [out] = engine.generate([prompt], params)
            total["elapsed"] += time.perf_counter() - start
            total["target"] += target.seconds
            total["drafter"] += drafter.seconds
            total["steps"] += engine.num_steps - num_steps_before
            total["emitted"] += len(out.token_ids)
            if out.metrics.get("spec"):
                total["stats"].merge(AcceptanceStats.from_dict(out.metrics["spec"]))
    for config, total in zip(configs, totals):
        tau = total["stats"].tau if config else 1.0
        label = "plain" if config is None else config.label() + (" + token map" if config.token_map else "") + (
            f" ({config.model})" if config.model else "")
        elapsed, steps = total["elapsed"], total["steps"]
        ms = [x / steps * 1e3 for x in (elapsed, total["target"], total["drafter"],
                                        elapsed - total["target"] - total["drafter"])]
        print(f"| {label} | {tau:.2f} | " + " | ".join(f"{x:.1f}" for x in ms) + f" | {total['emitted'] / elapsed:.1f} |")

if __name__ == "__main__":
    main()
