"""Runs in vLLM's Python environment for training.data.vllm_capture: imports vLLM and nothing of this project.

    python draftheads_vllm_worker.py SETTINGS_JSON REPLY_FD

Starts vLLM on the target with the `extract_hidden_states` method and a hidden-states connector (vLLM's own on a GPU,
draftheads_hidden_states' on a CPU), says {"ready": true} on REPLY_FD, then for each line of stdin (a JSON list of
token id lists) prefills them with max_tokens 1 and replies {"paths": [...]}, one safetensors file per list, in
order. Ends at the end of stdin.
"""
import fcntl
import json
import os
import sys

import torch
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

ON_CPU = not torch.cuda.is_available()


def written(path: str) -> None:
    """Waits until the connector's writer thread, which holds the file's lock until it is done, has written `path`."""
    lock = path + ".lock"
    if os.path.exists(lock):
        with open(lock) as file:
            fcntl.flock(file, fcntl.LOCK_SH)
        os.remove(lock)


def connector() -> dict:
    if not ON_CPU:
        return {"kv_connector": "ExampleHiddenStatesConnector"}
    return {"kv_connector": "CpuHiddenStatesConnector", "kv_connector_module_path": "draftheads_hidden_states"}


def main() -> None:
    settings, reply_fd = json.loads(sys.argv[1]), int(sys.argv[2])
    replies = os.fdopen(reply_fd, "w")
    # On a CPU: eager, as `vllm serve` runs there (serving/bench/vllm_process.py; compiling took ~35 s of each start
    # on 2 cores), and the model's worker inside the engine core's process (a process of its own imports vLLM again,
    # ~12 s). The engine core keeps a process of its own: run in this one (VLLM_ENABLE_V1_MULTIPROCESSING=0),
    # it left the first prefill's file unwritten, and `written` waiting on its lock.
    layout = {"enforce_eager": True, "distributed_executor_backend": "uni"} if ON_CPU else {}
    llm = LLM(model=settings["model"], skip_tokenizer_init=True, dtype=settings["dtype"], **layout,
              max_model_len=settings["max_model_len"], enable_prefix_caching=False,
              speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                  "draft_model_config": {"hf_config": {
                                      "eagle_aux_hidden_state_layer_ids": settings["layer_ids"]}}},
              kv_transfer_config={"kv_role": "kv_producer", **connector(),
                                  "kv_connector_extra_config": {"shared_storage_path": settings["storage"]}})
    replies.write(json.dumps({"ready": True}) + "\n")
    replies.flush()
    greedy_one = SamplingParams(max_tokens=1, temperature=0.0)
    for line in sys.stdin:
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in json.loads(line)]
        outputs = llm.generate(prompts, greedy_one, use_tqdm=False)
        paths = [output.kv_transfer_params["hidden_states_path"] for output in outputs]
        for path in paths:
            written(path)
        replies.write(json.dumps({"paths": paths}) + "\n")
        replies.flush()


if __name__ == "__main__":
    main()
