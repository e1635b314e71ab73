"""The `vllm` capture backend: vLLM runs the target with its `extract_hidden_states` speculative method, whose KV
connector (`ExampleHiddenStatesConnector`) writes each finished request's prompt rows of the asked layers to a
safetensors file ("hidden_states" [T, num_layers, hidden], "token_ids" [T]).

vLLM lives in a Python environment of its own (`make vllm`: .venv-vllm), so it runs in a worker process
(training/data/vllm_side, which imports nothing of this project) fed batches of token ids on its stdin and
answering on a pipe of its own, since vLLM logs to stdout. Layer ids are vLLM's aux hidden state ids, the input of
that layer; id L (the number of layers) is the last layer's output before the final norm, from which "last" is
made with the target's own final norm (heads.target_parts), as the LM head would read it.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from heads.target_parts import load_target_parts
from serving.bench.vllm_process import CPU_ENV
from serving.targets import fingerprint
from training.data.store import HIDDEN_DTYPE

VLLM_SIDE = Path(__file__).with_name("vllm_side")
WORKER = VLLM_SIDE / "draftheads_vllm_worker.py"
START_TIMEOUT_S = 900  # vLLM's start on a CPU: model load, compile, K/V cache profiling


class VllmCaptureError(RuntimeError):
    pass


class VllmCapture:
    """Up to `max_batch_examples` queued examples per step, one `LLM.generate` call each (max_tokens 1)."""

    def __init__(self, python: str | None, folder: Path, keys: list[str], aux_layers: tuple[int, ...], *,
                 dtype: str, max_model_len: int, max_batch_examples: int = 64):
        if python is None:
            raise ValueError("capture=vllm needs vLLM: run `make vllm` (it installs .venv-vllm), or pass "
                             "--vllm-python PATH of an environment where vLLM is installed")
        self.keys, self.max_batch_examples = keys, max_batch_examples
        num_layers = fingerprint(folder)["num_layers"]
        # "last" comes from the last layer's output (id L), normed here.
        self.layer_ids = list(dict.fromkeys(aux_layers)) + ([num_layers] if "last" in keys else [])
        self.norm = load_target_parts(folder).norm if "last" in keys else None
        self.storage = tempfile.TemporaryDirectory(prefix="draftheads-vllm-capture-")
        self.log = open(Path(self.storage.name) / "vllm.log", "w")
        read_fd, write_fd = os.pipe()
        settings = {"model": str(folder), "dtype": dtype, "max_model_len": max_model_len,
                    "layer_ids": self.layer_ids, "storage": self.storage.name}
        self.worker = subprocess.Popen([python, str(WORKER), json.dumps(settings), str(write_fd)],
                                       stdin=subprocess.PIPE, stdout=self.log, stderr=subprocess.STDOUT,
                                       pass_fds=(write_fd,), text=True,
                                       env={**os.environ, **CPU_ENV, "PYTHONPATH": str(VLLM_SIDE)})
        os.close(write_fd)
        self.replies = os.fdopen(read_fd)
        self._reply()  # the worker says it is ready once vLLM has started
        self.queue: list[dict] = []

    def _reply(self) -> dict:
        line = self.replies.readline()
        if not line:
            self.worker.wait(timeout=60)
            self.log.flush()
            tail = (Path(self.storage.name) / "vllm.log").read_text()[-3000:]
            raise VllmCaptureError(f"vLLM's capture worker stopped (exit {self.worker.returncode}); its log ends:\n{tail}")
        return json.loads(line)

    def add(self, example: dict) -> None:
        self.queue.append(example)

    def has_unfinished(self) -> bool:
        return bool(self.queue)

    def step(self) -> list[tuple[dict, dict]]:
        batch, self.queue = self.queue[:self.max_batch_examples], self.queue[self.max_batch_examples:]
        if not batch:
            return []
        self.worker.stdin.write(json.dumps([example["input_ids"] for example in batch]) + "\n")
        self.worker.stdin.flush()
        paths = self._reply()["paths"]
        done = []
        for example, path in zip(batch, paths):
            tensors = load_file(path)
            os.remove(path)
            if tensors["token_ids"].tolist() != example["input_ids"]:
                raise VllmCaptureError(f"vLLM wrote hidden states of other tokens than example {example['id']!r}'s")
            rows = tensors["hidden_states"].float()  # [T, len(layer_ids), hidden]
            captured = {f"aux.{i}": rows[:, n] for n, i in enumerate(self.layer_ids)}
            if self.norm is not None:
                with torch.no_grad():
                    captured["last"] = self.norm(rows[:, -1])
            done.append((example, {key: captured[key].to(HIDDEN_DTYPE) for key in self.keys}))
        return done

    def close(self) -> None:
        if self.worker.poll() is None:
            self.worker.stdin.close()
            try:
                self.worker.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.worker.kill()
                self.worker.wait()
        self.replies.close()
        self.log.close()
        self.storage.cleanup()
