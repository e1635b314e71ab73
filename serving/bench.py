"""`draftheads bench`: plain decoding and each speculative config side by side on the same prompts,
in one run, with transformers' `generate` as an optional baseline; in each setting of temperature and concurrency
asked for (`serving.sweep`), with one report over them all (`serving.report`).

Every row reports tokens/s and, for speculative rows, tau, the acceptance rate, rows verified per step, per-depth acceptance,
speedup over plain decoding in the same run, and whether greedy outputs are identical to plain decoding.
"""
from __future__ import annotations

import json
import resource
import time
from dataclasses import dataclass, field, fields

import torch

from serving.config_file import add_options, merge_options
from serving.request import SamplingParams
from serving.spec.config import SpeculativeConfig
from serving.spec.metrics import AcceptanceStats
from serving.spec.step import Speculator
from serving.targets import DEFAULT_TARGET


HELP = {
    "config": "YAML file whose keys are these options' names (configs/bench.yaml); options given on the command "
              "line override it, --speculative-config its whole list",
    "target": "target name or folder (see `draftheads info`)",
    "prompts": "prompt source: mt-bench (one question per category in turn), humaneval, sharegpt-heldout, or a JSONL file",
    "num_prompts": "first N prompts of the source (first turns)",
    "max_new_tokens": "tokens generated per prompt",
    "concurrency": "requests in flight at once; several (--concurrency 1 4 16) run a setting each",
    "temperature": "0 is greedy; > 0 samples (exact rejection sampling); several (--temperature 0 0.7) run every "
                   "concurrency at each",
    "seed": "per-request seeds are seed + index",
    "speculative_config": 'a speculative config, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'; repeat for more rows',
    "baseline": "hf also times transformers' generate on the same prompts",
    "dtype": "weights and activations; greedy outputs equal plain decoding's only in float32 (bfloat16 operators are "
             "not batch-invariant, so near-ties can flip between a decode and a verify step)",
    "block_size": "K/V block size in tokens",
    "device": "where the target runs: auto (the first CUDA GPU when torch sees one, else the CPU), cpu, cuda or cuda:N",
    "json": "also write the results as JSON to this path (a list of them for several settings)",
    "out": "write bench.json, bench.md, acceptance.png, summary.json (every setting and method: tau, speedup over "
           "plain in that setting, rows/step, identical, tokens/s), summary.md and speedup_vs_concurrency.png to DIR and "
           "log them to an offline wandb run there (WANDB_MODE=online syncs); each setting's result is kept in "
           "DIR/settings/ as it ends, and a rerun with the same options reuses it (delete the file to measure again)",
}
BASELINES, DTYPES = (None, "hf"), ("float32", "bfloat16")


@dataclass
class BenchConfig:
    target: str = DEFAULT_TARGET
    prompts: str = "mt-bench"
    num_prompts: int = 8
    max_new_tokens: int = 128
    concurrency: int | list[int] = 1  # one or several; a list after __post_init__
    temperature: float | list[float] = 0.0  # likewise: every temperature runs every concurrency
    seed: int = 0
    speculative_config: list = field(default_factory=list)  # SpeculativeConfig, or its JSON text or mapping
    baseline: str | None = None
    dtype: str = "float32"
    block_size: int = 16
    device: str = "auto"
    json: str | None = None
    out: str | None = None

    def __post_init__(self):
        self.concurrency = self.concurrency if isinstance(self.concurrency, list) else [self.concurrency]
        self.temperature = self.temperature if isinstance(self.temperature, list) else [self.temperature]
        for name, values in (("concurrency", self.concurrency), ("temperature", self.temperature)):
            if not values:
                raise ValueError(f"{name}=[] is invalid: give one value or several")
        for name, value in [("num_prompts", self.num_prompts), ("max_new_tokens", self.max_new_tokens),
                            *(("concurrency", c) for c in self.concurrency), ("block_size", self.block_size)]:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid: it must be an integer >= 1")
        if self.baseline not in BASELINES:
            raise ValueError(f"baseline={self.baseline!r} is invalid: choose hf, or leave it out for none")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is invalid: choose {' or '.join(DTYPES)}")
        if not isinstance(self.speculative_config, list):
            raise ValueError(f"speculative_config={self.speculative_config!r} is invalid: give a list of speculative "
                             "configs, each a mapping or its JSON text")
        self.speculative_config = [c if isinstance(c, SpeculativeConfig) else SpeculativeConfig.from_json(c)
                                   for c in self.speculative_config]
        for temperature in self.temperature:
            SamplingParams(max_tokens=self.max_new_tokens, temperature=temperature, seed=self.seed)
        from serving.engine import resolve_device

        resolve_device(self.device)  # a bad device fails before the prompts load


def add_arguments(parser) -> None:
    types = {"num_prompts": int, "max_new_tokens": int, "concurrency": int, "temperature": float, "seed": int,
             "block_size": int}
    add_options(parser, BenchConfig, HELP, types, {
        "config": {"metavar": "FILE"}, "speculative_config": {"action": "append", "metavar": "JSON"},
        "concurrency": {"nargs": "+", "metavar": "N"}, "temperature": {"nargs": "+", "metavar": "T"},
        "baseline": {"choices": ["hf"]}, "dtype": {"choices": DTYPES}, "json": {"metavar": "PATH"},
        "out": {"metavar": "DIR"}})
    parser.add_argument("--cost-model", action="store_true",
                        help="print the target's step-cost table on this device (what the adaptive policy prices steps "
                             "with: forward time by rows and sequences, from the cache or measured now) and exit")
    parser.add_argument("--remeasure", action="store_true",
                        help="with --cost-model: measure the table again instead of reading the cache")


def run(args) -> None:
    from serving.engine import Engine
    from serving.prompts import first_turn, load_prompts
    from serving.report import summary_markdown, write_report
    from serving.sweep import Setting, run_settings

    options = vars(args)
    show_cost_model, remeasure = options.pop("cost_model", False), options.pop("remeasure", False)
    config = BenchConfig(**merge_options(options, [f.name for f in fields(BenchConfig)]))
    if show_cost_model:
        from serving.spec.cost import load_or_measure

        engine = Engine(config.target, dtype=config.dtype, block_size=config.block_size, device=config.device)
        print(load_or_measure(engine, remeasure=remeasure).table())
        return
    dataset = load_prompts(config.prompts, config.num_prompts)
    messages = [first_turn(m) for m in dataset["messages"]]
    engine = Engine(config.target, dtype=config.dtype, block_size=config.block_size,
                    max_num_seqs=max(config.concurrency), device=config.device)
    settings = [Setting(config.prompts, float(t), c, config.baseline) for t in config.temperature for c in config.concurrency]
    results = run_settings(engine, {config.prompts: (messages, list(dataset["category"]))}, settings,
                           config.speculative_config, config.max_new_tokens, config.seed, out=config.out)
    if config.out:
        write_report(results, config.out, "bench")
    elif len(results) > 1:
        print("\n" + summary_markdown(results))
    if config.json:
        with open(config.json, "w") as f:
            json.dump(results[0] if len(results) == 1 else results, f, indent=2)
        print(f"wrote {config.json}")


def run_bench(engine, prompts, categories, configs, max_new_tokens, concurrency, temperature=0.0, seed=0,
              baseline=None, progress=False) -> dict:
    """Plain decoding, each speculative config and (baseline="hf") transformers' generate take turns on each group
    of `concurrency` prompts, the turn's first method one further each group, so that drift in the machine's speed
    hits every method alike. `progress` shows a bar over the prompts, each counted once every method has answered
    it."""
    from tqdm.auto import tqdm

    params = [SamplingParams(max_tokens=max_new_tokens, temperature=temperature, seed=seed + i) for i in range(len(prompts))]
    engine.scheduler.max_num_seqs = concurrency
    methods = [None, *configs]
    # Each drafter is loaded once, before any timing (a bad head fails here), and warmed up.
    speculators = [Speculator(engine, config) if config else None for config in methods]
    warm_up = engine.encode(prompts[0])[:32]
    for speculator in speculators:
        engine.use_speculator(speculator)
        engine.generate([warm_up], SamplingParams(max_tokens=4))
    seconds, outputs = [0.0] * len(methods), [[] for _ in methods]
    hf = HfGenerate(engine) if baseline == "hf" else None
    bar = tqdm(total=len(prompts), disable=not progress, unit="prompt",
               desc=f"plain + {len(configs)} drafters" + (" + generate" if hf else ""))
    for first in range(0, len(prompts), concurrency):
        group = slice(first, first + concurrency)
        turn = first // concurrency % len(methods)
        for m in [*range(turn, len(methods)), *range(turn)]:
            engine.use_speculator(speculators[m])
            start = time.perf_counter()
            outputs[m] += engine.generate(prompts[group], params[group])
            seconds[m] += time.perf_counter() - start
        if hf:
            hf.generate(prompts[group], max_new_tokens)
        bar.update(len(prompts[group]))
    bar.close()
    engine.use_speculator(None)
    rows, plain_outputs = [], outputs[0]
    for config, speculator, elapsed, method_outputs in zip(methods, speculators, seconds, outputs):
        num_tokens = sum(len(o.token_ids) for o in method_outputs)
        row = {"method": config.label() if config else "plain",
               "num_speculative_tokens": config.num_speculative_tokens if config else 0,
               "config": config.__dict__ if config else None,
               "tokens_per_s": num_tokens / elapsed, "num_tokens": num_tokens, "seconds": elapsed}
        if config is None:
            plain_rate = row["tokens_per_s"]
            row.update(tau=1.0, acceptance_rate=None, rows_per_step=1.0, per_position=[], speedup=1.0,
                       identical_to_plain=True)
        else:
            stats, per_category = AcceptanceStats(), {}
            for output, category in zip(method_outputs, categories):
                spec = output.metrics.get("spec")
                request_stats = AcceptanceStats.from_dict(spec) if spec else AcceptanceStats()
                stats.merge(request_stats)
                per_category.setdefault(category, AcceptanceStats()).merge(request_stats)
            summary = stats.to_dict()
            row.update(tau=summary["tau"], acceptance_rate=summary["acceptance_rate"], rows_per_step=summary["rows_per_step"],
                       per_position=summary["per_position"],
                       speedup=row["tokens_per_s"] / plain_rate,
                       identical_to_plain=all(a.token_ids == b.token_ids for a, b in zip(method_outputs, plain_outputs)),
                       per_category={c: {"tau": s.tau, "acceptance_rate": s.acceptance_rate} for c, s in sorted(per_category.items())})
        if temperature > 0:
            row["identical_to_plain"] = None  # sampled outputs agree in law, not token by token
        if speculator is not None and speculator.policy:
            row["adaptive"] = speculator.policy.summary()
        if speculator is not None:
            row.update(speculator.drafter.summary())  # lookahead: its pool's hit rate
        rows.append(row)
    result = {"target": str(engine.folder), "num_prompts": len(prompts), "max_new_tokens": max_new_tokens,
              "concurrency": concurrency, "temperature": temperature, "dtype": str(engine.dtype).replace("torch.", ""),
              "device": str(engine.device), "threads": torch.get_num_threads(), "rows": rows}
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
        self.model = AutoModelForCausalLM.from_pretrained(engine.folder, dtype=engine.dtype).to(engine.device).eval()
        self.pad = engine.tokenizer.pad_token_id if engine.tokenizer.pad_token_id is not None else 0
        self.seconds, self.num_tokens, self.outputs = 0.0, 0, []
        with torch.inference_mode():  # warm-up
            self.model.generate(torch.tensor([[self.pad, self.pad]], device=engine.device), max_new_tokens=2,
                                do_sample=False, pad_token_id=self.pad)

    @torch.inference_mode()
    def generate(self, prompts, max_new_tokens) -> None:
        encoded = [self.engine.encode(p) for p in prompts]
        eos = self.engine.model.config.eos_token_ids
        width = max(map(len, encoded))
        device = self.engine.device
        ids = torch.tensor([[self.pad] * (width - len(c)) + c for c in encoded], device=device)
        mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in encoded], device=device)
        start = time.perf_counter()
        out = self.model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=self.pad)
        out = out.cpu()  # waits for the device, so that the time is the work's
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
    source = torch.empty(64 * 2**20, dtype=torch.float32, device=engine.device)
    target = torch.empty_like(source)
    target.copy_(source)
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else lambda: None
    sync()
    start = time.perf_counter()
    for _ in range(5):
        target.copy_(source)
    sync()
    bandwidth = 5 * 2 * source.numel() * 4 / (time.perf_counter() - start)  # read + write
    floor_s = weight_bytes / bandwidth
    return {"weight_bytes": weight_bytes, "copy_bandwidth_gbs": bandwidth / 1e9, "step_floor_ms": floor_s * 1e3,
            "plain_step_ms": 1e3 / plain_row["tokens_per_s"] if plain_row["tokens_per_s"] else None}


def to_markdown(result: dict) -> str:
    has_hf = "hf_tokens_per_s" in result
    lines = [f"target {result['target']} | {result['num_prompts']} prompts x {result['max_new_tokens']} tokens | "
             f"concurrency {result['concurrency']} | temperature {result['temperature']} | {result['dtype']} on "
             f"{result.get('device', 'cpu')}, {result['threads']} threads", "",
             "| method | k | tau | accept rate | rows/step | per-depth conditional | tokens/s | speedup |"
             + (" vs generate |" if has_hf else "") + " identical |",
             "|---|---|---|---|---|---|---|---|" + ("---|" if has_hf else "") + "---|"]
    for row in result["rows"]:
        conditional = " ".join(f"{p['conditional']:.2f}" for p in row["per_position"]) or "-"
        rate = "-" if row["acceptance_rate"] is None else f"{row['acceptance_rate']:.2f}"
        identical = {True: "yes", False: "NO", None: "n/a"}[row["identical_to_plain"]]
        vs_hf = f" {row['speed_vs_hf']:.2f}x |" if has_hf else ""
        lines.append(f"| {row['method']} | {row['num_speculative_tokens'] or '-'} | {row['tau']:.2f} | {rate} | "
                     f"{row.get('rows_per_step', 1.0):.2f} | {conditional} | {row['tokens_per_s']:.1f} | {row['speedup']:.2f}x |{vs_hf} {identical} |")
    if has_hf:
        lines += ["", f"transformers generate: {result['hf_tokens_per_s']:.1f} tokens/s; engine plain / transformers = "
                  f"{result['speed_vs_hf']:.2f}x; identical to transformers: {result['identical_to_hf']}"]
    lines += ["", f"bandwidth floor: {result['weight_bytes'] / 1e6:.0f} MB of weights at {result['copy_bandwidth_gbs']:.1f} GB/s "
              f"= {result['step_floor_ms']:.1f} ms per step; plain decoding takes {result['plain_step_ms']:.1f} ms per token "
              f"per sequence; peak memory {result['peak_memory_gib']:.2f} GiB"]
    for row in result["rows"]:
        if "adaptive" in row:
            lines += ["", adaptive_markdown(row["method"], row["adaptive"])]
    return "\n".join(lines)


def adaptive_markdown(method: str, summary: dict) -> str:
    """What an adaptive row chose (depth: share of the choices, per number of running requests) and how far the
    step-cost model's predicted forward times were from the measured ones, per bucket of rows."""
    chosen = "; ".join(f"{n} running: " + " ".join(f"d{d} {c / sum(depths.values()):.0%}" for d, c in depths.items())
                       for n, depths in summary["chosen_depths"].items())
    timing = ", ".join(f"<={b['rows_at_most']} rows {b['predicted_ms']:.1f}/{b['measured_ms']:.1f} ms ({b['error']:+.0%})"
                       for b in summary["step_time"])
    return f"{method}: chose {chosen or 'nothing'}. Forward predicted/measured: {timing}"
