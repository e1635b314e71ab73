"""Fixtures for the head tests: target parts of the tiny families, transformers' reference outputs, and the
attention callables that check a head's causality (step by step with a K/V cache, flat [num_tokens])."""
from __future__ import annotations

from functools import lru_cache

import pytest
import torch

from heads import load_target_parts
from heads.attention import sdpa_gqa

FAMILIES = ("tiny_llama", "tiny_qwen2", "tiny_qwen3")


@pytest.fixture(params=FAMILIES)
def target_folder(request):
    return request.getfixturevalue(request.param)


@pytest.fixture
def parts(target_folder):
    return load_target_parts(target_folder)


@pytest.fixture
def llama_parts(tiny_llama):
    return load_target_parts(tiny_llama)


@lru_cache(maxsize=None)
def _hf_reference(folder: str):
    """(input_ids [2, 9], hidden_states: embeddings then every layer's input, the last one after the final norm,
    logits [2, 9, vocab]) from transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    input_ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(input_ids, output_hidden_states=True)
    return input_ids, out.hidden_states, out.logits


class StepAttention:
    """Attention for one new token per call: appends its K/V to a per-layer cache and attends over all of it."""

    def __init__(self):
        self.k, self.v = {}, {}

    def __call__(self, layer_idx, q, k, v):
        # q, k, v: [B, 1, heads, head_dim]; every cached key is in the past
        if layer_idx in self.k:
            k, v = torch.cat([self.k[layer_idx], k], dim=1), torch.cat([self.v[layer_idx], v], dim=1)
        self.k[layer_idx], self.v[layer_idx] = k, v
        return sdpa_gqa(q, k, v)


def _flat_causal_attention(layer_idx, q, k, v):
    """The engine's layout for one sequence: q, k, v [num_tokens, heads, head_dim]."""
    return sdpa_gqa(q[None], k[None], v[None], is_causal=True)[0]


def _assert_step_by_step_equals_dense(dense, step):
    """dense: [B, S, hidden]; step(t, attention) -> [B, 1, hidden] for token t alone with a K/V cache."""
    attention = StepAttention()
    for t in range(dense.shape[1]):
        torch.testing.assert_close(step(t, attention)[:, 0], dense[:, t], atol=1e-5, rtol=1e-5)


@pytest.fixture
def batch():
    """input_ids [2, 9], positions [2, 9], hidden [2, 9, 64], seeded."""
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, 256, (2, 9), generator=generator)
    positions = torch.arange(9).expand(2, 9)
    return input_ids, positions, torch.randn(2, 9, 64, generator=generator)


@pytest.fixture
def hf_reference():
    """hf_reference(folder) -> (input_ids, hidden_states, logits), cached per folder."""
    return lambda folder: _hf_reference(str(folder))


@pytest.fixture
def flat_attention():
    return _flat_causal_attention


@pytest.fixture
def assert_causal():
    """assert_causal(dense, step): running token by token with a K/V cache gives the dense outputs."""
    return _assert_step_by_step_equals_dense
