"""OpenAI's `n` with a drafter: the n samples of one request, added by the server's engine loop as siblings that
share the prompt's blocks, each speculating, keep the target's law at every generated position."""
from __future__ import annotations

import asyncio

import torch
from transformers import AutoModelForCausalLM

from serving.request import SamplingParams
from serving.server.loop import EngineLoop, Failed, Finished, Tokens
from serving.server.protocol import CompletionRequest
from serving.targets import build_tiny_model

from engine_helpers import assert_pool_idle, make_engine
from test_spec import exact_marginals, tv

PROMPT = [3, 5, 1, 6, 2, 7, 4, 0, 3]  # two full blocks of 4 that the siblings take from the prefix cache
NUM_REQUESTS, N, DEPTH = 300, 10, 3


async def answers(loop: EngineLoop, requests: list[CompletionRequest]) -> list[list[int]]:
    """Every sample's tokens, requests submitted at once as the server's handlers submit them."""
    async def one(i: int, body: CompletionRequest) -> list[list[int]]:
        samples = body.samples(DEPTH, False, 0)
        streams = loop.submit(PROMPT, [(f"r{i}-{j}", params) for j, params in enumerate(samples)])
        tokens = []
        for stream in streams:
            sample = []
            while True:
                event = await asyncio.wait_for(stream.get(), 120)
                assert not isinstance(event, Failed), event.message
                if isinstance(event, (Tokens, Finished)):
                    sample += event.token_ids
                if isinstance(event, Finished):
                    break
            tokens.append(sample)
        return tokens
    per_request = await asyncio.gather(*(one(i, body) for i, body in enumerate(requests)))
    return [sample for samples in per_request for sample in samples]


def test_n_samples_with_a_drafter_keep_the_target_law(v8_target, tmp_path):
    draft = build_tiny_model(tmp_path / "draft", "llama", seed=1, vocab_size=8, initializer_range=0.3)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2, "draft_temperature": 1.0}
    engine = make_engine(v8_target, spec, block_size=4, num_blocks=4096, max_model_len=64, max_num_seqs=128,
                         max_num_batched_tokens=8192)
    loop = EngineLoop(engine)
    loop.start()
    try:
        requests = [CompletionRequest(prompt=PROMPT, n=N, seed=N * i, temperature=1.0, max_tokens=DEPTH,
                                      ignore_eos=True) for i in range(NUM_REQUESTS)]
        samples = asyncio.run(answers(loop, requests))
        hits = loop.call(lambda e: e.block_manager.num_cached_blocks).result(10)
    finally:
        loop.stop()
    assert_pool_idle(engine)
    assert len(samples) == NUM_REQUESTS * N and all(len(s) == DEPTH for s in samples)
    assert len({tuple(s) for s in samples[:N]}) > 1, "the samples of one request differ"
    assert hits >= 2, "the siblings' prompt blocks are cached"
    stats = engine.speculator.stats
    assert 0 < sum(stats.accepted) < sum(stats.proposed), "drafts were both accepted and rejected"

    target_hf = AutoModelForCausalLM.from_pretrained(v8_target, dtype=torch.float32).eval()
    laws = exact_marginals(target_hf, PROMPT, SamplingParams(temperature=1.0, max_tokens=DEPTH), DEPTH)
    tokens = torch.tensor(samples)  # [samples, depth]
    distances = [tv(torch.bincount(tokens[:, j], minlength=8), laws[j]) for j in range(DEPTH)]
    # 3,000 draws over 8 tokens: the seeded noise is ~0.015
    assert max(distances) < 0.05, f"TV per generated position {distances}"
