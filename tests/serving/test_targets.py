"""Targets: tiny fixtures load in transformers, the default GGUF target converts faithfully and once,
the debug target shares its tokenizer, fingerprints are stable, and bad names fail clearly."""
from __future__ import annotations

import json
import logging
import re

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from serving import targets
from serving.targets import BUILTIN_TARGETS, DEFAULT_TARGET, build_tiny_model, fingerprint, resolve, target_info

TINY = ["tiny_llama", "tiny_llama_rope3", "tiny_qwen2", "tiny_qwen3"]
PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def default_folder():
    return resolve(DEFAULT_TARGET)


@pytest.fixture(scope="module")
def default_model(default_folder):
    return AutoModelForCausalLM.from_pretrained(default_folder, dtype=torch.float32).eval()


def built_logs(caplog):
    messages = [record.getMessage() for record in caplog.records if record.name == targets.__name__]
    return [message for message in messages if "building target" in message]


@pytest.mark.parametrize("fixture", TINY)
def test_tiny_model_loads_in_transformers(fixture, request):
    folder = request.getfixturevalue(fixture)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert model.dtype == torch.float32
    with torch.no_grad():
        logits = model(torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])).logits
    assert logits.shape == (1, 8, 256)
    assert torch.isfinite(logits).all()


def test_tiny_families_have_their_features(tiny_llama, tiny_llama_rope3, tiny_qwen2, tiny_qwen3):
    llama, qwen2, qwen3 = (AutoModelForCausalLM.from_pretrained(f) for f in (tiny_llama, tiny_qwen2, tiny_qwen3))
    assert llama.lm_head.weight.data_ptr() != llama.model.embed_tokens.weight.data_ptr()
    assert qwen2.lm_head.weight.data_ptr() == qwen2.model.embed_tokens.weight.data_ptr()
    attention = qwen2.model.layers[0].self_attn
    projections = (attention.q_proj, attention.k_proj, attention.v_proj)
    assert all(p.bias is not None and p.bias.abs().sum() > 0 for p in projections)
    q_norm = qwen3.model.layers[0].self_attn.q_norm.weight
    assert not torch.allclose(q_norm, torch.ones_like(q_norm))  # moved off 1 so a port that skips it fails
    config = json.loads((tiny_llama_rope3 / "config.json").read_text())
    scaling = config.get("rope_parameters") or config["rope_scaling"]
    assert scaling["rope_type"] == "llama3" and scaling["original_max_position_embeddings"] == 64


def test_tiny_model_is_seeded(tiny_llama, tmp_path):
    again = build_tiny_model(tmp_path / "again", "llama")
    assert (again / "model.safetensors").read_bytes() == (tiny_llama / "model.safetensors").read_bytes()


def test_fingerprint_is_stable_and_tells_tiny_models_apart(tiny_llama, tiny_qwen2, tiny_qwen3):
    prints = [fingerprint(f) for f in (tiny_llama, tiny_qwen2, tiny_qwen3)]
    assert prints[0] == fingerprint(tiny_llama)
    assert prints[0] == dict(
        architecture="llama", num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, vocab_size=256,
        vocab_hash=prints[0]["vocab_hash"], id=prints[0]["id"],
    )
    assert len({p["id"] for p in prints}) == 3


@pytest.mark.slow
def test_a_multimodal_checkpoint_is_fingerprinted_by_its_language_model(tiny_gemma3_multimodal, tiny_gemma3):
    """Its text config's sizes and family: a head made for the language model binds to either folder."""
    assert fingerprint(tiny_gemma3_multimodal) == fingerprint(tiny_gemma3)
    assert fingerprint(tiny_gemma3_multimodal)["architecture"] == "gemma3_text"
    assert targets.architecture(tiny_gemma3_multimodal) == "Gemma3ForCausalLM"
    info = target_info(str(tiny_gemma3_multimodal))
    assert info["architecture"] == "Gemma3ForConditionalGeneration" and info["num_layers"] == 4
    assert targets.generation_limits(tiny_gemma3_multimodal)[1] == 512


def test_default_target_matches_gguf(default_folder, default_model):
    config = json.loads((default_folder / "config.json").read_text())
    assert config["tie_word_embeddings"] and "quantization_config" not in config
    with safe_open(default_folder / "model.safetensors", framework="pt") as weights:
        assert "lm_head.weight" not in weights.keys()
    gguf = targets._default_gguf()
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2]])
    with torch.no_grad():
        torch.testing.assert_close(default_model(ids).logits, reference(ids).logits)


@pytest.mark.slow
def test_default_target_answers_a_chat_deterministically(default_folder, default_model):
    tokenizer = AutoTokenizer.from_pretrained(default_folder)
    assert "<|im_start|>" in tokenizer.chat_template
    inputs = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    answers = []
    for _ in range(2):
        output = default_model.generate(**inputs, max_new_tokens=16, do_sample=False)
        answers.append(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
    assert answers[0] == answers[1]
    words = set(re.findall(r"[a-z]+", answers[0].lower()))
    assert words & {"the", "is", "of", "capital", "paris", "france"}, answers[0]


def test_second_resolve_is_a_cache_hit(default_folder, caplog):
    stamp = (default_folder / "model.safetensors").stat().st_mtime_ns
    with caplog.at_level(logging.INFO, logger=targets.__name__):
        assert resolve(DEFAULT_TARGET) == default_folder
    assert built_logs(caplog) == []
    assert (default_folder / "model.safetensors").stat().st_mtime_ns == stamp


def test_debug_target_shares_the_default_tokenizer(default_folder):
    folder = resolve("debug")
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert model.config.vocab_size == len(tokenizer) == 49152
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(default_folder).chat_template
    assert fingerprint(folder)["vocab_hash"] == fingerprint(default_folder)["vocab_hash"]
    assert fingerprint(folder)["id"] != fingerprint(default_folder)["id"]
    inputs = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    output = model.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert output.shape[1] == inputs["input_ids"].shape[1] + 4


def test_interrupted_build_leaves_no_target(default_folder, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path))
    (tmp_path / "targets").mkdir()
    (tmp_path / "targets" / DEFAULT_TARGET).symlink_to(default_folder)  # reuse the converted default

    def interrupted(folder, *args, **kwargs):
        (folder / "config.json").write_text("{}")
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(targets, "build_tiny_model", interrupted)
        with pytest.raises(KeyboardInterrupt):
            resolve("debug")
    assert sorted(p.name for p in (tmp_path / "targets").iterdir()) == [DEFAULT_TARGET]
    with caplog.at_level(logging.INFO, logger=targets.__name__):
        folder = resolve("debug")
        assert resolve("debug") == folder
    assert folder == tmp_path / "targets" / "debug"
    assert len(built_logs(caplog)) == 1


def test_target_info_is_json(default_folder):
    info = json.loads(json.dumps(target_info(DEFAULT_TARGET)))
    assert info["folder"] == str(default_folder)
    assert (info["architecture"], info["num_layers"], info["hidden_size"]) == ("LlamaForCausalLM", 30, 576)
    assert (info["num_heads"], info["num_kv_heads"], info["vocab_size"]) == (9, 3, 49152)
    assert info["dtype"] == "float32" and info["tie_word_embeddings"] and info["has_chat_template"]
    assert info["fingerprint"] == fingerprint(default_folder)


def test_local_folder_resolves(tiny_qwen2):
    assert resolve(str(tiny_qwen2)) == tiny_qwen2.resolve()


def test_unknown_name_lists_builtins():
    with pytest.raises(ValueError, match="unknown target 'no-such-target'") as error:
        resolve("no-such-target")
    assert all(name in str(error.value) for name in BUILTIN_TARGETS)


@pytest.mark.parametrize("env", [{}, {"DRAFTHEADS_ONLINE": "1", "HF_HUB_OFFLINE": "1"}])
def test_hub_id_offline_says_how_to_go_online(env, monkeypatch):
    for name in ("DRAFTHEADS_ONLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="treated as offline") as error:
        resolve("draftheads-test/no-such-model")
    assert "DRAFTHEADS_ONLINE=1" in str(error.value) and DEFAULT_TARGET in str(error.value)
    assert ("unset HF_HUB_OFFLINE" in str(error.value)) == bool(env)


def test_folder_without_config_is_refused(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        resolve(str(tmp_path))
    with pytest.raises(ValueError, match="does not exist"):
        resolve(str(tmp_path / "missing"))
