"""P-EAGLE: the EAGLE-3 body drafting a block in one forward; its config's checks, its mask, and its checkpoint."""
from __future__ import annotations

import pytest
import torch

import heads
from heads import Peagle, PeagleConfig
from heads.attention import DenseCausalAttention, sdpa_gqa
from heads.peagle import block_mask

SIZES = dict(hidden_size=64, vocab_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
             max_position_embeddings=512, num_target_layers=4)


def test_config_errors_name_the_fix():
    assert PeagleConfig(mask_token_id=255, **SIZES).num_depths == 4
    with pytest.raises(ValueError, match=r"mask_token_id=256 must be a token id of the target's vocabulary \[0, 256\)"):
        PeagleConfig(mask_token_id=256, **SIZES)
    with pytest.raises(ValueError, match="mask_token_id=None must be a token id"):
        PeagleConfig(**SIZES)
    with pytest.raises(ValueError, match="num_depths=1 must be an integer >= 2"):
        PeagleConfig(mask_token_id=3, num_depths=1, **SIZES)
    with pytest.raises(ValueError, match=r"markov_rank=-1 must be an integer >= 0 \(0: no Markov head\)"):
        PeagleConfig(mask_token_id=3, markov_rank=-1, **SIZES)


def test_the_markov_bias_reads_the_token_before(llama_parts):
    """depth_logits adds markov_out(markov_in[row]) at depths >= 1, row the draft id of the token before or the one
    shared row past the draft vocabulary (markov_rows); a new Markov head adds nothing (markov_out starts at zero)."""
    vocab = list(range(0, 256, 4))  # draft ids 0..63 for target ids 0, 4, ..., 252
    head = Peagle.from_target(llama_parts, mask_token_id=7, draft_token_ids=vocab, markov_rank=3)
    out = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    previous = torch.tensor([8, 9, 252, 0])  # draft ids 2, (outside), 63, 0
    with torch.no_grad():
        torch.testing.assert_close(head.depth_logits(out, 2, previous), head.logits(out))
        head.markov_out.weight.normal_()
        expected = head.logits(out) + head.markov_in.weight[[2, 64, 63, 0]] @ head.markov_out.weight.T
        torch.testing.assert_close(head.depth_logits(out, 1, previous), expected)
        torch.testing.assert_close(head.depth_logits(out, 0, None), head.logits(out))
    assert head.markov_rows(previous).tolist() == [2, 64, 63, 0]
    assert head.markov_in.weight.shape == (65, 3) and head.markov_out.weight.shape == (64, 3)


def test_block_mask_equals_a_hand_built_one():
    # anchors 0..3 at depth 0, then (1, 1), (2, 1), (1, 2), one padding element
    anchors = torch.tensor([0, 1, 2, 3, 1, 2, 1, 0])
    depths = torch.tensor([0, 0, 0, 0, 1, 1, 2, 0])
    is_real = torch.tensor([True] * 7 + [False])
    expected = torch.tensor([
        # 0  1  2  3 11 21 12 pad
        [1, 0, 0, 0, 0, 0, 0, 0],  # (0, 0)
        [1, 1, 0, 0, 0, 0, 0, 0],  # (1, 0)
        [1, 1, 1, 0, 0, 0, 0, 0],  # (2, 0)
        [1, 1, 1, 1, 0, 0, 0, 0],  # (3, 0)
        [1, 1, 0, 0, 1, 0, 0, 0],  # (1, 1): context up to anchor 1, itself
        [1, 1, 1, 0, 0, 1, 0, 0],  # (2, 1)
        [1, 1, 0, 0, 1, 0, 1, 0],  # (1, 2): context up to anchor 1, (1, 1), itself
        [1, 0, 0, 0, 0, 0, 0, 0],  # padding row: key 0 only
    ], dtype=torch.bool)
    assert torch.equal(block_mask(anchors, depths, is_real), expected)


def test_block_mask_with_a_window_sees_only_the_keys_of_each_rows_window():
    """Window 2 over the hand-built block above: element (t, d) sits at position t + d and sees only keys at
    positions t + d - 1 and t + d, of those block_mask allows."""
    anchors = torch.tensor([0, 1, 2, 3, 1, 2, 1, 0])
    depths = torch.tensor([0, 0, 0, 0, 1, 1, 2, 0])
    is_real = torch.tensor([True] * 7 + [False])
    expected = torch.tensor([
        # 0  1  2  3 11 21 12 pad (positions 0 1 2 3 2 3 3)
        [1, 0, 0, 0, 0, 0, 0, 0],  # (0, 0) at 0
        [1, 1, 0, 0, 0, 0, 0, 0],  # (1, 0) at 1
        [0, 1, 1, 0, 0, 0, 0, 0],  # (2, 0) at 2
        [0, 0, 1, 1, 0, 0, 0, 0],  # (3, 0) at 3
        [0, 1, 0, 0, 1, 0, 0, 0],  # (1, 1) at 2: anchor 1 and itself
        [0, 0, 1, 0, 0, 1, 0, 0],  # (2, 1) at 3
        [0, 0, 0, 0, 1, 0, 1, 0],  # (1, 2) at 3: (1, 1) and itself; the context at 0..1 lies outside
        [1, 0, 0, 0, 0, 0, 0, 0],  # padding row: key 0 only
    ], dtype=torch.bool)
    assert torch.equal(block_mask(anchors, depths, is_real, window=2), expected)


def test_a_placeholder_row_sees_its_context_and_rollout_only(llama_parts):
    head = Peagle.from_target(llama_parts, mask_token_id=5, num_depths=3, aux_layers=(0, 1, 3))
    generator = torch.Generator().manual_seed(0)
    num = 6
    ids = torch.randint(3, 256, (num,), generator=generator)
    g = head.fuse(torch.randn(num, 3 * 64, generator=generator))
    # a block: depth 0 at anchors 0..5, then depths 1 and 2 at anchor 3, depth 1 at anchor 4
    anchors = torch.tensor(list(range(num)) + [3, 3, 4])
    depths = torch.tensor([0] * num + [1, 2, 1])
    mask_ids = torch.full((3,), head.config.mask_token_id)
    block_ids = torch.cat([ids, mask_ids])
    block_g = torch.cat([g, head.mask_feature().expand(3, -1)])
    mask = block_mask(anchors, depths, torch.ones(len(anchors), dtype=torch.bool))
    with torch.no_grad():
        out = head(block_ids[None], block_g[None], (anchors + depths)[None],
                   lambda i, q, k, v: sdpa_gqa(q, k, v, mask[None]))[0]
        # depth 0 is EAGLE-3's causal forward, untouched by the placeholders
        plain = head(ids[None], g[None], torch.arange(num)[None], DenseCausalAttention())[0]
        torch.testing.assert_close(out[:num], plain)
        # (3, 2) is the last row of a causal sequence: the context up to anchor 3, then its rollout (3, 1), (3, 2)
        sequence = head(torch.cat([ids[:4], mask_ids[:2]])[None], torch.cat([g[:4], block_g[num:num + 2]])[None],
                        torch.tensor([[0, 1, 2, 3, 4, 5]]), DenseCausalAttention())[0]
        torch.testing.assert_close(out[num + 1], sequence[-1])
        torch.testing.assert_close(out[num], sequence[-2])


def test_checkpoint_round_trip(llama_parts, tmp_path):
    head = Peagle.from_target(llama_parts, mask_token_id=7, num_depths=5, draft_token_ids=range(0, 256, 4),
                              markov_rank=2)
    heads.save(head, tmp_path / "p")
    loaded = heads.load(tmp_path / "p")
    assert isinstance(loaded, Peagle) and loaded.config == head.config
    assert loaded.mask_hidden.shape == (1, 1, 3 * 64)
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
