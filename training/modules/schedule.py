"""The learning-rate schedule: linear warmup from 0, then cosine or linear decay to `min_lr_ratio` of the peak
(or constant), as a factor of the peak learning rate per optimizer step."""
from __future__ import annotations

import math

SCHEDULES = ("cosine", "linear", "constant")


def lr_factor(step: int, num_warmup_steps: int, num_training_steps: int, schedule: str, min_lr_ratio: float) -> float:
    if step < num_warmup_steps:
        return (step + 1) / num_warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps))
    decay = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1 - progress
    return min_lr_ratio + (1 - min_lr_ratio) * decay
