"""DFlash: a block [anchor, MASK x (B-1)] drafted in one forward by Qwen3-style layers that attend to K/V projected
from the target's fused features before the anchor, checked against z-lab's layer written out with separate
projections; its defaults (z-lab's spacing) and its config errors."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import heads
from heads import DFlash, DFlashConfig
from heads.attention import DenseContextAttention

SIZES = dict(hidden_size=64, vocab_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
             max_position_embeddings=512)


def test_default_target_layers_are_zlabs_spacing_renumbered():
    # z-lab's build_target_layer_ids(36, 5) = [1, 9, 17, 25, 33] (outputs), the inputs of layers one higher
    assert DFlashConfig(num_target_layers=36, num_layers=5, mask_token_id=0, **SIZES).target_layers == (2, 10, 18, 26, 34)
    assert DFlashConfig(num_target_layers=30, num_layers=3, mask_token_id=0, **SIZES).target_layers == (2, 15, 28)
    assert DFlashConfig(num_target_layers=30, num_layers=1, mask_token_id=0, **SIZES).target_layers == (16,)


@pytest.mark.parametrize("fields, message", [
    (dict(block_size=1), r"block_size=1 must be an integer >= 2"),
    (dict(mask_token_id=256), r"mask_token_id=256 lies outside the target's vocabulary \[0, 256\)"),
    (dict(mask_token_id=None), r"mask_token_id=None lies outside"),
    (dict(target_layers=(1, 4)), r"target_layers=\[1, 4\] must be target layer ids in \[0, 4\)"),
    (dict(num_layers=0), r"num_layers must be a positive integer"),
])
def test_bad_configs_are_clear_errors(fields, message):
    with pytest.raises(ValueError, match=message):
        DFlashConfig(num_target_layers=4, **{"mask_token_id": 3, **fields}, **SIZES)


def zlab_block(head, block_ids, block_positions, states, context_positions, causal):
    """z-lab's DFlashDraftModel.forward written out for one sequence with separate q/k/v projections: the context
    c = hidden_norm(fc(states)); per layer k = k_norm(k_proj([c; input_norm(h)])), v = v_proj([c; input_norm(h)]),
    q = q_norm(q_proj(input_norm(h))), rope at [context positions; block positions]; the block sees all the context
    and itself (causal: the slots up to its own); then o_proj, the MLP, the final norm."""
    c = head.config
    h = head.target.embed(block_ids)
    target_hidden = head.hidden_norm(head.fc(states))
    num_ctx, num_block = len(context_positions), len(block_positions)
    q_size, kv_size = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    cos, sin = head.rope_tables(torch.cat([context_positions, block_positions]), h.dtype)

    def rope(x, cos, sin):
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # rotate_half
        return x * cos + rotated * sin * torch.cat([-torch.ones(half), torch.ones(half)])  # the table negates sin's first half

    mask = torch.ones(num_block, num_ctx + num_block, dtype=torch.bool)
    if causal:
        mask[:, num_ctx:] = torch.ones(num_block, num_block, dtype=torch.bool).tril()
    for layer in head.layers:
        w, b = layer.qkv.weight, layer.qkv.bias
        q_proj, k_proj, v_proj = w[:q_size], w[q_size:q_size + kv_size], w[q_size + kv_size:]
        x = layer.input_norm(h)
        q = layer.q_norm((x @ q_proj.T).unflatten(-1, (c.num_attention_heads, c.head_dim)))
        both = torch.cat([target_hidden, x])
        k = layer.k_norm((both @ k_proj.T).unflatten(-1, (c.num_key_value_heads, c.head_dim)))
        v = (both @ v_proj.T).unflatten(-1, (c.num_key_value_heads, c.head_dim))
        q, k = rope(q, cos[num_ctx:], sin[num_ctx:]), rope(k, cos, sin)
        group = c.num_attention_heads // c.num_key_value_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(c.head_dim)
        attn = scores.masked_fill(~mask, -math.inf).softmax(-1)
        out = torch.einsum("hqk,khd->qhd", attn, v).flatten(-2)
        h = h + layer.o(out)
        gate, up = layer.gate_up(layer.post_norm(h)).chunk(2, dim=-1)
        h = h + layer.down(F.silu(gate) * up)
    return head.norm(h)


@pytest.mark.parametrize("causal", [False, True])
def test_block_forward_equals_zlabs_layer(parts, causal):
    head = DFlash.from_target(parts, num_layers=2, target_layers=(1, 3), block_size=4, mask_token_id=5, causal=causal)
    assert head.config.qk_norm and not head.config.attention_bias  # Qwen3-style whatever the target
    torch.manual_seed(0)
    with torch.no_grad():
        for param in head.parameters():
            param.add_(0.1 * torch.randn(param.shape))
    states = torch.randn(7, 2 * 64)  # the target's layers 1 and 3 at positions 0..6
    block = head.block_ids(torch.tensor(17))
    assert block.tolist() == [17, 5, 5, 5]
    positions = torch.arange(7, 11)
    mask = torch.ones(1, 4, 7 + 4, dtype=torch.bool)
    if causal:
        mask[0, :, 7:] = torch.ones(4, 4, dtype=torch.bool).tril()
    with torch.no_grad():
        fused = head.fuse(states)
        out = head(block[None], positions[None], DenseContextAttention(mask), (fused[None], torch.arange(7)[None]))
        expected = zlab_block(head, block, positions, states, torch.arange(7), causal)
    torch.testing.assert_close(head.norm(out[0]), expected, atol=1e-5, rtol=1e-5)
    assert head.logits(out).shape == (1, 4, parts.vocab_size)


def test_saves_and_loads_with_its_fields(llama_parts, tmp_path):
    head = DFlash.from_target(llama_parts, num_layers=2, block_size=5, mask_token_id=7, causal=True)
    loaded = heads.load(heads.save(head, tmp_path / "dflash"))
    assert isinstance(loaded, DFlash) and loaded.config == head.config
    assert loaded.config.target_layers == (2, 2)  # z-lab's spacing over a 4-layer target: outputs of 1 and 1
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert not any(name.startswith(("embed", "lm_head")) for name in head.state_dict())  # the target's, borrowed
