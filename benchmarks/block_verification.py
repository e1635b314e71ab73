"""Standard (token by token) against block verification of sampled chains, each drafter verified both ways on the same
prompts with the same per-request seeds (seed + index: the same first draft, then the rules' draws part), at each
temperature; plain decoding times the speedups. Turns rotate over groups of `--concurrency` prompts, as the bench's
do, so that drift in the machine's speed hits every method alike.

Per row: tau (emitted tokens / verify steps) of each rule with its standard error, their difference with its
standard error, and the paired estimate of the same difference: at every verify step of a chain (both rules' runs)
the two rules' expected accepted counts given that drafted chain and the target's rows (`expected_accepted` in
serving/spec_decode/verify.py), their difference averaged over every verify step (a step that drafted no chain adds
0: both rules verify it alike). That estimate carries no accept-draw noise and compares the rules on the same chains,
so it resolves gaps of hundredths where the taus' own difference cannot; it leaves out only what the rules change
later (which contexts the steps start at). Standard errors are over requests (a ratio estimator: steps within a
request are not independent), the per-step counts summed per request. The paired estimate's own time (the target's
laws computed once more per step) is measured and left out of the speedups.

    python -m benchmarks.block_verification --drafter JSON [--drafter JSON ...] [--prompts mt-bench]
        [--num-prompts 80] [--max-new-tokens 64] [--temperature 0.7 1.0] [--concurrency 8] [--seed 0] [--json PATH]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time

import torch

from serving.config import EngineConfig
from serving.engine import Engine
from serving.request import SamplingParams
from serving.sampler import target_probs
from serving.spec_decode.config import SpeculativeConfig
from serving.spec_decode.speculator import Speculator
from serving.spec_decode.verify import expected_accepted
from serving.targets import DEFAULT_TARGET

RULES = ("standard", "block")


class PairedSpeculator(Speculator):
    """A speculator that also notes, per request, both rules' expected accepted counts at each sampled verify step of
    a chain, and the time that took."""

    def __init__(self, engine, config: SpeculativeConfig):
        super().__init__(engine, config)
        self.gaps: dict[str, float] = {}  # request id -> sum over its chain steps of E[block] - E[standard]
        self.num_chains = 0  # sampled verify steps of a chain
        self.overhead_s = 0.0

    def verify(self, request, logits, best):
        tree = request.spec.tree
        if len(tree) and tree.is_chain and not request.params.is_greedy and request.grammar is None:
            start = time.perf_counter()
            standard, block = expected_accepted(tree, target_probs(logits[:1 + len(tree)], request.params))
            self.gaps[request.request_id] = self.gaps.get(request.request_id, 0.0) + block - standard
            self.num_chains += 1
            self.overhead_s += time.perf_counter() - start
        return super().verify(request, logits, best)


def ratio(numerators: list[float], denominators: list[float]) -> tuple[float, float]:
    """sum(numerators) / sum(denominators) over requests, and its standard error (the ratio estimator's, over
    requests)."""
    m, total = len(numerators), sum(denominators)
    value = sum(numerators) / total
    if m < 2:
        return value, float("nan")
    residuals = sum((y - value * n) ** 2 for y, n in zip(numerators, denominators))
    return value, math.sqrt(residuals / (m * (m - 1))) / (total / m)


@dataclasses.dataclass
class Run:
    """One method's outputs and time over every prompt of a temperature."""
    speculator: PairedSpeculator | None
    outputs: list = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    def tokens_per_s(self) -> float:
        overhead = self.speculator.overhead_s if self.speculator else 0.0
        return sum(len(o.token_ids) for o in self.outputs) / (self.seconds - overhead)

    def counts(self) -> tuple[list[float], list[float], list[float]]:
        """Per request: (tokens emitted in verify steps, verify steps, summed paired gaps)."""
        specs = [o.metrics["spec"] for o in self.outputs]
        return ([s["num_emitted_tokens"] for s in specs], [s["num_verify_steps"] for s in specs],
                [self.speculator.gaps.get(o.request_id, 0.0) for o in self.outputs])


def run_temperature(engine, prompts, configs, temperature, max_new_tokens, concurrency, seed) -> list[dict]:
    params = [SamplingParams(temperature=temperature, seed=seed + i, max_tokens=max_new_tokens)
              for i in range(len(prompts))]
    runs = [Run(None)] + [Run(PairedSpeculator(engine, dataclasses.replace(config, rejection_sample_method=rule)))
                          for config in configs for rule in RULES]
    warm_up = engine.encode(prompts[0])[:32]
    for run in runs:
        engine.use_speculator(run.speculator)
        engine.generate([warm_up], SamplingParams(max_tokens=4))
    for first in range(0, len(prompts), concurrency):
        group = slice(first, first + concurrency)
        turn = first // concurrency % len(runs)
        for run in runs[turn:] + runs[:turn]:
            engine.use_speculator(run.speculator)
            start = time.perf_counter()
            run.outputs += engine.generate(prompts[group], params[group])
            run.seconds += time.perf_counter() - start
        print(f"  T {temperature:g}: {min(first + concurrency, len(prompts))}/{len(prompts)} prompts", flush=True)
    engine.use_speculator(None)
    plain_rate = runs[0].tokens_per_s()
    rows = []
    for c, config in enumerate(configs):
        standard, block = runs[1 + 2 * c], runs[2 + 2 * c]
        row = {"drafter": config.label(), "config": dataclasses.asdict(config), "temperature": temperature}
        steps, gaps = [], []
        for rule, run in zip(RULES, (standard, block)):
            e, s, g = run.counts()
            row[f"tau_{rule}"], row[f"tau_{rule}_se"] = ratio(e, s)
            row[f"steps_{rule}"], row[f"tokens_{rule}"] = sum(s), sum(len(o.token_ids) for o in run.outputs)
            row[f"chain_steps_{rule}"] = run.speculator.num_chains
            row[f"speedup_{rule}"] = run.tokens_per_s() / plain_rate
            steps.append(s)
            gaps += g
        row["difference"] = row["tau_block"] - row["tau_standard"]
        row["difference_se"] = math.hypot(row["tau_block_se"], row["tau_standard_se"])
        row["paired"], row["paired_se"] = ratio(gaps, steps[0] + steps[1])
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| drafter | T | verify steps (standard / block) | tau standard | tau block | block - standard "
             "| paired E[block - standard] per step | speedup standard | speedup block |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['drafter']} | {r['temperature']:g} | {r['steps_standard']:,} / {r['steps_block']:,} "
                     f"| {r['tau_standard']:.3f} ± {r['tau_standard_se']:.3f} | {r['tau_block']:.3f} ± "
                     f"{r['tau_block_se']:.3f} | {r['difference']:+.3f} ± {r['difference_se']:.3f} | "
                     f"{r['paired']:+.4f} ± {r['paired_se']:.4f} | {r['speedup_standard']:.2f}x | "
                     f"{r['speedup_block']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from serving.bench.prompts import first_turn, load_prompts

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", action="append", required=True, metavar="JSON",
                        help="a speculative config (its rejection_sample_method is set to each rule in turn)")
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--prompts", default="mt-bench")
    parser.add_argument("--num-prompts", type=int, default=80)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, nargs="+", default=[0.7, 1.0])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    if any(t <= 0 for t in args.temperature):
        parser.error("--temperature: block verification is for sampled requests; give temperatures > 0")
    configs = [SpeculativeConfig.from_json(text) for text in args.drafter]
    dataset = load_prompts(args.prompts, args.num_prompts)
    prompts = [first_turn(m) for m in dataset["messages"]]
    # a small K/V pool: short answers, and every draft_model drafter holds a pool of the same size
    engine = Engine(EngineConfig(args.target, max_num_seqs=args.concurrency, kv_cache_memory_gib=0.25))
    print(f"{args.target}, {len(prompts)} {args.prompts} prompts x {args.max_new_tokens} tokens, concurrency "
          f"{args.concurrency}, {torch.get_num_threads()} threads", flush=True)
    rows = []
    for temperature in args.temperature:
        rows += run_temperature(engine, prompts, configs, temperature, args.max_new_tokens, args.concurrency, args.seed)
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
