"""benchmarks/block_verification.py: its standard errors are the spread of what they estimate, and a run's rows carry
both rules' taus and the paired estimate, which is 0 for a drafter whose drafts are deterministic (a draft model
drafting greedily, q one-hot: both rules accept a prefix with its probability under the target) and positive for one
that samples."""
from __future__ import annotations

import json
import math
import random

from benchmarks.block_verification import main, ratio


def test_the_ratios_standard_error_is_its_spread_over_replications():
    """Requests of 20 to 60 steps, each with a tau of its own (heterogeneous, as prompts are), per-step counts
    1 + binomial: the standard error `ratio` states is, on average, the standard deviation of the ratio over 2,000
    replications (within 10%), and far above what independent steps would give."""
    draw = random.Random(0)

    def replication():
        numerators, denominators = [], []
        for _ in range(30):
            steps, rate = draw.randint(20, 60), draw.uniform(0.1, 0.6)
            numerators.append(sum(1 + sum(draw.random() < rate for _ in range(4)) for _ in range(steps)))
            denominators.append(steps)
        return ratio(numerators, denominators)

    values, errors = zip(*(replication() for _ in range(2_000)))
    mean = sum(values) / len(values)
    spread = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    stated = sum(errors) / len(errors)
    assert abs(stated / spread - 1) < 0.1, (stated, spread)
    assert math.isnan(ratio([3.0], [2.0])[1]) and ratio([3.0], [2.0])[0] == 1.5


def test_a_run_reports_both_rules_and_the_paired_gap(tmp_path):
    path = tmp_path / "rows.json"
    main(["--target", "debug", "--num-prompts", "4", "--max-new-tokens", "12", "--temperature", "1.0",
          "--concurrency", "2", "--json", str(path),
          "--drafter", json.dumps({"method": "draft_model", "model": "debug", "num_speculative_tokens": 3}),
          "--drafter", json.dumps({"method": "draft_model", "model": "debug", "draft_temperature": 2.0,
                                   "num_speculative_tokens": 3})])
    greedy, sampling = json.loads(path.read_text())
    assert greedy["drafter"] == "draft_model" and sampling["drafter"] == "draft_model draft T2"
    for row in (greedy, sampling):
        assert row["temperature"] == 1.0 and row["tokens_standard"] == row["tokens_block"] == 4 * 12
        for rule in ("standard", "block"):
            assert 1 <= row[f"tau_{rule}"] <= 4 and row[f"tau_{rule}_se"] >= 0 and row[f"speedup_{rule}"] > 0
            assert row[f"steps_{rule}"] * row[f"tau_{rule}"] <= 4 * 12 + 1e-9
        assert math.isclose(row["difference"], row["tau_block"] - row["tau_standard"])
    assert greedy["chain_steps_standard"] > 0 and greedy["chain_steps_block"] > 0
    assert abs(greedy["paired"]) < 1e-6, "greedy drafts, q one-hot: both rules expect the same from every chain"
    assert sampling["paired"] > 0, "q spread out: block verification expects more from the same chains"
