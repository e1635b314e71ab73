"""Medusa: k heads on the target's final hidden state; untrained they repeat the target's own next-token guess."""
from __future__ import annotations

import pytest
import torch

from heads import Medusa, MedusaConfig


@pytest.mark.parametrize("own_lm_head", [False, True])
def test_untrained_heads_repeat_the_targets_guess(target_folder, parts, hf_reference, own_lm_head):
    _, hidden_states, logits = hf_reference(target_folder)
    medusa = Medusa.from_target(parts, num_heads=3, num_layers=2, own_lm_head=own_lm_head)
    out = medusa(hidden_states[-1])  # the hidden state after the final norm
    assert out.shape == (3, 2, 9, 256)
    for head_logits in out:
        torch.testing.assert_close(head_logits, logits)
        assert torch.equal(head_logits.argmax(-1), logits.argmax(-1))


def test_shared_lm_head_stays_out_of_the_head(llama_parts):
    medusa = Medusa.from_target(llama_parts, num_heads=2)
    assert set(medusa.state_dict()) == {f"heads.{i}.0.linear.{p}" for i in range(2) for p in ("weight", "bias")}
    assert all(param.requires_grad for param in medusa.parameters())
    medusa(torch.randn(5, 64)).sum().backward()
    assert llama_parts.lm_head.weight.grad is None


def test_own_lm_heads_start_from_the_targets_and_train(llama_parts):
    medusa = Medusa.from_target(llama_parts, num_heads=2, own_lm_head=True)
    assert {"lm_heads.0.weight", "lm_heads.1.weight"} <= set(medusa.state_dict())
    for lm_head in medusa.lm_heads:
        assert torch.equal(lm_head.weight, llama_parts.lm_head.weight) and lm_head.weight.requires_grad
        assert lm_head.weight.data_ptr() != llama_parts.lm_head.weight.data_ptr()


def test_flat_tokens(llama_parts):
    medusa = Medusa.from_target(llama_parts, num_heads=4)
    assert medusa(torch.randn(7, 64)).shape == (4, 7, 256)


def test_config_validation(llama_parts):
    with pytest.raises(ValueError, match="num_heads must be a positive integer"):
        MedusaConfig.from_target(llama_parts, num_heads=0)


def test_unbound_head_says_how_to_bind(llama_parts):
    medusa = Medusa(MedusaConfig.from_target(llama_parts))
    with pytest.raises(RuntimeError, match="not bound to a target: call head.bind_target"):
        medusa(torch.randn(2, 64))
