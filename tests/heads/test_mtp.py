"""MTP: D chained modules, each eh_proj(concat(enorm(embed), hnorm(h))) -> decoder layer -> own norm -> target LM head."""
from __future__ import annotations

import pytest
import torch

from heads import Mtp, MtpConfig
from heads.attention import DenseCausalAttention


def test_chain_of_modules(parts, batch):
    input_ids, positions, hidden = batch  # hidden: h^0, the target's final hidden state after its norm
    mtp = Mtp.from_target(parts, depth=2)
    h1 = mtp.forward_module(0, input_ids[:, 1:], hidden[:, :-1], positions[:, :-1], DenseCausalAttention())
    h2 = mtp.forward_module(1, input_ids[:, 2:], h1[:, :-1], positions[:, :-2], DenseCausalAttention())
    assert h1.shape == (2, 8, 64) and h2.shape == (2, 7, 64)
    torch.testing.assert_close(mtp.logits(1, h2), parts.lm_head(mtp.blocks[1].norm(h2)))
    assert [block.layer.layer_idx for block in mtp.blocks] == [0, 1]
    names = set(mtp.state_dict())
    assert {"blocks.1.eh_proj.weight", "blocks.1.enorm.weight", "blocks.1.hnorm.weight", "blocks.1.norm.weight",
            "blocks.1.layer.input_norm.weight"} <= names
    assert "blocks.0.eh_proj.bias" not in names
    assert not any(name.startswith(("embed", "lm_head", "norm")) for name in names)


def test_eh_proj_reads_normed_embedding_then_normed_hidden(llama_parts, batch):
    input_ids, positions, hidden = batch
    mtp = Mtp.from_target(llama_parts)
    block = mtp.blocks[0]
    with torch.no_grad():
        block.enorm.weight.uniform_(0.5, 1.5)
        block.hnorm.weight.uniform_(0.5, 1.5)
    seen = []
    block.eh_proj.register_forward_hook(lambda module, args, out: seen.append(args[0]))
    mtp.forward_module(0, input_ids, hidden, positions, DenseCausalAttention())
    torch.testing.assert_close(seen[0], torch.cat([block.enorm(llama_parts.embed(input_ids)), block.hnorm(hidden)], -1))


def test_dense_equals_step_by_step(parts, batch, assert_causal, flat_attention):
    input_ids, positions, hidden = batch
    mtp = Mtp.from_target(parts, depth=2)
    with torch.no_grad():
        for j in range(2):
            dense = mtp.forward_module(j, input_ids, hidden, positions, DenseCausalAttention())
            assert_causal(dense, lambda t, attention: mtp.forward_module(
                j, input_ids[:, t:t + 1], hidden[:, t:t + 1], positions[:, t:t + 1], attention))
            torch.testing.assert_close(mtp.forward_module(j, input_ids[1], hidden[1], positions[1], flat_attention), dense[1])


def test_config_validation(llama_parts):
    with pytest.raises(ValueError, match="serve_mode='tree' is not one of chain, reuse_first"):
        MtpConfig.from_target(llama_parts, serve_mode="tree")
    with pytest.raises(ValueError, match="depth must be a positive integer"):
        MtpConfig.from_target(llama_parts, depth=0)
