"""Token trees (serving/spec_decode/tree.py) end to end: verification keeps the target's law, greedy tree speculation is
plain decoding, the accepted path's K/V is a fresh prefill's, EAGLE-2 trees drafted over the paged pool are the
dense head's, and bad tree configs are clear errors.

1. Sampled verification is exact: the empirical law of the first two emitted tokens of `verify_sampled` on a
   tree of width 2 at depths 1 and 2 is, within total variation 0.07 over 12,000 seeded samples, the exact law
   p_root(t1) * p(t2 | t1), computed from fixed random logits through `serving.sampler.target_probs` (the one
   definition of a request's sampling law) on a vocabulary of 7, at temperature 0.8 with top-k 5 and at
   temperature 1. Deterministic children (recursive rejection without replacement) and children drawn
   independently from an imperfect drafter's q (SpecInfer's multi-step speculative sampling). Where no node is
   accepted at depth 1 only one token comes out, and the second is drawn from p(. | t1), as the next target step
   would. Nodes are both accepted and rejected at both depths. (Checked against mutations of verify_sampled: a
   residual that keeps rejected children or ignores q, acceptance by p without renormalising, reading a node's
   parent's row: TV 0.09-0.37.) verify_sampled must also leave the caller's probabilities alone.
2. The same end to end through the engine: a vocabulary-8 target, a stub proposing that tree after the prefill's
   x1 (the target's likely tokens, or tokens drawn from an imperfect q), 6,000 seeded requests: the law of
   (x2, x3) is sum_x1 p(x1) p(x2 | x1) p(x3 | x1, x2) with p from transformers, within TV 0.07.
3. Greedy: a stub drafter that knows plain greedy decoding's continuation proposes random trees (random shapes,
   each node right with probability 0.6 when its parent is on the true path) under preemption, chunked prefill,
   prefix-cache hits, concurrency 1 and 4 and block sizes 1, 3 and 16: outputs equal plain decoding's (the same
   engine without speculation), the pool ends idle, and accepted paths reach depth >= 2 off node order (K/V moved).
4. A stub that always proposes the true path among random siblings in random node order (the target drafting for
   itself, in a tree): every verify step accepts the whole path, tau = 1 + depth.
5. After random-tree steps (block size 4), the target's K/V at every computed position of running requests,
   read through their block tables in all layers, equal a fresh plain engine's prefill of the same tokens.
6. Paged equals dense for EAGLE-2 trees: every proposal of an EAGLE-1, EAGLE-3 and MTP ('reuse_first') random head
   (topk 2, 3 depths, 6 nodes; float32 draft weights) makes the candidates (tokens, parents, scores within 2e-5)
   and keeps the tree that `tree_search.grow` gives over the head run densely (heads.attention.DenseCausalAttention)
   on the pairs (f_p, x_{p+1}) with h from transformers (f: h, or EAGLE-3's fuse of its aux layers' inputs), each
   node at depth d the input at position (newest) + d - 1 after the context and its own path. (Dropping the path
   from a node's keys, or one context key, fails it.) A random Medusa head's static tree (medusa_choices: node
   [r1..rd] is head d-1's r_d-th token under node [r1..r_{d-1}]) and dynamic tree (topk 2, 5 nodes: grow over its
   heads' ranked lists) equal the same recomputed from its logits at h_{T-2} from transformers.
7. Bad tree configs (SpeculativeConfig.from_json, the messages of serving/spec_decode/config.py) and a Medusa tree deeper
   than its heads are clear errors.
8. DraftTree, verify_greedy on a tree, and AcceptanceStats.record on trees, against hand-computed values.

Engine references are the same engine without speculation (test_spec.plain_outputs); everything is float32 and
single-threaded on tiny targets.
"""
from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from serving.drafters.base import Drafter
from serving.drafters.confidence import Confidence, top_log_probs
from serving.drafters.tree_search import Candidates, grow, grow_from_marginals
from serving.request import SamplingParams
from serving.sampler import sample, target_probs
from serving.spec_decode.config import SpeculativeConfig
from serving.spec_decode.metrics import AcceptanceStats
from serving.spec_decode.tree import DraftTree
from serving.spec_decode.verify import verify_greedy, verify_sampled

from test_spec import SCENARIOS, assert_pool_idle, make_engine, plain_outputs, random_prompts

VOCAB = 256


def tv(counts: torch.Tensor, law: torch.Tensor) -> float:
    return 0.5 * float((counts.double() / counts.sum() - law.double()).abs().sum())


# ---- 1. the sampled law ------------------------------------------------------------------------------------

V = 7  # a vocabulary small enough that the joint law of two tokens has 49 cells
NUM_SAMPLES = 12_000


def sampled_tables(params: SamplingParams):
    """Fixed random target laws: the root's, p(t2 | t1) for every t1 (rows2[t1]), and an imperfect drafter's q at
    both depths (q1, q2[t1]), which differ from the target's."""
    g = torch.Generator().manual_seed(1234)
    root = target_probs(2.0 * torch.randn(1, V, generator=g), params)[0]
    rows2 = target_probs(2.0 * torch.randn(V, V, generator=g), params)
    q1 = torch.softmax(1.5 * torch.randn(V, generator=g), -1)
    q2 = torch.softmax(1.5 * torch.randn(V, V, generator=g), -1)
    return root, rows2, q1, q2


def leaf_row():
    return torch.full((V,), 1.0 / V)  # the law of the third token, which the test does not look at


@pytest.mark.parametrize("temperature, top_k", [(0.8, 5), (1.0, 0)], ids=["T0.8-top5", "T1"])
@pytest.mark.parametrize("children", ["deterministic", "sampled"])
def test_sampled_tree_verification_keeps_the_target_law(children, temperature, top_k):
    params = SamplingParams(temperature=temperature, top_k=top_k, seed=0)
    root, rows2, q1, q2 = sampled_tables(params)
    # nodes 0, 1 hang off the newest token; 2, 3 off node 0 and 4 off node 1: width 2 at depths 1 and 2
    parents = (-1, -1, 0, 0, 1)
    first, second = root.argsort(descending=True)[:2].tolist()  # deterministic children: likely tokens
    fixed = DraftTree((second, first, *rows2[second].argsort(descending=True)[:2].tolist(),
                       int(rows2[first].argmax())), parents)
    verify_generator = torch.Generator().manual_seed(5)
    draft_generator = torch.Generator().manual_seed(6)
    counts = torch.zeros(V, V)
    num_accepted, num_rejected = [0, 0], [0, 0]  # at depths 1 and 2: nodes accepted / tried and rejected
    for _ in range(NUM_SAMPLES):
        if children == "deterministic":
            tree = fixed
        else:  # every node drawn independently from its parent's q row
            tokens = [sample(q1, draft_generator), sample(q1, draft_generator)]
            tokens += [sample(q2[tokens[0]], draft_generator), sample(q2[tokens[0]], draft_generator),
                       sample(q2[tokens[1]], draft_generator)]
            tree = DraftTree(tokens, parents, torch.stack([q1, q1, q2[tokens[0]], q2[tokens[0]], q2[tokens[1]]]))
        probs = torch.stack([root] + [rows2[t] if d == 1 else leaf_row() for t, d in zip(tree.tokens, tree.depths)])
        path, emitted = verify_sampled(tree, probs, verify_generator)
        assert emitted[:len(path)] == [tree.tokens[n] for n in path] and len(emitted) == len(path) + 1
        if not path:  # only t1 came out: the next target step draws t2 after it
            emitted.append(sample(rows2[emitted[0]], verify_generator))
        counts[emitted[0], emitted[1]] += 1
        for depth, parent in enumerate([-1] + path[:1]):
            if depth <= len(path) and tree.children[parent + 1]:
                tried = len(tree.children[parent + 1])
                if depth < len(path):
                    num_accepted[depth] += 1
                    tried = tree.children[parent + 1].index(path[depth])
                num_rejected[depth] += tried
    law = root[:, None] * rows2  # [t1, t2]
    distance = tv(counts.flatten(), law.flatten())
    assert distance <= 0.07, f"TV {distance:.4f} between the emitted pairs and the target law"
    assert all(num_accepted) and all(num_rejected), (num_accepted, num_rejected)
    assert tv(counts.sum(1), root) <= 0.05  # the first token alone, on 7 cells


def test_sampled_law_check_catches_a_wrong_residual(monkeypatch):
    """The check above is able to fail: rejecting a deterministic child without removing it from the residual
    (sampling the bonus from p instead of p without the rejected children) moves the law past 0.07."""
    import serving.spec_decode.verify as verify

    params = SamplingParams(temperature=0.8, top_k=5, seed=0)
    root, rows2, _, _ = sampled_tables(params)
    first, second = root.argsort(descending=True)[:2].tolist()
    tree = DraftTree((first, second), (-1, -1))
    probs = torch.stack([root, rows2[first], rows2[second]])
    g = torch.Generator().manual_seed(0)

    def emitted_law():
        counts = torch.zeros(V)
        for _ in range(4000):
            counts[verify.verify_sampled(tree, probs.clone(), g)[1][0]] += 1
        return tv(counts, root)

    assert emitted_law() <= 0.05
    real_sample = verify.sample
    monkeypatch.setattr(verify, "sample", lambda residual, generator: real_sample(root, generator))
    assert emitted_law() > 0.07


def test_sampled_verification_leaves_the_target_probs_alone():
    """verify_sampled reads the caller's probabilities and keeps its residuals to itself: rejecting deterministic
    children must not zero their tokens in the caller's rows."""
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([[0.05, 0.05, 0.9], [0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    before = probs.clone()
    tree = DraftTree([0, 1], [-1, -1])  # both children of the newest token are very likely rejected
    for _ in range(20):
        verify_sampled(tree, probs, g)
    torch.testing.assert_close(probs, before, atol=0, rtol=0)


# ---- 2. the sampled law end to end through the engine ------------------------------------------------------

E2E_PROMPT = [3, 5]
E2E_SAMPLES = 6000


def two_token_law(folder, prompt, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's law of the two tokens after x1, the prefill's: sum_x1 p(x1) p(x2 | x1) p(x3 | x1, x2) [x2, x3],
    with p from transformers through target_probs (vocabulary 8); also p2 [x1, x2] and p3 [x1, x2, x3]."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        def probs_after(contexts):
            return target_probs(hf(torch.tensor(contexts)).logits[:, -1].float(), params).double()

        p1 = probs_after([prompt])[0]
        p2 = probs_after([prompt + [x1] for x1 in range(8)])  # [x1, x2]
        p3 = probs_after([prompt + [x1, x2] for x1 in range(8) for x2 in range(8)]).view(8, 8, 8)
    return (p1[:, None, None] * p2[:, :, None] * p3).sum(0), p2, p3


def assert_two_token_law(outputs, law: torch.Tensor, name: str = "the target law", threshold: float = 0.07) -> None:
    """The engine's outputs' (x2, x3), the two tokens after the prefill's x1, follow `law` [x2, x3] (two_token_law's)
    within total variation `threshold`, and the law is not nearly one point (else any drafter would pass)."""
    counts = torch.zeros(law.shape)
    for o in outputs:
        counts[o.token_ids[1], o.token_ids[2]] += 1
    distance = tv(counts.flatten(), law.flatten())
    assert distance <= threshold, f"TV {distance:.4f} between the engine's (x2, x3) and {name}"
    assert float(law.max()) < 0.9


class FixedShapeStub(Drafter):
    """Proposes the tree of test_sampled_tree_verification_keeps_the_target_law's shape (width 2 at depths 1 and
    2) after x1: deterministic likely tokens (the target's two most likely x2, then its most likely x3 after each,
    two after the second likeliest x2), or tokens drawn independently from a fixed imperfect q (q1 at depth 1,
    q2[parent token] at depth 2) given with the tree."""

    def __init__(self, sampled: bool, p2: torch.Tensor, p3: torch.Tensor, vocab: int = 8):
        g = torch.Generator().manual_seed(77)
        self.q1 = torch.softmax(1.5 * torch.randn(vocab, generator=g), -1)
        self.q2 = torch.softmax(1.5 * torch.randn(vocab, vocab, generator=g), -1)
        self.sampled, self.p2, self.p3, self.generator = sampled, p2, p3, torch.Generator().manual_seed(78)

    def propose(self, ctx, requests, budgets):
        trees = {}
        for r in requests:
            if budgets[r.request_id][:2] != (5, 2):
                continue
            if self.sampled:
                a, b = sample(self.q1, self.generator), sample(self.q1, self.generator)
                tokens = [a, b, sample(self.q2[a], self.generator), sample(self.q2[a], self.generator),
                          sample(self.q2[b], self.generator)]
                q = torch.stack([self.q1, self.q1, self.q2[a], self.q2[a], self.q2[b]]).to(ctx.runner.device)
            else:
                x1 = r.token_ids[-1]
                first, second = self.p2[x1].argsort(descending=True)[:2].tolist()
                tokens = [second, first, *self.p3[x1, second].argsort(descending=True)[:2].tolist(),
                          int(self.p3[x1, first].argmax())]
                q = None
            trees[r.request_id] = DraftTree(tokens, (-1, -1, 0, 0, 1), q)
        return trees


@pytest.mark.parametrize("sampled, temperature, top_k", [(False, 1.0, 0), (True, 0.8, 5)],
                         ids=["deterministic-T1", "sampled-T0.8-top5"])
def test_sampled_tree_speculation_in_the_engine_keeps_the_target_law(v8_target, sampled, temperature, top_k):
    """x1 comes from the prefill, then the first verify step carries a 5-node tree after it: the law of (x2, x3)
    is the target's (two_token_law)."""
    params = [SamplingParams(temperature=temperature, top_k=top_k, seed=i, max_tokens=4, ignore_eos=True)
              for i in range(E2E_SAMPLES)]
    law, p2, p3 = two_token_law(v8_target, E2E_PROMPT, params[0])

    engine = make_engine(v8_target, {"method": "ngram", "num_speculative_tokens": 2}, block_size=4,
                         num_blocks=1024, max_model_len=64, max_num_seqs=256, max_num_batched_tokens=4096)
    engine.speculator.drafter = FixedShapeStub(sampled, p2, p3)
    engine.speculator.config.num_draft_tokens = 6
    outputs = engine.generate([E2E_PROMPT] * E2E_SAMPLES, params)
    assert_pool_idle(engine)
    stats = engine.speculator.stats
    assert stats.proposed[:2] == [E2E_SAMPLES, E2E_SAMPLES], "every request verifies one full tree after x1"
    assert 0 < stats.accepted[0] < stats.reached[0] and 0 < stats.accepted[1] < stats.reached[1]
    assert_two_token_law(outputs, law)


# ---- stub drafters that know plain greedy decoding's continuation ------------------------------------------


class TruthStub(Drafter):
    """Knows each prompt's plain greedy continuation; subclasses build the trees."""

    def __init__(self, truth: dict, seed: int = 0):
        self.truth, self.rng = truth, random.Random(seed)
        self.num_trees = 0

    def upcoming(self, request) -> list[int]:
        truth = self.truth[tuple(request.token_ids[:request.num_prompt_tokens])]
        n = request.num_output_tokens
        assert request.output_token_ids == truth[:n], "the engine diverged from plain decoding"
        return truth[n:]

    def propose(self, ctx, requests, budgets):
        trees = {}
        for r in requests:
            tree = self.tree(self.upcoming(r), budgets[r.request_id])
            assert len(tree) <= budgets[r.request_id].num_nodes and tree.depth <= budgets[r.request_id].depth
            trees[r.request_id] = tree
            self.num_trees += 1
        return trees

    def wrong(self, right: int | None) -> int:
        token = self.rng.randrange(VOCAB)
        return token if token != right else (token + 1) % VOCAB


class RandomTreeStub(TruthStub):
    """Random trees: up to budget.num_nodes nodes with random parents within budget.depth; a node whose parent is
    on the true path holds the true token at its depth with probability `p_right`, any other node a wrong one."""

    def __init__(self, truth, seed=0, p_right=0.6):
        super().__init__(truth, seed)
        self.p_right = p_right

    def tree(self, upcoming, budget):
        num_nodes = self.rng.randint(1, budget.num_nodes)
        tokens, parents, depths, on_path = [], [], [], []
        for i in range(num_nodes):
            parent = self.rng.choice([-1] + [j for j in range(i) if depths[j] < budget.depth])
            depth = 1 if parent < 0 else depths[parent] + 1
            right = upcoming[depth - 1] if depth - 1 < len(upcoming) else None
            parent_right = parent < 0 or on_path[parent]
            is_right = parent_right and right is not None and self.rng.random() < self.p_right
            tokens.append(right if is_right else self.wrong(right if parent_right else None))
            parents.append(parent)
            depths.append(depth)
            on_path.append(is_right)
        return DraftTree(tokens, parents)


class TruePathStub(TruthStub):
    """The true path to the budget's depth among wrong siblings (the budget's remaining nodes, hanging off the
    newest token, path nodes or other siblings), in a random topological order: every path is accepted whole."""

    def tree(self, upcoming, budget):
        depth = min(budget.depth, budget.num_nodes, len(upcoming))
        # specs: (parent spec or -1, token); specs 0..depth-1 are the true path
        specs = [(i - 1, upcoming[i]) for i in range(depth)]
        spec_depths = list(range(1, depth + 1))
        for s in range(depth, budget.num_nodes):
            parent = self.rng.choice([-1] + [j for j in range(s) if spec_depths[j] < depth])
            d = 1 if parent < 0 else spec_depths[parent] + 1
            right = upcoming[d - 1] if parent < depth and d - 1 < len(upcoming) else None
            specs.append((parent, self.wrong(right)))
            spec_depths.append(d)
        order, placed = [], {}
        pending = list(range(len(specs)))
        while pending:
            ready = [s for s in pending if specs[s][0] < 0 or specs[s][0] in placed]
            s = self.rng.choice(ready)
            placed[s] = len(order)
            order.append(s)
            pending.remove(s)
        return DraftTree([specs[s][1] for s in order], [-1 if specs[s][0] < 0 else placed[specs[s][0]] for s in order])


def stub_engine(folder, stub_class, truth, *, k=4, num_draft_tokens=9, seed=0, **engine_kwargs):
    """An engine whose drafter is `stub_class`, drafting trees of up to num_draft_tokens - 1 nodes and depth k;
    counts the K/V moves of accepted nodes off their depth's slot."""
    engine = make_engine(folder, {"method": "ngram", "num_speculative_tokens": k}, **engine_kwargs)
    engine.speculator.drafter = stub_class(truth, seed=seed)
    engine.speculator.config.num_draft_tokens = num_draft_tokens  # a stub stands in for a tree drafter
    engine.num_moves = 0
    move = engine.cache.move

    def counting_move(*args):
        engine.num_moves += 1
        move(*args)

    engine.cache.move = counting_move
    return engine


def scenario_run(folder, stub_class, scenario, block_size, max_num_seqs, seed=0):
    """One of test_spec's SCENARIOS with the stub drafting; returns (engine, outputs, plain greedy outputs)."""
    sc = SCENARIOS[scenario]
    params = SamplingParams(max_tokens=sc["max_tokens"], ignore_eos=True)
    prompts = sc["prompts"]
    all_prompts = ([sc["warmup"]] if "warmup" in sc else []) + prompts
    plain = plain_outputs(folder, all_prompts, params)
    truth = {tuple(p): out for p, out in zip(all_prompts, plain)}
    num_blocks = -(-sc["pool_tokens"] // block_size) if "pool_tokens" in sc else None
    engine = stub_engine(folder, stub_class, truth, seed=seed, block_size=block_size, num_blocks=num_blocks,
                         max_model_len=sc.get("max_model_len", 128), max_num_seqs=max_num_seqs, **sc.get("engine", {}))
    if "warmup" in sc:
        assert engine.generate([sc["warmup"]], params)[0].token_ids == plain[0]
        plain = plain[1:]
    return engine, engine.generate(prompts, params), plain


# ---- 3. greedy random trees are plain decoding -------------------------------------------------------------

RANDOM_TREE_CASES = [
    # (scenario, block size, max_num_seqs)
    ("single", 1, 1),
    ("single", 16, 1),
    ("batch", 3, 1),
    ("batch", 16, 4),
    ("preempt", 1, 4),
    ("preempt", 3, 4),
    ("preempt", 16, 4),
    ("prefix", 1, 4),
    ("prefix", 3, 1),
    ("prefix", 16, 4),
    ("chunked", 1, 4),
    ("chunked", 3, 4),
    ("chunked", 16, 1),
]


@pytest.mark.parametrize("scenario, block_size, max_num_seqs", RANDOM_TREE_CASES,
                         ids=[f"{s}-bs{b}-seqs{n}" for s, b, n in RANDOM_TREE_CASES])
def test_random_trees_reproduce_plain_greedy(tiny_llama, scenario, block_size, max_num_seqs):
    engine, outputs, plain = scenario_run(tiny_llama, RandomTreeStub, scenario, block_size, max_num_seqs,
                                          seed=10 * block_size + max_num_seqs)
    sc = SCENARIOS[scenario]
    for out, expected in zip(outputs, plain):
        assert out.token_ids == expected
        assert out.finish_reason == "length" and len(out.token_ids) == sc["max_tokens"]
    assert_pool_idle(engine)
    stats = engine.speculator.stats
    assert engine.speculator.drafter.num_trees > 0 and stats.num_draft_tokens > stats.num_drafts, "no trees verified"
    assert sum(stats.accepted[1:]) > 0, "no accepted path reached depth 2"
    assert 0 < stats.acceptance_rate < 1
    assert engine.num_moves > 0, "every accepted path was in node order: no K/V moved"
    if scenario == "preempt":
        assert sum(o.metrics["num_preemptions"] for o in outputs) > 0
    if scenario == "prefix":
        assert all(o.metrics["num_cached_tokens"] >= block_size for o in outputs)


# ---- 4. the true path among siblings is accepted whole -----------------------------------------------------


def test_the_true_path_among_siblings_is_accepted_whole(tiny_llama):
    k, max_tokens = 4, 31
    prompts = random_prompts((5, 12, 20, 33), seed=61)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    plain = plain_outputs(tiny_llama, prompts, params)
    engine = stub_engine(tiny_llama, TruePathStub, {tuple(p): o for p, o in zip(prompts, plain)}, k=k, block_size=4,
                         max_num_seqs=4)
    steps = []  # (output tokens after the step, tree, accepted path, tokens emitted)
    record = engine.speculator.record

    def spy(request, tree, path, num_emitted):
        steps.append((request.num_output_tokens, tree, path, num_emitted))
        record(request, tree, path, num_emitted)

    engine.speculator.record = spy
    outputs = engine.generate(prompts, params)
    assert [o.token_ids for o in outputs] == plain
    assert_pool_idle(engine)
    for num_output, tree, path, num_emitted in steps:
        assert len(path) == tree.depth and num_emitted == len(path) + 1
        if num_output < max_tokens:  # a step whose depth max_tokens did not cut drafts k
            assert tree.depth == k
    exact = (max_tokens - 1) / -(-(max_tokens - 1) // (k + 1))  # the first token comes from the prefill, unrecorded
    assert engine.speculator.stats.tau == pytest.approx(exact) and engine.speculator.stats.acceptance_rate < 1
    for o in outputs:
        assert o.metrics["spec"]["tau"] == pytest.approx(exact)
    assert engine.num_moves > 0


# ---- 5. the accepted path's K/V is a fresh prefill's -------------------------------------------------------


def test_kv_after_random_tree_steps_equals_a_fresh_prefill(tiny_llama):
    block_size = 4
    prompts = random_prompts((6, 17, 29), seed=71)
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    plain = plain_outputs(tiny_llama, prompts, params)
    engine = stub_engine(tiny_llama, RandomTreeStub, {tuple(p): o for p, o in zip(prompts, plain)}, seed=3,
                         block_size=block_size)
    for p in prompts:
        engine.add_request(p, params)
    while min(r.num_output_tokens for r in engine.requests.values()) < 30:
        assert not engine.step()
    assert engine.num_moves > 0 and sum(engine.speculator.stats.accepted[1:]) > 0
    fresh = make_engine(tiny_llama, block_size=block_size)
    for request in engine.scheduler.running:
        num = request.num_computed_tokens
        assert num == request.num_tokens - 1 and request.spec.tree  # the newest token waits, with a tree behind it
        rid = fresh.add_request(request.token_ids[:num], SamplingParams(max_tokens=2, ignore_eos=True))
        fresh.step()  # prefills all of it
        ref = fresh.requests[rid]
        assert ref.num_computed_tokens == num

        def kv(e, table):
            slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(num)])
            return e.cache.k[:, slots], e.cache.v[:, slots]

        (k_spec, v_spec), (k_ref, v_ref) = kv(engine, request.block_ids), kv(fresh, ref.block_ids)
        torch.testing.assert_close(k_spec, k_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v_spec, v_ref, atol=1e-5, rtol=1e-5)


# ---- 6. EAGLE-2 trees: paged equals dense ------------------------------------------------------------------


def head_top(head, out, topk, temperature):
    """(log-probabilities, target ids) of the topk most likely drafts after each row of head outputs: MTP reads
    module 0's logits (serve_mode 'reuse_first'), EAGLE-3 maps its draft vocabulary with to_target_ids, the others
    map through the head's token map where it has one."""
    kind = head.config.kind
    logits = head.logits(0, out) if kind == "mtp" else head.logits(out)
    log_probs, best = top_log_probs(logits, topk, temperature)
    if kind == "eagle3":
        best = head.to_target_ids(best)
    elif head.token_map is not None:
        best = head.token_map[best]
    return log_probs.tolist(), best.tolist()


@torch.no_grad()
def dense_candidates(head, states, tokens, budget, topk):
    """EAGLE-2's search after `tokens` (T of them), the head run densely: the pairs (f_p, x_{p+1}) for p in
    [0, T-2] give the newest output, f_p the target's final hidden state h_p (EAGLE-1, MTP) or EAGLE-3's fuse of
    the inputs of its aux layers at p; a node at depth d is the entry (its token, its parent's output) at position
    T-2+d after the context and its path's entries. MTP runs module 0 for every entry. Returns every candidate
    made (tree_search.Candidates)."""
    from heads.attention import DenseCausalAttention

    confidence = Confidence(head, 0.0)
    num = len(tokens) - 1
    if head.config.kind == "eagle3":
        features = head.fuse([states[i][:num] for i in head.config.aux_layers])
    else:
        features = states[-1][:num]
    ids = list(tokens[1:])

    def run(extra_ids, extra_features):
        all_ids = torch.tensor(ids + extra_ids)[None]
        feats = torch.cat([features, *[f[None] for f in extra_features]])[None]
        positions, attention = torch.arange(all_ids.shape[1])[None], DenseCausalAttention()
        if head.config.kind == "mtp":
            return head.forward_module(0, all_ids, feats, positions, attention)[0, -1]
        return head(all_ids, feats, positions, attention)[0, -1]

    def top(out, depth):
        return head_top(head, out, topk, confidence.temperature(depth))

    newest, outputs = run([], []), {}

    def expand(depth, nodes, found):
        rows = []
        for _, c in nodes:
            path = [c]
            while found[0].parents[path[0]] >= 0:
                path.insert(0, found[0].parents[path[0]])
            outputs[c] = run([found[0].tokens[n] for n in path], [newest] + [outputs[n] for n in path[:-1]])
            rows.append(outputs[c])
        return top(torch.stack(rows), depth + 1)

    return grow(top(newest[None], 1), expand, topk, [budget.depth], [confidence.log_threshold_for(budget)])[0]


def compare_candidates(where, paged, dense, tree, dense_tree) -> str | None:
    """A description of the first difference between a drafter's candidates and kept tree and the dense
    reference's: tokens, parents and depths exactly, scores within 2e-5; None if they agree."""
    if (paged.tokens, paged.parents, paged.depths) != (dense.tokens, dense.parents, dense.depths):
        return f"{where}: drafted candidates {paged.tokens} {paged.parents}, dense {dense.tokens} {dense.parents}"
    if not torch.allclose(torch.tensor(paged.scores), torch.tensor(dense.scores), atol=2e-5, rtol=0):
        return f"{where}: drafted scores {paged.scores}, dense {dense.scores}"
    if (tree.tokens, tree.parents) != (dense_tree.tokens, dense_tree.parents):
        return f"{where}: drafted tree {tree.tokens} {tree.parents}, dense {dense_tree.tokens} {dense_tree.parents}"
    return None


def record_trees(drafter, searches):
    """Wraps drafter.propose: every proposal as (request id, its tokens then, its budget, the tree, the
    candidates the search made for it, which the caller's spies put in `searches` in request order)."""
    records, propose = [], drafter.propose

    def spy(ctx, requests, budgets):
        before = {r.request_id: list(r.token_ids) for r in requests}
        searches.clear()
        trees = propose(ctx, requests, budgets)
        assert len(searches) == len(trees)
        records.extend((rid, before[rid], budgets[rid], tree, candidates)
                       for (rid, tree), candidates in zip(trees.items(), searches))
        return trees

    drafter.propose = spy
    return records


TREE_HEAD_KINDS = ["eagle", "eagle3", "mtp"]


def spy_on_grow(searches: list):
    """tree_search.grow, appending every request's candidates to `searches`."""
    def spy(*args, **kwargs):
        found = grow(*args, **kwargs)
        searches.extend(found)
        return found
    return spy


def test_top_log_probs_takes_a_temperature_per_row():
    """The block drafters read every depth's drafts in one call, each row at its depth's calibrated temperature:
    equal bit for bit to one call per temperature, and to a full log-softmax."""
    logits = torch.randn(2, 3, 40, generator=torch.Generator().manual_seed(5)) * 3  # [requests, depths, vocab]
    temperatures = torch.tensor([0.7, 1.0, 1.6])
    log_probs, ids = top_log_probs(logits, 4, temperatures[:, None])
    for d, t in enumerate(temperatures.tolist()):
        alone = top_log_probs(logits[:, d], 4, t)
        assert torch.equal(log_probs[:, d], alone[0]) and torch.equal(ids[:, d], alone[1])
        torch.testing.assert_close(log_probs[:, d], (logits[:, d] / t).log_softmax(-1).gather(-1, ids[:, d]))


def test_each_request_is_cut_at_its_own_threshold():
    """Two requests with the same head outputs, one cut at path probability 0.2 (the adaptive policy's price of a
    row for it) and one not: the cut request's nodes are exactly the other's that score at least 0.2."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 12, generator=generator) * 2  # one row of head logits per node, by node id

    def ranked(rows):
        log_probs, ids = top_log_probs(logits[rows], 3, 1.0)
        return log_probs.tolist(), ids.tolist()

    first = ranked(torch.tensor([0, 0]))
    # a node's children depend on the node (its token and depth), not on where it sits in either request's list
    expand = lambda depth, nodes, found: ranked(torch.tensor([(found[r].tokens[c] * 5 + depth) % 64 for r, c in nodes]))
    uncut, cut = grow(first, expand, 3, [4, 4], [-float("inf"), math.log(0.2)])
    kept = {(t, d, round(s, 9)) for t, d, s in zip(uncut.tokens, uncut.depths, uncut.scores) if s >= math.log(0.2)}
    assert {(t, d, round(s, 9)) for t, d, s in zip(cut.tokens, cut.depths, cut.scores)} == kept
    assert 0 < len(cut.tokens) < len(uncut.tokens) and max(cut.depths) >= 2


def generate_as_plain(engine, folder):
    """Three prompts of different lengths, 10 tokens each: the outputs, checked equal to plain decoding's."""
    prompts = random_prompts((5, 14, 23), seed=81)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    outputs = engine.generate(prompts, params)
    assert [o.token_ids for o in outputs] == plain_outputs(folder, prompts, params)
    return outputs


@pytest.mark.parametrize("kind", TREE_HEAD_KINDS)
def test_eagle_trees_drafted_over_the_pool_equal_the_dense_heads(kind, tiny_llama, heads_root, monkeypatch):
    """Every candidate the search makes (token, parent, depth, score: its path's log-probability under the head)
    and the tree kept, for every proposal of 3 requests under chunked prefill, block size 4: EAGLE-1, EAGLE-3
    (fused aux features, draft vocabulary mapped to the target's) and MTP served 'reuse_first' (module 0 drafts
    every depth)."""
    import serving.drafters.eagle as eagle
    from test_head_drafters import hf_hidden_states, load_as_drafted, random_head_dir

    head_dir = random_head_dir(kind, tiny_llama, heads_root)
    spec = {"method": kind, "model": head_dir, "num_speculative_tokens": 3, "topk": 2, "num_draft_tokens": 7,
            "draft_weights": "float32"}
    engine = make_engine(tiny_llama, spec, block_size=4, max_num_batched_tokens=16)
    drafter, searches = engine.speculator.drafter, []
    assert isinstance(drafter, eagle.EagleDrafter)

    monkeypatch.setattr(eagle, "grow", spy_on_grow(searches))
    records = record_trees(drafter, searches)
    outputs = generate_as_plain(engine, tiny_llama)
    head = load_as_drafted(head_dir, tiny_llama, "float32")
    assert head.config.kind == kind and (kind != "mtp" or head.config.serve_mode == "reuse_first")
    finals = {o.request_id: o.prompt_token_ids + o.token_ids for o in outputs}
    states = {rid: hf_hidden_states(tiny_llama, final) for rid, final in finals.items()}
    mismatches = []
    for rid, tokens, budget, tree, paged in records:
        assert tokens == finals[rid][:len(tokens)]
        dense = dense_candidates(head, states[rid], tokens, budget, topk=2)
        mismatch = compare_candidates(f"request {rid} at T={len(tokens)}", paged, dense, tree,
                                      dense.best(budget.num_nodes))
        if mismatch:
            mismatches.append(mismatch)
    assert len(records) >= 3 * 3
    assert not mismatches, f"{len(mismatches)} of {len(records)} proposals differ:\n" + "\n".join(mismatches)
    full = [tree for _, _, budget, tree, _ in records if budget.depth == 3 and budget.num_nodes == 6]
    assert full and all(len(t) == 6 and max(map(len, t.children)) == 2 and t.depth >= 2 for t in full)


MEDUSA_CHOICES = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]  # in topological order
# confidence_temperatures of the Medusa head. The random head's distributions are nearly flat; read flat at depth 1
# and sharp below it, a node's best child nearly keeps its score, so depth-3 nodes outscore depth-2 ones: the kept
# trees are the best-scored nodes, not the shallowest, and each depth reads its own temperature. (Scores at these
# temperatures differ from the dense ones by < 1e-5.)
MEDUSA_TEMPERATURES = [0.5, 0.04, 0.03]


def medusa_head_dir(folder, root) -> str:
    """random_head_dir's Medusa head (3 heads) with MEDUSA_TEMPERATURES in its config.json, as a fit writes them."""
    import heads
    from test_head_drafters import random_head_dir, target_parts

    path = root / f"medusa-{folder.name}-sharpened"
    if not path.exists():
        head = heads.load(random_head_dir("medusa", folder, root), target=target_parts(folder))
        head.config.confidence_temperatures = list(MEDUSA_TEMPERATURES)
        heads.save(head, path)
    return str(path)


@torch.no_grad()
def dense_medusa_candidates(head, hidden, budget, choices, topk):
    """Medusa's candidates from its heads' logits at `hidden` (h_{T-2}, the target's final hidden state of the
    newest computed token), head d-1 ranking the drafts at depth d, each read at the temperature of depth d.
    Static (`choices`): node [r_1..r_d] is head d-1's r_d-th most likely token (through the head's token map),
    its parent the node [r_1..r_{d-1}], scored by the sum of its ranks' log-probabilities along the path, the
    paths no deeper than the budget in the order given. Dynamic: tree_search.grow over the same ranked lists."""
    confidence = Confidence(head, 0.0)
    logits = head(hidden)  # [num_heads, vocab]

    def target_ids(best):
        return best if head.token_map is None else head.token_map[best]

    if choices is None:
        def top(depth):  # depth d's topk drafts and their log-probabilities, [1, topk]
            log_probs, best = top_log_probs(logits[depth - 1][None], topk, confidence.temperature(depth))
            return log_probs.tolist(), target_ids(best).tolist()

        def expand(depth, nodes, found):
            log_probs, ids = top(depth + 1)
            return log_probs * len(nodes), ids * len(nodes)

        return grow(top(1), expand, topk, [budget.depth], [confidence.log_threshold_for(budget)])[0]
    found, index = Candidates(), {}
    for path in map(tuple, choices):
        depth = len(path)
        if depth > budget.depth:
            continue
        log_probs = torch.log_softmax(logits[depth - 1].double() / confidence.temperature(depth), -1)
        ranked = log_probs.argsort(descending=True)
        parent = index.get(path[:-1], -1)
        score = (found.scores[parent] if parent >= 0 else 0.0) + float(log_probs[ranked[path[-1]]])
        index[path] = found.add(int(target_ids(ranked[path[-1]])), parent, depth, score)
    return found


def token_paths(tree) -> set[tuple[int, ...]]:
    return {tuple(tree.tokens[n] for n in tree.path(i)) for i in range(len(tree))}


@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_medusa_trees_equal_the_dense_heads(mode, tiny_llama, heads_root, monkeypatch):
    """A random Medusa head drafting a static tree (MEDUSA_CHOICES, 3 heads) or EAGLE-2's dynamic one (topk 2, 5
    nodes): every proposal's candidates (tokens, parents, depths exactly, scores within 2e-5) and kept tree equal
    the dense recomputation from the head's logits at h_{T-2} from transformers, for 3 requests under chunked
    prefill, block size 4; outputs are plain greedy decoding's."""
    import serving.drafters.medusa as medusa
    from test_head_drafters import hf_hidden_states, load_as_drafted

    head_dir = medusa_head_dir(tiny_llama, heads_root)
    spec = {"method": "medusa", "model": head_dir, "num_speculative_tokens": 3, "draft_weights": "float32"}
    if mode == "static":
        spec["medusa_choices"], choices, topk = MEDUSA_CHOICES, MEDUSA_CHOICES, None
    else:
        spec.update(topk=2, num_draft_tokens=6)
        choices, topk = None, 2
    engine = make_engine(tiny_llama, spec, block_size=4, max_num_batched_tokens=16)
    drafter, searches = engine.speculator.drafter, []
    assert isinstance(drafter, medusa.MedusaDrafter)
    if mode == "static":
        static = drafter._static

        def spy_static(*args, **kwargs):
            searches.append(static(*args, **kwargs))
            return searches[-1]

        drafter._static = spy_static
    else:
        monkeypatch.setattr(medusa, "grow", spy_on_grow(searches))
    records = record_trees(drafter, searches)
    outputs = generate_as_plain(engine, tiny_llama)
    head = load_as_drafted(head_dir, tiny_llama, "float32")
    finals = {o.request_id: o.prompt_token_ids + o.token_ids for o in outputs}
    states = {rid: hf_hidden_states(tiny_llama, final)[-1] for rid, final in finals.items()}
    mismatches, num_full, num_deep = [], 0, 0
    for rid, tokens, budget, tree, drafted in records:
        assert tokens == finals[rid][:len(tokens)]
        dense = dense_medusa_candidates(head, states[rid][len(tokens) - 2], budget, choices, topk)
        where = f"request {rid} at T={len(tokens)} ({budget})"
        mismatch = compare_candidates(where, drafted, dense, tree, dense.best(budget.num_nodes))
        if mismatch:
            mismatches.append(mismatch)
            continue
        # the shallowest nodes (by depth, then score) are not the tree kept: deeper nodes outscored shallower ones
        num_deep += tree != dense.best(len(dense.tokens)).prefix(budget.num_nodes)
        if mode == "static" and budget.depth == 3 and budget.num_nodes >= len(MEDUSA_CHOICES):
            # the whole static tree, whatever the scores: each choice's path of ranked tokens, once
            num_full += 1
            if len(tree) != len(MEDUSA_CHOICES) or token_paths(tree) != token_paths(DraftTree(dense.tokens, dense.parents)):
                mismatches.append(f"{where}: drafted tree {tree.tokens} {tree.parents} is not medusa_choices'")
        elif mode == "dynamic" and budget.depth == 3 and budget.num_nodes == 5:
            num_full += 1
            if not (len(tree) == 5 and max(map(len, tree.children)) == 2 and tree.depth >= 2):
                mismatches.append(f"{where}: drafted tree {tree.tokens} {tree.parents} is not a full tree")
    assert len(records) >= 3 * 3
    assert not mismatches, f"{len(mismatches)} of {len(records)} proposals differ:\n" + "\n".join(mismatches)
    assert num_full > 0, "no proposal had the full budget: the case tests little"
    assert num_deep > 0, "every tree kept was its shallowest nodes: the case cannot tell best-scored from shallowest"


@pytest.fixture(scope="module")
def heads_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tree_heads")


# ---- 7. bad tree configs -----------------------------------------------------------------------------------

HEAD = '"model": "h"'
BAD_TREE_CONFIGS = [
    ('{"method": "eagle", %s, "topk": 0}' % HEAD, r"topk=0 must be an integer >= 1 \(1: a chain\)"),
    ('{"method": "eagle", %s, "topk": true}' % HEAD, r"topk=True must be an integer >= 1"),
    ('{"method": "eagle", %s, "topk": 2, "num_speculative_tokens": 4, "num_draft_tokens": 4}' % HEAD,
     r"num_draft_tokens=4 cannot hold a path of num_speculative_tokens=4 drafts.*set num_draft_tokens >= 5"),
    ('{"method": "eagle", %s, "num_draft_tokens": 1}' % HEAD, r"num_draft_tokens=1 must be an integer >= 2"),
    ('{"method": "eagle", %s, "topk": 2, "num_speculative_tokens": 3, "num_draft_tokens": 12}' % HEAD,
     r"num_draft_tokens=12 asks for 11 draft nodes but the tree has 10 candidates at most \(topk=2 over 3 depths\)"
     r": set num_draft_tokens <= 11"),
    ('{"method": "mtp", %s, "num_speculative_tokens": 3, "num_draft_tokens": 5}' % HEAD,
     r"asks for 4 draft nodes but the tree has 3 candidates at most \(topk=1 over 3 depths\)"),
    ('{"method": "medusa", %s, "medusa_choices": [[0], [1]], "num_draft_tokens": 4}' % HEAD,
     r"asks for 3 draft nodes but the tree has 2 candidates at most \(its medusa_choices\): set num_draft_tokens <= 3"),
    ('{"method": "medusa", %s, "medusa_choices": [[0], [1, 0]]}' % HEAD,
     r"medusa_choices has \[1, 0\] but not its parent \[1\]: list every prefix"),
    ('{"method": "medusa", %s, "medusa_choices": [[0], [0, -1]]}' % HEAD,
     r"medusa_choices: \[0, -1\] is not a path of ranks \(a non-empty list of integers >= 0\)"),
    ('{"method": "medusa", %s, "medusa_choices": [[0], []]}' % HEAD, r"medusa_choices: \[\] is not a path of ranks"),
    ('{"method": "medusa", %s, "medusa_choices": [0, 1]}' % HEAD, r"medusa_choices: 0 is not a path of ranks"),
    ('{"method": "medusa", %s, "medusa_choices": "[[0]]"}' % HEAD,
     r"medusa_choices='\[\[0\]\]' must be a non-empty list of paths of ranks"),
    ('{"method": "medusa", %s, "medusa_choices": []}' % HEAD, r"medusa_choices=\[\] must be a non-empty list"),
    ('{"method": "medusa", %s, "medusa_choices": [[0], [0]]}' % HEAD, r"medusa_choices lists a path twice: \(0,\)"),
    ('{"method": "medusa", %s, "num_speculative_tokens": 2, "medusa_choices": [[0], [0, 0], [0, 0, 0]]}' % HEAD,
     r"medusa_choices has \[0, 0, 0\] of depth 3 but num_speculative_tokens is 2: raise num_speculative_tokens"),
    ('{"method": "medusa", %s, "medusa_choices": [[0]], "topk": 2}' % HEAD,
     r"give either medusa_choices \(a static tree\) or topk \(a dynamic one\), not both"),
    ('{"method": "eagle", %s, "medusa_choices": [[0]]}' % HEAD,
     r"medusa_choices applies to medusa heads, not 'eagle': use topk and num_draft_tokens"),
    ('{"method": "ngram", "topk": 2}',
     r"draft trees \(topk, medusa_choices\) apply to medusa, eagle, eagle3, mtp, peagle, dflash, dspark heads, not 'ngram': it drafts a chain"),
    ('{"method": "draft_model", %s, "medusa_choices": [[0]]}' % HEAD, r"apply to medusa, eagle, eagle3, mtp, peagle, dflash, dspark heads, not 'draft_model'"),
]


@pytest.mark.parametrize("text, message", BAD_TREE_CONFIGS, ids=range(len(BAD_TREE_CONFIGS)))
def test_bad_tree_configs_are_clear_errors(text, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_json(text)


def test_tree_config_defaults():
    eagle = SpeculativeConfig.from_json('{"method": "eagle", "model": "h", "topk": 2, "num_speculative_tokens": 3}')
    assert eagle.num_draft_tokens == 7 and eagle.max_draft_nodes == 6 and eagle.label() == "eagle top2 n7"
    chain = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 3}')
    assert chain.num_draft_tokens == 4 and chain.max_draft_nodes == 3
    # the largest tree topk 2 over 3 depths can hold: 2 + 2 * 4 candidates
    assert SpeculativeConfig(method="eagle", model="h", topk=2, num_speculative_tokens=3, num_draft_tokens=11).max_draft_nodes == 10
    medusa = SpeculativeConfig.from_json('{"method": "medusa", "model": "h", "medusa_choices": [[1, 0], [0], [1], [0, 0]]}')
    assert medusa.medusa_choices == [(0,), (1,), (1, 0), (0, 0)] and medusa.num_draft_tokens == 5


def test_medusa_choices_deeper_than_the_heads_are_a_clear_error(tiny_llama, tmp_path):
    """A tree no deeper than num_speculative_tokens, itself no more than the head's heads."""
    import heads
    from test_head_drafters import target_parts

    with torch.random.fork_rng():
        torch.manual_seed(0)
        head = heads.Medusa.from_target(target_parts(tiny_llama), num_heads=2)
    head_dir = heads.save(head, tmp_path / "medusa2")
    with pytest.raises(ValueError, match="num_speculative_tokens=3 exceeds this Medusa head's 2 heads"):
        make_engine(tiny_llama, {"method": "medusa", "model": str(head_dir), "num_speculative_tokens": 3,
                                 "medusa_choices": [[0], [0, 0], [0, 0, 0]]})


# ---- 8. DraftTree, greedy verification and AcceptanceStats -------------------------------------------------


def test_draft_tree_structure():
    #        newest
    #       /      \
    #     0(10)    1(11)
    #    /   \       \
    #  2(12) 3(13)   4(14)
    #    |
    #  5(15)
    tree = DraftTree([10, 11, 12, 13, 14, 15], [-1, -1, 0, 0, 1, 2])
    assert len(tree) == 6 and tree.depth == 3
    assert tree.depths == (1, 1, 2, 2, 2, 3)
    assert tree.children == ((0, 1), (2, 3), (4,), (5,), (), (), ())
    assert tree.path(5) == [0, 2, 5] and tree.path(4) == [1, 4] and tree.path(-1) == []
    assert tree.prefix(6) is tree and tree.prefix(10) is tree
    assert tree.prefix(4) == DraftTree([10, 11, 12, 13], [-1, -1, 0, 0])
    assert tree.prefix(6, max_depth=2) == DraftTree([10, 11, 12, 13, 14], [-1, -1, 0, 0, 1])
    # cutting depth renumbers the parents of the nodes kept
    deep_first = DraftTree([1, 2, 3, 4, 5], [-1, 0, 1, -1, 3])
    assert deep_first.prefix(5, max_depth=1) == DraftTree([1, 4], [-1, -1])
    assert deep_first.prefix(5, max_depth=2) == DraftTree([1, 2, 4, 5], [-1, 0, -1, 2])
    assert tree.prefix(0) == DraftTree() and len(DraftTree()) == 0 and DraftTree().depth == 0
    q = torch.eye(6)
    with_q = DraftTree(tree.tokens, tree.parents, q).prefix(6, max_depth=1)
    torch.testing.assert_close(with_q.q, q[[0, 1]])
    chain = DraftTree.chain([7, 8, 9])
    assert chain.parents == (-1, 0, 1) and chain.depths == (1, 2, 3) and chain.path(2) == [0, 1, 2]
    assert DraftTree.chain([]) == DraftTree()


@pytest.mark.parametrize("tokens, parents, message", [
    ([1, 2], [-1, 1], "node 1 of a draft tree has parent 1"),
    ([1, 2], [-1, 2], "node 1 of a draft tree has parent 2"),
    ([1], [-2], "node 0 of a draft tree has parent -2"),
    ([1, 2], [-1], "a draft tree needs one parent per token: 2 tokens, 1 parents"),
])
def test_invalid_draft_trees_raise(tokens, parents, message):
    with pytest.raises(ValueError, match=message):
        DraftTree(tokens, parents)


def test_draft_tree_q_needs_a_row_per_node():
    with pytest.raises(ValueError, match="q has 1 rows for 2 nodes"):
        DraftTree([1, 2], [-1, 0], torch.ones(1, 4))


def test_greedy_tree_verification():
    tree = DraftTree([10, 11, 12, 13, 14, 15], [-1, -1, 0, 0, 1, 2])
    # rows: newest, then nodes 0..5; each the target's argmax there
    assert verify_greedy(tree, [11, 0, 14, 0, 0, 0, 0]) == ([1, 4], [11, 14, 0])
    assert verify_greedy(tree, [10, 12, 0, 15, 0, 0, 9]) == ([0, 2, 5], [10, 12, 15, 9])
    assert verify_greedy(tree, [10, 13, 0, 0, 8, 0, 0]) == ([0, 3], [10, 13, 8])
    assert verify_greedy(tree, [7, 0, 0, 0, 0, 0, 0]) == ([], [7])
    assert verify_greedy(DraftTree(), [3]) == ([], [3])


def test_acceptance_stats_record_trees():
    tree = DraftTree([10, 11, 12, 13, 14, 15], [-1, -1, 0, 0, 1, 2])  # depth 3, node 4 a leaf at depth 2
    stats = AcceptanceStats(4)
    stats.record(tree, [0, 2, 5], 4)  # the whole deepest path: depth 4 was not reached (node 5 has no children)
    stats.record(tree, [1, 4], 3)  # a leaf at depth 2: depth 3 not tried
    stats.record(tree, [0], 2)  # node 0 has children: depth 2 tried and rejected
    stats.record(tree, [], 1)  # nothing accepted, depth 1 tried
    stats.record(DraftTree([5, 6], [-1, -1]), [1], 2)  # a depth-1 tree
    stats.record(DraftTree(), [], 1)  # no drafts
    stats.record(tree, [0, 2], 2)  # a stop cut the emitted tokens
    assert stats.proposed == [6, 5, 5, 0]
    assert stats.reached == [6, 4, 2, 0]
    assert stats.accepted == [5, 3, 1, 0]
    assert stats.num_steps == 7 and stats.num_drafts == 6 and stats.num_emitted == 15
    assert stats.num_draft_tokens == 6 * 5 + 2
    assert stats.rows_per_step == pytest.approx(1 + 32 / 7)
    assert stats.acceptance_rate == pytest.approx(9 / 32)
    assert stats.tau == pytest.approx(15 / 7)
    positions = stats.per_position()
    assert positions[1]["conditional"] == pytest.approx(0.75) and positions[2]["conditional"] == pytest.approx(0.5)
    assert positions[0]["survival"] == pytest.approx(5 / 6)
    assert AcceptanceStats.from_dict(stats.to_dict()).to_dict() == stats.to_dict()


def test_eagle_trees_for_more_requests_than_the_drafter_was_built_for(tiny_llama, heads_root):
    """The head's scratch region holds the nodes of max_num_seqs requests as the engine had it when the drafter was
    built; raised later (as the bench does), the drafter drafts in rounds, and outputs stay plain decoding's."""
    from test_head_drafters import random_head_dir

    prompts = random_prompts((5, 9, 14, 3, 20, 11), seed=21)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    spec = {"method": "eagle", "model": random_head_dir("eagle", tiny_llama, heads_root), "num_speculative_tokens": 3,
            "topk": 2, "num_draft_tokens": 6}
    engine = make_engine(tiny_llama, spec, block_size=4, max_num_seqs=2)
    engine.scheduler.max_num_seqs = 6
    calls = []
    draft = engine.speculator.drafter._draft
    engine.speculator.drafter._draft = lambda ctx, requests, budgets: calls.append(len(requests)) or draft(ctx, requests, budgets)
    assert [o.token_ids for o in engine.generate(prompts, params)] == plain_outputs(tiny_llama, prompts, params)
    assert max(calls) == 2 and calls.count(2) > calls.count(1)  # six running requests, drafted two at a time
    assert_pool_idle(engine)


@pytest.mark.parametrize("seed", range(4))
def test_trees_from_block_marginals_keep_the_most_probable_paths(seed):
    """A block drafter's tree (the product of per-depth marginals along each path) keeps the num_nodes paths of highest
    product among all of them, enumerated by brute force: exactly so where num_nodes <= topk (then the frontier of every
    depth holds each kept node's parent)."""
    generator = torch.Generator().manual_seed(seed)
    depth, topk, num_nodes = 3, 5, 5
    probs = torch.rand(1, depth, topk, generator=generator).sort(-1, descending=True).values
    tokens = torch.randint(0, 100, (1, depth, topk), generator=generator)
    tree = grow_from_marginals(probs.log().tolist(), tokens.tolist(), topk, [-math.inf])[0].best(num_nodes)
    paths = {}
    for length in range(1, depth + 1):
        for ranks in itertools.product(range(topk), repeat=length):
            paths[tuple(tokens[0, d, r].item() for d, r in enumerate(ranks))] = math.prod(
                probs[0, d, r].item() for d, r in enumerate(ranks))
    best = sorted(paths.values(), reverse=True)[:num_nodes]
    got = [paths[tuple(tree.tokens[n] for n in tree.path(i))] for i in range(len(tree))]
    assert sorted(got, reverse=True) == pytest.approx(best)
