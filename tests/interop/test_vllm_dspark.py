"""DSpark and the real vLLM 0.32 (its CPU build, `make vllm`). vLLM implements `"method": "dspark"` only in its V2
model runner, which needs Triton, absent from the CPU build: its config refuses the method, so no served acceptance
is compared here (the day the CPU build serves it, the refusal test fails and the served comparison of
test_vllm.py's DFlash case applies; with VLLM_USE_V2_MODEL_RUNNER=1 it says "Model Runner V2 requires Triton."). What vLLM's own code reads from our export is checked instead: its speculators
config converter (`update_dspark`) turns our speculators export into the Qwen3DSparkModel config its model and
speculator read, with our layers, slots, Markov rank and confidence head."""
from __future__ import annotations

import json
import subprocess

import pytest
import torch

import heads
from serving.bench import vllm_process
from training.export import export

pytestmark = pytest.mark.usefixtures("vllm_available")

CONVERT = """
import json, sys
from vllm.transformers_utils.configs.speculators.algos import update_dspark
config = json.load(open(sys.argv[1]))
converted = {}
update_dspark(config, converted)
print(json.dumps(converted))
"""

REFUSE = """
import sys
from vllm.engine.arg_utils import EngineArgs
args = EngineArgs(model=sys.argv[1], max_model_len=256, speculative_config={
    "method": "dspark", "model": sys.argv[2], "num_speculative_tokens": 4})
try:
    args.create_engine_config()
except Exception as error:
    print(" ".join(str(error).split()))  # pydantic's message spans lines
else:
    print("served")
"""


def vllm_python(code: str, *args) -> str:
    done = subprocess.run([str(vllm_process.executable()), "-c", code, *map(str, args)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def exported(tiny_llama, tmp_path_factory):
    parts = heads.load_target_parts(tiny_llama)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        head = heads.DSpark.from_target(parts, num_layers=1, target_layers=(1, 3), block_size=4, mask_token_id=9,
                                        markov_rank=8)
    return export(head, "speculators", tmp_path_factory.mktemp("dspark") / "speculators", verifier=tiny_llama)


def test_vllms_converter_reads_our_speculators_export(exported):
    converted = json.loads(vllm_python(CONVERT, exported / "config.json"))
    assert converted["architectures"] == ["Qwen3DSparkModel"]
    assert converted["eagle_aux_hidden_state_layer_ids"] == [1, 3] and converted["target_layer_ids"] == [0, 2]
    assert converted["sample_from_anchor"] is True and converted["dspark_bonus_anchor"] is False
    assert (converted["markov_rank"], converted["markov_head_type"], converted["block_size"]) == (8, "vanilla", 4)
    assert converted["enable_confidence_head"] is True and converted["confidence_head_with_markov"] is True
    assert converted["mask_token_id"] == 9


def test_vllms_cpu_build_refuses_dspark(exported, tiny_llama):
    said = vllm_python(REFUSE, tiny_llama, exported)
    assert "Model Runner V1 does not support: dspark speculative decoding" in said, said
