"""EAGLE-1: fc(concat(embed(x_{t+1}), h_t)) into one decoder layer without input norm; logits by the target's LM head."""
from __future__ import annotations

import torch
from heads import Eagle
from heads.attention import DenseCausalAttention


def test_shapes_and_own_tensors(parts, batch):
    input_ids, positions, hidden = batch
    eagle = Eagle.from_target(parts)
    features = eagle(input_ids, hidden, positions, DenseCausalAttention())
    assert features.shape == (2, 9, 64)
    torch.testing.assert_close(eagle.logits(features), parts.lm_head(features))
    names = set(eagle.state_dict())
    assert {"fc.weight", "fc.bias"} <= names
    assert not any(name.startswith(("embed", "norm", "lm_head")) for name in names)
    assert "layer.input_norm.weight" not in names  # no input norm on the fused features
    assert ("layer.qkv.bias" in names) == parts.layer.qkv_bias
    assert ("layer.q_norm.weight" in names) == parts.layer.qk_norm


def test_fc_reads_embedding_then_hidden(llama_parts, batch):
    input_ids, positions, hidden = batch
    eagle = Eagle.from_target(llama_parts)
    seen = []
    eagle.fc.register_forward_hook(lambda module, args, out: seen.append(args[0]))
    eagle(input_ids, hidden, positions, DenseCausalAttention())
    torch.testing.assert_close(seen[0], torch.cat([llama_parts.embed(input_ids), hidden], dim=-1))


def test_dense_equals_step_by_step(parts, batch, assert_causal):
    input_ids, positions, hidden = batch
    eagle = Eagle.from_target(parts)
    with torch.no_grad():
        dense = eagle(input_ids, hidden, positions, DenseCausalAttention())
        assert_causal(dense, lambda t, attention: eagle(
            input_ids[:, t:t + 1], hidden[:, t:t + 1], positions[:, t:t + 1], attention))


def test_flat_tokens_equal_a_batch_row(llama_parts, batch, flat_attention):
    input_ids, positions, hidden = batch
    eagle = Eagle.from_target(llama_parts)
    with torch.no_grad():
        dense = eagle(input_ids, hidden, positions, DenseCausalAttention())
        flat = eagle(input_ids[1], hidden[1], positions[1], flat_attention)
    torch.testing.assert_close(flat, dense[1])


def test_gradients_reach_the_head_only(llama_parts, batch):
    input_ids, positions, hidden = batch
    eagle = Eagle.from_target(llama_parts)
    eagle.logits(eagle(input_ids, hidden, positions, DenseCausalAttention())).logsumexp(-1).sum().backward()
    assert all(param.grad is not None for param in eagle.parameters())
    assert all(param.grad is None for param in llama_parts.parameters())
