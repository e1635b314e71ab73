"""Where a step's time goes, four views of it, each measured side by side in one run (methods or engines take turns:
this machine's speed drifts):

    python -m benchmarks.step plain         a plain decode step by part (scheduler, metadata, linear layers, LM head,
                                            attention, norms, argmax, emitting), float32 and bfloat16 weights
    python -m benchmarks.step verify        a verify step of n rows against a one-row step
    python -m benchmarks.step speculative   a speculative step at concurrency 1: target forward, drafter, the rest
    python -m benchmarks.step no-draft      each speculative config with nothing drafted (or --as-chosen) against plain

`python -m benchmarks.step VIEW --help` lists each view's options.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from contextlib import ExitStack, contextmanager

import torch
from torch import nn

from serving import attention, model_runner
from serving.attention import KVCache, PagedAttention, PagedMetadata
from serving.bench.offline import bandwidth_floor
from serving.bench.prompts import first_turn, load_prompts
from serving.config import WEIGHTS, EngineConfig
from serving.engine import Engine
from serving.kernels import FusedRMSNorm, KernelLayer, PackedLinear
from serving.model import Model
from serving.request import SamplingParams
from serving.spec_decode.config import SpeculativeConfig
from serving.spec_decode.metrics import AcceptanceStats
from serving.spec_decode.speculator import Speculator
from serving.spec_decode.tree import DraftTree
from serving.targets import DEFAULT_TARGET, resolve


PARTS = ("linear layers", "LM head", "attention", "norms", "between kernels", "forward", "scheduler",
         "batch and metadata", "argmax", "emit tokens", "rest of step", "step")
INNER = {"forward": ("linear layers", "LM head", "attention", "norms"),
         "step": ("forward", "scheduler", "batch and metadata", "argmax", "emit tokens")}
REMAINDER = {"forward": "between kernels", "step": "rest of step"}


class Clock:
    """Seconds per part of the step being timed (`totals`), and of each step timed so far (`steps`)."""

    def __init__(self):
        self.totals = defaultdict(float)
        self.steps: list[dict] = []

    def part(self, name: str) -> float:
        """The median over the timed steps of a part's seconds (a remainder: its outer part less the inner ones)."""
        for outer, rest in REMAINDER.items():
            if rest == name:
                return statistics.median(s[outer] - sum(s[p] for p in INNER[outer]) for s in self.steps)
        return statistics.median(s[name] for s in self.steps)

    def timed(self, label, fn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[label] += time.perf_counter() - start
        return call


@contextmanager
def patched(owner, name, value):
    missing = object()
    original = owner.__dict__.get(name, missing)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if original is missing:
            delattr(owner, name)
        else:
            setattr(owner, name, original)


@contextmanager
def instrumented(engine: Engine, clock: Clock):
    """Every part of `engine`'s step wrapped by `clock`, for the duration of the block."""
    model, runner = engine.model, engine.runner
    with ExitStack() as stack:
        stack.enter_context(patched(model, "fused", None))  # the layers one call each, so that each part is seen
        for module in model.modules():
            if isinstance(module, PackedLinear):
                label = "LM head" if module is model.packed_lm_head else "linear layers"
                stack.enter_context(patched(module, "forward", clock.timed(label, module.forward)))
            elif isinstance(module, FusedRMSNorm):
                stack.enter_context(patched(module, "forward", clock.timed("norms", module.forward)))
            elif isinstance(module, KernelLayer):
                for name in ("pre", "post"):
                    stack.enter_context(patched(module, name, clock.timed("linear layers", getattr(module, name))))
        stack.enter_context(patched(attention.PagedAttention, "__call__",
                                    clock.timed("attention", attention.PagedAttention.__call__)))
        stack.enter_context(patched(model, "forward", clock.timed("forward", model.forward)))
        stack.enter_context(patched(model_runner, "argmax", clock.timed("argmax", model_runner.argmax)))
        stack.enter_context(patched(runner, "build_batch", clock.timed("batch and metadata", runner.build_batch)))
        stack.enter_context(patched(engine.scheduler, "schedule", clock.timed("scheduler", engine.scheduler.schedule)))
        stack.enter_context(patched(engine, "_emit", clock.timed("emit tokens", engine._emit)))
        yield


def start_decoding(engine: Engine, concurrency: int, context: int, max_tokens: int) -> None:
    """`concurrency` requests of random prompts, prefilled, each then decoding one token per step."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(concurrency):
        prompt = torch.randint(0, engine.model.config.vocab_size, (context,), generator=generator).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    while any(r.num_output_tokens == 0 for r in engine.requests.values()):
        engine.step()


def timed_steps(engine: Engine, steps: int, clock: Clock | None) -> list[float]:
    times = []
    with instrumented(engine, clock) if clock else ExitStack():
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
            if clock:
                clock.steps.append({**clock.totals, "step": times[-1]})
                clock.totals.clear()
    return times


def outside_forward_warm(engine: Engine, steps: int) -> list[float]:
    """Seconds of steps whose forward returns the last real forward's output at once: the engine's own work (the
    scheduler, batch and metadata, argmax, emitting, bookkeeping) with the caches as that work leaves them, where after
    a real forward they hold what streaming the weights left (the rows "step" less "forward" measure that)."""
    model = engine.model
    recorded = []
    with patched(model, "forward", lambda *args, **kwargs: recorded.append(type(model).forward(model, *args, **kwargs))
                 or recorded[-1]):
        engine.step()
    with patched(model, "forward", lambda *args, **kwargs: recorded[-1]):
        return timed_steps(engine, steps, None)


def kv_bytes_per_step(engine: Engine) -> int:
    c = engine.model.config
    per_token = 2 * c.num_layers * c.layer.num_kv_heads * c.layer.head_dim * engine.cache.k.element_size()
    return per_token * sum(r.num_tokens for r in engine.requests.values())


def plain(argv=None) -> None:
    """Where a plain decode step's time goes, at each concurrency asked for and for each way of storing the target's
    weights, side by side in one run: engines with float32 and bfloat16 weights take turns, a round of timed steps each;
    with --modules, also each with the target's layers run module by module (the DecoderLayers that KernelLayer wraps:
    the engine before serving.kernels.KernelLayer).

    A step splits into the scheduler, building the batch and its attention metadata (the model runner), the target's
    forward, the argmax of its logits rows, emitting tokens (sampling, stop checks) and the rest of the engine's step
    (prefix-cache bookkeeping, the step's outputs). The forward splits into the linear layers (serving/kernels.c's
    packed GEMMs; with KernelLayers, their two calls per layer, which also norm, rotate and apply SiLU), the LM head,
    paged attention (writing the step's K/V and attending), the RMSNorms, and everything between them: embedding, rope,
    SiLU times up, residual adds, views and the layer loop itself. Each part is timed by
    a wrapper around its Python call (~0.3 us each, ~200 calls a step), with the target's layers run one kernel call at
    a time; the uninstrumented step (the whole forward in one call of serving.kernels.KernelForward) is timed in the same
    rounds. The floor of a part is the bytes it must read (weights; K/V for attention) over the measured copy
    bandwidth. One more row times steps whose forward replays the last one's output: the engine's own work (everything
    but the forward) as fast as it runs with its data still in the caches, which a real forward's weights have streamed
    through.

        python -m benchmarks.step plain [--target smollm2-135m-instruct] [--concurrency 1 16] [--weights float32 bfloat16]
            [--modules] [--context 256] [--steps 16] [--rounds 4]
    """
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step plain", description=plain.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--weights", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--modules", action="store_true", help="also each with its layers run module by module")
    parser.add_argument("--context", type=int, default=256, help="prompt tokens of each request")
    parser.add_argument("--steps", type=int, default=16, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=4, help="rounds; each engine runs steps plain and instrumented")
    parser.add_argument("--num-threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.num_threads)
    for concurrency in args.concurrency:
        max_tokens = 3 * args.rounds * args.steps + 8
        engines = {}
        for w in args.weights:
            for modules in (False, True) if args.modules else (False,):
                engine = Engine(EngineConfig(args.target, weights=w, device="cpu", max_num_seqs=concurrency,
                                             num_blocks=concurrency * -(-(args.context + max_tokens) // 16) + 1,
                                             max_model_len=args.context + max_tokens,
                                             enable_prefix_caching=False))
                if modules:
                    engine.model.layers = nn.ModuleList(layer.reference for layer in engine.model.layers)
                engines[f"{w} modules" if modules else w] = engine
        for engine in engines.values():
            start_decoding(engine, concurrency, args.context, max_tokens)
            timed_steps(engine, 2, None)  # warm up
        clocks = {w: Clock() for w in engines}
        uninstrumented = {w: [] for w in engines}
        kv = {w: [] for w in engines}
        warm = {w: [] for w in engines}
        for _ in range(args.rounds):  # taking turns: the machine's speed drifts, and other work shares its cores
            for w, engine in engines.items():
                kv[w].append(kv_bytes_per_step(engine))
                uninstrumented[w] += timed_steps(engine, args.steps, None)
                timed_steps(engine, args.steps, clocks[w])
                warm[w] += outside_forward_warm(engine, args.steps)
        num_steps = args.rounds * args.steps
        print(f"\nconcurrency {concurrency}, context {args.context}+, {args.target}, {torch.get_num_threads()} threads, "
              f"{num_steps} steps per engine; medians over steps")
        floors = {}
        for w, engine in engines.items():
            floor = bandwidth_floor(engine, {"tokens_per_s": 0})
            head = engine.model.packed_lm_head.weights()
            head_bytes = head.numel() * head.element_size()
            gbs = floor["copy_bandwidth_gbs"] * 1e9
            floors[w] = {"linear layers": (floor["weight_bytes"] - head_bytes) / gbs * 1e3, "LM head": head_bytes / gbs * 1e3,
                         "attention": statistics.mean(kv[w]) / gbs * 1e3}
            floors[w]["step"] = sum(floors[w].values())
            print(f"{w}: {floor['weight_bytes'] / 1e6:.0f} MB of weights + {statistics.mean(kv[w]) / 1e6:.0f} MB of K/V "
                  f"per step at {floor['copy_bandwidth_gbs']:.1f} GB/s = {floors[w]['step']:.1f} ms floor")
        print("\n| part | " + " | ".join(f"{w} ms | {w} floor ms" for w in engines) + " |")
        print("|---|" + "---|---|" * len(engines))
        for part in PARTS:
            cells = []
            for w in engines:
                ms = clocks[w].part(part) * 1e3
                floor = floors[w].get(part)
                cells.append(f"{ms:.2f} | {floor:.2f}" if floor is not None else f"{ms:.2f} | ")
            print(f"| {part} | " + " | ".join(cells) + " |")
        print("| step less forward, caches warm (the forward's output replayed) | " + " | ".join(
            f"{statistics.median(warm[w]) * 1e3:.2f} | " for w in engines) + " |")
        print("| step, uninstrumented (median) | " + " | ".join(
            f"{statistics.median(uninstrumented[w]) * 1e3:.2f} | {floors[w]['step']:.2f}" for w in engines) + " |")
        print("| tok/s, uninstrumented | " + " | ".join(
            f"{concurrency / statistics.median(uninstrumented[w]):.1f} | {concurrency / floors[w]['step'] * 1e3:.1f}" for w in engines) + " |")
        del engines


def verify(argv=None) -> None:
    """What a verify step costs against a plain decode step: one target forward over the newest token and a draft
    tree of n - 1 nodes (rows = n) at a given context, through the engine's model and paged tree attention, timed side
    by side in one run. The tree is 4-ary (node i hangs off node i // 4 - 1), the shape EAGLE-2 trees take; a chain
    of the same rows costs the same in the linear layers, which dominate. With --weights float32,bfloat16, the target
    with each (EngineConfig.weights) takes turns, one table each.

        python -m benchmarks.step verify [--target smollm2-135m-instruct] [--context 300] [--repeats 20] [--rows 1,5,8,16,32,64]
            [--weights float32]
    """
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step verify", description=verify.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--context", type=int, default=300, help="tokens already in the K/V cache")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--rows", default="1,5,8,16,32,64", help="rows per step: the newest token and rows - 1 nodes")
    parser.add_argument("--weights", default="float32", help="comma-separated: float32, bfloat16")
    args = parser.parse_args(argv)
    sizes = [int(n) for n in args.rows.split(",")]
    weights = args.weights.split(",")
    models = {w: Model.from_folder(resolve(args.target), weights=WEIGHTS[w]) for w in weights}
    c = models[weights[0]].config
    num_blocks = (args.context + max(sizes)) // args.block_size + 2
    caches = {w: KVCache(c.num_layers, num_blocks, args.block_size, c.layer.num_kv_heads, c.layer.head_dim, torch.float32,
                         "cpu") for w in weights}  # each model's own keys
    table = list(range(num_blocks))
    ids = torch.randint(0, c.vocab_size, (args.context + max(sizes),))
    for w in weights:
        models[w](ids[:args.context], torch.arange(args.context), PagedAttention(
            caches[w], PagedMetadata.build([args.context], [args.context], [table], args.block_size, "cpu")))
    newest = args.context  # position of the newest token, computed in the step

    def forward(w: str, num_rows: int) -> float:
        tree = DraftTree(tuple(range(num_rows - 1)), tuple(i // 4 - 1 for i in range(num_rows - 1)))
        slot = lambda node: newest + 1 + node  # the table is the identity
        paths = [[slot(n) for n in tree.path(i)] for i in range(len(tree))]
        meta = PagedMetadata.build([1], [newest + 1], [table], args.block_size, "cpu", [paths])
        positions = torch.tensor([newest] + [newest + d for d in tree.depths])
        start = time.perf_counter()
        models[w](ids[newest:newest + num_rows], positions, PagedAttention(caches[w], meta), torch.arange(num_rows))
        return time.perf_counter() - start

    times = {(w, n): [] for w in weights for n in sizes}
    for _ in range(args.repeats):  # interleaved, so drift hits every size and model alike
        for w in weights:
            for n in sizes:
                times[w, n].append(forward(w, n))
    print(f"target {args.target}, context {args.context}, {torch.get_num_threads()} threads, median of {args.repeats}")
    for w in weights:
        base = statistics.median(times[w, 1])
        print(f"\n{w} weights\n| rows in the step | draft nodes | ms | vs 1 row |")
        print("|---|---|---|---|")
        for n in sizes:
            ms = statistics.median(times[w, n]) * 1e3
            print(f"| {n} | {n - 1} | {ms:.1f} | {ms / (base * 1e3):.2f}x |")


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


def speculative(argv=None) -> None:
    """Where a speculative step's time goes at concurrency 1: the target's forward (verify), the drafter (catch-up
    and drafting) and the rest of the engine step, per method, measured side by side in one run (methods take turns
    prompt by prompt).

        python -m benchmarks.step speculative --speculative-config '{"method": "eagle", "model": "runs/eagle/heads/best"}' \
            [--speculative-config ...] [--prompts humaneval] [--num-prompts 3] [--max-new-tokens 64] [--dtype bfloat16]
    """
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step speculative", description=speculative.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--speculative-config", action="append", default=[], metavar="JSON")
    parser.add_argument("--prompts", default="mt-bench", help="a prompt source of `draftheads bench --prompts`")
    parser.add_argument("--num-prompts", type=int, default=3, help="first turns, one at a time")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the engine's compute mode (bfloat16: products of bfloat16 operands, the heads' too)")
    args = parser.parse_args(argv)
    prompts = [first_turn(m) for m in load_prompts(args.prompts, args.num_prompts)["messages"]]
    engine = Engine(EngineConfig(args.target, max_num_seqs=1, dtype=args.dtype))
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
            for name in ("observe", "catch_up", "propose"):  # a drafter's catch-up runs before it proposes
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


def no_draft(argv=None) -> dict:
    """What the speculative path costs when nothing is drafted: plain decoding against each speculative config under
    the adaptive policy forced to draft nothing, on the same prompts all at once, taking turns with the order rotated
    each round (the machine's speed drifts). This is the floor of the adaptive policy at a batch size where drafting
    never pays: the verification and bookkeeping of every step, and a head's own upkeep (its features noted each
    step). With --as-chosen the policy chooses as it serves instead: the adaptive setting itself, timed with the
    rotation a single group of the bench (`draftheads bench` at a concurrency equal to its prompts) cannot have.

        python -m benchmarks.step no-draft --speculative-config JSON [--speculative-config JSON ...]
            [--prompts humaneval] [--num-prompts 16] [--max-new-tokens 48] [--rounds 8] [--temperature 0.0]
            [--as-chosen] [--no-prefix-caching]

    Prints each method's times, its tokens per second over all rounds against plain's (1.0: free), and the median
    over rounds of plain's time over the method's in the same round (with EOS ignored and greedy, the same tokens).
    """
    p = argparse.ArgumentParser(prog="python -m benchmarks.step no-draft", description=no_draft.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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

VIEWS = {"plain": plain, "verify": verify, "speculative": speculative, "no-draft": no_draft}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in VIEWS:
        print(__doc__)
        raise SystemExit(f"choose a view: {', '.join(VIEWS)}")
    return VIEWS[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
