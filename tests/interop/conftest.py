"""The interop tests need vLLM's CPU build (`make vllm`). Where it is missing they fail under CI (the variable
`CI` set, as `.ci/run` sets it) naming the fix, and are skipped elsewhere with the same message."""
from __future__ import annotations

import os

import pytest

from serving.bench import vllm_process


@pytest.fixture(scope="session")
def vllm_available():
    reason = vllm_process.missing_reason()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
