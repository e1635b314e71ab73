"""Self-distillation throughput on the default target (float32), on the first turns of ShareGPT prompts:

1. `draftheads generate` (answers, hidden states "last" and "eagle3", shards written) in answer tokens/s at
   each concurrency;
2. one pass against two: the engine generating while it captures hidden states, against the engine generating
   without capture followed by a separate teacher-forced capture pass over the final token ids (prefill only,
   as a two-stage pipeline would run it), in wall time on the same prompts. Engine loads are not timed.

    .venv/bin/python -m benchmarks.generate          # 32 prompts, 32 new tokens: a few minutes
    .venv/bin/python -m benchmarks.generate --num-prompts 4 --max-new-tokens 4 --concurrency 1,2   # smoke run
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from serving.config import EngineConfig
from serving.engine import Engine
from serving.bench.prompts import first_turn, load_prompts
from serving.request import SamplingParams
from serving.targets import DEFAULT_TARGET, fingerprint, resolve
from training.data.generate import GenerateConfig, default_aux_layers, generate


def short_prompts(num_prompts: int, max_prompt_tokens: int) -> list[dict]:
    """The first `num_prompts` ShareGPT conversations whose first turn renders to at most max_prompt_tokens."""
    tokenizer = AutoTokenizer.from_pretrained(resolve(DEFAULT_TARGET))
    chosen = []
    for row in load_prompts("sharegpt"):
        messages = first_turn(row["messages"])
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if len(tokenizer.encode(text, add_special_tokens=False)) <= max_prompt_tokens:
            chosen.append({"id": row["id"], "messages": messages})
            if len(chosen) == num_prompts:
                return chosen
    raise ValueError(f"ShareGPT has only {len(chosen)} prompts of at most {max_prompt_tokens} tokens")


def timed(engine: Engine, prompts: list, params: SamplingParams) -> tuple[list, float]:
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    return outputs, time.perf_counter() - start


def one_pass_vs_two(prompts: list[dict], concurrency: int, max_new_tokens: int) -> dict:
    aux_layers = default_aux_layers(fingerprint(resolve(DEFAULT_TARGET))["num_layers"])
    settings = dict(max_num_seqs=concurrency, kv_cache_memory_gib=0.5)
    plain = Engine(EngineConfig(DEFAULT_TARGET, **settings))
    capturing = Engine(EngineConfig(DEFAULT_TARGET, capture_hidden=True, aux_layers=aux_layers, **settings))
    for engine in (plain, capturing):  # first calls pick kernels and touch the K/V pool
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    params = SamplingParams(max_tokens=max_new_tokens)
    messages = [p["messages"] for p in prompts]
    answers, generate_s = timed(plain, messages, params)
    final_ids = [a.prompt_token_ids + a.token_ids for a in answers]
    # One more token per request: the engine's smallest request. Its hidden states past the final ids are unused.
    _, capture_s = timed(capturing, final_ids, SamplingParams(max_tokens=1))
    captured, one_pass_s = timed(capturing, messages, params)
    if [c.token_ids for c in captured] != [a.token_ids for a in answers]:
        print("note: greedy answers differ with and without capture (float rounding under another batch shape)")
    return {"generate_s": generate_s, "capture_s": capture_s, "one_pass_s": one_pass_s,
            "num_tokens": sum(len(a.token_ids) for a in answers)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--max-prompt-tokens", type=int, default=256, help="skip longer ShareGPT prompts")
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrencies for the generate runs")
    parser.add_argument("--two-pass-concurrency", type=int, default=8)
    parser.add_argument("--num-threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)

    prompts = short_prompts(args.num_prompts, args.max_prompt_tokens)
    results = {"num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "generate": {}}
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "prompts.jsonl"
        source.write_text("".join(json.dumps(p) + "\n" for p in prompts))
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            summary = generate(GenerateConfig(prompts=str(source), out=f"{folder}/store-{concurrency}",
                                              max_new_tokens=args.max_new_tokens, concurrency=concurrency), progress=False)
            results["generate"][concurrency] = {key: summary[key] for key in
                                                ("num_new_answer_tokens", "elapsed_s", "answer_tokens_per_s")}
    results["passes"] = one_pass_vs_two(prompts, args.two_pass_concurrency, args.max_new_tokens)

    print(f"\n{len(prompts)} ShareGPT first turns (<= {args.max_prompt_tokens} prompt tokens), "
          f"{args.max_new_tokens} new tokens max, {DEFAULT_TARGET} float32, layers last+eagle3\n")
    print(f"{'generate, concurrency':<34}{'answer tokens':>14}{'wall s':>9}{'tok/s':>9}")
    for concurrency, row in results["generate"].items():
        print(f"{concurrency:<34}{row['num_new_answer_tokens']:>14}{row['elapsed_s']:>9.1f}{row['answer_tokens_per_s']:>9.1f}")
    p = results["passes"]
    two_pass_s = p["generate_s"] + p["capture_s"]
    print(f"\n{'engine, concurrency ' + str(args.two_pass_concurrency):<34}{'wall s':>9}{'tok/s':>9}")
    for name, seconds in (("generate, no capture", p["generate_s"]), ("teacher-forced capture pass", p["capture_s"]),
                          ("two passes", two_pass_s), ("one pass (generate with capture)", p["one_pass_s"])):
        print(f"{name:<34}{seconds:>9.1f}{p['num_tokens'] / seconds:>9.1f}")
    print(f"\ntwo passes / one pass: {two_pass_s / p['one_pass_s']:.2f}x wall time; "
          f"capture costs {p['one_pass_s'] / p['generate_s']:.2f}x plain generation")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
