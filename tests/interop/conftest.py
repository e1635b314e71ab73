"""The interop tests need vLLM's CPU build (`make vllm`) and speculators (`make speculators`). Where one is missing
they fail under CI (the variable `CI` set, as `.ci/run` sets it) naming the fix, and are skipped elsewhere with the
same message."""
from __future__ import annotations

import os

import pytest

import speculators_process
from serving.bench import vllm_process


def require(reason: str | None) -> None:
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)


@pytest.fixture(scope="session")
def vllm_available():
    require(vllm_process.missing_reason())


@pytest.fixture(scope="session")
def speculators_python():
    """speculators' venv's Python (`make speculators`)."""
    require(speculators_process.missing_reason())
    return speculators_process.executable()
