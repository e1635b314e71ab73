"""What a refactor must not change: tau, rows per step, accepted drafts per depth and identity with plain decoding of
a fixed set of drafters, greedy, at concurrency 1 and 4, as JSON. Run it on two checkouts and compare the files:
everything but tokens/s must be equal.

    python benchmarks/acceptance_snapshot.py --head eagle=DIR --head eagle3=DIR --head medusa=DIR --head mtp=DIR \
        --out before.json
"""
from __future__ import annotations

import argparse
import json

from serving.bench.offline import run_bench
from serving.bench.prompts import first_turn, load_prompts
from serving.config import EngineConfig
from serving.engine import Engine
from serving.spec_decode.config import SpeculativeConfig
from serving.targets import DEFAULT_TARGET

LOOKUP = {"prompt_lookup_min": 1, "prompt_lookup_max": 3}  # pinned: the defaults have since moved to vLLM's


def drafters(heads: dict[str, str]) -> list[dict]:
    """Prompt lookup, early exit, and per head one setting of those the engine has: a tree, a chain, lookup first."""
    configs = [{"method": "ngram", "num_speculative_tokens": 4, **LOOKUP},
               {"method": "early_exit", "num_layers": 12, "num_speculative_tokens": 3}]
    settings = {"eagle": {"num_speculative_tokens": 4, "topk": 4, "num_draft_tokens": 10},
                "eagle3": {"num_speculative_tokens": 4, "prompt_lookup_first": True, **LOOKUP},
                "medusa": {"num_speculative_tokens": 3, "topk": 2, "num_draft_tokens": 6},
                "mtp": {"num_speculative_tokens": 3, "prompt_lookup_first": True, **LOOKUP}}
    return configs + [{"method": kind, "model": folder, **settings[kind]} for kind, folder in heads.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--head", action="append", default=[], metavar="KIND=DIR",
                        help="a head folder of kind eagle, eagle3, medusa or mtp for the target")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--out", required=True, metavar="FILE")
    args = parser.parse_args()
    heads = dict(item.split("=", 1) for item in args.head)
    engine = Engine(EngineConfig(args.target, max_num_seqs=4))
    configs = [SpeculativeConfig.from_json(c) for c in drafters(heads)]
    prompts = ([first_turn(m) for m in load_prompts("mt-bench", 2)["messages"]]
               + [first_turn(m) for m in load_prompts("humaneval", 2)["messages"]])
    snapshot = {}
    for concurrency in (1, 4):
        result = run_bench(engine, prompts, ["all"] * len(prompts), configs, args.max_new_tokens, concurrency)
        for row in result["rows"]:
            snapshot[f"c{concurrency} {row['method']}"] = {
                "tau": round(row["tau"], 6), "rows_per_step": round(row["rows_per_step"], 6),
                "identical": row["identical_to_plain"], "num_tokens": row["num_tokens"],
                "accepted_per_depth": [p["accepted"] for p in row["per_position"]],
                "tokens_per_s": round(row["tokens_per_s"], 1)}
    with open(args.out, "w") as f:
        json.dump(snapshot, f, indent=1)
    print(json.dumps(snapshot, indent=1))


if __name__ == "__main__":
    main()
