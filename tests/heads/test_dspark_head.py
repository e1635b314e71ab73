"""DSpark: DFlash's block forward plus a rank-r transition bias from the previous token and a confidence logit,
checked against the maths written out with plain matrix products; which slot drafts which token; saving and
loading; the warm start from a DFlash head; config errors."""
from __future__ import annotations

import pytest
import torch

import heads
from heads import DFlash, DSpark, DSparkConfig
from heads.attention import DenseContextAttention

SIZES = dict(hidden_size=64, vocab_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
             max_position_embeddings=512, num_target_layers=4)


def perturbed(head, seed=0):
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in head.parameters():
            param.add_(0.1 * torch.randn(param.shape))
    return head


@pytest.mark.parametrize("sample_from_anchor, slots, num_drafts", [(True, [0, 1, 2, 3], 4), (False, [1, 2, 3], 3)])
def test_which_slot_drafts_which_token(sample_from_anchor, slots, num_drafts):
    config = DSparkConfig(mask_token_id=3, block_size=4, sample_from_anchor=sample_from_anchor, **SIZES)
    assert config.num_drafts == num_drafts
    assert [config.draft_slot(j) for j in range(1, num_drafts + 1)] == slots
    assert config.markov_rank == 256 and config.confidence_head and config.confidence_with_markov  # speculators'


@pytest.mark.parametrize("with_markov", [True, False])
def test_logits_and_confidence_are_the_backbone_plus_the_transition_bias(llama_parts, with_markov):
    head = perturbed(DSpark.from_target(llama_parts, num_layers=2, block_size=4, mask_token_id=5, markov_rank=8,
                                        confidence_with_markov=with_markov))
    states = torch.randn(6, 2 * 64)
    block, positions = head.block_ids(torch.tensor(17)), torch.arange(6, 10)
    with torch.no_grad():
        out = head(block[None], positions[None], DenseContextAttention(torch.ones(1, 4, 10, dtype=torch.bool)),
                   (head.fuse(states)[None], torch.arange(6)[None]))[0]
        previous = torch.tensor([17, 40, 41, 42])  # the anchor, then drafts 1..3
        embed = head.markov_embed(previous)
        logits = head.markov_logits(out, embed)
        confidence = head.confidence_logit(out, embed)
    normed = head.norm(out)
    w1, w2 = head.markov_w1.weight, head.markov_w2.weight  # [vocab, r], [vocab, r]
    expected = normed @ llama_parts.lm_head.weight.T + w1[previous] @ w2.T
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    features = torch.cat([normed, w1[previous]], -1) if with_markov else normed
    torch.testing.assert_close(confidence, features @ head.confidence.weight[0] + head.confidence.bias[0])
    assert head.confidence.in_features == 64 + (8 if with_markov else 0)


def test_saves_and_loads_with_its_fields(llama_parts, tmp_path):
    head = perturbed(DSpark.from_target(llama_parts, num_layers=1, block_size=5, mask_token_id=7, markov_rank=16,
                                        sample_from_anchor=False, confidence_with_markov=False))
    loaded = heads.load(heads.save(head, tmp_path / "dspark"))
    assert isinstance(loaded, DSpark) and loaded.config == head.config
    assert set(loaded.state_dict()) >= {"markov_w1.weight", "markov_w2.weight", "confidence.weight",
                                        "confidence.bias"}
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_a_head_without_confidence_saves_no_confidence_tensors(llama_parts, tmp_path):
    head = DSpark.from_target(llama_parts, block_size=3, mask_token_id=7, markov_rank=4, confidence_head=False)
    loaded = heads.load(heads.save(head, tmp_path / "dspark"))
    assert loaded.confidence is None and not any(name.startswith("confidence") for name in loaded.state_dict())


def test_warm_start_copies_a_dflash_heads_tensors(llama_parts):
    dflash = perturbed(DFlash.from_target(llama_parts, num_layers=2, block_size=4, mask_token_id=5))
    dspark = DSpark.from_target(llama_parts, num_layers=2, block_size=4, mask_token_id=5, markov_rank=8)
    fresh_w2 = dspark.markov_w2.weight.clone()
    dspark.warm_start(dflash)
    for name, tensor in dflash.state_dict().items():
        assert torch.equal(dspark.state_dict()[name], tensor), name
    assert torch.equal(dspark.markov_w2.weight, fresh_w2)  # the Markov head starts fresh


def test_warm_start_refuses_a_dflash_head_of_another_shape(llama_parts):
    dflash = DFlash.from_target(llama_parts, num_layers=1, block_size=6, mask_token_id=5)
    dspark = DSpark.from_target(llama_parts, num_layers=1, block_size=4, mask_token_id=5, markov_rank=8)
    with pytest.raises(ValueError, match=r"differs from this DSpark head in block_size \(6 vs 4\)"):
        dspark.warm_start(dflash)


@pytest.mark.parametrize("fields, message", [
    (dict(markov_rank=0), r"markov_rank=0 must be a positive integer"),
    (dict(causal=True), r"causal=true: DSpark's blocks attend bidirectionally"),
    (dict(sample_from_anchor=1), r"sample_from_anchor=1 must be true or false"),
])
def test_bad_configs_are_clear_errors(fields, message):
    with pytest.raises(ValueError, match=message):
        DSparkConfig(mask_token_id=3, **fields, **SIZES)


def test_warm_start_refuses_a_dflash_head_over_another_token_map(tiny_llama):
    from heads.token_map import lm_head_rows

    ids = torch.arange(10, 60)
    parts = heads.load_target_parts(tiny_llama)
    parts.lm_head = lm_head_rows(parts.lm_head, ids)
    dflash = DFlash.from_target(parts, ids, num_layers=1, block_size=4, mask_token_id=5)
    dspark = DSpark.from_target(parts, ids.flip(0), num_layers=1, block_size=4, mask_token_id=5, markov_rank=8)
    with pytest.raises(ValueError, match="drafts over another token map than this DSpark head"):
        dspark.warm_start(dflash)
