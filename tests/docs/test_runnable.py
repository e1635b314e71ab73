"""Every code block of README.md and docs/ marked runnable (tests/docs/runnable.py) runs, so an example cannot go
stale: Python blocks as written, bash blocks on the debug target's folder (as "your own model") with small sizes."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from runnable import ROOT, commands, pages, runnable_blocks, with_sizes

pytestmark = pytest.mark.e2e

BLOCKS = [block for page in pages() for block in runnable_blocks(page)]
# Appended to each draftheads command of a bash block: a store of a dozen short answers, one epoch, a short bench.
SIZES = {
    "generate": ["--num-prompts", "12", "--max-new-tokens", "16", "--concurrency", "12"],
    "fit": ["--trainer.max_epochs", "1", "--data.heldout_fraction", "0.3", "--trainer.logger", "false",
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"],
    "bench": ["--num-prompts", "2", "--max-new-tokens", "8"],
}


def test_readme_quickstarts_are_marked_runnable():
    readme = {block.lang for block in BLOCKS if block.path.name == "README.md"}
    assert readme == {"python", "bash"}


def run(block, tmp_path) -> subprocess.CompletedProcess:
    from serving.targets import resolve

    (tmp_path / "configs").symlink_to(ROOT / "configs")  # the blocks name configs/ as from the repository's root
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MODEL": str(resolve("debug")), "WANDB_MODE": "offline"}
    if block.lang == "python":
        args = [sys.executable, "-c", block.code]
    else:
        script = [f'draftheads() {{ "{sys.executable}" -m training "$@"; }}', "set -euo pipefail"]
        args = ["bash", "-c", "\n".join(script + [with_sizes(c, SIZES) for c in commands(block.code)])]
    return subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.parametrize("block", BLOCKS, ids=lambda block: block.id)
def test_block_runs(block, tmp_path):
    done = run(block, tmp_path)
    assert done.returncode == 0, f"{block.id} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    for out in re.findall(r"--out\s+(\S+)", block.code):  # every command that names its output wrote it
        assert (tmp_path / out).exists(), out
    if "draftheads export" in block.code:
        out = re.findall(r"draftheads export .*--out\s+(\S+)", block.code)[-1]
        assert json.loads((tmp_path / out / "config.json").read_text())["draftheads"]["kind"]
