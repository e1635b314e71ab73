"""The DFlash drafter in the engine (serving/drafters/dflash.py).

1. Paged equals dense: every proposal of a random DFlash head (bidirectional and causal blocks; chains and topk-2
   trees) makes the candidates (tokens, parents, depths; scores within 2e-5) and keeps the tree that
   `grow_from_marginals` gives over the head run densely on one block [newest, MASK x (B-1)] at positions
   T-1..T+B-2 with the explicit mask (heads.attention.DenseContextAttention: the whole context, the target layers'
   inputs from transformers at positions < T-1, and the block, whole or causal), under chunked prefill, block size 4.
2. Greedy outputs equal plain decoding's at concurrency 1 and 4 (forced preemption, chunked prefill, prompts sharing
   prefixes with earlier ones: prefix-cache hits), chains and trees, and the pool ends idle.
3. Sampled: with a topk-2 tree the law of (x2, x3) after the prefill's x1 is the target's within TV 0.07.
4. A draft length past the block's is a clear error.
"""
from __future__ import annotations

import pytest
import torch

import heads
import serving.drafters.dflash as dflash
from heads.attention import DenseContextAttention
from serving.drafters.confidence import Confidence, top_log_probs
from serving.drafters.tree_search import grow_from_marginals
from serving.request import SamplingParams

from test_head_drafters import (assert_pool_idle, greedy, hf_hidden_states, load_as_drafted, make_engine, perturb,
                                plain_outputs, random_prompts, target_parts)
from test_trees import E2E_PROMPT, assert_two_token_law, compare_candidates, record_trees, two_token_law

BLOCK = 4  # drafts up to 3 tokens


def random_dflash_dir(folder, root, *, causal=False, mask_token_id=7, target_layers=(1, 3), seed=11) -> str:
    path = root / f"dflash-{folder.name}-{'causal' if causal else 'bidirectional'}"
    if not path.exists():
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            head = heads.DFlash.from_target(target_parts(folder), num_layers=2, target_layers=target_layers,
                                            block_size=BLOCK, mask_token_id=mask_token_id, causal=causal)
        heads.save(perturb(head, seed + 1), path)
    return str(path)


@pytest.fixture(scope="module")
def heads_root(tmp_path_factory):
    return tmp_path_factory.mktemp("dflash_heads")


@torch.no_grad()
def dense_block_outputs(head, states, tokens) -> torch.Tensor:
    """[B, hidden] the outputs of the slots of the block after `tokens`, run densely with the explicit mask: the
    context is every position before the newest token."""
    anchor, size = len(tokens) - 1, head.config.block_size
    features = torch.cat([states[i][:anchor] for i in head.config.target_layers], dim=-1)
    context = (head.fuse(features)[None], torch.arange(anchor)[None])
    mask = torch.ones(1, size, anchor + size, dtype=torch.bool)
    if head.config.causal:
        mask[0, :, anchor:] = torch.ones(size, size, dtype=torch.bool).tril()
    return head(head.block_ids(torch.tensor(tokens[-1]))[None], torch.arange(anchor, anchor + size)[None],
                DenseContextAttention(mask), context)[0]


@torch.no_grad()
def dense_block_logits(head, states, tokens) -> torch.Tensor:
    """[B-1, vocab] the head's logits at the mask slots 1..B-1."""
    return head.logits(dense_block_outputs(head, states, tokens)[1:])


def dense_candidates(head, logits, budget, topk):
    confidence = Confidence(head, 0.0)
    depths = range(min(len(logits), budget.depth))
    log_probs, tokens = zip(*(top_log_probs(logits[d], topk, confidence.temperature(d + 1)) for d in depths))
    return grow_from_marginals([torch.stack(log_probs).tolist()], [torch.stack(tokens).tolist()], topk,
                               [confidence.log_threshold_for(budget)])[0]


def proposals_equal_dense(target, spec, module, search, dense_of, monkeypatch) -> list:
    """Generates greedily with the engine (outputs equal to plain decoding), spying on `module`'s `search`; every
    proposal's candidates and kept tree must be those of dense_of(head, the target's hidden states, its tokens, its
    budget). Returns the records (request id, tokens, budget, tree, candidates)."""
    engine = make_engine(target, spec, block_size=4, max_num_batched_tokens=16, max_num_seqs=3)
    searches = []

    def spy(*args, **kwargs):
        found = search(*args, **kwargs)
        searches.extend(found)
        return found

    monkeypatch.setattr(module, search.__name__, spy)
    records = record_trees(engine.speculator.drafter, searches)
    prompts = random_prompts((5, 14, 23), seed=81)
    outputs = engine.generate(prompts, greedy(10))
    assert [o.token_ids for o in outputs] == plain_outputs(target, prompts, 10)
    head = load_as_drafted(spec["model"], target, "float32")
    finals = {o.request_id: o.prompt_token_ids + o.token_ids for o in outputs}
    states = {rid: hf_hidden_states(target, final) for rid, final in finals.items()}
    mismatches = []
    for rid, tokens, budget, tree, paged in records:
        assert tokens == finals[rid][:len(tokens)]
        dense = dense_of(head, states[rid], tokens, budget)
        mismatch = compare_candidates(f"request {rid} at T={len(tokens)}", paged, dense, tree, dense.best(budget.num_nodes))
        if mismatch:
            mismatches.append(mismatch)
    assert len(records) >= 3 * 3
    assert not mismatches, f"{len(mismatches)} of {len(records)} proposals differ:\n" + "\n".join(mismatches)
    return records


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("topk", [1, 2])
def test_paged_blocks_equal_the_dense_head_with_the_explicit_mask(causal, topk, tiny_llama, heads_root, monkeypatch):
    head_dir = random_dflash_dir(tiny_llama, heads_root, causal=causal)
    spec = {"method": "dflash", "model": head_dir, "num_speculative_tokens": 3, "topk": topk,
            "num_draft_tokens": 7 if topk == 2 else 4, "draft_weights": "float32"}
    records = proposals_equal_dense(
        tiny_llama, spec, dflash, grow_from_marginals, lambda head, states, tokens, budget: dense_candidates(
            head, dense_block_logits(head, states, tokens), budget, topk), monkeypatch)
    full = [tree for _, _, budget, tree, _ in records if budget.depth == 3 and budget.num_nodes == 3 * topk]
    assert full and all(len(t) == 3 * topk and t.depth >= 2 for t in full)
    assert topk > 1 or all(t.depth == 3 for t in full)
    if topk == 2:
        assert any(max(map(len, t.children)) == 2 for t in full)


SCENARIOS = {
    # one request at a time; prompts of up to 50 tokens prefill in chunks of 16
    1: dict(max_num_seqs=1, max_num_batched_tokens=16),
    # 4 requests at a time in a pool of 40 blocks of 4: preemption by recompute; a budget of 24 tokens chunks prefills
    4: dict(max_num_seqs=4, max_num_batched_tokens=24, num_blocks=40, max_model_len=96),
}
BASE_PROMPTS = random_prompts((3, 7, 12, 18, 25, 33), seed=5)
# later prompts repeat earlier ones' first 13 tokens: prefix-cache hits on blocks the head's context K/V fill
PROMPTS = BASE_PROMPTS + [p[:13] + tail for p, tail in zip(BASE_PROMPTS[3:], random_prompts((4, 9, 2), seed=6))]


def greedy_speculation_stats(target, spec: dict, concurrency: int, topk: int):
    """Runs PROMPTS greedily under SCENARIOS[concurrency] with `spec` (a tree of topk where topk > 1), checks the
    outputs are plain decoding's, the pool ends idle, prefixes were hit and (at 4) requests preempted; returns the
    speculator's stats."""
    if topk > 1:
        spec = {**spec, "topk": topk, "num_draft_tokens": 8}
    engine = make_engine(target, spec, **SCENARIOS[concurrency])
    outputs = engine.generate(PROMPTS, greedy(24))
    assert [o.token_ids for o in outputs] == plain_outputs(target, PROMPTS, 24)
    assert_pool_idle(engine)
    stats = engine.speculator.stats
    assert sum(stats.proposed) > 0 and stats.num_draft_tokens > 0
    assert sum(o.metrics["num_cached_tokens"] for o in outputs) > 0, "no prefix-cache hit"
    if concurrency == 4:
        assert sum(o.metrics["num_preemptions"] for o in outputs) > 0, "no preemption: the pool is too roomy"
    return stats


@pytest.mark.parametrize("concurrency", [1, 4])
@pytest.mark.parametrize("topk", [1, 3])
def test_greedy_outputs_are_plain_decodings(concurrency, topk, tiny_llama, heads_root):
    spec = {"method": "dflash", "model": random_dflash_dir(tiny_llama, heads_root), "num_speculative_tokens": 3}
    stats = greedy_speculation_stats(tiny_llama, spec, concurrency, topk)
    if topk > 1:
        assert stats.num_draft_tokens > sum(stats.proposed), "trees verify more nodes than depths"


def test_sampled_trees_keep_the_target_law(v8_target, heads_root):
    """x1 comes from the prefill; the DFlash tree after it (topk 2, 2 depths, 5 nodes) is verified by sampling: the
    law of (x2, x3) over 6,000 seeded requests is the target's."""
    num = 6000
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=4, ignore_eos=True) for i in range(num)]
    law, _, _ = two_token_law(v8_target, E2E_PROMPT, params[0])
    head_dir = random_dflash_dir(v8_target, heads_root, mask_token_id=7, target_layers=(0, 2))
    spec = {"method": "dflash", "model": head_dir, "num_speculative_tokens": 2, "topk": 2, "num_draft_tokens": 6}
    engine = make_engine(v8_target, spec, block_size=4, num_blocks=1024, max_model_len=64, max_num_seqs=256,
                         max_num_batched_tokens=4096)
    outputs = engine.generate([E2E_PROMPT] * num, params)
    assert_pool_idle(engine)
    stats = engine.speculator.stats
    assert stats.proposed[0] >= num and 0 < stats.accepted[0] < stats.reached[0] and 0 < stats.accepted[1]
    assert_two_token_law(outputs, law)


def test_a_draft_longer_than_the_block_is_a_clear_error(tiny_llama, heads_root):
    spec = {"method": "dflash", "model": random_dflash_dir(tiny_llama, heads_root), "num_speculative_tokens": 4}
    with pytest.raises(ValueError, match=r"num_speculative_tokens=4 exceeds the 3 drafts of this DFlash head's block"):
        make_engine(tiny_llama, spec)
