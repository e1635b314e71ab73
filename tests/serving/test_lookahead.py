"""Lookahead decoding (serving/drafters/lookahead.py) end to end.

1. Greedy outputs equal plain decoding's (the same engine without speculation) at concurrency 1 and 4, under
   preemption, chunked prefill (budgets too small for the window: candidates only) and block sizes 1, 3 and 16, for
   small windows and the paper's default (W 15, N 5, G 15); window rows are computed and candidates accepted. With
   the adaptive policy too.
2. The window's rows see what the paper's mask says: every logits row the drafter reads (the last level, column i)
   equals transformers' logits at the end of context + level 0's columns 1..i + column i of levels 1..N - 2, the
   Jacobi trajectory behind it, at consecutive positions after the newest token.
3. Repeated text: a target whose next token depends on the current token only (attention outputs zeroed), a prompt
   that repeats a cycle of its greedy map: the pool holds the continuation from the prompt, so the first verify
   step already accepts N - 1 tokens, and tau > 2.
4. The sampled law at temperature 1 is the target's: a vocabulary-8 target, a prompt whose n-grams give every token
   candidates, 6,000 seeded requests: the law of (x2, x3) is sum_x1 p(x1) p(x2 | x1) p(x3 | x1, x2) with p from
   transformers, within TV 0.07, with candidates both accepted and rejected at depths 1 and 2.
5. The window's shape (offsets and rows seen, as llama.cpp's diagram of the mask for W 4, N 4), the pool's
   most-recent-G rule, the trie, DraftTree.prefix keeping the window whole or dropping it, and config defaults and
   errors.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from serving.drafters.lookahead import LookaheadDrafter, NgramPool, trie
from serving.request import SamplingParams
from serving.spec_decode.config import SpeculativeConfig
from serving.spec_decode.tree import DraftTree, LookaheadRows

from test_spec import SCENARIOS, assert_pool_idle, make_engine, plain_outputs, random_prompts
from test_trees import assert_two_token_law, two_token_law

SMALL = {"method": "lookahead", "window": 3, "ngram": 3, "max_candidates": 2}
WIDE = {"method": "lookahead", "window": 5, "ngram": 4, "max_candidates": 3}
DEFAULT = {"method": "lookahead"}


# ---- 1. greedy is plain decoding -------------------------------------------------------------------------------

GREEDY_CASES = [
    # (spec, scenario, block size, max_num_seqs)
    (SMALL, "single", 16, 1),
    (SMALL, "preempt", 3, 4),
    (WIDE, "preempt", 1, 4),
    (WIDE, "batch", 16, 1),
    (DEFAULT, "batch", 16, 4),
    (DEFAULT, "preempt", 16, 4),
    (SMALL, "chunked", 3, 4),
]


@pytest.mark.parametrize("spec, scenario, block_size, max_num_seqs", GREEDY_CASES,
                         ids=[f"W{s.get('window', 15)}-{sc}-bs{b}-seqs{n}" for s, sc, b, n in GREEDY_CASES])
def test_greedy_lookahead_is_plain_decoding(tiny_llama, spec, scenario, block_size, max_num_seqs):
    sc = SCENARIOS[scenario]
    params = SamplingParams(max_tokens=sc["max_tokens"], ignore_eos=True)
    plain = plain_outputs(tiny_llama, sc["prompts"], params)
    num_blocks = -(-sc["pool_tokens"] // block_size) if "pool_tokens" in sc else None
    engine = make_engine(tiny_llama, spec, block_size=block_size, num_blocks=num_blocks,
                         max_model_len=sc.get("max_model_len", 128), max_num_seqs=max_num_seqs, **sc.get("engine", {}))
    outputs = engine.generate(sc["prompts"], params)
    assert [o.token_ids for o in outputs] == plain
    assert_pool_idle(engine)
    stats = engine.speculator.stats
    assert stats.num_lookahead_rows > 0 and sum(stats.accepted) > 0
    assert engine.speculator.drafter.summary()["pool_hits"] > 0
    if scenario == "preempt":
        assert sum(o.metrics["num_preemptions"] for o in outputs) > 0


def test_adaptive_lookahead_is_plain_decoding(tiny_llama):
    """The adaptive policy prices the window's rows as any others (max_draft_nodes counts them): outputs stay plain
    decoding's under preemption."""
    sc = SCENARIOS["preempt"]
    params = SamplingParams(max_tokens=sc["max_tokens"], ignore_eos=True)
    engine = make_engine(tiny_llama, dict(SMALL, adaptive=True), block_size=3, num_blocks=50, max_model_len=96,
                         max_num_seqs=4)
    outputs = engine.generate(sc["prompts"], params)
    assert [o.token_ids for o in outputs] == plain_outputs(tiny_llama, sc["prompts"], params)
    assert_pool_idle(engine)


# ---- 2. the window's rows see the Jacobi trajectory behind them ------------------------------------------------


def test_window_rows_read_the_logits_of_their_trajectory(tiny_llama):
    w, n = WIDE["window"], WIDE["ngram"]
    prompts = random_prompts((9, 20), seed=31)
    engine = make_engine(tiny_llama, WIDE, block_size=3, max_num_seqs=2)
    drafter = engine.speculator.drafter
    observe, seen = drafter.observe, []

    def spy(ctx):
        step = ctx.step
        batch = step.batch
        for i, (request, tree) in enumerate(zip(batch.requests, batch.trees)):
            if tree.lookahead is None:
                continue
            num_real = batch.num_scheduled[i] - batch.num_tree_rows[i]
            newest = int(batch.positions[batch.token_start[i] + num_real - 1])
            first = batch.logits_start[i] + 1 + len(tree)
            seen.append((request.token_ids[:newest + 1], tree.lookahead.tokens,
                         step.out.logits[first:first + w].clone()))
        observe(ctx)

    drafter.observe = spy
    engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert len(seen) > 10
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    for context, tokens, logits in seen:
        level0, levels = tokens[:w - 1], [tokens[w - 1 + j * w:w - 1 + (j + 1) * w] for j in range(n - 2)]
        for i in range(w):
            trajectory = list(level0[:i]) + [level[i] for level in levels]
            with torch.no_grad():
                expected = hf(torch.tensor([context + trajectory])).logits[0, -1]
            torch.testing.assert_close(logits[i], expected, atol=1e-4, rtol=1e-4)


# ---- 3. repeated text: the pool finds the continuation ---------------------------------------------------------


@pytest.fixture(scope="module")
def token_map_llama(tiny_llama, tmp_path_factory):
    """tiny_llama with every attention output zeroed: its next token is a function of the current token alone."""
    folder = tmp_path_factory.mktemp("token_map_llama")
    shutil.copyfile(Path(tiny_llama) / "config.json", folder / "config.json")
    weights = load_file(Path(tiny_llama) / "model.safetensors")
    weights = {name: torch.zeros_like(w) if name.endswith("o_proj.weight") else w for name, w in weights.items()}
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_repeated_text_is_found_in_the_pool(token_map_llama):
    hf = AutoModelForCausalLM.from_pretrained(token_map_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        step = hf(torch.arange(256)[:, None]).logits[:, -1].argmax(-1).tolist()  # token -> its greedy successor
    cycles = []
    for start in range(256):
        orbit = [start]
        while step[orbit[-1]] not in orbit:
            orbit.append(step[orbit[-1]])
        cycles.append(orbit[orbit.index(step[orbit[-1]]):])
    cycle = max(cycles, key=len)
    assert len(cycle) >= 4, cycle
    prompt = cycle * 3
    spec = {"method": "lookahead", "window": 2, "ngram": 4, "max_candidates": 2}
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    engine = make_engine(token_map_llama, spec)
    first_paths = []
    record = engine.speculator.record

    def spy(request, tree, path, num_emitted):
        first_paths.append(len(path))
        record(request, tree, path, num_emitted)

    engine.speculator.record = spy
    [out] = engine.generate([prompt], params)
    assert out.token_ids == plain_outputs(token_map_llama, [prompt], params)[0]
    assert out.token_ids[:len(cycle)] == cycle  # the text repeats on
    assert first_paths[0] == spec["ngram"] - 1, "the first verify step (no Jacobi n-gram yet) accepts a whole candidate"
    assert engine.speculator.stats.tau > 2


# ---- 4. the sampled law -----------------------------------------------------------------------------------------

SAMPLED_PROMPT = [0, 1, 2, 3, 4, 5, 6, 7, 0, 2, 4, 6, 1, 3, 5, 7, 0, 3, 6, 1, 4, 7, 2, 5]  # two followers per token
NUM_SAMPLES = 6000


def test_sampled_lookahead_keeps_the_target_law(v8_target):
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=4, ignore_eos=True) for i in range(NUM_SAMPLES)]
    law, _, _ = two_token_law(v8_target, SAMPLED_PROMPT, params[0])

    engine = make_engine(v8_target, {"method": "lookahead", "window": 2, "ngram": 3, "max_candidates": 2}, block_size=4,
                         num_blocks=2048, max_model_len=64, max_num_seqs=256, max_num_batched_tokens=4096)
    outputs = engine.generate([SAMPLED_PROMPT] * NUM_SAMPLES, params)
    assert_pool_idle(engine)
    stats = engine.speculator.stats
    assert stats.num_lookahead_rows > 0
    assert 0 < stats.accepted[0] < stats.reached[0] and 0 < stats.accepted[1] < stats.reached[1]
    assert_two_token_law(outputs, law)


# ---- 5. the window, the pool, the trie, the tree, the config ----------------------------------------------------


def test_window_rows_follow_the_papers_mask():
    """W 4, N 4 (llama.cpp's example has W 5): level 0 columns 1..3 at offsets 1..3, then levels 1 and 2 of 4
    columns; a row sees level 0 up to its column, then its column at the levels up to its own."""
    drafter = LookaheadDrafter(SpeculativeConfig(method="lookahead", window=4, ngram=4, max_candidates=2))
    assert drafter.offsets == (1, 2, 3, 1, 2, 3, 4, 2, 3, 4, 5)
    assert drafter.sees == ((0,), (0, 1), (0, 1, 2),
                            (3,), (0, 4), (0, 1, 5), (0, 1, 2, 6),
                            (3, 7), (0, 4, 8), (0, 1, 5, 9), (0, 1, 2, 6, 10))


def test_pool_keeps_the_most_recent_followers():
    pool = NgramPool(3, max_per_key=2)
    pool.extend([1, 2, 3, 1, 4, 5, 1, 2, 3])  # followers of 1: (2, 3), (4, 5), (2, 3) again: most recent
    assert pool.candidates(1) == [(2, 3), (4, 5)]
    pool.add(1, (6, 7))  # full: the oldest goes
    assert pool.candidates(1) == [(6, 7), (2, 3)]
    pool.extend([1, 2, 3, 1, 4, 5, 1, 2, 3, 9])  # only the new n-gram (2, 3, 9)
    assert pool.candidates(2) == [(3, 9), (3, 1)] and pool.candidates(1) == [(6, 7), (2, 3)]


def test_candidates_merge_into_a_trie():
    assert trie([(5, 6, 7), (5, 6, 8), (9, 1, 2)], 10, 3) == ([5, 6, 7, 8, 9, 1, 2], [-1, 0, 1, 1, -1, 4, 5])
    assert trie([(5, 6, 7), (5, 6, 8), (9, 1, 2)], 5, 3) == ([5, 6, 7, 8, 9], [-1, 0, 1, 1, -1])
    assert trie([(5, 6, 7), (5, 8, 8)], 10, 2) == ([5, 6, 8], [-1, 0, 0])


def test_a_tree_keeps_its_window_whole_or_drops_it():
    window = LookaheadRows((4, 4, 4), (1, 1, 2), ((0,), (1,), (0, 2)), 2)
    tree = DraftTree((7, 8, 9), (-1, 0, -1), lookahead=window)
    assert (len(tree), tree.num_rows, bool(DraftTree(lookahead=window))) == (3, 6, True)
    assert tree.prefix(6) is tree
    assert tree.prefix(5).lookahead is window and tree.prefix(5).tokens == (7, 8)
    assert tree.prefix(6, max_depth=1).tokens == (7, 9)
    assert tree.prefix(2).lookahead is None and tree.prefix(2).tokens == (7, 8)
    with pytest.raises(ValueError, match="itself last"):
        LookaheadRows((4, 4), (1, 2), ((0,), (1, 0)), 1)


def test_lookahead_config_defaults_and_errors():
    config = SpeculativeConfig.from_json('{"method": "lookahead"}')
    assert (config.window, config.ngram, config.max_candidates) == (15, 5, 15)  # the paper's, for 7B models
    assert (config.num_speculative_tokens, config.num_draft_tokens) == (4, 61)
    assert (config.num_lookahead_rows, config.max_draft_nodes, config.label()) == (59, 119, "lookahead W15 N5 G15")
    small = SpeculativeConfig.from_json(SMALL)
    assert (small.num_speculative_tokens, small.max_draft_nodes, small.label()) == (2, 9, "lookahead W3 N3 G2")
    assert SpeculativeConfig(method="ngram").num_speculative_tokens == 4
    for values, message in [
        ({"method": "ngram", "window": 3}, "window applies to lookahead, not 'ngram'"),
        ({"method": "lookahead", "ngram": 2}, r"ngram=2 must be an integer >= 3"),
        ({"method": "lookahead", "window": 0}, r"window=0 must be an integer >= 1"),
        ({"method": "lookahead", "max_candidates": 1.5}, r"max_candidates=1.5 must be an integer >= 1"),
        ({"method": "lookahead", "ngram": 3, "num_speculative_tokens": 3},
         "exceeds lookahead's candidates of ngram - 1 = 2"),
        ({"method": "lookahead", "num_draft_tokens": 62}, r"60 candidates at most \(max_candidates=15 of 4 tokens\)"),
        ({"method": "lookahead", "topk": 2}, "its tree is its candidates' trie"),
    ]:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.from_json(values)
