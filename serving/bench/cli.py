"""`draftheads bench`: plain decoding and each speculative config side by side on the same prompts,
in one run, with transformers' `generate` as an optional baseline; in each setting of temperature and concurrency
asked for (`serving.bench.sweep`), with one report over them all (`serving.bench.report`).

Every row reports tokens/s and, for speculative rows, tau, the acceptance rate, rows verified per step, per-depth acceptance,
speedup over plain decoding in the same run, and whether greedy outputs are identical to plain decoding.
"""
from __future__ import annotations

import json
import resource
import time
from dataclasses import dataclass, field, fields

import torch

from heads.config import is_positive_int
from serving.config import HELP as ENGINE_HELP, WEIGHTS, EngineConfig
from serving.config_file import add_options, merge_options
from serving.request import SamplingParams
from serving.spec_decode.config import SpeculativeConfig
from serving.targets import DEFAULT_TARGET


HELP = {
    "config": "YAML file whose keys are these options' names (configs/bench.yaml); options given on the command "
              "line override it, --speculative-config its whole list",
    "target": ENGINE_HELP["target"],
    "prompts": "prompt source: mt-bench (one question per category in turn), humaneval, humaneval-repeat (each problem "
               "twice: serving/bench/prompts.py), sharegpt-heldout, or a JSONL file",
    "num_prompts": "first N prompts of the source (first turns)",
    "max_new_tokens": "tokens generated per prompt",
    "concurrency": "requests in flight at once; several (--concurrency 1 4 16) run a setting each",
    "temperature": "0 is greedy; > 0 samples (exact rejection sampling); several (--temperature 0 0.7) run every "
                   "concurrency at each",
    "seed": "per-request seeds are seed + index",
    "speculative_config": 'a speculative config, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'; repeat for more rows',
    "baseline": "hf also times transformers' generate on the same prompts",
    "structured_outputs": "constrain every answer (plain decoding's too), as vLLM's structured_outputs: JSON with one "
                          "of json (a schema), json_object, regex, choice, grammar, e.g. '{\"json\": {\"type\": "
                          "\"object\"}}'",
    "dtype": ENGINE_HELP["dtype"],
    "weights": ENGINE_HELP["weights"],
    "block_size": ENGINE_HELP["block_size"],
    "device": ENGINE_HELP["device"],
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
    structured_outputs: dict | str | None = None  # vLLM's fields, or their JSON text
    dtype: str = "float32"
    weights: str = "float32"
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
            if not is_positive_int(value):
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
        if isinstance(self.structured_outputs, str):
            try:
                self.structured_outputs = json.loads(self.structured_outputs)
            except json.JSONDecodeError as error:
                raise ValueError(f"structured_outputs is not valid JSON ({error}): {self.structured_outputs!r}") from None
        if self.structured_outputs is not None:
            SamplingParams(structured_outputs=self.structured_outputs)  # a bad schema or grammar fails here
        self.engine_config()  # a bad device or weights fails before the prompts load

    def engine_config(self, max_num_seqs: int = 64) -> EngineConfig:
        return EngineConfig(self.target, dtype=self.dtype, weights=self.weights, block_size=self.block_size,
                            max_num_seqs=max_num_seqs, device=self.device)


def add_arguments(parser) -> None:
    types = {"num_prompts": int, "max_new_tokens": int, "concurrency": int, "temperature": float, "seed": int,
             "block_size": int}
    add_options(parser, BenchConfig, HELP, types, {
        "config": {"metavar": "FILE"}, "speculative_config": {"action": "append", "metavar": "JSON"},
        "concurrency": {"nargs": "+", "metavar": "N"}, "temperature": {"nargs": "+", "metavar": "T"},
        "baseline": {"choices": ["hf"]}, "dtype": {"choices": DTYPES}, "weights": {"choices": list(WEIGHTS)},
        "structured_outputs": {"metavar": "JSON"}, "json": {"metavar": "PATH"},
        "out": {"metavar": "DIR"}})
    parser.add_argument("--cost-model", action="store_true",
                        help="print the target's step-cost table on this device (what the adaptive policy prices steps "
                             "with: forward time by rows and sequences, from the cache or measured now) and exit")
    parser.add_argument("--remeasure", action="store_true",
                        help="with --cost-model: measure the table again instead of reading the cache")


def run(args) -> None:
    from serving.engine import Engine
    from serving.bench.prompts import first_turn, load_prompts
    from serving.bench.report import summary_markdown, write_report
    from serving.bench.sweep import Setting, run_settings

    options = vars(args)
    show_cost_model, remeasure = options.pop("cost_model", False), options.pop("remeasure", False)
    config = BenchConfig(**merge_options(options, [f.name for f in fields(BenchConfig)]))
    if show_cost_model:
        from serving.spec_decode.cost import load_or_measure

        engine = Engine(config.engine_config())
        print(load_or_measure(engine, remeasure=remeasure).table())
        return
    dataset = load_prompts(config.prompts, config.num_prompts)
    messages = [first_turn(m) for m in dataset["messages"]]
    engine = Engine(config.engine_config(max_num_seqs=max(config.concurrency)))
    settings = [Setting(config.prompts, float(t), c, config.baseline) for t in config.temperature for c in config.concurrency]
    results = run_settings(engine, {config.prompts: (messages, list(dataset["category"]))}, settings,
                           config.speculative_config, config.max_new_tokens, config.seed, out=config.out,
                           structured_outputs=config.structured_outputs)
    if config.out:
        write_report(results, config.out, "bench")
    elif len(results) > 1:
        print("\n" + summary_markdown(results))
    if config.json:
        with open(config.json, "w") as f:
            json.dump(results[0] if len(results) == 1 else results, f, indent=2)
        print(f"wrote {config.json}")
