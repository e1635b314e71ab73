"""What the speculative path costs when nothing is drafted: plain decoding against each speculative config under
the adaptive policy forced to draft nothing, on the same prompts all at once, taking turns with the order rotated
each round (the machine's speed drifts). This is the floor of the adaptive policy at a batch size where drafting
never pays: the verification and bookkeeping of every step, and a head's own upkeep (its features noted each
step; an EAGLE or MTP head's catch-up over prompts and at finish while the prefix cache is on).

    python benchmarks/no_draft_cost.py --speculative-config JSON [--speculative-config JSON ...]
        [--prompts humaneval] [--num-prompts 16] [--max-new-tokens 48] [--rounds 8] [--no-prefix-caching]

Prints each method's times and the ratio of the summed times, plain's over the method's (1.0: free).
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from serving.engine import Engine
from serving.prompts import first_turn, load_prompts
from serving.request import SamplingParams
from serving.spec.config import SpeculativeConfig
from serving.spec.step import Speculator
from serving.targets import DEFAULT_TARGET


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--speculative-config", action="append", required=True, help="a config as JSON; repeat for more")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--prompts", default="humaneval")
    p.add_argument("--num-prompts", type=int, default=16, help="all in flight at once")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--num-threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.num_threads)
    engine = Engine(args.target, device="cpu", max_num_seqs=args.num_prompts,
                    enable_prefix_caching=not args.no_prefix_caching)
    prompts = [first_turn(row["messages"]) for row in load_prompts(args.prompts, args.num_prompts)]
    params = SamplingParams(max_tokens=args.max_new_tokens, ignore_eos=True)
    methods = {"plain": None}
    for text in args.speculative_config:
        config = SpeculativeConfig.from_json({**json.loads(text), "adaptive": True})
        speculator = Speculator(engine, config)
        engine.use_speculator(speculator)  # calibrates, then drafts nothing from here on
        speculator.policy.choose = lambda *args, **kwargs: {}
        methods[config.label()] = speculator
    names, times = list(methods), {name: [] for name in methods}
    for round_ in range(args.rounds):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            engine.use_speculator(methods[name])
            start = time.perf_counter()
            engine.generate(prompts, params)
            times[name].append(time.perf_counter() - start)
    engine.use_speculator(None)
    result = {name: {"seconds": seconds, "vs_plain": sum(times["plain"]) / sum(seconds)} for name, seconds in times.items()}
    for name, row in result.items():
        print(f"{name:50s} {' '.join(f'{s:.3f}' for s in row['seconds'])}  plain/this {row['vs_plain']:.3f}")
    return result


if __name__ == "__main__":
    main()
