"""Suffix decoding (serving/drafters/suffix_tree.py, suffix.py, fallback.py).

1. The suffix tree against brute force: after random sequences are appended in random pieces (and some removed),
   every node's count is the number of occurrences of its path (at most max_depth tokens) in the sequences held, and
   no other path has a node; each draft equals one made from those brute-force counts by the rule in suffix_tree.py's
   docstring (every match length, best first by path probability, the min_token_prob floor, the max_spec_factor cap,
   the highest score, the longer match at ties).
2. The global tree keeps the answers of at most suffix_decoding_max_cached_requests requests, the oldest evicted
   first: an evicted answer no longer drives drafts, the latest does; a preempted request's partial answer leaves.
3. Greedy speculation is plain decoding at concurrency 1 and 4, with preemption, chunked prefill and the prefix cache;
   also with the adaptive policy.
4. Sampled speculation keeps the target's law: 6,000 seeded requests whose suffix trees (the global tree of earlier
   answers) propose trees of several children after x1; the law of (x2, x3) is the target's within TV 0.07.
5. A prompt answered a second time drafts the first answer: tau > 3 on the second answer.
6. Bad options are clear errors naming the fix.
"""
from __future__ import annotations

import heapq
import itertools
import math
import random
from types import SimpleNamespace

import pytest
import torch

from serving.drafters.base import DraftBudget
from serving.drafters.suffix import Suffix, SuffixDrafter
from serving.drafters.suffix_tree import SuffixCache, SuffixTree
from serving.request import SamplingParams, SpecState
from serving.spec_decode.config import SpeculativeConfig
from serving.spec_decode.tree import DraftTree

from test_spec import SCENARIOS, assert_pool_idle, make_engine, plain_outputs
from test_trees import E2E_PROMPT, assert_two_token_law, two_token_law

# ---- 1. the tree against brute force -------------------------------------------------------------------------


def occurrences(seqs, path) -> int:
    n = len(path)
    return sum(seq[i:i + n] == path for seq in seqs for i in range(len(seq) - n + 1))


def tree_paths(tree, node=0, path=()):
    for token, child in tree.children[node].items():
        yield path + (token,), tree.counts[child]
        yield from tree_paths(tree, child, path + (token,))


def reference_draft(seqs, context, max_depth, max_nodes, factor, min_prob):
    """The draft of suffix_tree.py's rule computed from brute-force counts: (tokens, parents, probs, score)."""
    def count(path):
        return occurrences(seqs, list(path)) if len(path) <= max_depth else 0

    vocab = sorted({t for seq in seqs for t in seq})
    best = ([], [], [], 0.0)
    for m in range(1, len(context)):
        pattern = tuple(context[len(context) - m:])
        if count(pattern) == 0:
            break
        limit = min(max_nodes, int(m * factor + 1e-6))
        tokens, parents, probs, heap, order = [], [], [], [], itertools.count()

        def push(path, prob, parent):
            children = sorted(((count(path + (t,)), t) for t in vocab if count(path + (t,))), key=lambda c: (-c[0], c[1]))
            for c, t in children:
                if prob * c / count(path) >= min_prob:
                    heapq.heappush(heap, (-prob * c / count(path), next(order), path + (t,), parent))

        push(pattern, 1.0, -1)
        while heap and len(tokens) < limit:
            neg, _, path, parent = heapq.heappop(heap)
            tokens.append(path[-1])
            parents.append(parent)
            probs.append(-neg)
            push(path, -neg, len(tokens) - 1)
        if sum(probs) >= best[3]:
            best = (tokens, parents, probs, sum(probs))
    return best


@pytest.mark.parametrize("max_depth", [1, 3, 6])
def test_suffix_tree_counts_every_path_as_brute_force(max_depth):
    rng = random.Random(max_depth)
    tree, seqs = SuffixTree(max_depth), {}
    for key in range(12):
        vocab = rng.choice([2, 3, 5])
        seqs[key] = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        pieces = sorted({*rng.sample(range(1, len(seqs[key]) + 1), min(3, len(seqs[key]))), len(seqs[key])})
        for a, b in zip([0, *pieces], pieces):
            tree.extend(key, seqs[key][a:b])
        if key % 4 == 1:  # some leave
            tree.remove(key - 1)
            del seqs[key - 1]
    held = list(seqs.values())
    paths = dict(tree_paths(tree))
    expected = {}
    for seq in held:
        for i in range(len(seq)):
            for n in range(1, min(max_depth, len(seq) - i) + 1):
                expected[tuple(seq[i:i + n])] = occurrences(held, seq[i:i + n])
    assert paths == expected


@pytest.mark.parametrize("max_depth, factor, min_prob", [(4, 1.0, 0.1), (6, 2.0, 0.0), (8, 0.5, 0.3), (5, 3.0, 0.1)])
def test_suffix_drafts_follow_their_rule_on_random_sequences(max_depth, factor, min_prob):
    rng = random.Random(int(max_depth * 10 + factor * 3))
    num_drafted, num_trees = 0, 0
    for _ in range(60):
        vocab = rng.choice([2, 3, 4, 8])
        seqs = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 25))] for _ in range(rng.randrange(1, 4))]
        tree = SuffixTree(max_depth)
        for key, seq in enumerate(seqs):
            tree.extend(key, seq)
        context = seqs[-1][-max_depth:]
        max_nodes = rng.randrange(1, 12)
        # the tree's own suffix nodes (the context ends its last sequence), or every match walked from the root
        key = len(seqs) - 1 if rng.random() < 0.5 else None
        draft = tree.speculate(key, context, max_nodes, factor, min_prob)
        tokens, parents, probs, score = reference_draft(seqs, context, max_depth, max_nodes, factor, min_prob)
        assert (draft.tokens, draft.parents) == (tokens, parents), (seqs, max_nodes)
        assert draft.probs == pytest.approx(probs) and draft.score == pytest.approx(score)
        assert all(a >= b for a, b in zip(draft.probs, draft.probs[1:]))  # best first: any prefix is a tree
        num_drafted += bool(tokens)
        num_trees += len(set(parents)) < len(parents)
    assert num_drafted > 20 and (num_trees > 5 or factor < 1)  # drafts, and branching ones, occur


# ---- 2. the global tree and its eviction ---------------------------------------------------------------------


def fake_request(request_id, prompt, answer=(), finished=False):
    tokens = list(prompt) + list(answer)
    return SimpleNamespace(request_id=request_id, token_ids=tokens, num_prompt_tokens=len(prompt),
                           num_tokens=len(tokens), spec=SpecState(), is_finished=finished)


def suffix_drafter(**options):
    return SuffixDrafter(SpeculativeConfig(method="suffix", **options))


def test_the_global_tree_keeps_the_latest_answers_and_evicts_the_oldest():
    drafter = suffix_drafter(suffix_decoding_max_cached_requests=3, suffix_decoding_max_spec_factor=4.0)
    answers = [[50 + i, 60 + i, 70 + i, 80 + i] for i in range(5)]
    for i, answer in enumerate(answers):  # five answers to unrelated prompts, each after the marker 7 8
        request = fake_request(f"r{i}", [i, 9], [7, 8, *answer], finished=True)
        drafter.state(request)
        drafter.reset(request)
        assert drafter.num_cached_requests == min(i + 1, 3)
    budget = DraftBudget(8, 8)
    probe = fake_request("probe", [1, 2, 3], [7, 8])  # the probe's own answer takes a slot too: r0..r2 evicted
    tree = drafter.speculate(probe, 4).cut(budget).tree
    assert drafter.num_cached_requests == 3
    assert tree.tokens == (53, 54, 63, 64)  # r3's and r4's answers after "7 8", none of the evicted ones
    assert tree.parents == (-1, -1, 0, 1)
    assert drafter.speculate(probe, 8).cut(budget).tree.tokens == (53, 54, 63, 64, 73, 74, 83, 84)
    drafter.reset(probe)  # preempted (not finished): its partial answer leaves the global tree
    assert drafter.num_cached_requests == 2


def test_no_global_tree_when_no_requests_are_cached():
    drafter = suffix_drafter(suffix_decoding_max_cached_requests=0)
    done = fake_request("a", [1], [7, 8, 9, 10], finished=True)
    drafter.state(done)
    drafter.reset(done)
    assert not drafter.speculate(fake_request("b", [2], [7, 8]), 8).tree
    assert drafter.speculate(fake_request("c", [7, 8, 9, 7], [8]), 8).tree.tokens[:1] == (9,)  # its own prompt


def test_a_cut_keeps_the_best_nodes_within_the_budget():
    cache = SuffixCache(8, 10)
    cache.start(0, [1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2])
    draft = cache.speculate(0, [1, 2, 3, 1, 2], 6, 3.0, 0.0)
    suffix = Suffix(DraftTree(draft.tokens, draft.parents, survivals=tuple(draft.probs)), draft.score)
    cut = suffix.cut(DraftBudget(3, 1))
    assert all(d == 1 for d in cut.tree.depths) and cut.score == pytest.approx(sum(cut.probs))
    high = suffix.cut(DraftBudget(6, 8, math.log(0.5)))
    assert all(p >= 0.5 for p in high.probs) and len(high.tree) == sum(p >= 0.5 for p in suffix.probs)


# ---- 3. greedy speculation is plain decoding ------------------------------------------------------------------

GREEDY_CASES = [
    # (scenario, block size, max_num_seqs, extra options)
    ("single", 16, 1, {}),
    ("batch", 3, 4, {}),
    ("batch", 16, 1, {"suffix_decoding_max_spec_factor": 4.0, "suffix_decoding_min_token_prob": 0.0}),
    ("preempt", 1, 4, {}),
    ("preempt", 16, 4, {"suffix_decoding_max_spec_factor": 2.0}),
    ("prefix", 3, 4, {}),
    ("chunked", 1, 4, {"num_speculative_tokens": 6}),
    ("batch", 16, 4, {"adaptive": True}),
]


@pytest.mark.parametrize("scenario, block_size, max_num_seqs, options", GREEDY_CASES,
                         ids=[f"{s}-bs{b}-seqs{n}-{i}" for i, (s, b, n, _) in enumerate(GREEDY_CASES)])
def test_suffix_speculation_reproduces_plain_greedy(tiny_llama, scenario, block_size, max_num_seqs, options):
    sc = SCENARIOS[scenario]
    params = SamplingParams(max_tokens=sc["max_tokens"], ignore_eos=True)
    all_prompts = ([sc["warmup"]] if "warmup" in sc else []) + sc["prompts"]
    plain = plain_outputs(tiny_llama, all_prompts, params)
    num_blocks = -(-sc["pool_tokens"] // block_size) if "pool_tokens" in sc else None
    engine = make_engine(tiny_llama, {"method": "suffix", **options}, block_size=block_size, num_blocks=num_blocks,
                         max_model_len=sc.get("max_model_len", 128), max_num_seqs=max_num_seqs, **sc.get("engine", {}))
    if "warmup" in sc:  # its prefix is in the cache for the prompts after it
        assert engine.generate([sc["warmup"]], params)[0].token_ids == plain[0]
    outputs = engine.generate(sc["prompts"], params)
    assert [o.token_ids for o in outputs] == plain[len(all_prompts) - len(sc["prompts"]):]
    assert_pool_idle(engine)
    stats = engine.speculator.stats
    assert sum(stats.proposed) > 0 and sum(stats.accepted) > 0, "the suffix trees never drafted a right token"
    if scenario == "preempt":
        assert sum(o.metrics["num_preemptions"] for o in outputs) > 0
    drafter = engine.speculator.drafter
    assert not drafter.cache.local_trees  # every request's own tree left with it
    if not options.get("adaptive"):  # every answer is in the global tree (the adaptive policy's calibration adds its own)
        assert drafter.num_cached_requests == len(all_prompts)


# ---- 4. the sampled law ---------------------------------------------------------------------------------------


def test_sampled_suffix_speculation_keeps_the_target_law(v8_target):
    """x1 comes from the prefill; the first verify step carries the suffix trees' draft after it, grown from the
    answers of the requests before (4 nodes from a 1-token match with max_spec_factor 4): several children where
    earlier answers went different ways. The law of (x2, x3) is the target's."""
    num = 6000
    params = [SamplingParams(temperature=0.8, top_k=5, seed=i, max_tokens=4, ignore_eos=True) for i in range(num)]
    law, _, _ = two_token_law(v8_target, E2E_PROMPT, params[0])
    engine = make_engine(v8_target, {"method": "suffix", "num_speculative_tokens": 2, "num_draft_tokens": 5,
                                     "suffix_decoding_max_spec_factor": 4.0, "suffix_decoding_min_token_prob": 0.05},
                         block_size=4, num_blocks=1024, max_model_len=64, max_num_seqs=64, max_num_batched_tokens=4096)
    widths = []
    propose = engine.speculator.drafter.propose

    def recording(ctx, requests, budgets):
        trees = propose(ctx, requests, budgets)
        widths.extend(len(t.children[0]) for t in trees.values())
        return trees

    engine.speculator.drafter.propose = recording
    outputs = engine.generate([E2E_PROMPT] * num, params)
    assert_pool_idle(engine)
    stats = engine.speculator.stats
    assert max(widths) >= 2 and sum(w >= 2 for w in widths) > num // 2, "few trees branch: the test tests chains"
    assert 0 < stats.accepted[0] < stats.reached[0] and 0 < stats.accepted[1] < stats.reached[1]
    assert_two_token_law(outputs, law)


# ---- 5. a repeated prompt ------------------------------------------------------------------------------------


def test_a_repeated_prompt_drafts_its_first_answer(tiny_llama):
    prompt = [5, 17, 3, 99, 42, 8, 61, 23]
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    engine = make_engine(tiny_llama, {"method": "suffix"}, max_num_seqs=1)
    first, second = engine.generate([prompt, prompt], params)
    assert first.token_ids == second.token_ids == plain_outputs(tiny_llama, [prompt], params)[0]
    assert second.metrics["spec"]["tau"] > 3, second.metrics["spec"]
    assert second.metrics["spec"]["tau"] > first.metrics["spec"]["tau"] + 1


# ---- 6. bad options ------------------------------------------------------------------------------------------

BAD = [
    ('{"method": "suffix", "suffix_decoding_max_tree_depth": -1}', "suffix_decoding_max_tree_depth=-1 must be an integer >= 1"),
    ('{"method": "suffix", "suffix_decoding_max_tree_depth": 0}', "suffix_decoding_max_tree_depth=0 must be an integer >= 1"),
    ('{"method": "suffix", "suffix_decoding_max_tree_depth": 2.5}', "suffix_decoding_max_tree_depth=2.5"),
    ('{"method": "suffix", "suffix_decoding_max_cached_requests": -1}', r"max_cached_requests=-1 must be an integer >= 0 \(0: no global"),
    ('{"method": "suffix", "suffix_decoding_max_spec_factor": -0.5}', "max_spec_factor=-0.5 must be a number >= 0"),
    ('{"method": "suffix", "suffix_decoding_min_token_prob": 1.5}', r"min_token_prob=1.5 must be a probability in \[0, 1\]"),
    ('{"method": "suffix", "suffix_decoding_min_token_prob": -0.1}', r"min_token_prob=-0.1 must be a probability in \[0, 1\]"),
    ('{"method": "ngram", "suffix_decoding_max_tree_depth": 8}', "suffix_decoding_max_tree_depth applies to suffix and to heads with suffix_first, not 'ngram'"),
    ('{"method": "suffix", "suffix_first": true}', r"suffix_first applies to medusa, eagle, eagle3, mtp, peagle, dflash, dspark heads, not 'suffix' \(which drafts by suffix"),
    ('{"method": "eagle", "model": "x", "suffix_first": true, "prompt_lookup_first": true}', "either suffix_first or prompt_lookup_first"),
    ('{"method": "eagle", "model": "x", "suffix_first": true, "suffix_first_min_score": -1}', "suffix_first_min_score=-1 must be a number >= 0"),
    ('{"method": "suffix", "suffix_first_min_score": 2}', "suffix_first_min_score applies to heads with suffix_first"),
    ('{"method": "suffix", "topk": 2}', r"draft trees \(topk, medusa_choices\) apply to"),
]


@pytest.mark.parametrize("text, message", BAD)
def test_bad_suffix_options_are_clear_errors(text, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_json(text)


def test_suffix_options_default_as_vllms():
    config = SpeculativeConfig(method="suffix")
    assert (config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests,
            config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob) == (24, 10000, 1.0, 0.1)
    assert config.num_speculative_tokens == 24 and config.num_draft_tokens == 25  # vLLM: at most 24 drafts a step
    assert SpeculativeConfig(method="suffix", suffix_decoding_max_tree_depth=8).num_speculative_tokens == 8
    assert SpeculativeConfig(method="suffix", num_speculative_tokens=4, num_draft_tokens=3).num_draft_tokens == 3


def test_suffix_rows_name_the_options_that_differ_from_vllms():
    labels = [SpeculativeConfig(method="suffix", **options).label()
              for options in ({}, {"suffix_decoding_min_token_prob": 0.3}, {"suffix_decoding_max_spec_factor": 2.0})]
    assert labels == ["suffix k24 n25", "suffix k24 n25 p0.3", "suffix k24 n25 x2"]


# ---- 7. suffix first, then a head ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, fixture, concurrency", [("eagle", "tiny_qwen3", 8), ("eagle3", "tiny_llama", 1)])
def test_suffix_first_drafts_where_it_scores_and_the_head_elsewhere(kind, fixture, concurrency, request):
    """Prompts that repeat their first third: suffix decoding drafts where its score reaches suffix_first_min_score,
    the head everywhere else, its proposals equal to the dense reference although it drafted nothing at the suffix
    steps (its catch-up covers every kept token). Outputs stay plain greedy decoding's, with preemption at 8."""
    import test_head_drafters as heads_tests

    folder = request.getfixturevalue(fixture)
    head_dir = heads_tests.random_head_dir(kind, folder, request.getfixturevalue("tmp_path"))
    spec = dict(heads_tests.spec_config(kind, head_dir), suffix_first=True)
    engine = heads_tests.make_engine(folder, spec, **heads_tests.SCENARIOS[concurrency])
    drafter = engine.speculator.drafter
    proposals = heads_tests.record_proposals(engine)
    by_head = set()
    head_propose = drafter.head.propose

    def spy(ctx, requests, budgets):
        by_head.update((r.request_id, r.num_tokens) for r in requests)
        return head_propose(ctx, requests, budgets)

    drafter.head.propose = spy
    prompts = heads_tests.REPEATING
    outputs = engine.generate(prompts, heads_tests.greedy(heads_tests.MAX_TOKENS))
    assert [o.token_ids for o in outputs] == heads_tests.plain_outputs(folder, prompts, heads_tests.MAX_TOKENS)
    assert_pool_idle(engine)
    if concurrency == 8:
        assert sum(o.metrics["num_preemptions"] for o in outputs) > 0
    head_proposals = [p for p in proposals if (p.request_id, len(p.token_ids)) in by_head]
    suffix_proposals = [p for p in proposals if (p.request_id, len(p.token_ids)) not in by_head]
    assert len(head_proposals) >= 8 and len(suffix_proposals) >= 4, (len(head_proposals), len(suffix_proposals))
    assert drafter.summary()["suffix_share"] == pytest.approx(len(suffix_proposals) / len(proposals))
    finals = {o.request_id: o.prompt_token_ids + o.token_ids for o in outputs}
    num_checked, mismatches = heads_tests.check_against_dense(folder, heads_tests.load_as_drafted(head_dir, folder),
                                                              head_proposals, finals)
    assert num_checked and not mismatches, mismatches[:5]
