"""Training DFlash: the blocks' attention mask against one written out by hand, and the weighted loss against its
formula over blocks each run alone on the context before its anchor."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from heads.attention import DenseContextAttention
from training.modules import DFlashModule
from training.modules.dflash import block_mask, slot_weights


def toy_batch(hidden: int, seed: int = 0) -> tuple[dict, dict]:
    """Two sequences of 12 positions (the second padded from 9), answers from position 4, random ids and hidden
    states of the store's two kinds (two aux layers side by side, the last layer)."""
    torch.manual_seed(seed)
    batch_size, num_positions = 2, 12
    ids = torch.randint(20, 200, (batch_size, num_positions))
    padding = torch.ones(batch_size, num_positions, dtype=torch.bool)
    padding[1, 9:] = False
    answer = padding.clone()
    answer[:, :4] = False
    batch = {"input_ids": ids, "padding_mask": padding, "loss_mask": answer}
    states = {"eagle3": torch.randn(batch_size, num_positions, 2 * hidden),
              "last": torch.randn(batch_size, num_positions, hidden)}
    return batch, states


@pytest.mark.parametrize("causal", [False, True])
def test_block_mask_equals_the_hand_built_mask(causal):
    """One sequence of 5 positions, the last padding; blocks of 3 at anchors 2 and 4. Columns: the 5 context positions,
    then block 0's rows, then block 1's."""
    anchors = torch.tensor([[2, 4]])
    padding = torch.tensor([[True, True, True, True, False]])
    o, x = 1, 0
    own = [[o, o, o], [o, o, o], [o, o, o]] if not causal else [[o, x, x], [o, o, x], [o, o, o]]
    none = [[x] * 3] * 3
    context = [[o, o, x, x, x]] * 3 + [[o, o, o, o, x]] * 3  # before each anchor, padding never
    expected = [context[r] + (own[r] + none[r] if r < 3 else none[r - 3] + own[r - 3]) for r in range(6)]
    assert block_mask(anchors, padding, 3, causal).tolist() == [[[bool(v) for v in row] for row in expected]]


def test_slot_weights_decay_from_the_first_draft():
    assert slot_weights(4, 2.0).tolist() == pytest.approx([0.0, 1.0, math.exp(-0.5), math.exp(-1.0)])


def test_loss_is_the_weighted_cross_entropy_of_blocks_that_see_only_the_context_before_their_anchor():
    """Every block run alone, on the context strictly before its anchor with its own rows unmasked, gives the logits of
    the batched forward; the loss is sum over drafted labels of exp(-(k-1)/gamma) * CE / their number, slot 0 left
    out, labels past an answer or the sequence left out."""
    torch.manual_seed(0)
    module = DFlashModule(target="debug", block_size=4, mask_token_id=16, num_anchors=3, gamma=2.0,
                          num_speculative_tokens=3, target_layers=[1, 2])
    with torch.no_grad():
        for param in module.head.parameters():
            param.add_(0.1 * torch.randn(param.shape))
    batch, states = toy_batch(module.head.config.hidden_size)
    ids, answer = batch["input_ids"], batch["loss_mask"]
    batch_size, num_positions = ids.shape
    loss, terms = module._loss(batch, states, ids, answer, torch.Generator().manual_seed(5))
    anchors, is_anchor = module.sample_anchors(answer, torch.Generator().manual_seed(5))
    assert is_anchor.all() and ((anchors >= 3) & (anchors <= 10)).all()  # the next token an answer token
    total, count, weights = 0.0, 0, slot_weights(4, 2.0)
    head = module.head
    with torch.no_grad():
        for b in range(batch_size):
            for a in anchors[b].tolist():
                block = head.block_ids(ids[b, a])
                context = (head.fuse(states["eagle3"][b, :a])[None], torch.arange(a)[None])
                out = head(block[None], torch.arange(a, a + 4)[None], DenseContextAttention(torch.ones(1, 4, a + 4, dtype=torch.bool)), context)
                logits = head.logits(out[0])
                for k in range(1, 4):
                    if a + k < num_positions and answer[b, a + k]:
                        total += float(weights[k] * F.cross_entropy(logits[k], ids[b, a + k]))
                        count += 1
    assert count > 6
    assert float(loss.detach()) == pytest.approx(total / count, rel=1e-4)
    assert set(terms) == {"loss_1", "loss_2", "loss_3", "acc_1", "acc_2", "acc_3"}
