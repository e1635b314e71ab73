"""The DSpark drafter in the engine (serving/drafters/dspark.py).

1. Paged equals dense: every proposal of a random DSpark head (anchor-sampling and fill-in slots, with and without a
   confidence head; chains and topk-2 trees) makes the candidates and keeps the tree that the search gives over the
   head run densely on one block at positions T-1..T+B-2 with the explicit mask, each node's children scored from the
   backbone logits of its depth plus the Markov bias of its own token (and the confidence head's survival).
2. Greedy outputs equal plain decoding's at concurrency 1 and 4 (preemption, chunked prefill, prefix-cache hits),
   chains and trees, and the pool ends idle.
3. Sampled: with a topk-2 tree the law of (x2, x3) after the prefill's x1 is the target's within TV 0.07.
4. A draft length past the block's is a clear error; the confidence head's survival cuts chains the adaptive
   policy prices.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import heads
from heads.token_map import lm_head_rows
import serving.drafters.dspark as dspark
import serving.drafters.markov as markov
from serving.drafters.confidence import Confidence, top_log_probs
from serving.drafters.tree_search import grow
from serving.request import SamplingParams

from test_dflash_drafter import dense_block_outputs, greedy_speculation_stats, proposals_equal_dense
from test_head_drafters import assert_pool_idle, make_engine, perturb, target_parts
from test_trees import E2E_PROMPT, assert_two_token_law, two_token_law

BLOCK = 4  # 4 drafts sampling from the anchor, 3 in DFlash's slots


def random_dspark_dir(folder, root, *, anchor=True, confidence=True, mask_token_id=7, target_layers=(1, 3),
                      seed=11, markov_scale=1.0, mapped=False) -> str:
    """A random DSpark head whose Markov bias is as large as the backbone's logits (drafts follow the chain), or
    `markov_scale` times that: a small one moves only near-ties (the drafter reads the shortlist's rows of W2 alone);
    `mapped`: trained over a token map of half the vocabulary (the drafter reads each draft token's bias from its
    table of transitions)."""
    path = root / f"dspark-{folder.name}-{anchor}-{confidence}-{markov_scale}-{mapped}"
    if not path.exists():
        parts, token_map = target_parts(folder), None
        if mapped:
            vocab = len(parts.lm_head.weight)
            token_map = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:vocab // 2]
            parts.lm_head = lm_head_rows(parts.lm_head, token_map)
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            head = heads.DSpark.from_target(parts, token_map, num_layers=2, target_layers=target_layers,
                                            block_size=BLOCK, mask_token_id=mask_token_id, markov_rank=16,
                                            sample_from_anchor=anchor, confidence_head=confidence)
            with torch.no_grad():
                head.markov_w1.weight.normal_(0, 1.0)
        perturb(head, seed + 1)
        with torch.no_grad():
            head.markov_w1.weight.mul_(markov_scale)
        heads.save(head, path)
    return str(path)


@pytest.fixture(scope="module")
def heads_root(tmp_path_factory):
    return tmp_path_factory.mktemp("dspark_heads")


def dense_block_rows(head, states, tokens) -> torch.Tensor:
    """[drafts, hidden] the outputs of the draft slots of the block after `tokens`, run densely."""
    return dense_block_outputs(head, states, tokens)[head.draft_slots]


@torch.no_grad()
def dense_candidates(head, rows, newest, budget, topk, threshold=0.0):
    """The search with every node's children written out from the head's maths: softmax of
    lm_head(norm(row)) + W2 W1[parent token] at the depth's temperature, topk of it; with a confidence head the
    best child scores log sigmoid(w . [norm(row), W1[parent]] + b) and the others that plus their log-ratio."""
    confidence = Confidence(head, threshold)
    w1, w2 = head.markov_w1.weight, head.markov_w2.weight

    def children(depth, previous):
        normed = head.norm(rows[depth])
        logits = normed @ head.target.lm_head.weight.T + w1[previous] @ w2.T
        log_probs, tokens = top_log_probs(logits, topk, confidence.temperature(depth + 1))
        if head.token_map is not None:  # rows of the map -> target ids
            tokens = head.token_map[tokens]
        if head.confidence is not None:
            features = torch.cat([normed, w1[previous]])
            accept = F.logsigmoid(features @ head.confidence.weight[0] + head.confidence.bias[0])
            log_probs = accept + log_probs - log_probs[0]
        return log_probs.tolist(), tokens.tolist()

    def expand(depth, nodes, found):
        pairs = [children(depth, found[0].tokens[node]) for _, node in nodes]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    first = children(0, newest)
    depth = min(len(rows), budget.depth)
    return grow(([first[0]], [first[1]]), expand, topk, [depth], [confidence.log_threshold_for(budget)])[0]


def dense_of(topk, threshold=0.0):
    def candidates(head, states, tokens, budget):
        return dense_candidates(head, dense_block_rows(head, states, tokens), tokens[-1], budget, topk, threshold)
    return candidates


@pytest.mark.parametrize("anchor, confidence", [(True, True), (False, True), (True, False)],
                         ids=["anchor", "fill-in", "no-confidence"])
@pytest.mark.parametrize("topk", [1, 2])
def test_paged_blocks_equal_the_dense_head_with_the_explicit_mask(anchor, confidence, topk, tiny_llama, heads_root,
                                                                  monkeypatch):
    head_dir = random_dspark_dir(tiny_llama, heads_root, anchor=anchor, confidence=confidence)
    spec = {"method": "dspark", "model": head_dir, "num_speculative_tokens": 3, "topk": topk,
            "num_draft_tokens": 7 if topk == 2 else 4, "draft_weights": "float32"}
    records = proposals_equal_dense(tiny_llama, spec, dspark, grow, dense_of(topk), monkeypatch)
    full = [tree for _, _, budget, tree, _ in records if budget.depth == 3 and budget.num_nodes == 3 * topk]
    assert full and all(len(t) == 3 * topk and t.depth >= 2 for t in full)
    if topk == 2:
        assert any(max(map(len, t.children)) == 2 for t in full)


@pytest.mark.parametrize("confidence", [True, False], ids=["confidence", "no-confidence"])
@pytest.mark.parametrize("topk", [1, 2])
def test_a_head_over_a_token_map_reads_each_draft_tokens_bias_from_its_transitions(confidence, topk, tiny_llama,
                                                                                  heads_root, monkeypatch):
    """A head over a token map holds the bias after every token of the map (drafters/markov.py, `Transitions`): only
    a newest token outside the map (half the vocabulary here) pays a product over W2, and the candidates are still
    the dense head's."""
    full_products = []
    make_transitions = markov.Transitions.__init__

    def counting(transitions, w1, w2, token_map):
        make_transitions(transitions, w1, w2, token_map)
        forward = w2.forward
        w2.forward = lambda x: full_products.append(len(x)) or forward(x)

    monkeypatch.setattr(markov.Transitions, "__init__", counting)
    head_dir = random_dspark_dir(tiny_llama, heads_root, confidence=confidence, mapped=True)
    spec = {"method": "dspark", "model": head_dir, "num_speculative_tokens": 3, "topk": topk,
            "num_draft_tokens": 7 if topk == 2 else 4, "draft_weights": "float32"}
    records = proposals_equal_dense(tiny_llama, spec, dspark, grow, dense_of(topk), monkeypatch)
    assert sum(len(tree) for *_, tree, _ in records) > len(records)  # nodes past depth 1 were drafted
    assert 0 < len(full_products) < len(records)  # some newest tokens' children alone (one product per step at most)


@pytest.mark.parametrize("topk", [1, 2])
def test_a_small_markov_bias_drafts_from_the_shortlist_alone(topk, tiny_llama, heads_root, monkeypatch):
    """With a Markov bias that cannot lift a token past the backbone's shortlist (drafters/markov.py), the drafter
    never computes the full product over W2 and reads most nodes' children from the step's table, and its
    candidates are still the dense head's exactly."""
    full_products, lookups = [], []
    make_step, table_get = markov.MarkovStep.__init__, dspark.ChildrenTable.get

    def counting(step, w1, w2):
        make_step(step, w1, w2)
        forward = w2.forward
        w2.forward = lambda x: full_products.append(len(x)) or forward(x)

    def looked_up(table, *args):
        children = table_get(table, *args)
        lookups.append(children is not None)
        return children

    monkeypatch.setattr(markov.MarkovStep, "__init__", counting)
    monkeypatch.setattr(dspark.ChildrenTable, "get", looked_up)
    head_dir = random_dspark_dir(tiny_llama, heads_root, markov_scale=0.01)
    spec = {"method": "dspark", "model": head_dir, "num_speculative_tokens": 3, "topk": topk,
            "num_draft_tokens": 7 if topk == 2 else 4, "draft_weights": "float32"}
    proposals_equal_dense(tiny_llama, spec, dspark, grow, dense_of(topk), monkeypatch)
    assert not full_products
    assert sum(lookups) > 0.8 * len(lookups)


def test_the_confidence_heads_survival_cuts_chains(tiny_llama, heads_root, monkeypatch):
    """With confidence_threshold the chain stops where the product of the confidence head's probabilities falls below
    it, as the dense reference's does: some chains end before their budget."""
    head_dir = random_dspark_dir(tiny_llama, heads_root)
    spec = {"method": "dspark", "model": head_dir, "num_speculative_tokens": 4, "confidence_threshold": 0.2,
            "draft_weights": "float32"}
    records = proposals_equal_dense(tiny_llama, spec, dspark, grow, dense_of(1, threshold=0.2), monkeypatch)
    assert any(0 < len(tree) < budget.chain_length for _, _, budget, tree, _ in records)


@pytest.mark.parametrize("concurrency", [1, 4])
@pytest.mark.parametrize("topk", [1, 3])
def test_greedy_outputs_are_plain_decodings(concurrency, topk, tiny_llama, heads_root):
    spec = {"method": "dspark", "model": random_dspark_dir(tiny_llama, heads_root), "num_speculative_tokens": 4}
    greedy_speculation_stats(tiny_llama, spec, concurrency, topk)


def test_sampled_trees_keep_the_target_law(v8_target, heads_root):
    num = 6000
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=4, ignore_eos=True) for i in range(num)]
    law, _, _ = two_token_law(v8_target, E2E_PROMPT, params[0])
    head_dir = random_dspark_dir(v8_target, heads_root, mask_token_id=7, target_layers=(0, 2))
    spec = {"method": "dspark", "model": head_dir, "num_speculative_tokens": 2, "topk": 2, "num_draft_tokens": 6}
    engine = make_engine(v8_target, spec, block_size=4, num_blocks=1024, max_model_len=64, max_num_seqs=256,
                         max_num_batched_tokens=4096)
    outputs = engine.generate([E2E_PROMPT] * num, params)
    assert_pool_idle(engine)
    stats = engine.speculator.stats
    assert stats.proposed[0] >= num and 0 < stats.accepted[0] < stats.reached[0]
    assert_two_token_law(outputs, law)


def test_a_draft_longer_than_the_block_is_a_clear_error(tiny_llama, heads_root):
    spec = {"method": "dspark", "model": random_dspark_dir(tiny_llama, heads_root, anchor=False),
            "num_speculative_tokens": 4}
    with pytest.raises(ValueError, match=r"num_speculative_tokens=4 exceeds the 3 drafts of this DSpark head's block "
                                         r"\(block_size=4, sample_from_anchor=false\)"):
        make_engine(tiny_llama, spec)
