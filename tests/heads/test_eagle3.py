"""EAGLE-3: fused low/middle/high target layers, a 2h-wide attention input, its own norm and reduced-vocabulary LM head."""
from __future__ import annotations

import pytest
import torch

from heads import Eagle3, Eagle3Config
from heads.attention import DenseCausalAttention


def test_default_aux_layers():
    sizes = dict(hidden_size=64, vocab_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                 max_position_embeddings=512)
    assert Eagle3Config(num_target_layers=32, **sizes).aux_layers == (2, 16, 29)
    assert Eagle3Config(num_target_layers=4, **sizes).aux_layers == (2, 2, 1)
    assert Eagle3Config(num_target_layers=4, **sizes).draft_vocab_size == 256
    with pytest.raises(ValueError, match="aux_layers=\\(2, 1, -1\\) must be target layer ids in \\[0, 2\\)"):
        Eagle3Config(num_target_layers=2, **sizes)
    with pytest.raises(ValueError, match="draft_vocab_size=300 exceeds the target's vocab_size=256"):
        Eagle3Config(num_target_layers=4, draft_vocab_size=300, **sizes)


def test_forward_on_the_targets_aux_states(target_folder, parts, hf_reference):
    input_ids, hidden_states, _ = hf_reference(target_folder)
    eagle3 = Eagle3.from_target(parts, aux_layers=(0, 1, 3), draft_token_ids=range(10, 60))
    # hidden_states[i] is the input of target layer i: what the engine captures for aux layer i
    aux = [hidden_states[i] for i in eagle3.config.aux_layers]
    g = eagle3.fuse(aux)
    torch.testing.assert_close(g, eagle3.fuse(torch.cat(aux, dim=-1)))
    positions = torch.arange(9).expand(2, 9)
    out = eagle3(input_ids[:, 1:], g[:, :-1], positions[:, :-1], DenseCausalAttention())
    assert out.shape == (2, 8, 64) and eagle3.logits(out).shape == (2, 8, 50)
    # training-time test: the next step feeds the output back in place of g, one position on
    again = eagle3(input_ids[:, 1:], out, positions[:, 1:], DenseCausalAttention())
    assert again.shape == (2, 8, 64)


def test_attention_input_is_normed_embedding_then_normed_g(llama_parts, batch):
    input_ids, positions, g = batch
    eagle3 = Eagle3.from_target(llama_parts)
    with torch.no_grad():
        eagle3.input_norm.weight.uniform_(0.5, 1.5)
        eagle3.hidden_norm.weight.uniform_(0.5, 1.5)
    seen = []
    eagle3.layer.qkv.register_forward_hook(lambda module, args, out: seen.append(args[0]))
    eagle3(input_ids, g, positions, DenseCausalAttention())
    expected = torch.cat([eagle3.input_norm(llama_parts.embed(input_ids)), eagle3.hidden_norm(g)], dim=-1)
    torch.testing.assert_close(seen[0], expected)
    assert eagle3.layer.qkv.in_features == 128 and eagle3.fc.in_features == 192 and eagle3.fc.bias is None


def test_dense_equals_step_by_step(parts, batch, assert_causal, flat_attention):
    input_ids, positions, g = batch
    eagle3 = Eagle3.from_target(parts, draft_token_ids=range(0, 256, 2))
    with torch.no_grad():
        dense = eagle3(input_ids, g, positions, DenseCausalAttention())
        assert_causal(dense, lambda t, attention: eagle3(
            input_ids[:, t:t + 1], g[:, t:t + 1], positions[:, t:t + 1], attention))
        torch.testing.assert_close(eagle3(input_ids[0], g[0], positions[0], flat_attention), dense[0])


def test_draft_vocabulary_maps_both_ways(llama_parts):
    chosen = [200, 7, 31, 3, 150]
    eagle3 = Eagle3.from_target(llama_parts, draft_token_ids=chosen)
    assert eagle3.config.draft_vocab_size == 5
    expected = torch.tensor(sorted(chosen))
    assert torch.equal(eagle3.draft_token_ids, expected)
    assert torch.equal(eagle3.to_target_ids(torch.tensor([[4, 0], [1, 1]])), torch.tensor([[200, 3], [7, 7]]))
    assert torch.equal(eagle3.d2t, expected - torch.arange(5))  # target_id = draft_id + d2t[draft_id]
    assert eagle3.t2d.dtype == torch.bool and eagle3.t2d.shape == (256,)
    assert torch.equal(eagle3.t2d.nonzero().flatten(), expected)
    # t2d selects the target's logits in draft-id order: the training targets of the draft head
    target_logits = torch.randn(3, 256)
    torch.testing.assert_close(target_logits[:, eagle3.t2d], target_logits[:, expected])


def test_new_head_starts_from_the_targets_rows_and_norm(llama_parts):
    chosen = torch.tensor([9, 40, 41, 255])
    eagle3 = Eagle3.from_target(llama_parts, draft_token_ids=chosen)
    assert torch.equal(eagle3.norm.weight, llama_parts.norm.weight)
    out = torch.randn(6, 64)
    torch.testing.assert_close(eagle3.logits(out), llama_parts.lm_head(llama_parts.norm(out))[:, chosen])


def test_whole_vocabulary_by_default(llama_parts):
    eagle3 = Eagle3.from_target(llama_parts)
    assert eagle3.config.draft_vocab_size == 256 and eagle3.t2d.all() and not eagle3.d2t.any()
    torch.testing.assert_close(eagle3.lm_head.weight, llama_parts.lm_head.weight)


def test_bad_draft_vocabularies(llama_parts):
    eagle3 = Eagle3.from_target(llama_parts, draft_token_ids=range(4))
    with pytest.raises(ValueError, match="3 draft token ids given, draft_vocab_size is 4"):
        eagle3.set_draft_vocab([1, 2, 3])
    with pytest.raises(ValueError, match="must be distinct"):
        eagle3.set_draft_vocab([1, 2, 3, 3])
    with pytest.raises(ValueError, match="must lie in \\[0, 256\\)"):
        eagle3.set_draft_vocab([1, 2, 3, 256])


def test_saved_tensors_include_its_own_norm_head_and_maps(llama_parts):
    names = set(Eagle3.from_target(llama_parts, draft_token_ids=range(8)).state_dict())
    assert {"d2t", "t2d", "norm.weight", "lm_head.weight", "fc.weight", "input_norm.weight", "hidden_norm.weight"} <= names
    assert not any(name.startswith("embed") for name in names)


def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@torch.no_grad()
def eagle31(parts, **norms):
    """An EAGLE-3 head with EAGLE 3.1's `norms`, every norm weight moved off 1."""
    head = Eagle3.from_target(parts, aux_layers=(0, 1, 3), **norms)
    generator = torch.Generator().manual_seed(5)
    for name, param in head.named_parameters():
        if "norm" in name:
            param.uniform_(0.5, 1.5, generator=generator)
    return head


def test_eagle31_norms_before_fc_normalise_the_aux_states_together_or_each(llama_parts):
    """norm_before_fc: fc(Norm(concat(a, b, c))), one weight 3h wide; fc_norm: fc(concat(Norm_a(a), Norm_b(b),
    Norm_c(c))); off: fc(concat(a, b, c)) as in EAGLE-3."""
    aux = [torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(i)) * (i + 1) * 10 for i in range(3)]
    eps = llama_parts.layer.rms_norm_eps
    with torch.no_grad():
        together = eagle31(llama_parts, norm_before_fc=True)
        assert together.fc_input_norm.weight.shape == (192,)
        torch.testing.assert_close(together.fuse(aux), together.fc(rms_norm(torch.cat(aux, -1), together.fc_input_norm.weight, eps)))
        each = eagle31(llama_parts, fc_norm=True)
        assert len(each.fc_norm) == 3
        expected = torch.cat([rms_norm(a, norm.weight, eps) for a, norm in zip(aux, each.fc_norm)], -1)
        torch.testing.assert_close(each.fuse(aux), each.fc(expected))
        plain = eagle31(llama_parts)
        torch.testing.assert_close(plain.fuse(aux), plain.fc(torch.cat(aux, -1)))
        assert not any("fc_norm" in name or "fc_input_norm" in name for name in plain.state_dict())
    with pytest.raises(ValueError, match="norm_before_fc and fc_norm exclude each other"):
        Eagle3.from_target(llama_parts, norm_before_fc=True, fc_norm=True)


def test_eagle31_norm_output_feeds_the_normed_output_back(llama_parts, batch):
    """With norm_output the layer's output goes through the final norm before the next step reads it as g, and the
    LM head reads it as is: the same logits as EAGLE-3's at the first step, another input at the next."""
    input_ids, positions, g = batch
    plain = eagle31(llama_parts)
    normed = eagle31(llama_parts, norm_output=True)
    normed.load_state_dict(plain.state_dict())
    with torch.no_grad():
        out, out_normed = (head(input_ids, g, positions, DenseCausalAttention()) for head in (plain, normed))
        torch.testing.assert_close(out_normed, plain.norm(out))
        torch.testing.assert_close(normed.logits(out_normed), plain.logits(out))
        again = normed(input_ids, out_normed, positions + 1, DenseCausalAttention())
        torch.testing.assert_close(again, plain.norm(plain(input_ids, plain.norm(out), positions + 1, DenseCausalAttention())))


@pytest.mark.parametrize("norms", [{"norm_before_fc": True}, {"fc_norm": True, "norm_output": True}])
def test_eagle31_heads_save_and_load_with_their_norms(norms, llama_parts, tmp_path):
    import heads

    head = eagle31(llama_parts, **norms)
    loaded = heads.load(heads.save(head, tmp_path / "head"), target=llama_parts)
    assert loaded.config == head.config and all(getattr(loaded.config, name) for name in norms)
    assert loaded.state_dict().keys() == head.state_dict().keys()
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    with pytest.raises(ValueError, match="norm_output=1 must be true or false"):
        Eagle3.from_target(llama_parts, norm_output=1)
