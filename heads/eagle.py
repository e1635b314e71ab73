"""EAGLE-1 (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty").

EAGLE drafts at the feature level. At position t it reads the target's feature h_t (the final hidden state
after the final norm) and the embedding of the token that follows, x_{t+1}, fuses them with
`fc(concat(embed(x_{t+1}), h_t))` (2h -> h, with a bias unless fc_bias is off) and runs one decoder layer, without an input norm as
EAGLE's reference code has it, to predict the next feature h_{t+1}. The target's frozen LM head turns that
feature into logits for x_{t+2}; features live in the target's post-norm space, so no norm comes before it.
Drafting continues autoregressively on the head's own predicted features: the next step reads (x_{t+2},
predicted h_{t+1}) at position t+1. Positions are those of h_t, as in EAGLE and vLLM; the layer keeps its own
K/V (layer index 0).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from heads.config import HeadConfig
from heads.draft_head import DraftHead
from heads.layer import DecoderLayer


@dataclass
class EagleConfig(HeadConfig):
    kind = "eagle"

    fc_bias: bool = True  # EAGLE's fc has a bias; vLLM's EAGLE-1 layer has none (export for vLLM needs False)


class Eagle(DraftHead):
    config_class = EagleConfig

    def __init__(self, config: EagleConfig):
        super().__init__(config)
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=config.fc_bias)
        self.layer = DecoderLayer(config.layer_config(), layer_idx=0, input_norm=False)
        self.rope = config.rope()

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, attention) -> torch.Tensor:
        """input_ids: [...] x_{t+1}; hidden: [..., hidden] h_t; positions: [...] t -> features [..., hidden] ~ h_{t+1}."""
        embeds = self.input_embedding()(input_ids)  # [..., hidden]
        x = self.fc(torch.cat([embeds, hidden], dim=-1))  # [..., hidden]
        cos, sin = self.rope_tables(positions, x.dtype)
        return self.layer(x, cos, sin, attention)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """features: [..., hidden] -> [..., vocab] over x_{t+2}."""
        return self.target.lm_head(features)
