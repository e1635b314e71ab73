"""What the speculative path costs when nothing is drafted: plain decoding against each speculative config under
the adaptive policy forced to draft nothing, on the same prompts all at once, taking turns with the order rotated
each round (the machine's speed drifts). This is the floor of the adaptive policy at a batch size where drafting
never pays: the verification and bookkeeping of every step, and a head's own upkeep (its features noted each
step). With --as-chosen the policy chooses as it serves instead: the adaptive setting itself, timed with the
rotation a single group of the bench (`draftheads bench` at a concurrency equal to its prompts) cannot have.

    python benchmarks/no_draft_cost.py --speculative-config JSON [--speculative-config JSON ...]
        [--prompts humaneval] [--num-prompts 16] [--max-new-tokens 48] [--rounds 8] [--temperature 0.0]
        [--as-chosen] [--no-prefix-caching]

Prints each method's times, its tokens per second over all rounds against plain's (1.0: free), and the median
over rounds of plain's time over the method's in the same round (with EOS ignored and greedy, the same tokens).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from serving.config import EngineConfig
from serving.engine import Engine
from serving.bench.prompts import first_turn, load_prompts
from serving.request import SamplingParams
from serving.spec_decode.config import SpeculativeConfig
from serving.spec_decode.speculator import Speculator
from serving.targets import DEFAULT_TARGET


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--speculative-config", action="append", required=True, help="a config as JSON; repeat for more")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--prompts", default="humaneval")
    p.add_argument("--num-prompts", type=int, default=16, help="all in flight at once")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sampled, seeded per prompt")
    p.add_argument("--as-chosen", action="store_true", help="let the adaptive policy choose (default: draft nothing)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--num-threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.num_threads)
    engine = Engine(EngineConfig(args.target, device="cpu", max_num_seqs=args.num_prompts,
                    enable_prefix_caching=not args.no_prefix_caching))
    prompts = [first_turn(row["messages"]) for row in load_prompts(args.prompts, args.num_prompts)]
    # forced to draft nothing, every request runs to the end together; as chosen, they finish as they do in the bench
    params = [SamplingParams(max_tokens=args.max_new_tokens, ignore_eos=not args.as_chosen, temperature=args.temperature,
                             seed=i) for i in range(len(prompts))]
    methods = {"plain": None}
    for text in args.speculative_config:
        config = SpeculativeConfig.from_json({**json.loads(text), "adaptive": True})
        speculator = Speculator(engine, config)
        engine.use_speculator(speculator)  # calibrates
        if not args.as_chosen:
            speculator.policy.choose = lambda *args, **kwargs: {}
        methods[config.label()] = speculator
    names, times, tokens = list(methods), {name: [] for name in methods}, {name: 0 for name in methods}
    for round_ in range(args.rounds):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            engine.use_speculator(methods[name])
            start = time.perf_counter()
            outputs = engine.generate(prompts, params)
            times[name].append(time.perf_counter() - start)
            tokens[name] += sum(len(o.token_ids) for o in outputs)
    engine.use_speculator(None)
    rate = {name: tokens[name] / sum(times[name]) for name in names}
    result = {name: {"seconds": times[name], "tokens": tokens[name], "vs_plain": rate[name] / rate["plain"],
                     # plain's time over the method's in each round, the median of them: one slow turn moves it less
                     "median_round": statistics.median(p / s for p, s in zip(times["plain"], times[name]))}
              for name in names}
    for name, row in result.items():
        print(f"{name:50s} {' '.join(f'{s:.3f}' for s in row['seconds'])}  tokens/s vs plain {row['vs_plain']:.3f}"
              f"  median round {row['median_round']:.3f}")
    return result

if __name__ == "__main__":
    main()
