"""Sliding-window layers keep their own KV cache group: blocks wholly before every row's window go back to the pool
as a sequence grows, prefix hits cover the blocks a window reads, and every output stays the full-context engine's
and transformers'."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import heads
from serving import targets
from serving import kv_groups
from serving.blocks import BlockManager, KVCacheGroups, SlidingWindowBlockManager
from serving.request import Request, SamplingParams
from serving.targets import build_tiny_model

from engine_helpers import assert_pool_idle, greedy, make_engine, random_prompts

NULL = SlidingWindowBlockManager.NULL


@pytest.fixture(scope="module")
def gemma3_w32(tmp_path_factory):
    """Gemma 3 with windows of 32 keys on layers 0-2 and a global layer 3, positions for 4k-token requests."""
    return build_tiny_model(tmp_path_factory.mktemp("gemma3_w32"), "gemma3_text", sliding_window=32,
                            layer_types=["sliding_attention"] * 3 + ["full_attention"], query_pre_attn_scalar=24,
                            max_position_embeddings=4608)


@pytest.fixture(scope="module")
def all_windowed(tmp_path_factory):
    """Every layer with a window of 12 keys (Mistral's kind): the full-attention group holds no layer."""
    return build_tiny_model(tmp_path_factory.mktemp("all_windowed"), "gemma3_text", sliding_window=12,
                            layer_types=["sliding_attention"] * 4, query_pre_attn_scalar=24)


@pytest.fixture(scope="module")
def all_windowed_draft(tmp_path_factory):
    """all_windowed's architecture with other weights: a draft model whose drafts are mostly rejected."""
    return build_tiny_model(tmp_path_factory.mktemp("all_windowed_draft"), "gemma3_text", seed=1, sliding_window=12,
                            layer_types=["sliding_attention"] * 4, query_pre_attn_scalar=24)


def hf_greedy(folder, prompt, max_new_tokens) -> list[int]:
    """transformers' greedy tokens, each from a forward over the whole sequence without a cache (its generate()
    through the sliding-window cache departs from its own forward once a prompt is over twice the window)."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            tokens.append(int(model(torch.tensor([tokens]), use_cache=False).logits[0, -1].argmax()))
    return tokens[len(prompt):]


def held(table) -> int:
    return sum(block != NULL for block in table)


def step_all(engine, check=lambda engine: None) -> dict:
    """Runs the engine dry, calling `check` after every step; the outputs by request id."""
    outputs = {}
    while engine.has_unfinished():
        for output in engine.step():
            outputs[output.request_id] = output
        check(engine)
    return outputs


# ---- the managers ------------------------------------------------------------------------------------------


def test_window_group_frees_blocks_before_the_next_rows_window_and_keeps_positions_linear():
    manager = SlidingWindowBlockManager(num_blocks=8, block_size=4, window=6, group=1)
    request = Request("a", list(range(30)), SamplingParams())
    request.block_tables = [[], []]
    assert manager.allocate_slots(request, 10)  # positions 0-9
    assert request.block_tables[1] == [1, 2, 3] and manager.num_free_blocks == 5
    request.num_computed_tokens = 10  # the next row sits at 10 and sees 5..10: block 0 (0-3) is out of every window
    assert manager.allocate_slots(request, 3)
    assert request.block_tables[1][0] == NULL and held(request.block_tables[1]) == 3
    request.num_computed_tokens = 13  # sees 8..13: blocks 0 and 1 (4-7) are out
    assert manager.allocate_slots(request, 1)
    assert request.block_tables[1][:2] == [NULL, NULL] and len(request.block_tables[1]) == 4
    assert manager.num_free_blocks == 8 - 2
    manager.free_table(request)
    assert manager.num_free_blocks == 8 and not any(manager.ref_counts)


def window_hit(cached: dict, hashes: list[int], num_blocks: int, num_window_blocks: int) -> int:
    """The reference: the most blocks n <= num_blocks whose last num_window_blocks (all, when fewer) are cached."""
    return max(n for n in range(num_blocks + 1)
               if all(hashes[i] in cached for i in range(max(0, n - num_window_blocks), n)))


def test_a_prefix_hit_needs_the_window_s_blocks_in_every_group():
    """Window 9 over blocks of 4: a row at a block boundary reads the two blocks before it. The first request's early
    windowed blocks were freed but stay registered, so a later request hits the whole prefix; once the windowed
    group has evicted a block inside the window, the hit stops where that group still holds a window's blocks,
    though the full group holds more."""
    groups = KVCacheGroups([BlockManager(32, 4), SlidingWindowBlockManager(12, 4, window=9, group=1)])
    windowed = groups.groups[1]
    prompt = list(range(100, 130))
    first = Request("first", prompt, SamplingParams())
    first.num_computed_tokens = groups.get_computed_tokens(first)
    while first.num_computed_tokens < 28:  # 4 tokens a step, registered after each
        assert groups.allocate_slots(first, 4)
        first.num_computed_tokens += 4
        groups.cache_blocks(first, first.num_computed_tokens)
    window_table, full_table, hashes = list(first.block_tables[1]), list(first.block_ids), list(first.block_hashes)
    # the last allocation saw the next row at 24, whose window starts at 16: blocks 0-3 went back
    assert window_table[:4] == [NULL] * 4 and held(window_table) == 3 and len(full_table) == 7
    groups.free(first)
    second = Request("second", prompt + [1], SamplingParams())
    assert groups.get_computed_tokens(second) == 28
    assert second.block_tables[1] == [NULL] * 5 + window_table[5:7] and second.block_ids == full_table
    groups.free(second)

    victim = window_table[5]  # handing it out evicts block 5's hash from the windowed group only
    other = Request("other", list(range(500, 548)), SamplingParams())
    other.block_tables = [[], []]
    while victim in windowed.free_queue:
        assert windowed.allocate_slots(other, 4 * (len(other.block_tables[1]) + 1))
    assert hashes[5] not in windowed.cached_blocks and hashes[5] in groups.full.cached_blocks
    third = Request("third", prompt + [2], SamplingParams())
    hit = groups.get_computed_tokens(third) // 4
    assert hit == window_hit(windowed.cached_blocks, hashes, 7, 2) < 7
    assert third.block_ids == full_table[:hit] and held(third.block_tables[1]) == min(hit, 2)


def test_pools_are_sized_by_group():
    """One group: the budget's blocks, as before. Gemma 3 270M's layout (window 512 on 15 layers of 18) in 1 GiB:
    the window's group holds max_num_seqs windows when they fit in half the budget, else what half of it holds, and
    the full group the rest; num_blocks set: every group that many."""
    layer_block = 32 * 1024  # one layer's K/V of one block: 16 tokens, one head of 256, float32
    sizes = dict(layer_block_bytes=layer_block, block_size=16, max_model_len=4096, max_num_batched_tokens=512)
    (one,) = kv_groups.plan((0,) * 18, num_blocks=None, memory_bytes=2**30, max_num_seqs=64, **sizes)
    assert one.num_blocks == 2**30 // (18 * layer_block)
    gemma = tuple(0 if i % 6 == 5 else 512 for i in range(18))
    for max_num_seqs, windowed in ((8, 8 * (32 + 2) + 32), (64, int((64 * 34 + 32) * 2**29 / ((64 * 34 + 32) * 15 * layer_block)))):
        full, window = kv_groups.plan(gemma, num_blocks=None, memory_bytes=2**30, max_num_seqs=max_num_seqs, **sizes)
        assert (window.window, len(window.layers), window.num_blocks) == (512, 15, windowed)
        assert full.layers == (5, 11, 17) and full.num_blocks == (2**30 - windowed * 15 * layer_block) // (3 * layer_block)
        assert kv_groups.pool_bytes([full, window], layer_block) <= 2**30 + 15 * layer_block  # and the null block
    assert [g.num_blocks for g in kv_groups.plan(gemma, num_blocks=100, memory_bytes=0, max_num_seqs=1, **sizes)] == [100, 100]


# ---- the engine ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", ["gemma3_w32", "all_windowed"])
def test_windowed_groups_free_blocks_and_decode_as_transformers(fixture, request):
    """Prompts past the window in chunks of 12 tokens (a chunk's rows reach back across the window's edge), blocks
    of 4: the windowed group gives blocks back while the full group keeps them all, and greedy outputs are
    transformers'."""
    folder = request.getfixturevalue(fixture)
    prompts = random_prompts([70, 45, 9], seed=3)
    engine = make_engine(folder, block_size=4, num_blocks=256, max_num_batched_tokens=12, max_model_len=160)
    window = engine.model.config.windows[0]
    assert len(engine.block_manager.groups) == 2 and engine.runner.caches[0].k.shape[0] == (fixture == "gemma3_w32")
    seen = []

    def check(engine):
        for r in engine.scheduler.running:
            table, full = r.block_tables[1], r.block_tables[0]
            assert len(table) == len(full)
            # freed at the last allocation, which saw the next row at most a chunk of 12 before num_computed_tokens
            first_needed = max(0, r.num_computed_tokens - 12 - window + 1) // 4
            assert set(table[:first_needed]) <= {NULL}
            seen.append((held(table), len(full)))

    ids = [engine.add_request(p, greedy(20)) for p in prompts]
    outputs = step_all(engine, check)
    for prompt, rid in zip(prompts, ids):
        assert outputs[rid].token_ids == hf_greedy(folder, prompt, 20)
    assert max(h for h, _ in seen) <= -(-window // 4) + 1 + 3  # a chunk of 12 rows past the window
    assert max(f for _, f in seen) >= 80 // 4 and min(h for h, f in seen if f >= 20) <= -(-window // 4) + 1
    assert_pool_idle(engine)


def test_prefix_hits_and_preemption_on_windowed_models(all_windowed):
    """A long shared prefix is computed once and hit again after its early windowed blocks were freed; a pool too
    small for every request preempts by recompute; outputs stay transformers'."""
    prefix = random_prompts([40], seed=8)[0]
    prompts = [prefix + tail for tail in random_prompts([5, 9, 3, 12], seed=9)]
    engine = make_engine(all_windowed, block_size=4, num_blocks=32, max_num_batched_tokens=16, max_model_len=96)
    first = engine.generate(prompts[:1], greedy(16))[0]
    outputs = engine.generate(prompts, greedy(16))
    assert outputs[0].metrics["num_cached_tokens"] >= 40 - 4
    assert sum(o.metrics["num_preemptions"] for o in outputs) > 0, "no preemption: the pool is too roomy"
    assert first.token_ids == outputs[0].token_ids
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == hf_greedy(all_windowed, prompt, 16)
    assert_pool_idle(engine)


def random_eagle(folder, root) -> str:
    with torch.random.fork_rng():
        torch.manual_seed(4)
        head = heads.Eagle.from_target(heads.load_target_parts(folder, fingerprint=targets.fingerprint(folder)))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in head.parameters():  # away from the target's copied parts: drafts both accepted and rejected
            param.add_(0.1 * torch.randn(param.shape, generator=g))
    return str(heads.save(head, root / f"eagle-{folder.name}"))


@pytest.mark.parametrize("drafter", ["draft_model", "self_draft", "eagle_tree", "early_exit"])
def test_speculation_past_the_window_reproduces_plain_greedy(drafter, all_windowed, all_windowed_draft,
                                                             tmp_path_factory):
    """Chains of a draft model (mostly rejected, and the target itself: always accepted), trees of a random EAGLE
    head and the target's first layers (early exit, writing the target's own windowed pools): verify rows ahead of
    the computed tokens and rollbacks after rejection never need a freed block; a drafter's own pool follows the
    full group's tables; preemption by recompute."""
    spec = {"draft_model": {"method": "draft_model", "model": str(all_windowed_draft), "num_speculative_tokens": 3},
            "self_draft": {"method": "draft_model", "model": str(all_windowed), "num_speculative_tokens": 4},
            "eagle_tree": {"method": "eagle", "model": random_eagle(all_windowed, tmp_path_factory.mktemp("heads")),
                           "num_speculative_tokens": 3, "topk": 3, "num_draft_tokens": 8},
            "early_exit": {"method": "early_exit", "num_layers": 2, "num_speculative_tokens": 3}}[drafter]
    prompts = random_prompts([30, 50, 17, 41], seed=11)
    engine = make_engine(all_windowed, spec, block_size=4, num_blocks=36, max_num_batched_tokens=24, max_model_len=96)
    outputs = engine.generate(prompts, greedy(30))
    plain = make_engine(all_windowed, block_size=4, num_blocks=256, max_model_len=96).generate(prompts, greedy(30))
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    assert sum(o.metrics["num_preemptions"] for o in outputs) > 0, "no preemption: the pool is too roomy"
    stats = engine.speculator.stats
    assert sum(stats.proposed) > 0
    if drafter == "self_draft":
        assert sum(stats.accepted) == sum(stats.proposed)
    else:
        assert sum(stats.accepted) < sum(stats.proposed)  # rollbacks
    assert_pool_idle(engine)


@pytest.mark.parametrize("spec", [None, 3])
def test_a_4k_request_holds_its_window_s_blocks_on_the_windowed_group(gemma3_w32, gemma3_w32_spec_folder, spec):
    """Window 32 over blocks of 16: after every decode step the windowed group holds the blocks from the window of
    the next row to the last draft row, at most window / block_size + 1 (+ the draft rows' blocks), while the full
    group holds every block."""
    config = None if spec is None else {"method": "draft_model", "model": str(gemma3_w32_spec_folder),
                                        "num_speculative_tokens": spec}
    engine = make_engine(gemma3_w32, config, block_size=16, num_blocks=300, max_model_len=4200,
                         max_num_batched_tokens=512)
    prompt = random_prompts([4000], seed=13)[0]
    engine.add_request(prompt, greedy(48))
    counts = []

    def check(engine):
        for r in engine.scheduler.running:
            if r.num_output_tokens < 2:  # not after a decode step yet (the prompt's last chunk emitted one token)
                continue
            # the last allocation saw the next row at num_computed_tokens - 1 (plain decoding: before the step) or
            # num_computed_tokens (the drafts' reservation, after it)
            first = max(0, r.num_computed_tokens - 1 - 32 + 1) // 16
            table, full = r.block_tables[1], r.block_ids
            assert set(table[:first]) <= {NULL} and table == [NULL] * (len(table) - held(table)) + table[-held(table):]
            assert held(table) <= 32 // 16 + 1 + -(-r.spec.tree.num_rows // 16)
            assert len(full) >= (r.num_tokens - 2) // 16 + 1 and len(set(full)) == len(full)  # every position's block
            counts.append(held(table))

    outputs = step_all(engine, check)
    assert len(counts) >= 48 // (1 + (spec or 0)) - 2 and max(counts) <= 32 // 16 + 1 + (spec is not None)
    if spec is None:
        assert max(counts) == 32 // 16 + 1
    tokens = next(iter(outputs.values())).token_ids
    assert len(tokens) == 48
    if spec is not None:
        plain = make_engine(gemma3_w32, block_size=16, num_blocks=300, max_model_len=4200).generate([prompt], greedy(48))
        assert tokens == plain[0].token_ids
    assert_pool_idle(engine)


@pytest.fixture(scope="module")
def gemma3_w32_spec_folder(gemma3_w32):
    return gemma3_w32  # the target as its own draft model: every draft accepted, the tree rows always present
