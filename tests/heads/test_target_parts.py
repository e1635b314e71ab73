"""Target parts: exactly the target's embedding, final norm and LM head (tied or not), frozen, and its rope settings."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from heads import load_target_parts


def test_parts_reproduce_the_targets_logits_from_its_final_hidden_state(target_folder, parts, hf_reference):
    input_ids, hidden_states, logits = hf_reference(target_folder)
    # transformers' last hidden_states entry is after the final norm: the LM head reads it directly.
    torch.testing.assert_close(parts.lm_head(hidden_states[-1]), logits)
    torch.testing.assert_close(parts.embed(input_ids), hidden_states[0])
    assert not any(param.requires_grad for param in parts.parameters())


def test_tied_embeddings_share_one_tensor(tiny_qwen2, tiny_llama):
    tied, untied = load_target_parts(tiny_qwen2), load_target_parts(tiny_llama)
    assert tied.tie_word_embeddings and tied.lm_head.weight is tied.embed.weight
    assert not untied.tie_word_embeddings and not torch.equal(untied.lm_head.weight, untied.embed.weight)


def test_layer_settings_follow_the_family(tiny_llama, tiny_qwen2, tiny_qwen3):
    llama, qwen2, qwen3 = (load_target_parts(folder).layer for folder in (tiny_llama, tiny_qwen2, tiny_qwen3))
    assert (llama.qkv_bias, llama.qk_norm) == (False, False)
    assert (qwen2.qkv_bias, qwen2.qk_norm) == (True, False)
    assert (qwen3.qkv_bias, qwen3.qk_norm) == (False, True)
    assert (llama.hidden_size, llama.num_heads, llama.num_kv_heads, llama.head_dim) == (64, 4, 2, 16)


def test_rope_settings_from_a_transformers_v5_config(tiny_llama_rope3, tiny_llama):
    scaled = load_target_parts(tiny_llama_rope3)
    assert scaled.rope_theta == 10000.0 and scaled.rope_scaling["rope_type"] == "llama3"
    assert scaled.rope_scaling["original_max_position_embeddings"] == 64
    plain = load_target_parts(tiny_llama)
    assert plain.rope_scaling is None and plain.max_position_embeddings == 512 and plain.num_layers == 4


def test_rope_settings_from_a_legacy_config(tiny_llama, tmp_path):
    folder = shutil.copytree(tiny_llama, tmp_path / "legacy")
    config = json.loads((folder / "config.json").read_text())
    del config["rope_parameters"]
    config["rope_theta"] = 500000.0
    config["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 64}
    (folder / "config.json").write_text(json.dumps(config))
    parts = load_target_parts(folder)
    assert parts.rope_theta == 500000.0 and parts.rope_scaling["factor"] == 8.0


def test_missing_lm_head_means_tied(tiny_llama, tmp_path):
    folder = shutil.copytree(tiny_llama, tmp_path / "headless")
    tensors = load_file(folder / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, folder / "model.safetensors")
    parts = load_target_parts(folder)
    assert parts.lm_head.weight is parts.embed.weight


def test_dtype_and_fingerprint(tiny_llama):
    parts = load_target_parts(tiny_llama, dtype=torch.bfloat16, fingerprint={"id": "x", "hidden_size": 64})
    assert parts.embed.weight.dtype == torch.bfloat16 and parts.norm.weight.dtype == torch.bfloat16
    assert parts.describe() == {"id": "x", "hidden_size": 64, "vocab_size": 256, "num_layers": 4}


def test_not_a_model_folder(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        load_target_parts(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_target_parts(tmp_path)


def _rename_tensors(folder, rename, extra=None):
    """Rewrite folder's model.safetensors with each tensor renamed by `rename` (and `extra` tensors added)."""
    tensors = load_file(folder / "model.safetensors")
    save_file({**{rename(name): tensor for name, tensor in tensors.items()}, **(extra or {})},
              folder / "model.safetensors")


@pytest.mark.parametrize("layout", ["as saved", "model.language_model"])
def test_a_multimodal_checkpoints_parts_are_its_language_models(layout, tiny_gemma3_multimodal, tiny_gemma3,
                                                                  tmp_path):
    """Gemma3ForConditionalGeneration's `text_config` and `language_model.model.*` tensors (or newer transformers'
    `model.language_model.*`): the parts hold transformers' own embedding, final norm and tied LM head, and give its
    logits from its last hidden state."""
    from transformers import AutoModelForCausalLM

    folder = tiny_gemma3_multimodal
    if layout != "as saved":
        folder = shutil.copytree(tiny_gemma3_multimodal, tmp_path / "renamed")
        _rename_tensors(folder, lambda name: name.replace("language_model.model.", "model.language_model.", 1))
    parts = load_target_parts(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    language_model = hf.model.language_model
    assert type(hf).__name__ == "Gemma3ForConditionalGeneration"
    torch.testing.assert_close(parts.embed.weight, language_model.embed_tokens.weight, rtol=0, atol=0)
    torch.testing.assert_close(parts.norm.weight, 1 + language_model.norm.weight, rtol=0, atol=0)
    assert parts.tie_word_embeddings and parts.lm_head.weight is parts.embed.weight
    assert (parts.model_type, parts.num_layers, parts.vocab_size, parts.hidden_size) == ("gemma3_text", 4, 256, 64)
    assert parts.layer == load_target_parts(tiny_gemma3).layer  # the text config's settings
    input_ids = torch.randint(3, 250, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = hf(input_ids, output_hidden_states=True)
    torch.testing.assert_close(parts.lm_head(out.hidden_states[-1]), out.logits)


def test_an_untied_lm_head_under_the_language_models_prefix(tiny_llama, tmp_path):
    """Llama 4's and LLaVA's layout: `language_model.model.*`, an untied `language_model.lm_head.weight`, a vision
    tower beside them; the parts are the language model's alone."""
    folder = shutil.copytree(tiny_llama, tmp_path / "llava")
    config = json.loads((folder / "config.json").read_text())
    top = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "text_config": config,
           "vision_config": {"hidden_size": 8}, "tie_word_embeddings": False}
    (folder / "config.json").write_text(json.dumps(top))
    _rename_tensors(folder, lambda name: "language_model." + name, {"vision_tower.patch.weight": torch.ones(8, 3)})
    parts, reference = load_target_parts(folder), load_target_parts(tiny_llama)
    assert not parts.tie_word_embeddings
    for ours, theirs in zip(parts.state_dict().values(), reference.state_dict().values()):
        assert torch.equal(ours, theirs)
    assert parts.layer == reference.layer and parts.num_layers == reference.num_layers


def test_a_multimodal_checkpoint_without_the_language_models_tensors_names_the_prefixes(tiny_llama, tmp_path):
    folder = shutil.copytree(tiny_llama, tmp_path / "elsewhere")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({"model_type": "llava", "text_config": config}))
    _rename_tensors(folder, lambda name: "text." + name)
    with pytest.raises(ValueError, match="no tensor model.embed_tokens.weight .*language_model.model."):
        load_target_parts(folder)
