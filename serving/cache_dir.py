"""The project's cache folder, shared by every reader and writer of it: built targets (targets/), compiled kernels
(kernels/), step-cost tables (step_cost/), parsed prompt files (prompts/). A module of its own, without torch, so
that the prompt sources a bench client reads import no more than they need."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$DRAFTHEADS_CACHE, default ~/.cache/draftheads, with a leading ~ expanded."""
    return Path(os.environ.get("DRAFTHEADS_CACHE") or Path.home() / ".cache" / "draftheads").expanduser()
