"""The adaptive policy (serving/spec_decode/adaptive.py) and the step-cost model it prices with (serving/spec_decode/cost.py).

1. On synthetic cost tables: where verified rows are nearly free the policy drafts the maximum, where each costs a
   full step it drafts nothing, in between it drafts for the requests whose acceptance repays the rows and not for
   the others.
2. A stub drafter whose drafts switch from always right to always wrong and back: the chosen depth follows within a
   few steps each way.
3. Greedy outputs equal plain decoding's with the policy on, for every drafter, alone and four at a time with
   preemption; the sampled law is the target's (the engine TV test of test_trees.py with the policy on).
4. The cost model's cache: used when it matches, measured anew with a warning when corrupt or foreign.
"""
from __future__ import annotations

import json
import logging
import math
from types import SimpleNamespace

import numpy as np
import pytest

from serving.drafters.base import DraftBudget, Drafter
from serving.drafters.confidence import Confidence
from serving.drafters.tree_search import Candidates, grow
from serving.request import SamplingParams, SpecState
from serving.spec_decode import cost
from serving.spec_decode.adaptive import REALISM_DECAY, REALISM_PRIOR, AdaptivePolicy, Estimate
from serving.spec_decode.config import SpeculativeConfig
from serving.spec_decode.cost import DraftCost, LinearFit, StepCost
from serving.spec_decode.tree import DraftTree
from test_spec import assert_pool_idle, make_engine, plain_outputs, random_prompts


def linear_cost(per_row: float) -> StepCost:
    """A step of 1 row takes 1 s; each further row adds `per_row` s."""
    return StepCost(rows=[1, 1024], seconds=[1.0, 1.0 + 1023 * per_row], per_seq=0.0, context=0)


def free_drafting() -> DraftCost:
    draft = DraftCost()
    draft.add(1, 1, 0.0), draft.add(2, 1, 0.0), draft.add(1, 2, 0.0)
    return draft


def decoding(request_id: str) -> SimpleNamespace:
    """A running request that has just emitted a token: one row to compute next step."""
    return SimpleNamespace(request_id=request_id, num_tokens=50, num_computed_tokens=49, spec=SpecState())


def fake_scheduler(requests) -> SimpleNamespace:
    return SimpleNamespace(running=requests, max_num_batched_tokens=512)


def policy_for(per_row: float, k: int = 4, **config) -> AdaptivePolicy:
    config = {"method": "ngram"} | config
    return AdaptivePolicy(SpeculativeConfig(num_speculative_tokens=k, adaptive=True, **config),
                          linear_cost(per_row), free_drafting())


def choose(policy, acceptance: dict[str, float], k: int = 4) -> dict[str, int]:
    """The depth chosen for each request, whose prior acceptance at every depth is `acceptance[id]` (the policy's
    estimates are seeded with many tries at that rate)."""
    requests = [decoding(rid) for rid in acceptance]
    for request, rate in zip(requests, acceptance.values()):
        request.spec.estimate = Estimate(hits=[100 * rate] * k, tries=[100.0] * k)
    limits = {rid: DraftBudget(policy.config.max_draft_nodes, k) for rid in acceptance}
    budgets = policy.choose(fake_scheduler(requests), requests, limits, prior=[0.5] * k)
    return {rid: budgets[rid].depth if rid in budgets else 0 for rid in acceptance}


# ---- 1. synthetic cost tables --------------------------------------------------------------------------


def test_nearly_free_rows_draft_the_maximum():
    assert choose(policy_for(1e-4), {"a": 0.3, "b": 0.6, "c": 0.9}) == {"a": 4, "b": 4, "c": 4}


def test_rows_that_cost_a_full_step_draft_nothing():
    assert choose(policy_for(1.0), {"a": 0.3, "b": 0.6, "c": 0.95}) == {"a": 0, "b": 0, "c": 0}


def test_in_between_only_the_requests_that_repay_draft():
    # Four requests decode in a step of 4 rows (1.3 s); a row more costs 0.1 s, 7.7% of the step, and gains each
    # request's survival over a quarter of the step's tokens, so only high acceptance repays it.
    depths = choose(policy_for(0.1), {"low1": 0.1, "low2": 0.15, "high1": 0.9, "high2": 0.95})
    assert depths["low1"] == depths["low2"] == 0
    assert depths["high1"] >= 2 and depths["high2"] >= depths["high1"]


def test_a_prefill_chunk_in_the_step_does_not_make_drafts_look_cheap():
    # A row costs 0.8 of a 1-row step: one draft at acceptance 0.7 yields 1.7 tokens in 1.8 s, below plain's 1 in 1,
    # and a request prefilling 400 rows in the same step changes nothing (beside its 321 s a draft's 0.8 s would
    # look free); where a row costs 0.05 the request drafts either way.
    prefilling = SimpleNamespace(request_id="p", num_tokens=900, num_computed_tokens=0)
    for per_row, drafts in ((0.8, False), (0.05, True)):
        for running in ([decoding("a")], [decoding("a"), prefilling]):
            policy = policy_for(per_row)
            running[0].spec.estimate = Estimate(hits=[70.0] * 4, tries=[100.0] * 4)
            budgets = policy.choose(fake_scheduler(running), running[:1], {"a": DraftBudget(4, 4)}, prior=[0.7] * 4)
            assert ("a" in budgets) == drafts, (per_row, len(running))


def test_trees_are_cut_by_depth_and_the_histogram_counts_choices():
    policy = policy_for(1e-4, method="eagle", model="head", topk=4, num_draft_tokens=13)  # 12 nodes at depth 4: 3 per depth
    assert policy.num_nodes == (0, 3, 6, 9, 12)
    requests = [decoding("a"), decoding("b")]
    limits = {"a": DraftBudget(5, 4), "b": DraftBudget(12, 2)}  # room for 5 nodes; 2 tokens left before max_tokens
    budgets = policy.choose(fake_scheduler(requests), requests, limits, prior=[0.9] * 4)
    assert {rid: budget[:2] for rid, budget in budgets.items()} == {"a": (3, 1), "b": (6, 2)}
    assert dict(policy.chosen[2]) == {1: 1, 2: 1}
    medusa = AdaptivePolicy(SpeculativeConfig(method="medusa", model="x", num_speculative_tokens=3,
                                              medusa_choices=[[0], [1], [0, 0], [0, 1], [0, 0, 0]], adaptive=True),
                            linear_cost(1e-4), free_drafting())
    assert medusa.num_nodes == (0, 2, 4, 5)


def test_a_head_keeps_the_nodes_that_repay_their_row():
    # One request at acceptance 0.9 drafts 4 (1 + .9 + .81 + .729 + .6561 tokens in 1 + 4 * 0.1 s); a further node
    # of path probability s adds s tokens for 0.1 s, so it repays its row when s >= 0.1 * that rate.
    policy = policy_for(0.1)
    requests = [decoding("a")]
    requests[0].spec.estimate = Estimate(hits=[90.0] * 4, tries=[100.0] * 4)
    budget = policy.choose(fake_scheduler(requests), requests, {"a": DraftBudget(4, 4)}, prior=[0.9] * 4)["a"]
    assert budget.depth == 4
    assert budget.min_log_survival == pytest.approx(math.log(0.1 * (1 + .9 + .81 + .729 + .6561) / 1.4))
    assert budget.row_prices == pytest.approx([0.1 * (1 + .9 + .81 + .729 + .6561) / 1.4] * 4)
    policy.overhead_s = 0.6  # the engine's own work per step makes the step's rate lower, so the cut too
    lower = policy.choose(fake_scheduler(requests), requests, {"a": DraftBudget(4, 4)}, prior=[0.9] * 4)["a"]
    assert lower.min_log_survival == pytest.approx(math.log(0.1 * (1 + .9 + .81 + .729 + .6561) / 2.0))


def test_each_row_is_priced_where_it_falls_in_the_step():
    # Two further rows cost 0.01 s each, the third 0.5 s (a step's cost is uneven in its rows): the first draft's
    # row is priced at 0.01 s of the step's rate, not at what the row past the budget costs.
    table = StepCost(rows=[1, 2, 3, 4, 5, 6], seconds=[1.0, 1.01, 1.02, 1.52, 1.53, 1.54], per_seq=0.0, context=0)
    policy = AdaptivePolicy(SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=True), table,
                            free_drafting(), per_request=False)
    requests = [decoding("a")]
    budget = policy.choose(fake_scheduler(requests), requests, {"a": DraftBudget(4, 4)}, prior=[0.95] * 4)["a"]
    rate = (1 + .95 + .95 ** 2 + .95 ** 3 + .95 ** 4) / 1.53
    assert budget.depth == 4
    assert budget.row_prices == pytest.approx([0.01 * rate, 0.01 * rate, 0.5 * rate, 0.01 * rate])
    assert budget.min_log_survival == pytest.approx(math.log(0.01 * rate))


def test_a_head_expands_the_nodes_whose_children_may_repay_a_forward():
    # A calibrated head's depth d + 1 is one more forward, priced at a catch-up call's 0.2 s: a node at depth d is
    # expanded where its survival times the drafter's acceptance at d + 1 repays that and its first child's row.
    policy = AdaptivePolicy(SpeculativeConfig(method="ngram", num_speculative_tokens=3, adaptive=True),
                            linear_cost(0.01), free_drafting(), per_request=False)
    for rows in (3, 10, 20):
        policy.draft_cost.add_catch_up(rows, 0.2)
    requests = [decoding("a")]
    prior = [0.9, 0.5, 0.25]
    budget = policy.choose(fake_scheduler(requests), requests, {"a": DraftBudget(3, 3)}, prior=prior)["a"]
    rate = (1 + .9 + .45 + .1125) / (1.03 + 0.2)  # the catch-up's call is paid with the drafting one
    assert budget.depth == 3 and budget.row_prices == pytest.approx([0.01 * rate] * 3)
    assert budget.min_log_expand == pytest.approx([math.log((0.2 + 0.01) * rate / p) for p in prior[1:]])
    cut = math.exp(budget.min_log_expand[0])
    assert budget.expands(1, math.log(cut * 1.01)) and not budget.expands(1, math.log(cut * 0.99))
    assert budget.expands(3, -50.0)  # past the budget's entries nothing stops it: its depth does


def test_a_drafter_surer_than_right_is_asked_for_more():
    # A calibrated head gives its chains' nodes survivals 0.8 and 0.4; verification accepts depth 1 half the time
    # and depth 2 a tenth: over the last ~100 steps (and the prior's few tokens of agreement) its survivals are worth
    # about 0.5 / 0.8 and 0.1 / 0.4 of what they say, and each row's price is asked of them in that proportion.
    policy = AdaptivePolicy(SpeculativeConfig(method="ngram", num_speculative_tokens=2, adaptive=True),
                            linear_cost(0.01), free_drafting(), per_request=False)
    requests = [decoding("a")]
    fresh = policy.choose(fake_scheduler(requests), requests, {"a": DraftBudget(2, 2)}, prior=[0.9, 0.9])["a"]
    assert policy.realism(1) == policy.realism(2) == 1.0  # before any verify step: the drafter's word
    tree = DraftTree.chain([3, 4], survivals=(0.8, 0.4))
    for step in range(2000):
        policy.record_survivals(tree, 2 if step % 10 == 0 else 1 if step % 10 < 5 else 0)
    steps = 1 / (1 - REALISM_DECAY)
    first, second = policy.realism(1), policy.realism(2)
    assert first == pytest.approx((0.5 * steps + REALISM_PRIOR) / (0.8 * steps + REALISM_PRIOR), rel=0.05)
    assert second == pytest.approx((0.1 * steps + REALISM_PRIOR) / (0.4 * steps + REALISM_PRIOR), rel=0.05)
    budget = policy.choose(fake_scheduler(requests), requests, {"a": DraftBudget(2, 2)}, prior=[0.9, 0.9])["a"]
    assert budget.row_prices == pytest.approx([fresh.row_prices[0] / first, fresh.row_prices[1] / second])
    assert DraftTree.chain([3, 4], survivals=(0.8, 0.4)).prefix(1).survivals == (0.8,)


def test_the_search_expands_only_the_nodes_its_budget_says():
    # Two requests' first drafts at 0.6 and 0.1; the second's budget asks 0.3 of a node worth its forward.
    first = ([[math.log(0.6)], [math.log(0.1)]], [[5], [6]])
    asked = []

    def expand(depth, nodes, found):
        asked.extend(nodes)
        return [[math.log(0.5)] for _ in nodes], [[7] for _ in nodes]

    budgets = [DraftBudget(3, 3), DraftBudget(3, 3, min_log_expand=(math.log(0.3),))]
    found = grow(first, expand, 1, [3, 3], [-math.inf, -math.inf], budgets)
    assert [r for r, _ in asked] == [0, 0]  # depths 2 and 3 of the first request only
    assert found[0].depths == [1, 2, 3] and found[1].depths == [1]


@pytest.mark.parametrize("survivals, prices, kept", [
    ((0.6, 0.3, 0.2, 0.15), (0.05, 0.05, 0.5, 0.05), 2),  # the dear third row is not repaid
    ((0.6, 0.5, 0.45, 0.44), (0.05, 0.05, 0.5, 0.05), 4),  # it is, by the cheap row after it
    ((0.04, 0.03), (0.05, 0.05), 0),  # no node repays its row
    ((0.9, 0.8, 0.7, 0.6, 0.5), (), 4),  # no prices: num_nodes of them
    ((0.9, 0.8, 0.7, 0.6, 0.5), (0.1,), 4),  # past the prices, the last one holds; num_nodes caps
])
def test_a_budget_keeps_the_prefix_that_repays_its_rows_most(survivals, prices, kept):
    assert DraftBudget(4, 4, row_prices=prices).num_kept(survivals) == kept


def test_a_head_drafts_within_the_row_prices():
    # A chain whose drafts survive at 0.6, 0.3, 0.2, 0.15: priced as above, the tree keeps the first two.
    candidates = Candidates()
    parent, score = -1, 0.0
    for depth, survival in enumerate((0.6, 0.3, 0.2, 0.15), start=1):
        parent = candidates.add(10 + depth, parent, depth, math.log(survival))
    assert candidates.within(DraftBudget(4, 4, row_prices=(0.05, 0.05, 0.5, 0.05))) == DraftTree.chain([11, 12])
    assert candidates.within(DraftBudget(3, 4)) == DraftTree.chain([11, 12, 13])


def test_a_calibrated_drafter_is_judged_by_its_acceptance_over_all_requests():
    # A head's own confidence cuts each draft; the depth it may draft follows the drafter's acceptance over every
    # request (the prior), not one request's few recent steps.
    def depths(per_request: bool) -> dict[str, int]:
        policy = AdaptivePolicy(SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=True),
                                linear_cost(0.05), free_drafting(), per_request=per_request)
        requests = [decoding("unlucky"), decoding("lucky")]
        requests[0].spec.estimate = Estimate(hits=[0.0] * 4, tries=[3.0] * 4)
        requests[1].spec.estimate = Estimate([3.0] * 4, [3.0] * 4)
        budgets = policy.choose(fake_scheduler(requests), requests, {r.request_id: DraftBudget(4, 4) for r in requests},
                                prior=[0.7] * 4)
        return {r.request_id: budgets[r.request_id].depth if r.request_id in budgets else 0 for r in requests}

    assert depths(per_request=True) == {"unlucky": 0, "lucky": 4}
    both = depths(per_request=False)
    assert both["unlucky"] == both["lucky"] > 0


def test_the_learned_overhead_follows_the_steps_beyond_the_table():
    policy = policy_for(0.1)
    for _ in range(60):
        policy.record_step(4, 4, 4, 1.3 + 0.25, has_prefill=False)  # the table says 1.3 s; the engine took 0.25 s more
    policy.record_step(40, 4, 3, 2.0, has_prefill=True)  # a prefill chunk's step, priced well above: not learned from
    assert policy.overhead_s == pytest.approx(0.25, rel=0.01)
    assert policy.step_time(4, 4) == pytest.approx(1.55, rel=0.01)
    timing = policy.summary()["step_time"]
    assert timing[0]["rows_at_most"] == 4 and timing[0]["measured_ms"] == pytest.approx(1550)


def test_a_drafting_call_must_be_repaid_too():
    def with_draft_cost(seconds):
        policy = policy_for(1e-4)
        policy.draft_cost = DraftCost()
        for depth, nodes in ((1, 1), (2, 2), (4, 4)):  # the same seconds whatever it drafts
            policy.draft_cost.add(depth, nodes, seconds)
        return policy

    # depth 4 at acceptance 0.9 expects 1 + 3.1 tokens: a step of 1 s plus the call, against 1 token in 1 s
    assert choose(with_draft_cost(2.0), {"a": 0.9}) == {"a": 4}
    assert choose(with_draft_cost(3.5), {"a": 0.9}) == {"a": 0}


# ---- 2. following a request's acceptance -----------------------------------------------------------------


class SwitchingStub(Drafter):
    """Drafts the true continuation (plain greedy decoding's) while output position is in `right`, else wrong
    tokens; records the depth it was asked for at each output position."""

    def __init__(self, truth: dict, right):
        self.truth, self.right, self.asked = truth, right, {}

    def propose(self, ctx, requests, budgets):
        trees = {}
        for r in requests:
            n = r.num_output_tokens
            upcoming = self.truth.get(tuple(r.token_ids[:r.num_prompt_tokens]), [])[n:]
            depth = budgets[r.request_id].depth
            self.asked[n] = depth
            tokens = [t if self.right(n) else (t + 1) % 256 for t in upcoming[:depth]]
            trees[r.request_id] = DraftTree.chain(tokens)
        return trees


def test_the_chosen_depth_follows_acceptance_and_recovers(tiny_llama, monkeypatch):
    prompt = random_prompts([12], seed=5)
    truth = plain_outputs(tiny_llama, prompt, SamplingParams(max_tokens=120, ignore_eos=True))[0]
    # a row costs 30% of a step: depth 1 repays acceptance above 0.3
    monkeypatch.setattr(cost, "load_or_measure", lambda engine, remeasure=False: linear_cost(0.3))
    engine = make_engine(tiny_llama, {"method": "ngram", "num_speculative_tokens": 4, "adaptive": True},
                         num_blocks=64, max_model_len=256)
    stub = SwitchingStub({tuple(prompt[0]): truth}, lambda n: n < 40 or n >= 80)
    engine.speculator.drafter = stub
    engine.speculator.policy.draft_cost = free_drafting()
    out = engine.generate(prompt, SamplingParams(max_tokens=120, ignore_eos=True))[0]
    assert out.token_ids == truth
    asked = dict(sorted(stub.asked.items()))
    drafted_at = [n for n, depth in asked.items()]
    # while right: the maximum from the start (a deeper depth not tried yet is expected to accept), each step
    # jumping 5 tokens
    assert [asked[n] for n in drafted_at if n < 40] and all(asked[n] == 4 for n in drafted_at if n < 40)
    # once wrong: within 5 steps no more drafts, and later only occasional probes, never two steps in a row
    wrong_phase = [n for n in range(40, 80)]
    probes = [n for n in wrong_phase if n in asked]
    assert len(probes) <= 12, f"kept drafting while every draft was rejected: {probes}"
    late = [n for n in probes if n >= 45]
    assert len(late) <= 8 and all(b - a > 1 for a, b in zip(late, late[1:])), f"probes not sparse after the switch: {late}"
    # right again: back to the maximum within a few steps
    back = [n for n in drafted_at if n >= 80 and asked[n] == 4]
    assert back and back[0] <= 95, f"never went back to drafting 4 after acceptance returned: {asked}"
    summary = engine.speculator.policy.summary()
    assert set(summary["chosen_depths"][1]) >= {0, 4}


# ---- 3. exactness with the policy on ----------------------------------------------------------------------

DRAFTERS = ["ngram", "draft_model", "early_exit", "medusa", "eagle", "eagle3", "mtp", "eagle-tree"]


def drafter_spec(name, folder, heads_root) -> dict:
    if name in ("ngram",):  # short suffixes, so that the tiny target's answers give lookups to choose from
        return {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    if name == "draft_model":
        return {"method": "draft_model", "model": str(folder)}
    if name == "early_exit":
        return {"method": "early_exit", "num_layers": 2}
    from test_head_drafters import random_head_dir

    kind = name.removesuffix("-tree")
    spec = {"method": kind, "model": random_head_dir(kind, folder, heads_root)}
    return spec | ({"topk": 3, "num_draft_tokens": 8} if name.endswith("-tree") else {})


@pytest.fixture(scope="module")
def heads_root(tmp_path_factory):
    return tmp_path_factory.mktemp("adaptive_heads")


@pytest.mark.parametrize("concurrency", [1, 4])
@pytest.mark.parametrize("name", DRAFTERS)
def test_adaptive_greedy_outputs_equal_plain_decoding(name, concurrency, tiny_llama, heads_root, monkeypatch):
    # rows cost 5% of a step: cheap enough that requests draft, dear enough that some do not
    monkeypatch.setattr(cost, "load_or_measure", lambda engine, remeasure=False: linear_cost(0.05))
    # A random head is unsure of every draft, so the price of a row would cut them all: here drafts must reach
    # verification (the cut itself: test_a_head_keeps_the_nodes_that_repay_their_row, test_trees, and the prices by
    # row: test_a_budget_keeps_the_prefix_that_repays_its_rows_most).
    monkeypatch.setattr(Confidence, "log_threshold_for", lambda self, budget: self.log_threshold)
    monkeypatch.setattr(DraftBudget, "num_kept", lambda self, survivals: min(len(survivals), self.num_nodes))
    monkeypatch.setattr(DraftBudget, "expands", lambda self, depth, log_survival: True)
    prompts = random_prompts([3, 9, 17, 30, 41], seed=concurrency)
    prompts[1] = prompts[1] * 4  # repeated text, which prompt lookup finds
    spec = drafter_spec(name, tiny_llama, heads_root) | {"num_speculative_tokens": 3, "adaptive": True}
    # four at a time share 120 tokens of K/V and 32 tokens a step: chunked prefill and preemption
    pool = dict(num_blocks=256) if concurrency == 1 else dict(num_blocks=30, max_num_batched_tokens=32)
    engine = make_engine(tiny_llama, spec, block_size=4, max_model_len=96, max_num_seqs=concurrency, **pool)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outputs = engine.generate(prompts, params)
    assert [o.token_ids for o in outputs] == plain_outputs(tiny_llama, prompts, params)
    assert_pool_idle(engine)
    chosen = engine.speculator.policy.summary()["chosen_depths"]
    assert sum(n for depths in chosen.values() for d, n in depths.items() if d > 0), "the policy never drafted"
    assert engine.speculator.stats.num_draft_tokens > 0, "no draft was verified"
    assert engine.speculator.policy.per_request == (name in ("ngram", "draft_model", "early_exit"))
    if concurrency == 4:
        assert sum(o.metrics["num_preemptions"] for o in outputs) > 0, "no preemption: the pool is too roomy"


def test_adaptive_keeps_the_sampled_law(v8_target, monkeypatch):
    import test_trees

    monkeypatch.setattr(cost, "load_or_measure", lambda engine, remeasure=False: linear_cost(1e-4))
    real = test_trees.make_engine

    def adaptive_engine(folder, spec, **kwargs):
        engine = real(folder, spec | {"adaptive": True}, **kwargs)
        engine.speculator.policy.draft_cost = free_drafting()
        engine.speculator.policy.num_nodes = (0, 1, 5)  # the stub's tree: 5 nodes, depth 2
        return engine

    monkeypatch.setattr(test_trees, "make_engine", adaptive_engine)
    test_trees.test_sampled_tree_speculation_in_the_engine_keeps_the_target_law(v8_target, False, 1.0, 0)


# ---- 4. the cost model and its cache ---------------------------------------------------------------------


def test_step_cost_is_measured_once_then_read_from_the_cache(tiny_llama, monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(cost, "step_cost_dir", lambda: tmp_path)
    engine = make_engine(tiny_llama, max_num_seqs=4)
    measured = cost.load_or_measure(engine)
    assert measured.rows[0] == 1 and len(measured.rows) >= 8 and all(s > 0 for s in measured.seconds)
    assert measured.key["target"] == engine.fingerprint["id"] and measured.key["dtype"] == "float32"
    (path,) = tmp_path.glob("*.json")
    calls = []
    monkeypatch.setattr(cost, "measure", lambda engine: calls.append(1) or StepCost([1, 2], [1.0, 2.0], 0.0, 4))
    assert cost.load_or_measure(engine).seconds == measured.seconds and not calls  # the cache, as measured

    for spoiled in ("{not json", json.dumps({**json.loads(path.read_text()), "key": {"machine": "elsewhere"}}),
                    json.dumps({**json.loads(path.read_text()), "seconds": [1.0]})):
        path.write_text(spoiled)
        with caplog.at_level(logging.WARNING, logger="serving.spec_decode.cost"):
            caplog.clear()
            again = cost.load_or_measure(engine)
        assert calls and again.seconds == [1.0, 2.0], "a spoiled cache was trusted"
        assert "measuring again" in caplog.text
        calls.clear()
        path.write_text(json.dumps({**json.loads(path.read_text()), "key": measured.key} | {"seconds": measured.seconds,
                                                                                            "rows": measured.rows}))
    assert cost.load_or_measure(engine, remeasure=True).seconds == [1.0, 2.0] and calls


def test_step_cost_predicts_between_and_past_the_measured_rows():
    model = StepCost(rows=[1, 2, 4, 8], seconds=[1.0, 1.0, 1.4, 2.2], per_seq=0.05, context=16)
    assert model.predict(1) == 1.0
    assert model.predict(3) == pytest.approx(1.2)
    assert model.predict(16) == pytest.approx(3.8)  # the last slope, 0.2 per row, carried on
    assert model.predict(4, num_seqs=3) == pytest.approx(1.5)
    assert "| 8 | 2200.00 | 2200.00 | 2.20x |" in model.table()
    # a verify step computes logits on every row, a prefill chunk on one at most
    model.per_logits_row = 0.01
    assert model.predict(8) == pytest.approx(2.2 + 7 * 0.01)
    assert model.predict(8, num_logits_rows=1) == pytest.approx(2.2)
    assert model.predict(8, num_seqs=3, num_logits_rows=3) == pytest.approx(2.2 + 0.02 + 0.1)


def test_draft_cost_fits_its_calls():
    draft = DraftCost()
    for depth in (1, 2, 4):
        for nodes in (1, 4, 9):
            draft.add(depth, nodes, 0.002 + 0.003 * depth + 0.0005 * nodes)
    for rows in (1, 3, 40):
        draft.add_catch_up(rows, 0.001 + 0.0001 * rows)
    assert draft.call.coef == pytest.approx((0.002, 0.003, 0.0005))
    assert draft.catch_up.coef == pytest.approx((0.001, 0.0001))
    # a choice is priced at the call plus the catch-up's call, not its rows (serving/spec_decode/cost.py says why)
    assert draft.predict(3, 6) == pytest.approx(0.002 + 0.009 + 0.003 + 0.001)
    assert draft.predict(0, 0) == 0.0


def test_a_cost_fit_never_trades_a_negative_coefficient():
    # Nearly collinear terms (nodes = 2 * depth, but for one call) and timings that fall with depth: the
    # unconstrained fit pairs a large positive coefficient with a negative one; clamped, it would overprice.
    fit = LinearFit(3)
    for depth, nodes, seconds in ((1, 2, 0.0050), (2, 4, 0.0049), (3, 6, 0.0048), (4, 8, 0.0047), (2, 5, 0.0049)):
        fit.add((1.0, depth, nodes), seconds)
    a, b, c = fit.coef
    assert min(a, b, c) >= 0
    unconstrained = np.linalg.lstsq(fit.gram, fit.moment, rcond=None)[0]
    assert (unconstrained < 0).any()
    for depth, nodes, seconds in ((1, 2, 0.0050), (4, 8, 0.0047)):
        assert a + b * depth + c * nodes == pytest.approx(seconds, rel=0.05)


def test_adaptive_engine_calibrates_and_reports(tiny_llama):
    engine = make_engine(tiny_llama, {"method": "ngram", "num_speculative_tokens": 3, "adaptive": True})
    policy = engine.speculator.policy
    assert engine.speculator.is_calibrated and policy.draft_cost.num_calls >= 3
    assert engine.speculator.stats.num_steps == 0 and not policy.timings, "calibration's steps were kept"
    engine.generate(random_prompts([20, 8], seed=1), SamplingParams(max_tokens=12, ignore_eos=True))
    summary = policy.summary()
    assert summary["step_time"] and all(b["measured_ms"] > 0 for b in summary["step_time"])
    assert sum(sum(depths.values()) for depths in summary["chosen_depths"].values()) > 0, summary
    with pytest.raises(ValueError, match="adaptive"):
        SpeculativeConfig(method="ngram", adaptive="yes")
    assert SpeculativeConfig(method="ngram", adaptive=True).label() == "ngram adaptive"


def test_bench_prints_the_cost_model(tiny_llama, tmp_path, monkeypatch, capsys):
    from training.cli import main

    monkeypatch.setattr(cost, "step_cost_dir", lambda: tmp_path)
    assert main(["bench", "--cost-model", "--target", str(tiny_llama), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "| rows | ms, one row of logits | ms, logits on every row | vs 1 row |" in out and "\n| 128 | " in out
    assert "measured 0.0 h ago" in out and "each further row of logits" in out
    assert len(list(tmp_path.glob("*.json"))) == 1
