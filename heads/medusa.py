"""Medusa heads (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple
Decoding Heads", Medusa-1).

The target's LM head already turns h_t, its final hidden state after the final norm, into x_{t+1}. Medusa
adds k heads on the same h_t: head i (0-based) predicts x_{t+2+i}. A head is a stack of residual blocks
`x + SiLU(W x + b)` followed by an LM head. This version zero-initialises W and b, so an untrained head
returns h_t unchanged and guesses what the target guesses; the LM head is the target's, shared and frozen,
unless `own_lm_head` gives each head its own copy of it, which then trains and is saved. No K/V cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from heads.config import HeadConfig, require_positive_int
from heads.draft_head import DraftHead


@dataclass
class MedusaConfig(HeadConfig):
    kind = "medusa"
    takes_draft_window = False

    num_heads: int = 4  # k: head i predicts x_{t+2+i}
    num_layers: int = 1  # residual blocks per head
    own_lm_head: bool = False

    def __post_init__(self):
        super().__post_init__()
        require_positive_int(self, "num_heads")
        require_positive_int(self, "num_layers")


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class Medusa(DraftHead):
    config_class = MedusaConfig

    def __init__(self, config: MedusaConfig):
        super().__init__(config)
        c = config
        self.heads = nn.ModuleList(
            nn.Sequential(*(ResBlock(c.hidden_size) for _ in range(c.num_layers))) for _ in range(c.num_heads)
        )
        if c.own_lm_head:
            rows = c.token_map_size or c.vocab_size
            self.lm_heads = nn.ModuleList(nn.Linear(c.hidden_size, rows, bias=False) for _ in range(c.num_heads))

    def init_from_target(self) -> "Medusa":
        if self.config.own_lm_head:
            with torch.no_grad():
                for lm_head in self.lm_heads:
                    lm_head.weight.copy_(self.target.lm_head.weight)
        return self

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [..., hidden] h_t after the target's final norm -> logits [num_heads, ..., vocab]."""
        if not self.config.own_lm_head:  # one pass over the shared LM head's weights for every head
            return self.target.lm_head(torch.stack([head(hidden) for head in self.heads]))
        return torch.stack([lm_head(head(hidden)) for head, lm_head in zip(self.heads, self.lm_heads)])
