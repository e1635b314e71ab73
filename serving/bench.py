"""`draftheads bench`: plain decoding and each speculative config side by side on the same prompts,
in one run, with transformers' `generate` as an optional baseline.

Every row reports tokens/s and, for speculative rows, tau, the acceptance rate, per-position acceptance,
speedup over plain decoding in the same run, and whether greedy outputs are identical to plain decoding.
"""
from __future__ import annotations

import json
import resource
import time

import torch

from serving.request import SamplingParams
from serving.spec.config import SpeculativeConfig
from serving.spec.metrics import AcceptanceStats


def add_arguments(parser) -> None:
    from serving.targets import DEFAULT_TARGET

    parser.add_argument("--target", default=DEFAULT_TARGET, help="target name or folder (see `draftheads info`)")
    parser.add_argument("--prompts", default="mt-bench", help="prompt source: mt-bench, humaneval, sharegpt-heldout, or a JSONL file")
    parser.add_argument("--num-prompts", type=int, default=8, help="first N prompts of the source (first turns)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt")
    parser.add_argument("--concurrency", type=int, default=1, help="requests in flight at once")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy; > 0 samples (exact rejection sampling)")
    parser.add_argument("--seed", type=int, default=0, help="per-request seeds are seed + index")
    parser.add_argument("--speculative-config", action="append", default=[], metavar="JSON",
                        help='a speculative config, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'; repeat for more rows')
    parser.add_argument("--baseline", choices=["hf"], default=None, help="also time transformers' generate on the same prompts")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="weights and activations; greedy outputs equal plain decoding's only in float32 (bfloat16 "
                             "operators are not batch-invariant, so near-ties can flip between a decode and a verify step)")
    parser.add_argument("--block-size", type=int, default=16, help="K/V block size in tokens")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")


def run(args) -> None:
    from serving.engine import Engine
    from serving.prompts import first_turn, load_prompts

    for option in ("num_prompts", "max_new_tokens", "concurrency"):
        if getattr(args, option) < 1:
            raise ValueError(f"--{option.replace('_', '-')}={getattr(args, option)} must be >= 1")
    configs = [SpeculativeConfig.from_json(text) for text in args.speculative_config]
    dataset = load_prompts(args.prompts, args.num_prompts)
    messages = [first_turn(m) for m in dataset["messages"]]
    engine = Engine(args.target, dtype=args.dtype, block_size=args.block_size, max_num_seqs=args.concurrency)
    result = run_bench(engine, messages, list(dataset["category"]), configs, args.max_new_tokens, args.concurrency,
                       args.temperature, args.seed, baseline=args.baseline, progress=True)
    print(to_markdown(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")


def run_bench(engine, prompts, categories, configs, max_new_tokens, concurrency, temperature=0.0, seed=0,
              baseline=None, progress=False) -> dict:
    """Plain decoding, each speculative config and (baseline="hf") transformers' generate take turns on each group
    of `concurrency` prompts, so that drift in the machine's speed hits every method alike. `progress` shows a bar
    over the prompts, each counted once every method has answered it."""
    from tqdm.auto import tqdm

    params = [SamplingParams(max_tokens=max_new_tokens, temperature=temperature, seed=seed + i) for i in range(len(prompts))]
    engine.scheduler.max_num_seqs = concurrency
    methods = [None, *configs]
    warm_up = engine.encode(prompts[0])[:32]
    for config in methods:  # loads every drafter (a bad head fails here, before any timing) and warms it up
        engine.set_speculative_config(config)
        engine.generate([warm_up], SamplingParams(max_tokens=4))
    seconds, outputs = [0.0] * len(methods), [[] for _ in methods]
    hf = HfGenerate(engine) if baseline == "hf" else None
    bar = tqdm(total=len(prompts), disable=not progress, unit="prompt",
               desc=f"plain + {len(configs)} drafters" + (" + generate" if hf else ""))
    for first in range(0, len(prompts), concurrency):
        group = slice(first, first + concurrency)
        for m, config in enumerate(methods):
            engine.set_speculative_config(config)
            start = time.perf_counter()
            outputs[m] += engine.generate(prompts[group], params[group])
            seconds[m] += time.perf_counter() - start
        if hf:
            hf.generate(prompts[group], max_new_tokens)
        bar.update(len(prompts[group]))
    bar.close()
    engine.set_speculative_config(None)
    rows, plain_outputs = [], outputs[0]
    for config, elapsed, method_outputs in zip(methods, seconds, outputs):
        num_tokens = sum(len(o.token_ids) for o in method_outputs)
        row = {"method": config.label() if config else "plain",
               "num_speculative_tokens": config.num_speculative_tokens if config else 0,
               "config": config.__dict__ if config else None,
               "tokens_per_s": num_tokens / elapsed, "num_tokens": num_tokens, "seconds": elapsed}
        if config is None:
            plain_rate = row["tokens_per_s"]
            row.update(tau=1.0, acceptance_rate=None, per_position=[], speedup=1.0, identical_to_plain=True)
        else:
            stats, per_category = AcceptanceStats(), {}
            for output, category in zip(method_outputs, categories):
                spec = output.metrics.get("spec")
                request_stats = AcceptanceStats.from_dict(spec) if spec else AcceptanceStats()
                stats.merge(request_stats)
                per_category.setdefault(category, AcceptanceStats()).merge(request_stats)
            summary = stats.to_dict()
            row.update(tau=summary["tau"], acceptance_rate=summary["acceptance_rate"], per_position=summary["per_position"],
                       speedup=row["tokens_per_s"] / plain_rate,
                       identical_to_plain=all(a.token_ids == b.token_ids for a, b in zip(method_outputs, plain_outputs)),
                       per_category={c: {"tau": s.tau, "acceptance_rate": s.acceptance_rate} for c, s in sorted(per_category.items())})
            if temperature > 0:
                row["identical_to_plain"] = None  # sampled outputs agree in law, not token by token
        rows.append(row)
    result = {"target": str(engine.folder), "num_prompts": len(prompts), "max_new_tokens": max_new_tokens,
              "concurrency": concurrency, "temperature": temperature, "dtype": str(engine.dtype).replace("torch.", ""),
              "threads": torch.get_num_threads(), "rows": rows}
    if hf:
        hf_rate = hf.num_tokens / hf.seconds
        result["hf_tokens_per_s"] = hf_rate
        result["speed_vs_hf"] = rows[0]["tokens_per_s"] / hf_rate
        result["identical_to_hf"] = all(a.token_ids == b for a, b in zip(plain_outputs, hf.outputs)) if temperature == 0 else None
        for row in rows:
            row["speed_vs_hf"] = row["tokens_per_s"] / hf_rate
    result.update(bandwidth_floor(engine, rows[0]))
    result["peak_memory_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return result


class HfGenerate:
    """transformers' generate on the engine's target, greedy, one static batch per call with left padding."""

    def __init__(self, engine):
        from transformers import AutoModelForCausalLM

        self.engine = engine
        self.model = AutoModelForCausalLM.from_pretrained(engine.folder, dtype=engine.dtype).eval()
        self.pad = engine.tokenizer.pad_token_id if engine.tokenizer.pad_token_id is not None else 0
        self.seconds, self.num_tokens, self.outputs = 0.0, 0, []
        with torch.inference_mode():  # warm-up
            self.model.generate(torch.tensor([[self.pad, self.pad]]), max_new_tokens=2, do_sample=False, pad_token_id=self.pad)

    @torch.inference_mode()
    def generate(self, prompts, max_new_tokens) -> None:
        encoded = [self.engine.encode(p) for p in prompts]
        eos = self.engine.model.config.eos_token_ids
        width = max(map(len, encoded))
        ids = torch.tensor([[self.pad] * (width - len(c)) + c for c in encoded])
        mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in encoded])
        start = time.perf_counter()
        out = self.model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=self.pad)
        self.seconds += time.perf_counter() - start
        for row in out[:, width:].tolist():
            cut = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
            self.outputs.append(row[:cut])
            self.num_tokens += cut


def bandwidth_floor(engine, plain_row) -> dict:
    """Bytes of weights read per decode step over the measured copy bandwidth: the fastest a step can be."""
    read = [engine.model.layers, engine.model.norm, engine.model.logits_head]  # of the embedding, one row per token
    tensors = {id(t): t for module in read for t in [*module.parameters(), *module.buffers()]}
    weight_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    source = torch.empty(64 * 2**20, dtype=torch.float32)
    target = torch.empty_like(source)
    target.copy_(source)
    start = time.perf_counter()
    for _ in range(5):
        target.copy_(source)
    bandwidth = 5 * 2 * source.numel() * 4 / (time.perf_counter() - start)  # read + write
    floor_s = weight_bytes / bandwidth
    return {"weight_bytes": weight_bytes, "copy_bandwidth_gbs": bandwidth / 1e9, "step_floor_ms": floor_s * 1e3,
            "plain_step_ms": 1e3 / plain_row["tokens_per_s"] if plain_row["tokens_per_s"] else None}


def to_markdown(result: dict) -> str:
    has_hf = "hf_tokens_per_s" in result
    lines = [f"target {result['target']} | {result['num_prompts']} prompts x {result['max_new_tokens']} tokens | "
             f"concurrency {result['concurrency']} | temperature {result['temperature']} | {result['dtype']}, "
             f"{result['threads']} threads", "",
             "| method | k | tau | accept rate | per-position conditional | tokens/s | speedup |"
             + (" vs generate |" if has_hf else "") + " identical |",
             "|---|---|---|---|---|---|---|" + ("---|" if has_hf else "") + "---|"]
    for row in result["rows"]:
        conditional = " ".join(f"{p['conditional']:.2f}" for p in row["per_position"]) or "-"
        rate = "-" if row["acceptance_rate"] is None else f"{row['acceptance_rate']:.2f}"
        identical = {True: "yes", False: "NO", None: "n/a"}[row["identical_to_plain"]]
        vs_hf = f" {row['speed_vs_hf']:.2f}x |" if has_hf else ""
        lines.append(f"| {row['method']} | {row['num_speculative_tokens'] or '-'} | {row['tau']:.2f} | {rate} | "
                     f"{conditional} | {row['tokens_per_s']:.1f} | {row['speedup']:.2f}x |{vs_hf} {identical} |")
    if has_hf:
        lines += ["", f"transformers generate: {result['hf_tokens_per_s']:.1f} tokens/s; engine plain / transformers = "
                  f"{result['speed_vs_hf']:.2f}x; identical to transformers: {result['identical_to_hf']}"]
    lines += ["", f"bandwidth floor: {result['weight_bytes'] / 1e6:.0f} MB of weights at {result['copy_bandwidth_gbs']:.1f} GB/s "
              f"= {result['step_floor_ms']:.1f} ms per step; plain decoding takes {result['plain_step_ms']:.1f} ms per token "
              f"per sequence; peak memory {result['peak_memory_gib']:.2f} GiB"]
    return "\n".join(lines)
