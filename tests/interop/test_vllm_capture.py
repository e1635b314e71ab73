"""The `vllm` capture backend against the engine's: vLLM's extract_hidden_states over the same dataset answers
writes a store whose tokens equal the engine's and whose hidden states agree within bfloat16 rounding (the aux
layers as vLLM hands them over, "last" normed here from vLLM's last layer output)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))

from test_capture import assert_stores_agree, capture_store  # noqa: E402

from serving.bench import vllm_process  # noqa: E402
from serving.targets import DEFAULT_TARGET, build_tiny_model, resolve  # noqa: E402


def test_vllm_and_engine_captures_agree(vllm_available, tmp_path):
    # head_dim 32: vLLM's CPU attention refuses the conftest default of 16
    target = build_tiny_model(tmp_path / "llama", "llama", tokenizer_from=resolve(DEFAULT_TARGET), hidden_size=128,
                              intermediate_size=256)
    vllm = capture_store(target, tmp_path / "vllm", "vllm", vllm_python=str(vllm_process.executable()))
    assert vllm.meta["captured_by"] == ["vllm"]
    assert_stores_agree(capture_store(target, tmp_path / "engine", "engine"), vllm)
