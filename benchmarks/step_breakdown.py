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
through (on this project's 2-core machines ~3x longer after one: Results, round 33).

    python benchmarks/step_breakdown.py [--target smollm2-135m-instruct] [--concurrency 1 16] [--weights float32 bfloat16]
        [--modules] [--context 256] [--steps 16] [--rounds 4]
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from contextlib import ExitStack, contextmanager

import torch

from serving import attention, model_runner
from serving.bench.offline import bandwidth_floor
from serving.config import EngineConfig
from serving.engine import Engine
from torch import nn

from serving.kernels import FusedRMSNorm, KernelLayer, PackedLinear
from serving.request import SamplingParams
from serving.targets import DEFAULT_TARGET

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--weights", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--modules", action="store_true", help="also each with its layers run module by module")
    parser.add_argument("--context", type=int, default=256, help="prompt tokens of each request")
    parser.add_argument("--steps", type=int, default=16, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=4, help="rounds; each engine runs steps plain and instrumented")
    parser.add_argument("--num-threads", type=int, default=2)
    args = parser.parse_args()
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
        plain = {w: [] for w in engines}
        kv = {w: [] for w in engines}
        warm = {w: [] for w in engines}
        for _ in range(args.rounds):  # taking turns: the machine's speed drifts, and other work shares its cores
            for w, engine in engines.items():
                kv[w].append(kv_bytes_per_step(engine))
                plain[w] += timed_steps(engine, args.steps, None)
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
            f"{statistics.median(plain[w]) * 1e3:.2f} | {floors[w]['step']:.2f}" for w in engines) + " |")
        print("| tok/s, uninstrumented | " + " | ".join(
            f"{concurrency / statistics.median(plain[w]):.1f} | {concurrency / floors[w]['step'] * 1e3:.1f}" for w in engines) + " |")
        del engines


if __name__ == "__main__":
    main()
