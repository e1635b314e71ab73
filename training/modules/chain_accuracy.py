"""Per-position accuracy of a draft chain and the mean acceptance length it implies.

For draft position i (1-based) at anchor t: reached_i counts anchors whose label i is an answer token and whose
drafts 1..i-1 are all right; accepted_i those of them whose draft i is right too. The conditional accuracy
acc_i = accepted_i / reached_i is the engine's conditional acceptance under greedy verification against the
target's own tokens, and chain verification of k drafts then emits on average

    tau = 1 + sum_{i=1..k} prod_{j<=i} acc_j

tokens per step (docs/design.md, "Measuring acceptance"). That formula scores a chain from every answer position alike;
the engine starts each chain where the previous one ended (a + 1 tokens on after a accepted drafts), which falls
on harder positions more often. tau_walk follows the engine: along each example, a chain at the first anchor
whose first label is an answer token, then at the anchor a + 1 further, emitted tokens over chains. On answers
the target wrote greedily, that is the engine's tau on the same text but for each answer's last chain (the
engine drafts no further than its token budget). Counts are summed across devices before computing.
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
        self.add_state("walk_steps", torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("walk_emitted", torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")

    def update(self, correct: torch.Tensor, valid: torch.Tensor) -> None:
        """correct, valid: [B, S, num_positions] (or [S, num_positions], one example) bool: draft i right at
        anchor t of an example, and its label an answer token."""
        accepted = (correct & valid).long().cumprod(-1).sum(-1)  # [..., S] drafts a chain at each anchor would land
        self._walk(accepted.reshape(-1, accepted.shape[-1]).tolist(), valid[..., 0].reshape(-1, valid.shape[-2]).tolist())
        on_chain = reached(correct, valid)
        self.reached += on_chain.flatten(0, -2).sum(0)
        self.accepted += (on_chain & correct).flatten(0, -2).sum(0)

    def _walk(self, accepted: list[list[int]], starts: list[list[bool]]) -> None:
        steps = emitted = 0
        for landed, answer in zip(accepted, starts):
            t = 0
            while t < len(answer):
                if answer[t]:
                    steps, emitted = steps + 1, emitted + landed[t] + 1
                    t += landed[t] + 1
                else:
                    t += 1
        self.walk_steps += steps
        self.walk_emitted += emitted

    def compute(self) -> dict[str, torch.Tensor]:
        """accuracy: [k] conditional accuracy per position (0 where never reached); tau, tau_walk: [] at
        k = num_positions."""
        accuracy = self.accepted.double() / self.reached.clamp(min=1).double()
        tau_walk = self.walk_emitted.double() / self.walk_steps.clamp(min=1).double()
        return {"accuracy": accuracy.float(), "tau": (1 + accuracy.cumprod(0).sum()).float(), "tau_walk": tau_walk.float()}


def reached(correct: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[..., k] bool: draft i's label is an answer token and drafts 1..i-1 are all right (the chain reaches i)."""
    all_right = correct.long().cumprod(-1).bool()
    return valid & torch.cat([torch.ones_like(all_right[..., :1]), all_right[..., :-1]], dim=-1)
