"""Per-position temperatures that make a head's probability of its draft match how often that draft is right.

The engine's confidence cut (`confidence_threshold`) reads p(draft) = softmax(logits / T_i)[argmax] at draft
position i. A head trained for several epochs on a small store is overconfident, so a threshold on T = 1 means a
different thing for every head and every position. Validation fits T_i on a grid: among the anchors the chain
reaches (drafts 1..i-1 all right, as the engine verifies them), the T_i whose p(draft) has the least binary
cross-entropy against "draft i is right". The head's config keeps them (`confidence_temperatures`).
"""
from __future__ import annotations

import torch
from torchmetrics import Metric

from serving.drafters.confidence import log_confidence

TEMPERATURES = tuple(2 ** (k / 4) for k in range(-4, 13))  # 0.5 .. 8


class Calibration(Metric):
    full_state_update = False

    def __init__(self, num_positions: int):
        super().__init__()
        self.add_state("loss", torch.zeros(num_positions, len(TEMPERATURES), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.zeros(num_positions, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, position: int, logits: torch.Tensor, right: torch.Tensor) -> None:
        """logits: [N, vocab] of draft position `position` (0-based) at anchors the chain reaches; right: [N] bool."""
        if not len(right):
            return
        right = right.float()
        for g, temperature in enumerate(TEMPERATURES):
            log_p = log_confidence(logits, temperature).clamp(max=-1e-6)
            log_not = torch.log(-torch.expm1(log_p))
            self.loss[position, g] -= (right * log_p + (1 - right) * log_not).sum().double()
        self.count[position] += len(right)

    def compute(self) -> list[float]:
        """T_i per position: the grid's best, 1.0 where no anchor reached position i."""
        best = self.loss.argmin(-1).tolist()
        return [TEMPERATURES[g] if n else 1.0 for g, n in zip(best, self.count.tolist())]
