"""What a drafter sees of the engine: the model runner (the target's model, its K/V pool, flat forwards), the
engine's limits, and the step's outputs. A drafter never sees the engine itself."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from serving.model_runner import Batch, ModelRunner, RunOutput
from serving.request import Request


@dataclass
class StepOutputs:
    """What the target pass of this step computed and kept, for drafters that read it."""
    run: RunOutput
    accepted_paths: dict[str, list[int]]  # request id -> the tree nodes accepted this step, depth 1 first
    # seconds the step took before drafting: scheduling, the batch, the target's forward, verification (what the
    # adaptive policy's step cost predicts; drafting is priced apart)
    elapsed_s: float = 0.0

    def __post_init__(self):
        self.index = {r.request_id: i for i, r in enumerate(self.batch.requests)}  # request id -> its place in the batch

    @property
    def batch(self) -> Batch:
        return self.run.batch

    @property
    def out(self):
        """The target's ModelOutput: logits, hidden rows, aux layers' rows."""
        return self.run.out

    def kept_rows(self, request: Request) -> tuple[list[int], int]:
        """(the rows of the flat batch that computed the tokens the request kept this step, in position order; the
        position of the first): its real tokens, then its accepted nodes."""
        i = self.index[request.request_id]
        first = self.batch.token_start[i]
        num_real = self.batch.num_scheduled[i] - self.batch.num_tree_rows[i]
        path = self.accepted_paths.get(request.request_id, [])
        rows = list(range(first, first + num_real)) + [first + num_real + node for node in path]
        start = int(self.batch.positions[first])
        return rows[:request.num_computed_tokens - start], start


@dataclass
class DraftContext:
    runner: ModelRunner  # the target's model and K/V pool (block size, device), flat forwards over chunks
    target: Path  # the target's folder
    fingerprint: dict  # the target's identity (serving.targets.fingerprint): heads check it
    max_num_seqs: int  # requests drafted at once at most
    enable_prefix_caching: bool  # blocks are shared between requests: a pooled drafter keeps what they need
    # the target's products' input dtype (the engine's compute mode): heads with bfloat16 weights multiply so too
    compute: torch.dtype = torch.float32
    step: StepOutputs | None = None  # this step's target pass, while drafting
