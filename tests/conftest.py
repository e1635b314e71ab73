"""Shared fixtures: tiny seeded random float32 Hugging Face model folders (no tokenizer; tests pass token ids).

All but `v8_target` share hidden 64, 4 layers, 4 query heads over 2 KV heads, intermediate 128, vocab 256, 512 positions,
rope theta 10000; see `serving.targets.build_tiny_model`.
"""
from __future__ import annotations

import contextlib
import re

import pytest
import torch

from serving.targets import build_tiny_model

# Markers by where a test lives (pyproject.toml registers them; `make test-fast` leaves them out): whole folders, the
# training files whose tests fit heads through Lightning, and the statistical checks of sampled laws by name.
FOLDER_MARKS = {"interop": "interop", "e2e": "e2e"}
FIT_FILES = {"test_fit.py", "test_resume.py", "test_ddp.py", "test_recipes.py", "test_configs.py", "test_modules.py"}
LAW = re.compile(r"keeps?_the_(masked_)?target_law|sampled_law_is|frequencies_follow")


def pytest_collection_modifyitems(items):
    for item in items:
        path = item.path
        folder = path.parent.name
        if folder in FOLDER_MARKS:
            item.add_marker(FOLDER_MARKS[folder])
        if folder == "training" and path.name in FIT_FILES:
            item.add_marker("fit")
        if LAW.search(item.name):
            item.add_marker("law")

LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Two shared cores: intra-op threads spinning against each other slow the tiny models tenfold."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture(autouse=True, scope="session")
def private_cache_dir(tmp_path_factory):
    """Step-cost tables measured by tests stay out of the user's cache (serving/spec_decode/cost.py)."""
    folder = tmp_path_factory.mktemp("step_cost")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("serving.spec_decode.cost.step_cost_dir", lambda: folder)
        yield


@pytest.fixture
def device_unnamed_is_meta():
    """A context manager: inside it a tensor made without naming its device lands on the meta device, which holds
    no data, so code that forgot the engine's device fails on this CPU as it would on a GPU."""
    @contextlib.contextmanager
    def scope():
        torch.set_default_device("meta")
        try:
            yield
        finally:
            torch.set_default_device(None)
    return scope


@pytest.fixture(scope="session")
def v8_target(tmp_path_factory):
    """Llama over a vocabulary of 8, initializer_range 0.3: next-token laws far from uniform, so drafts are both
    accepted and rejected and sampled laws can be compared over every token."""
    return build_tiny_model(tmp_path_factory.mktemp("v8_target"), "llama", vocab_size=8, initializer_range=0.3)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """Llama, untied embeddings."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_llama_rope3(tmp_path_factory):
    """Llama with llama3 rope scaling (original context 64, so positions past 64 feel the scaling)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama_rope3"), "llama", rope_scaling=LLAMA3_ROPE_SCALING)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    """Qwen2: q/k/v biases, tied embeddings."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    """Qwen3: per-head q/k RMSNorm, untied embeddings."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3")


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory):
    """Gemma 3: sliding windows of 8 keys on layers 0-2 with their own rope base, layer 3 global; (1 + w) norms around
    the attention and the MLP, GeLU, scores scaled by query_pre_attn_scalar 24 (not head_dim 16), tied embeddings."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_gemma3"), "gemma3_text", sliding_window=8,
                            layer_types=["sliding_attention"] * 3 + ["full_attention"], query_pre_attn_scalar=24)


@pytest.fixture(scope="session")
def tiny_gpt_oss(tmp_path_factory):
    """gpt-oss: attention sinks, q/k/v/o biases, sliding windows of 8 keys on alternate layers, yarn rope, 4 experts
    with biases, top 2 by a biased router (softmax over the two), clamped SwiGLU over interleaved gate/up columns."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_gpt_oss"), "gpt_oss", head_dim=16, num_local_experts=4,
                            num_experts_per_tok=2, intermediate_size=32, sliding_window=8)


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory):
    """Qwen3-MoE: 8 experts, each row through its top 2 (weights renormalised), layer 1 dense (mlp_only_layers)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_moe"), "qwen3_moe", num_experts=8,
                            num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[1])


@pytest.fixture(scope="session")
def tiny_gemma3_multimodal(tmp_path_factory, tiny_gemma3):
    """Gemma3ForConditionalGeneration as transformers saves it (config.json's `text_config`, the language model's
    tensors under `language_model.`, a vision tower and projector beside it) whose language model is tiny_gemma3."""
    from transformers import AutoModelForCausalLM, Gemma3Config, Gemma3ForConditionalGeneration

    text = AutoModelForCausalLM.from_pretrained(tiny_gemma3, dtype=torch.float32)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = Gemma3Config(text_config=text.config.to_dict(), vision_config=vision, mm_tokens_per_image=4,
                          image_token_index=255, boi_token_index=253, eoi_token_index=254)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Gemma3ForConditionalGeneration(config)
    model.model.language_model.load_state_dict(text.model.state_dict())
    folder = tmp_path_factory.mktemp("tiny_gemma3_multimodal")
    model.save_pretrained(folder)
    return folder
