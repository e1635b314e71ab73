"""Where a speculative step's time goes at concurrency 1: the target's forward (verify), the drafter (catch-up
and drafting) and the rest of the engine step, per method, measured side by side in one run.

    python benchmarks/spec_step.py --speculative-config '{"method": "eagle", "model": "runs/eagle/heads/best"}' \
        [--speculative-config ...] [--num-prompts 3] [--max-new-tokens 64]
"""
from __future__ import annotations

import argparse
import time

import torch

from serving.engine import Engine
from serving.prompts import first_turn, load_prompts
from serving.request import SamplingParams
from serving.spec.config import SpeculativeConfig
from serving.spec.metrics import AcceptanceStats
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
    engine = Engine(args.target, max_num_seqs=1)
    params = SamplingParams(max_tokens=args.max_new_tokens, ignore_eos=True)
    target = Timer()
    target.wrap(engine.model, "forward")
    print(f"target {args.target}, {len(prompts)} prompts one at a time x {args.max_new_tokens} tokens, "
          f"{torch.get_num_threads()} threads; milliseconds per engine step")
    print("| method | tau | step | target forward | drafter | rest | tok/s |")
    print("|---|---|---|---|---|---|---|")
    for text in [None, *args.speculative_config]:
        config = SpeculativeConfig.from_json(text) if text else None
        engine.set_speculative_config(config)
        engine.generate(prompts[:1], SamplingParams(max_tokens=8))  # warm-up
        drafter = Timer()
        if engine.speculator:
            for name in ("observe", "propose"):
                if hasattr(engine.speculator.drafter, name):
                    drafter.wrap(engine.speculator.drafter, name)
        target.seconds, num_steps_before, emitted, stats = 0.0, engine.num_steps, 0, AcceptanceStats()
        start = time.perf_counter()
        for prompt in prompts:
            [out] = engine.generate([prompt], params)
            emitted += len(out.token_ids)
            if out.metrics.get("spec"):
                stats.merge(AcceptanceStats.from_dict(out.metrics["spec"]))
        elapsed = time.perf_counter() - start
        steps = engine.num_steps - num_steps_before
        tau = stats.tau if config else 1.0
        label = "plain" if config is None else config.label() + (" + token map" if config.token_map else "")
        ms = [x / steps * 1e3 for x in (elapsed, target.seconds, drafter.seconds, elapsed - target.seconds - drafter.seconds)]
        print(f"| {label} | {tau:.2f} | " + " | ".join(f"{x:.1f}" for x in ms) + f" | {emitted / elapsed:.1f} |")


if __name__ == "__main__":
    main()
