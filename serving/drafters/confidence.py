"""The maths every head drafter scores its drafts with, and training calibrates against
(training/modules/calibration.py): a draft's log-probability at the temperature its fit calibrated, and the cut of
paths whose probability falls below a threshold."""
from __future__ import annotations

import math

import torch

from serving import kernels


def log_confidence(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(argmax) under softmax(logits / temperature), without materialising the softmax: [..., vocab] -> [...].
    The one definition the cut reads and training calibrates against."""
    shifted = logits.float() - logits.amax(-1, keepdim=True).float()
    return -torch.logsumexp(shifted / temperature, dim=-1)


def top_log_probs(logits: torch.Tensor, num: int, temperature: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The `num` most likely entries of each row of logits: (their log-probabilities under softmax(logits /
    temperature), [..., num]; their indices, [..., num]). temperature: one for every row, or a tensor of each row's
    that broadcasts as [..., 1]. One pass of the kernels over the rows where they run (serving.kernels.top_log_probs),
    else a fused log-softmax and a top-k (logsumexp takes five passes: 2-3x the time on a drafter's few rows after a
    forward has evicted the caches)."""
    return kernels.top_log_probs(logits, num, temperature)


class Confidence:
    """The head's probability of a draft at depth d is read at the temperature its fit calibrated for draft d
    (`confidence_temperatures` in its config.json, 1 past them): the estimate that the target accepts it. A path's
    score is the sum of those log-probabilities; `confidence_threshold` (or the adaptive policy's price of a row, per
    request) prunes nodes whose path probability falls below it (a draft pays when the chance that it and every
    draft before it land exceeds what verifying and drafting one more token costs as a share of a step)."""

    def __init__(self, head, threshold: float):
        self.log_threshold = math.log(threshold) if threshold > 0 else -math.inf
        self.temperatures = list(head.config.confidence_temperatures)

    def log_threshold_for(self, budget) -> float:
        """The cut for a request drafted within `budget` (serving.drafters.base.DraftBudget): the config's threshold,
        or the adaptive policy's price of a row where that is higher."""
        return max(self.log_threshold, budget.min_log_survival)

    def temperature(self, depth: int) -> float:
        """T of the drafts at `depth` (1 for the newest token's children)."""
        return self.temperatures[depth - 1] if depth - 1 < len(self.temperatures) else 1.0
