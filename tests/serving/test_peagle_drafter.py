"""P-EAGLE in the engine (serving/drafters/peagle.py): a block of drafts from one head forward per step.

1. Paged equals dense: every proposal of a random P-EAGLE head (chain, and a tree of topk 2; per-depth calibrated
   temperatures; float32 draft weights), with chunked prefill, four requests at once sharing a cached prefix, makes
   the candidates (tokens, parents, depths; scores within 2e-5) and keeps the tree that `grow_from_marginals` gives
   over the same module run densely with an explicit mask (heads.peagle.block_mask): the pairs (fuse(aux_p), x_{p+1})
   at positions 0..T-2 from transformers' hidden states, then depth - 1 placeholder rows at T-2+d, each seeing the
   context and the placeholders before it. One head forward per drafting step.
2. Greedy outputs are plain decoding's at concurrency 1 and 4, with forced preemption, chunked prefill and prefix-cache
   hits, as a chain and as a tree.
3. Sampled: the law of the two tokens after the prefill's, each step verifying a P-EAGLE tree, is the target's within
   total variation 0.07 (as tests/serving/test_trees.py's engine test, with the head in place of its stub).
4. Serving more drafts than the head was trained for is a clear error.
1-3 also with a Markov head (markov_rank > 0): the dense reference then drafts node by node, each node's children from
its depth's logits plus the bias from its own token (heads.Peagle.depth_logits).
"""
from __future__ import annotations

import pytest
import torch

import heads
from heads.attention import sdpa_gqa
from heads.peagle import block_mask
from serving.drafters.confidence import Confidence, top_log_probs
from serving.drafters.tree_search import grow, grow_from_marginals
from serving.request import SamplingParams

from test_head_drafters import (EAGLE3_AUX, assert_pool_idle, greedy, hf_hidden_states, load_as_drafted, make_engine,
                                perturb, plain_outputs, random_prompts, target_parts)
from test_trees import E2E_PROMPT, E2E_SAMPLES, assert_two_token_law, compare_candidates, two_token_law

PREFIX = random_prompts((21,), seed=31)[0]
PROMPTS = [PREFIX + tail for tail in random_prompts((1, 6, 3, 11, 2, 9), seed=32)] + random_prompts((13, 30), seed=33)
TEMPERATURES = [0.7, 1.4, 2.0, 1.1]


def peagle_head_dir(folder, root, *, num_depths=4, full_vocab=False, markov_rank=0, draft_window=0) -> str:
    """A random P-EAGLE head for the target in `folder` (perturbed weights, a random half of the vocabulary unless
    `full_vocab`, calibrated temperatures per depth, a Markov head of `markov_rank`, a `draft_window`), saved under
    `root`."""
    parts = target_parts(folder)
    path = root / f"peagle-{folder.name}-{num_depths}-{full_vocab}-{markov_rank}-{draft_window}"
    if not path.exists():
        with torch.random.fork_rng():
            torch.manual_seed(11)
            vocab = range(parts.vocab_size) if full_vocab else torch.randperm(parts.vocab_size)[:parts.vocab_size // 2]
            head = heads.Peagle.from_target(parts, draft_token_ids=vocab, aux_layers=EAGLE3_AUX, mask_token_id=5,
                                            num_depths=num_depths, markov_rank=markov_rank, draft_window=draft_window)
        head = perturb(head, seed=12)
        if markov_rank:  # a bias on the scale of the logits' differences, not far above them
            head.markov_out.weight.data.mul_(0.25)
        head.config.confidence_temperatures = TEMPERATURES[:num_depths]
        heads.save(head, path)
    return str(path)


@pytest.fixture(scope="module")
def heads_root(tmp_path_factory):
    return tmp_path_factory.mktemp("peagle_heads")


@torch.no_grad()
def dense_candidates(head, states, tokens, budget, topk):
    """The block search after `tokens` (T of them), the head run densely over its context and placeholders with
    block_mask: every candidate made (tree_search.Candidates)."""
    num, num_masks = len(tokens) - 1, budget.depth - 1
    ids = torch.tensor(list(tokens[1:]) + [head.config.mask_token_id] * num_masks)
    g = torch.cat([head.fuse([states[i][:num] for i in head.config.aux_layers]),
                   head.mask_feature().expand(num_masks, -1)])
    anchors = torch.tensor(list(range(num)) + [num - 1] * num_masks)
    depths = torch.tensor([0] * num + list(range(1, num_masks + 1)))
    mask = block_mask(anchors, depths, torch.ones(len(ids), dtype=torch.bool), head.config.draft_window)
    out = head(ids[None], g[None], (anchors + depths)[None], lambda i, q, k, v: sdpa_gqa(q, k, v, mask[None]))[0]
    confidence = Confidence(head, 0.0)
    rows = [num - 1] + list(range(num, num + num_masks))  # depth d's row
    threshold = [confidence.log_threshold_for(budget)]
    if head.config.markov_rank:
        def top(depth, previous):
            log_probs, best = top_log_probs(head.depth_logits(out[rows[depth]], depth, previous), topk,
                                            confidence.temperature(depth + 1))
            return log_probs.tolist(), head.to_target_ids(best).tolist()

        def expand(depth, nodes, found):
            children = [top(depth, torch.tensor(found[0].tokens[c])) for _, c in nodes]
            return [c[0] for c in children], [c[1] for c in children]

        first = top(0, None)
        return grow(([first[0]], [first[1]]), expand, topk, [budget.depth], threshold)[0]
    log_probs, best = zip(*(top_log_probs(head.logits(out[row]), topk, confidence.temperature(d + 1))
                            for d, row in enumerate(rows)))
    tokens = head.to_target_ids(torch.stack(best))  # [depth, topk]
    return grow_from_marginals([torch.stack(log_probs).tolist()], [tokens.tolist()], topk, threshold)[0]


@pytest.mark.parametrize(("topk", "markov_rank", "draft_window"),
                         [(1, 0, 0), (2, 0, 0), (1, 8, 0), (2, 8, 0), (2, 0, 4)],
                         ids=["chain-marginals", "tree-marginals", "chain-markov", "tree-markov", "tree-window"])
def test_paged_block_drafts_equal_the_dense_forward(topk, markov_rank, draft_window, tiny_llama, heads_root, monkeypatch):
    """The paged block forward against the dense one under block_mask (with a draft window of 4: the window's mask
    too), proposal by proposal."""
    import serving.drafters.peagle as peagle

    head_dir = peagle_head_dir(tiny_llama, heads_root, markov_rank=markov_rank, draft_window=draft_window)
    spec = {"method": "peagle", "model": head_dir, "num_speculative_tokens": 3, "topk": topk,
            "num_draft_tokens": 6 if topk > 1 else 4, "draft_weights": "float32"}
    engine = make_engine(tiny_llama, spec, max_num_seqs=4, max_num_batched_tokens=16)
    drafter = engine.speculator.drafter
    assert isinstance(drafter, peagle.PeagleDrafter)
    searches, records, forwards = [], [], []
    search_name = "grow" if markov_rank else "grow_from_marginals"
    search = getattr(peagle, search_name)
    monkeypatch.setattr(peagle, search_name, lambda *a, **k: searches.extend(found := search(*a, **k)) or found)
    forward = drafter._forward
    drafter._forward = lambda *args: forwards.append(1) or forward(*args)
    propose = drafter.propose

    def spy(ctx, requests, budgets):
        before = {r.request_id: list(r.token_ids) for r in requests}
        searches.clear()
        num_forwards = len(forwards)
        trees = propose(ctx, requests, budgets)
        assert len(forwards) - num_forwards == 1, "one head forward per drafting step"
        records.extend((rid, before[rid], budgets[rid], tree, found)
                       for (rid, tree), found in zip(trees.items(), searches))
        return trees

    drafter.propose = spy
    engine.generate(PROMPTS[:1], greedy(4))  # the shared prefix is cached for the requests after
    outputs = engine.generate(PROMPTS, greedy(12))
    assert [o.token_ids for o in outputs] == plain_outputs(tiny_llama, PROMPTS, 12)
    assert sum(o.metrics["num_cached_tokens"] for o in outputs) >= 20 * 6
    head = load_as_drafted(head_dir, tiny_llama, "float32")
    finals = {o.request_id: o.prompt_token_ids + o.token_ids for o in outputs}
    states = {rid: hf_hidden_states(tiny_llama, final) for rid, final in finals.items()}
    mismatches = []
    for rid, tokens, budget, tree, paged in records:
        if rid not in finals:
            continue  # the warm-up request's
        dense = dense_candidates(head, states[rid], tokens, budget, topk)
        mismatch = compare_candidates(f"request {rid} at T={len(tokens)}", paged, dense, tree,
                                      dense.best(budget.num_nodes))
        if mismatch:
            mismatches.append(mismatch)
    assert len(records) >= 8 * 3
    assert not mismatches, f"{len(mismatches)} of {len(records)} proposals differ:\n" + "\n".join(mismatches)
    num_nodes = spec["num_draft_tokens"] - 1
    full = [tree for _, _, budget, tree, _ in records if budget.depth == 3 and budget.num_nodes == num_nodes]
    assert full and all(len(tree) == num_nodes and tree.depth >= 2 for tree in full)


@pytest.mark.parametrize(("topk", "markov_rank"), [(1, 0), (2, 0), (2, 8)], ids=["chain", "tree", "markov-tree"])
@pytest.mark.parametrize("concurrency", [1, 4])
def test_greedy_outputs_are_plain_decodings(concurrency, topk, markov_rank, tiny_llama, heads_root):
    spec = {"method": "peagle", "model": peagle_head_dir(tiny_llama, heads_root, markov_rank=markov_rank),
            "num_speculative_tokens": 4, "topk": topk}
    # concurrency 4: 8 requests growing to 22-60 tokens in 28 blocks of 4 force preemption
    engine = make_engine(tiny_llama, spec, max_num_seqs=concurrency, max_num_batched_tokens=16,
                         **({"num_blocks": 28, "max_model_len": 96} if concurrency > 1 else {}))
    engine.generate(PROMPTS[:1], greedy(4))
    outputs = engine.generate(PROMPTS, greedy(20))
    assert [o.token_ids for o in outputs] == plain_outputs(tiny_llama, PROMPTS, 20)
    assert_pool_idle(engine)
    assert sum(engine.speculator.stats.proposed) > 0
    assert sum(o.metrics["num_cached_tokens"] for o in outputs) > 0
    if concurrency > 1:
        assert sum(o.metrics["num_preemptions"] for o in outputs) > 0


@pytest.mark.parametrize("markov_rank", [0, 8], ids=["marginals", "markov"])
def test_a_sampled_tree_keeps_the_target_law(markov_rank, v8_target, heads_root):
    """x1 comes from the prefill; the first verify step carries the head's tree (topk 2, 2 depths, 4 nodes), a later
    one a depth-1 tree where x3 is still to come: the law of (x2, x3) is the target's (two_token_law)."""
    params = [SamplingParams(temperature=0.8, top_k=5, seed=i, max_tokens=4, ignore_eos=True)
              for i in range(E2E_SAMPLES)]
    law, _, _ = two_token_law(v8_target, E2E_PROMPT, params[0])
    spec = {"method": "peagle", "model": peagle_head_dir(v8_target, heads_root, num_depths=2, full_vocab=True,
                                                             markov_rank=markov_rank),
            "num_speculative_tokens": 2, "topk": 2, "num_draft_tokens": 5}
    engine = make_engine(v8_target, spec, block_size=4, num_blocks=1024, max_model_len=64, max_num_seqs=256,
                         max_num_batched_tokens=4096)
    outputs = engine.generate([E2E_PROMPT] * E2E_SAMPLES, params)
    assert_pool_idle(engine)
    stats = engine.speculator.stats
    assert stats.proposed[1] == E2E_SAMPLES, "every request verifies a tree of depth 2 after x1 (and later ones)"
    assert 0 < stats.accepted[0] < stats.reached[0] and 0 < stats.accepted[1] < stats.reached[1]
    assert_two_token_law(outputs, law)


def test_more_drafts_than_depths_trained_is_a_clear_error(tiny_llama, heads_root):
    head_dir = peagle_head_dir(tiny_llama, heads_root, num_depths=2, full_vocab=True)
    with pytest.raises(ValueError, match="num_speculative_tokens=3 exceeds the 2 depths .* was trained for"):
        make_engine(tiny_llama, {"method": "peagle", "model": head_dir, "num_speculative_tokens": 3})
