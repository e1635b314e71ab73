"""What the engine tests share: random token prompts, an engine over a tiny target, plain decoding's outputs
(memoized) to compare speculation against, and the check that a finished engine holds no block."""
from __future__ import annotations

import torch

from serving.config import EngineConfig
from serving.engine import Engine
from serving.request import SamplingParams

VOCAB = 256  # the tiny targets' (tests/conftest.py)


def random_prompts(lengths, seed, vocab=VOCAB, low=0) -> list[list[int]]:
    """Prompts of the given lengths, token ids in [low, vocab), seeded."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(low, vocab, (n,), generator=g).tolist() for n in lengths]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def make_engine(folder, spec=None, *, block_size=16, num_blocks=None, max_model_len=128, **kwargs) -> Engine:
    """An engine over a tiny target; num_blocks by default holds 4,096 tokens."""
    if num_blocks is None:
        num_blocks = -(-4096 // block_size)
    return Engine(EngineConfig(str(folder), block_size=block_size, num_blocks=num_blocks, max_model_len=max_model_len,
                               speculative_config=spec, **kwargs))


_PLAIN: dict = {}


def plain_outputs(folder, prompts, params, **engine_settings) -> list[list[int]]:
    """Outputs of the engine without speculation (greedy or seeded: `params` one SamplingParams or one per prompt),
    memoized by target, prompts, params and the engine's settings (make_engine's keywords)."""
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    key = (str(folder), tuple(map(tuple, prompts)), tuple(repr(p) for p in params_list),
           tuple(sorted(engine_settings.items())))
    if key not in _PLAIN:
        engine = make_engine(folder, **engine_settings)
        _PLAIN[key] = [o.token_ids for o in engine.generate(prompts, params_list)]
    return _PLAIN[key]


def assert_pool_idle(engine) -> None:
    """Every request finished: no block of any KV cache group is held, rollback and draft reservations leaked nothing."""
    for bm in engine.block_manager.groups:
        assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)
    assert not engine.scheduler.running and not engine.scheduler.waiting
