"""Training P-EAGLE (training/modules/peagle.py): conditional drop-token sampling and the block a batch becomes."""
from __future__ import annotations

import pytest
import torch

import training.modules.peagle as peagle
from training.modules import PeagleModule
from training.modules.peagle import sample_rollouts


@pytest.mark.parametrize("seed", range(3))
def test_each_depth_keeps_a_decaying_share_of_the_depth_before(seed):
    generator = torch.Generator().manual_seed(seed)
    valid = torch.rand(60, 5, generator=generator) < 0.9  # [S, K]
    rollouts = sample_rollouts(valid, 0.7, 0.2, generator)
    n = int(valid[:, 0].sum())
    kept = set(valid[:, 0].nonzero()[:, 0].tolist())
    assert len(rollouts) == 4
    for depth, anchors in enumerate(rollouts, start=1):
        anchors = anchors.tolist()
        assert anchors == sorted(set(anchors))
        eligible = {t for t in kept if valid[t, depth]}
        assert set(anchors) <= eligible  # conditional: among the depth before's, with a valid label here
        assert len(anchors) == min(len(eligible), int((n - depth) * max(0.7 ** depth, 0.2)))
        kept = set(anchors)
    assert len(rollouts[3]) < len(rollouts[0])
    assert sample_rollouts(torch.zeros(10, 3, dtype=torch.bool), 0.7, 0.2) == []


def test_a_batch_becomes_the_block_with_the_papers_mask(monkeypatch):
    """Example 0 of 4 positions with rollouts (1, 1), (2, 1), (1, 2); example 1 padded after 3 positions with one
    rollout (0, 1): every element's token, position and the mask the layer attends with, against hand-built ones."""
    module = PeagleModule(target="debug", draft_vocab_size=1024, mask_token_id=7, num_depths=3)
    seen = {}
    monkeypatch.setattr(peagle, "sdpa_gqa", lambda q, k, v, mask: seen.setdefault("mask", mask) is None or q)
    module.head.register_forward_pre_hook(lambda head, args: seen.update(ids=args[0], positions=args[2]))
    batch = {"input_ids": torch.tensor([[10, 11, 12, 13], [20, 21, 22, 0]]),
             "padding_mask": torch.tensor([[True] * 4, [True, True, True, False]])}
    hidden = {"eagle3": torch.randn(2, 4, 3 * module.head.config.hidden_size)}
    rollouts = [[torch.tensor([1, 2]), torch.tensor([1])], [torch.tensor([0])]]
    _, anchors, depths, is_real = module.block(batch, hidden, rollouts)
    assert anchors.tolist() == [[0, 1, 2, 3, 1, 2, 1], [0, 1, 2, 3, 0, 0, 0]]
    assert depths.tolist() == [[0, 0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 1, 0, 0]]
    assert is_real.tolist() == [[True] * 7, [True, True, True, False, True, False, False]]
    # depth 0 reads x_{t+1} at t; a placeholder the mask token at anchor + depth
    assert seen["ids"].tolist() == [[11, 12, 13, 0, 7, 7, 7], [21, 22, 0, 0, 7, 21, 21]]
    assert seen["positions"].tolist() == [[0, 1, 2, 3, 2, 3, 3], [0, 1, 2, 3, 1, 0, 0]]
    expected = torch.tensor([
        [  # 0  1  2  3 11 21 12
            [1, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0, 0],
            [1, 1, 1, 1, 0, 0, 0],
            [1, 1, 0, 0, 1, 0, 0],  # (1, 1): the context up to anchor 1, itself
            [1, 1, 1, 0, 0, 1, 0],  # (2, 1)
            [1, 1, 0, 0, 1, 0, 1],  # (1, 2): the context up to anchor 1, (1, 1), itself
        ], [  # 0  1  2  pad 01 pad pad
            [1, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0, 0],  # a padded position's row: never read
            [1, 0, 0, 0, 1, 0, 0],  # (0, 1)
            [1, 0, 0, 0, 0, 0, 0],  # padding rows see key 0 only
            [1, 0, 0, 0, 0, 0, 0],
        ]], dtype=torch.bool)
    assert torch.equal(seen["mask"], expected)


def test_a_markov_head_reads_the_label_of_the_depth_before():
    """Each depth d >= 1 element's bias comes from the label of depth d - 1 at its anchor (x_{t+d+1}), the draft a
    chain holds there whenever it reaches depth d; the loss is the depths' mean over those logits."""
    module = PeagleModule(target="debug", draft_vocab_size=1024, mask_token_id=7, num_depths=3, markov_rank=4)
    input_ids = torch.arange(10, 18)[None]  # x_t = 10 + t
    batch = {"input_ids": input_ids, "padding_mask": torch.ones(1, 8, dtype=torch.bool)}
    hidden = {"eagle3": torch.randn(1, 8, 3 * module.head.config.hidden_size)}
    torch.nn.init.normal_(module.head.markov_out.weight)
    calls = []
    depth_logits = module.head.depth_logits
    module.head.depth_logits = lambda out, depth, previous: calls.append((depth, previous.tolist())) or depth_logits(
        out, depth, previous)
    block = module.block(batch, hidden, [[torch.tensor([1, 2]), torch.tensor([1])]])
    last = torch.randn(1, 8, module.head.config.hidden_size)
    loss, terms = module._loss(input_ids, torch.ones(1, 8, dtype=torch.bool), last, *block)
    # depth 1 at anchors 1, 2 predicts x_4, x_5 after x_3, x_4; depth 2 at anchor 1 predicts x_5 after x_4
    assert calls[1:] == [(1, [13, 14]), (2, [14])]
    assert calls[0][0] == 0
    torch.testing.assert_close(loss, sum(terms[f"loss_{d}"] for d in (1, 2, 3)) / 3)
