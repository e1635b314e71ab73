"""Training DSpark: the loss against its formula over blocks each run alone on the context before their anchor (the
token loss with the Markov bias of the true previous token, plus the confidence head's cross-entropy against
1 - TV), the validation chain against the same written-out drafts, and the warm start from a DFlash head folder."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import heads
from heads.attention import DenseContextAttention
from training.modules import DFlashModule, DSparkModule

from test_dflash_training import toy_batch


def perturbed(module):
    torch.manual_seed(0)
    with torch.no_grad():
        for param in module.head.parameters():
            param.add_(0.1 * torch.randn(param.shape))
    return module


def block_logits(module, states, ids, b, a, previous):
    """Drafts of the block anchored at a, run alone on the context before it: [(draft j, logits, confidence)]."""
    head = module.head
    c = head.config
    block = head.block_ids(ids[b, a])
    context = (head.fuse(states["eagle3"][b, :a])[None], torch.arange(a)[None])
    mask = torch.ones(1, c.block_size, a + c.block_size, dtype=torch.bool)
    out = head(block[None], torch.arange(a, a + c.block_size)[None], DenseContextAttention(mask), context)[0]
    found = []
    for j in range(1, c.num_drafts + 1):
        row = out[c.draft_slot(j)]
        embed = head.markov_w1.weight[previous(j)]
        logits = head.norm(row) @ module.target_parts.lm_head.weight.T + embed @ head.markov_w2.weight.T
        features = torch.cat([head.norm(row), embed])
        found.append((j, logits, features @ head.confidence.weight[0] + head.confidence.bias[0]))
    return found


@pytest.mark.parametrize("sample_from_anchor", [True, False])
def test_loss_is_the_weighted_token_loss_plus_the_confidence_loss(sample_from_anchor):
    module = perturbed(DSparkModule(target="debug", block_size=4, mask_token_id=16, num_anchors=3, gamma=2.0,
                                    num_speculative_tokens=3, target_layers=[1, 2], markov_rank=8,
                                    sample_from_anchor=sample_from_anchor, confidence_weight=0.5))
    batch, states = toy_batch(module.head.config.hidden_size)
    ids, answer = batch["input_ids"], batch["loss_mask"]
    loss, terms = module._loss(batch, states, ids, answer, torch.Generator().manual_seed(5))
    anchors, _ = module.sample_anchors(answer, torch.Generator().manual_seed(5))
    total, count = 0.0, 0
    with torch.no_grad():
        for b in range(2):
            for a in anchors[b].tolist():
                for j, logits, confidence in block_logits(module, states, ids, b, a, lambda j: ids[b, min(a + j - 1, 11)]):
                    if a + j < ids.shape[1] and answer[b, a + j]:
                        weight = math.exp(-(j - 1) / 2.0)
                        p = module.target_parts.lm_head(states["last"][b, a + j - 1]).softmax(-1)
                        accept = torch.minimum(logits.softmax(-1), p).sum()
                        bce = F.binary_cross_entropy_with_logits(confidence, accept)
                        total += weight * float(F.cross_entropy(logits, ids[b, a + j]) + 0.5 * bce)
                        count += 1
    assert count > 6
    assert float(loss.detach()) == pytest.approx(total / count, rel=1e-4)
    drafts = 4 if sample_from_anchor else 3
    assert {f"acc_{j}" for j in range(1, drafts + 1)} <= set(terms) and "confidence_error" in terms


def test_validation_drafts_follow_the_true_previous_token():
    module = perturbed(DSparkModule(target="debug", block_size=4, mask_token_id=16, num_speculative_tokens=3,
                                    target_layers=[1, 2], markov_rank=8))
    batch, states = toy_batch(module.head.config.hidden_size, seed=1)
    ids = batch["input_ids"]
    with torch.no_grad():
        _, correct, valid, logits = module.validation_outputs(batch, states)
        b, t = 0, 5  # the block anchored at t + 1
        expected = block_logits(module, states, ids, b, t + 1, lambda j: ids[b, min(t + j, 11)])
    for s in range(3):
        rows = valid[..., s].flatten().nonzero().flatten().tolist()  # logits[s]'s rows, in [B, S] order
        torch.testing.assert_close(logits[s][rows.index(b * ids.shape[1] + t)], expected[s][1], atol=1e-4, rtol=1e-4)


def test_warm_starts_from_a_dflash_head_folder(tmp_path):
    dflash = perturbed(DFlashModule(target="debug", block_size=4, mask_token_id=16, target_layers=[1, 2],
                                    num_speculative_tokens=3))
    folder = heads.save(dflash.head, tmp_path / "dflash")
    dspark = DSparkModule(target="debug", block_size=4, mask_token_id=16, target_layers=[1, 2], markov_rank=8,
                          num_speculative_tokens=3, init_from=str(folder))
    dspark.start_from(folder)
    for name, tensor in dflash.head.state_dict().items():
        assert torch.equal(dspark.head.state_dict()[name], tensor), name
    other = DSparkModule(target="debug", block_size=5, mask_token_id=16, target_layers=[1, 2], markov_rank=8)
    with pytest.raises(ValueError, match=r"init_from .*: the DFlash head differs from this DSpark head in block_size"):
        other.start_from(folder)


def test_more_drafts_than_a_block_makes_is_a_clear_error():
    with pytest.raises(ValueError, match=r"num_speculative_tokens=5 exceeds the block's 4 drafts"):
        DSparkModule(target="debug", block_size=4, mask_token_id=16, num_speculative_tokens=5, markov_rank=8)
    DSparkModule(target="debug", block_size=4, mask_token_id=16, num_speculative_tokens=4, markov_rank=8)
