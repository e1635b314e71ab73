"""Per-position accuracy of a draft chain and the mean acceptance length it implies.

For draft position i (1-based) at anchor t: reached_i counts anchors whose label i is an answer token and whose
drafts 1..i-1 are all right; accepted_i those of them whose draft i is right too. The conditional accuracy
acc_i = accepted_i / reached_i is the engine's conditional acceptance under greedy verification against the
target's own tokens, and chain verification of k drafts then emits on average

    tau = 1 + sum_{i=1..k} prod_{j<=i} acc_j

tokens per step (DESIGN.md, "Measuring acceptance"). Counts are summed across devices before computing.
"""
from __future__ import annotations

import torch
from torchmetrics import Metric


class ChainAccuracy(Metric):
    full_state_update = False

    def __init__(self, num_positions: int):
        super().__init__()
        self.num_positions = num_positions
        self.add_state("reached", torch.zeros(num_positions, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("accepted", torch.zeros(num_positions, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, correct: torch.Tensor, valid: torch.Tensor) -> None:
        """correct, valid: [..., num_positions] bool: draft i right at an anchor, and its label an answer token."""
        correct, valid = correct.flatten(0, -2), valid.flatten(0, -2)
        all_right = correct.long().cumprod(-1).bool()  # [N, k] drafts 1..i all right
        before_right = torch.cat([torch.ones_like(all_right[:, :1]), all_right[:, :-1]], dim=-1)
        self.reached += (valid & before_right).sum(0)
        self.accepted += (valid & all_right).sum(0)

    def compute(self) -> dict[str, torch.Tensor]:
        """accuracy: [k] conditional accuracy per position (0 where never reached); tau: [] at k = num_positions."""
        accuracy = self.accepted.double() / self.reached.clamp(min=1).double()
        return {"accuracy": accuracy.float(), "tau": (1 + accuracy.cumprod(0).sum()).float()}
