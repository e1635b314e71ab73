"""speculators (vllm-project/speculators 0.9, in its own venv `.venv-speculators` made by `make speculators`) run as
a subprocess: tests/interop/speculators_side.py builds, saves and runs its models there."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SIDE = Path(__file__).with_name("speculators_side.py")
ENV_VAR = "DRAFTHEADS_SPECULATORS_PYTHON"  # a Python with speculators to use instead of .venv-speculators/bin/python


def executable() -> Path:
    return Path(os.environ.get(ENV_VAR) or ROOT / ".venv-speculators" / "bin" / "python")


def missing_reason() -> str | None:
    """Why speculators cannot run here, or None when its Python imports its models."""
    path = executable()
    if not (path.is_file() and os.access(path, os.X_OK)):
        return (f"speculators is not installed at {path}: run `make speculators` (it installs speculators, pinned in "
                f"the Makefile, into .venv-speculators), or point {ENV_VAR} at a Python that has it")
    found = subprocess.run([str(path), "-c", "import speculators.models"], capture_output=True, text=True, timeout=300)
    if found.returncode:
        return (f"{path} cannot import speculators.models ({found.stderr.strip().splitlines()[-1:]}): rerun `make "
                "speculators` (rm -rf .venv-speculators first)")
    return None


def run(*args) -> None:
    """speculators_side.py with `args` in speculators' venv; its output in the error when it fails."""
    done = subprocess.run([str(executable()), str(SIDE), *map(str, args)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode:
        raise RuntimeError(f"speculators_side.py {' '.join(map(str, args))} failed:\n{done.stderr[-4000:]}")
