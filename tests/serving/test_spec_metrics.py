"""Acceptance metrics (docs/design.md, "Measuring acceptance"): `AcceptanceStats.record` / `merge` on hand-made
steps, then the real engine driven by stub drafters with a known accept pattern (never, always, the first
two), whose per-request and engine-level counts must equal what the step schedule implies by hand.

The schedule: the prefill emits the first token and is no verify step. Every later step of a request with
`out` output tokens carries d = min(k, max_tokens - out - 1) drafts (d = 0 on the last step), accepts a of
them by the pattern and emits a + 1 tokens. vLLM names: spec_decode_num_drafts counts steps with at least
one draft, spec_decode_num_draft_tokens the drafts, spec_decode_num_accepted_tokens(_per_pos) the accepted.
A chain of d drafts is the tree whose node i hangs off node i - 1 (`DraftTree.chain`); accepting a of them is the
path [0 .. a - 1].
"""
from __future__ import annotations

import pytest

from serving.drafters.base import DraftBudget, Drafter
from serving.config import EngineConfig
from serving.engine import Engine
from serving.request import SamplingParams
from serving.spec_decode.metrics import AcceptanceStats
from serving.spec_decode.tree import DraftTree

from engine_helpers import random_prompts

VOCAB = 256


# ---- AcceptanceStats by hand ----------------------------------------------------------------------------


def record_chain(stats: AcceptanceStats, num_drafts: int, num_accepted: int, num_emitted: int) -> None:
    """One verify step of a chain of `num_drafts` drafts whose first `num_accepted` were accepted."""
    stats.record(DraftTree.chain(range(num_drafts)), list(range(num_accepted)), num_emitted)


def hand_stats() -> AcceptanceStats:
    """Four steps: (drafts, accepted, emitted) = (3, 0, 1), (3, 3, 4), (2, 1, 2), (0, 0, 1)."""
    stats = AcceptanceStats(3)
    record_chain(stats, 3, 0, 1)
    record_chain(stats, 3, 3, 4)
    record_chain(stats, 2, 1, 2)
    record_chain(stats, 0, 0, 1)
    return stats


def test_record_counts_per_position_by_hand():
    stats = hand_stats()
    assert stats.num_steps == 4 and stats.num_emitted == 8 and stats.num_drafts == 3 and stats.num_draft_tokens == 8
    assert stats.proposed == [3, 3, 2]
    # position i is reached when the i - 1 drafts before it were accepted
    assert stats.reached == [3, 2, 1]
    assert stats.accepted == [2, 1, 1]
    assert stats.tau == 2.0
    assert stats.acceptance_rate == 4 / 8
    assert stats.rows_per_step == 1 + 8 / 4
    rows = stats.per_position()
    assert [r["position"] for r in rows] == [1, 2, 3]
    assert [r["conditional"] for r in rows] == pytest.approx([2 / 3, 1 / 2, 1 / 1])
    d = stats.to_dict()
    assert d["tau"] == 2.0 and d["acceptance_rate"] == 0.5 and d["rows_per_step"] == 3.0
    assert d["num_verify_steps"] == 4 and d["num_emitted_tokens"] == 8
    assert d["spec_decode_num_drafts"] == 3
    assert d["spec_decode_num_draft_tokens"] == 8
    assert d["spec_decode_num_accepted_tokens"] == 4
    assert d["spec_decode_num_accepted_tokens_per_pos"] == [2, 1, 1]
    assert d["per_position"] == rows
    # vLLM's mean acceptance length counts drafting steps only: 1 + 4 accepted / 3 drafts, beside tau's 8 / 4
    assert stats.mean_acceptance_length == d["mean_acceptance_length"] == 1 + 4 / 3


def test_survival_is_vllms_per_position_rate(tiny_llama):
    """docs/design.md: survival is `accepted_i / steps`, "vLLM's per-position definition", which vLLM computes as
    spec_decode_num_accepted_tokens_per_pos[i] / spec_decode_num_drafts: over steps that carried drafts. A
    verify step without drafts (nothing proposed, or max_tokens leaves no room) has no position to survive."""
    # the same steps with and without a draft-less one: survival must not change
    without = AcceptanceStats(3)
    for step in ((3, 0, 1), (3, 3, 4), (2, 1, 2)):
        record_chain(without, *step)
    assert [r["survival"] for r in without.per_position()] == pytest.approx([2 / 3, 1 / 3, 1 / 3])
    stats = hand_stats()  # 3 steps with drafts, 1 without
    survival = [r["survival"] for r in stats.per_position()]
    # through the engine: a drafter that is always right survives every position of every drafted step
    engine, (out,) = run(tiny_llama, "always", random_prompts([13], seed=1), [12], 4)  # steps (4,4,5) (4,4,5) (0,0,1)
    engine_survival = [r["survival"] for r in out.metrics["spec"]["per_position"]]
    assert (survival, engine_survival) == (pytest.approx([2 / 3, 1 / 3, 1 / 3]), pytest.approx([1.0] * 4))


def test_record_grows_past_the_configured_positions():
    stats = AcceptanceStats(2)
    record_chain(stats, 4, 2, 3)
    assert stats.proposed == [1, 1, 1, 1] and stats.reached == [1, 1, 1, 0] and stats.accepted == [1, 1, 0, 0]
    record_chain(stats, 1, 1, 2)  # every draft accepted plus a bonus token
    assert stats.proposed == [2, 1, 1, 1] and stats.reached == [2, 1, 1, 0] and stats.accepted == [2, 1, 0, 0]
    assert stats.tau == 2.5 and stats.acceptance_rate == 3 / 5 and stats.num_draft_tokens == 5


def test_tree_nodes_count_as_draft_tokens_and_positions_as_depths():
    """A tree: the acceptance rate is over every verified node (not over depths), positions are depths, and a depth
    is reached only where the accepted path stopped at a node with children."""
    #  root -> 0 (wrong), 1 -> 2 -> 4 ; 1 -> 3 ; 5 (wrong) at depth 1: 6 nodes, depth 3
    tree = DraftTree((10, 11, 12, 13, 14, 15), (-1, -1, 1, 1, 2, -1))
    stats = AcceptanceStats(1)
    stats.record(tree, [1, 2], 3)  # stopped at node 2, whose child 4 was tried and rejected
    assert stats.proposed == [1, 1, 1] and stats.reached == [1, 1, 1] and stats.accepted == [1, 1, 0]
    assert stats.num_draft_tokens == 6 and stats.acceptance_rate == 2 / 6 and stats.rows_per_step == 7.0
    stats.record(tree, [1, 3], 3)  # node 3 is a leaf: depth 3 was not tried
    assert stats.proposed == [2, 2, 2] and stats.reached == [2, 2, 1] and stats.accepted == [2, 2, 0]
    stats.record(tree, [], 1)  # every child of the root rejected
    assert stats.proposed == [3, 3, 3] and stats.reached == [3, 2, 1] and stats.accepted == [2, 2, 0]
    assert stats.num_draft_tokens == 18 and stats.acceptance_rate == 4 / 18 and stats.rows_per_step == 7.0
    assert stats.tau == 7 / 3 and stats.num_drafts == 3
    d = stats.to_dict()
    assert d["spec_decode_num_draft_tokens"] == 18 and d["spec_decode_num_accepted_tokens"] == 4
    assert AcceptanceStats.from_dict(d).to_dict() == d


def test_empty_stats_are_zero_not_errors():
    stats = AcceptanceStats(2)
    assert stats.tau == 0.0 and stats.acceptance_rate == 0.0
    assert stats.per_position() == [
        {"position": 1, "proposed": 0, "reached": 0, "accepted": 0, "conditional": 0.0, "survival": 0.0},
        {"position": 2, "proposed": 0, "reached": 0, "accepted": 0, "conditional": 0.0, "survival": 0.0},
    ]
    assert stats.rows_per_step == 0.0
    record_chain(stats, 0, 0, 1)  # plain decoding: tau 1, nothing proposed
    assert stats.tau == 1.0 and stats.acceptance_rate == 0.0 and stats.num_drafts == 0 and stats.rows_per_step == 1.0
    assert stats.to_dict()["spec_decode_num_accepted_tokens_per_pos"] == [0, 0]


def test_merge_equals_recording_everything_in_one():
    steps_a = [(3, 0, 1), (3, 3, 4), (0, 0, 1)]
    steps_b = [(5, 4, 5), (2, 1, 2), (1, 0, 1)]
    a, b, together = AcceptanceStats(3), AcceptanceStats(5), AcceptanceStats(3)
    for step in steps_a:
        record_chain(a, *step)
        record_chain(together, *step)
    for step in steps_b:
        record_chain(b, *step)
        record_chain(together, *step)
    b_before = b.to_dict()
    a.merge(b)
    assert a.to_dict() == together.to_dict()
    assert len(a.proposed) == 5  # grown to the longer one
    assert b.to_dict() == b_before  # the merged-in stats are untouched
    # merging into a longer one from a shorter one pads the shorter side
    c = AcceptanceStats(5)
    for step in steps_b:
        record_chain(c, *step)
    short = AcceptanceStats(1)
    record_chain(short, 1, 1, 2)
    c.merge(short)
    assert c.proposed == [4, 2, 1, 1, 1] and c.accepted == [3, 1, 1, 1, 0]
    assert c.num_steps == 4 and c.num_emitted == 10 and c.num_drafts == 4 and c.num_draft_tokens == 9


# ---- through the engine with stub drafters ----------------------------------------------------------------


class PatternStub(Drafter):
    """Proposes each request's true plain-greedy continuation, with only the first `num_right` drafts right
    (None: all right) and `extra` drafts past the budget, as a chain; `silent` proposes nothing at all."""

    def __init__(self, truth, num_right=None, extra=0, silent=False):
        self.truth, self.num_right, self.extra, self.silent = truth, num_right, extra, silent
        self.budgets = []

    def propose(self, ctx, requests, budgets):
        proposals = {}
        for r in requests:
            self.budgets.append(budgets[r.request_id])
            if self.silent:
                continue
            truth = self.truth[tuple(r.token_ids[:r.num_prompt_tokens])]
            budget = budgets[r.request_id]
            upcoming = truth[r.num_output_tokens:r.num_output_tokens + min(budget.num_nodes, budget.depth) + self.extra]
            right = len(upcoming) if self.num_right is None else self.num_right
            proposals[r.request_id] = DraftTree.chain(upcoming[:right] + [(t + 1) % VOCAB for t in upcoming[right:]])
        return proposals

    def observe(self, ctx):
        pass


PATTERNS = {
    "never": dict(num_right=0),
    "always": dict(num_right=None),
    "first-two": dict(num_right=2),
    "always-overproposing": dict(num_right=None, extra=3),
    "silent": dict(silent=True),
}


def accepted_by(pattern: str, num_drafts: int) -> int:
    return {"never": 0, "always": num_drafts, "first-two": min(2, num_drafts), "always-overproposing": num_drafts,
            "silent": 0}[pattern]


def schedule(pattern: str, max_tokens: int, k: int) -> list[tuple[int, int, int]]:
    """(drafts, accepted, emitted) of every verify step of one request, by the rules in the module docstring."""
    steps, out = [], 1
    while out < max_tokens:
        d = 0 if pattern == "silent" else min(k, max_tokens - out - 1)
        a = accepted_by(pattern, d)
        steps.append((d, a, a + 1))
        out += a + 1
    return steps


def expected_summary(steps, k) -> dict:
    """The counts and ratios of docs/design.md, from the step list, without AcceptanceStats."""
    proposed = [sum(d > i for d, _, _ in steps) for i in range(k)]
    reached = [sum(d > i and a >= i for d, a, _ in steps) for i in range(k)]
    accepted = [sum(a > i for _, a, _ in steps) for i in range(k)]
    emitted = sum(e for _, _, e in steps)
    return {
        "tau": emitted / len(steps),
        "acceptance_rate": sum(accepted) / sum(proposed) if sum(proposed) else 0.0,
        "rows_per_step": 1 + sum(d for d, _, _ in steps) / len(steps),
        "num_verify_steps": len(steps),
        "num_emitted_tokens": emitted,
        "spec_decode_num_drafts": sum(d > 0 for d, _, _ in steps),
        "spec_decode_num_draft_tokens": sum(d for d, _, _ in steps),
        "spec_decode_num_accepted_tokens": sum(accepted),
        "spec_decode_num_accepted_tokens_per_pos": accepted,
        "proposed": proposed,
        "reached": reached,
        "conditional": [a / r if r else 0.0 for a, r in zip(accepted, reached)],
    }


def observed(spec: dict) -> dict:
    """A metrics["spec"] dict in the shape of `expected_summary` (survival is checked on its own)."""
    rows = spec["per_position"]
    assert [r["position"] for r in rows] == list(range(1, len(rows) + 1))
    assert [r["accepted"] for r in rows] == spec["spec_decode_num_accepted_tokens_per_pos"]
    keys = ("tau", "acceptance_rate", "rows_per_step", "num_verify_steps", "num_emitted_tokens", "spec_decode_num_drafts",
            "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos")
    summary = {key: spec[key] for key in keys}
    summary.update(proposed=[r["proposed"] for r in rows], reached=[r["reached"] for r in rows],
                   conditional=[r["conditional"] for r in rows])
    return summary


def assert_summary(actual: dict, expected: dict):
    assert set(actual) == set(expected)
    for key, value in expected.items():
        assert actual[key] == pytest.approx(value), key


def run(folder, pattern, prompts, max_tokens, k, block_size=16):
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    plain = Engine(EngineConfig(str(folder), block_size=16, num_blocks=256, max_model_len=256)).generate(prompts, params)
    truth = {tuple(p): o.token_ids for p, o in zip(prompts, plain)}
    engine = Engine(EngineConfig(str(folder), block_size=block_size, num_blocks=-(-4096 // block_size), max_model_len=256,
                    speculative_config={"method": "ngram", "num_speculative_tokens": k}))
    engine.speculator.drafter = PatternStub(truth, **PATTERNS[pattern])
    outputs = engine.generate(prompts, params)
    for out, ref in zip(outputs, plain):
        assert out.token_ids == ref.token_ids
    return engine, outputs


# Literal hand counts for one request each.
HAND_CASES = [
    # never, max_tokens 6, k 3: steps (3,0,1) (3,0,1) (2,0,1) (1,0,1) (0,0,1)
    ("never", 6, 3, dict(tau=1.0, acceptance_rate=0.0, rows_per_step=1 + 9 / 5, num_verify_steps=5, num_emitted_tokens=5,
                         spec_decode_num_drafts=4, spec_decode_num_draft_tokens=9, spec_decode_num_accepted_tokens=0,
                         spec_decode_num_accepted_tokens_per_pos=[0, 0, 0], proposed=[4, 3, 2], reached=[4, 0, 0],
                         conditional=[0.0, 0.0, 0.0])),
    # always, max_tokens 12, k 4: steps (4,4,5) (4,4,5) (0,0,1)
    ("always", 12, 4, dict(tau=11 / 3, acceptance_rate=1.0, rows_per_step=1 + 8 / 3, num_verify_steps=3, num_emitted_tokens=11,
                           spec_decode_num_drafts=2, spec_decode_num_draft_tokens=8, spec_decode_num_accepted_tokens=8,
                           spec_decode_num_accepted_tokens_per_pos=[2, 2, 2, 2], proposed=[2, 2, 2, 2],
                           reached=[2, 2, 2, 2], conditional=[1.0, 1.0, 1.0, 1.0])),
    # first two, max_tokens 10, k 3: steps (3,2,3) (3,2,3) (2,2,3)
    ("first-two", 10, 3, dict(tau=3.0, acceptance_rate=0.75, rows_per_step=1 + 8 / 3, num_verify_steps=3, num_emitted_tokens=9,
                              spec_decode_num_drafts=3, spec_decode_num_draft_tokens=8, spec_decode_num_accepted_tokens=6,
                              spec_decode_num_accepted_tokens_per_pos=[3, 3, 0], proposed=[3, 3, 2], reached=[3, 3, 2],
                              conditional=[1.0, 1.0, 0.0])),
]


@pytest.mark.parametrize("pattern, max_tokens, k, expected", HAND_CASES, ids=[c[0] for c in HAND_CASES])
def test_one_request_counts_by_hand(tiny_llama, pattern, max_tokens, k, expected):
    assert_summary(expected_summary(schedule(pattern, max_tokens, k), k), expected)  # the model agrees
    engine, (out,) = run(tiny_llama, pattern, random_prompts([13], seed=1), [max_tokens], k)
    assert_summary(observed(out.metrics["spec"]), expected)
    assert_summary(observed(engine.speculator.stats.to_dict()), expected)
    # every drafted step offers k nodes (plenty of room) at most d deep (max_tokens)
    assert engine.speculator.drafter.budgets == [DraftBudget(k, d) for d, _, _ in schedule(pattern, max_tokens, k) if d > 0]


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_batch_counts_per_request_and_merged(tiny_llama, pattern):
    """Eight concurrent requests with different max_tokens: each request's metrics follow its own schedule and
    the engine's stats are their sum."""
    k = 4
    max_tokens = (2, 3, 5, 9, 13, 20, 33, 7)
    prompts = random_prompts((4, 9, 15, 6, 22, 11, 30, 3), seed=2)
    engine, outputs = run(tiny_llama, pattern, prompts, max_tokens, k, block_size=3)
    merged = []
    for out, m in zip(outputs, max_tokens):
        steps = schedule(pattern, m, k)
        merged += steps
        assert len(out.token_ids) == m
        assert_summary(observed(out.metrics["spec"]), expected_summary(steps, k))
    engine_summary = observed(engine.speculator.stats.to_dict())
    assert_summary(engine_summary, expected_summary(merged, k))
    if pattern == "never" or pattern == "silent":
        assert engine_summary["tau"] == 1.0 and engine_summary["acceptance_rate"] == 0.0
    if pattern == "always":
        assert engine_summary["acceptance_rate"] == 1.0
    if pattern == "silent":
        assert engine_summary["spec_decode_num_drafts"] == 0 and engine_summary["proposed"] == [0] * k


def test_engine_stats_are_the_merge_of_request_stats(tiny_llama):
    k = 3
    prompts = random_prompts((5, 12, 8), seed=3)
    engine, outputs = run(tiny_llama, "first-two", prompts, (11, 17, 6), k)
    merged = AcceptanceStats(k)
    for out in outputs:
        spec = out.metrics["spec"]
        part = AcceptanceStats(k)
        part.num_steps, part.num_emitted = spec["num_verify_steps"], spec["num_emitted_tokens"]
        part.num_drafts = spec["spec_decode_num_drafts"]
        part.num_draft_tokens = spec["spec_decode_num_draft_tokens"]
        part.proposed = [r["proposed"] for r in spec["per_position"]]
        part.reached = [r["reached"] for r in spec["per_position"]]
        part.accepted = [r["accepted"] for r in spec["per_position"]]
        assert part.to_dict() == spec
        merged.merge(part)
    assert merged.to_dict() == engine.speculator.stats.to_dict()


def test_from_dict_gives_back_the_counts_of_to_dict():
    stats = AcceptanceStats()
    for record in [(3, 0, 1), (3, 3, 4), (2, 1, 2), (0, 0, 1)]:
        record_chain(stats, *record)
    again = AcceptanceStats.from_dict(stats.to_dict())
    assert again.to_dict() == stats.to_dict()
    assert (again.proposed, again.reached, again.accepted) == ([3, 3, 2], [3, 2, 1], [2, 1, 1])
