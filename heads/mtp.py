"""Multi-token prediction modules (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", section 2.2).

D modules run in sequence. Module j (0-based here; the paper's module j+1) reads h^j_t, the previous
module's output at position t (h^0 is the target's final hidden state after the final norm, as the store
holds it), and the embedding of x_{t+j+1}; it predicts x_{t+j+2}:

    h'  = eh_proj(concat(enorm(embed(x_{t+j+1})), hnorm(h^j_t)))     2h -> h, no bias
    h^{j+1}_t = DecoderLayer(h')                                     with its input norm
    logits = target lm_head(norm(h^{j+1}_t))                         the module's own final norm

The paper's equation (21) writes the concatenation as [hnorm(h); enorm(emb)], but DeepSeek-V3's released MTP
weights, vLLM (deepseek_mtp.py) and SGLang (deepseek_nextn.py) all use [enorm(emb), hnorm(h)]; this version
follows them so their weights map on directly. Module j's output before its final norm is module j+1's h.
The embedding and LM head are the target's, shared and frozen. Module j's decoder layer has layer index j,
so each keeps its own K/V. Positions are those of h_t. At serving time `serve_mode` runs the D modules in
order ("chain") or reuses module 0 autoregressively ("reuse_first"), as vLLM and SGLang do when they draft
more tokens than there are modules.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from heads.config import HeadConfig, require_positive_int
from heads.draft_head import DraftHead
from heads.layer import DecoderLayer, RMSNorm

SERVE_MODES = ("chain", "reuse_first")


@dataclass
class MtpConfig(HeadConfig):
    kind = "mtp"

    depth: int = 1  # D modules
    serve_mode: str = "chain"

    def __post_init__(self):
        super().__post_init__()
        require_positive_int(self, "depth")
        if self.serve_mode not in SERVE_MODES:
            raise ValueError(f"serve_mode={self.serve_mode!r} is not one of {', '.join(SERVE_MODES)}")


class MtpModule(nn.Module):
    def __init__(self, config: MtpConfig, index: int):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.layer = DecoderLayer(config.layer_config(), layer_idx=index)
        self.norm = RMSNorm(h, eps)


class Mtp(DraftHead):
    config_class = MtpConfig

    def __init__(self, config: MtpConfig):
        super().__init__(config)
        self.blocks = nn.ModuleList(MtpModule(config, j) for j in range(config.depth))
        self.rope = config.rope()

    def forward_module(self, j: int, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                       attention) -> torch.Tensor:
        """input_ids: [...] x_{t+j+1}; hidden: [..., hidden] h^j_t; positions: [...] t -> h^{j+1}_t [..., hidden]."""
        block = self.blocks[j]
        embeds = block.enorm(self.input_embedding()(input_ids))  # [..., hidden]
        x = block.eh_proj(torch.cat([embeds, block.hnorm(hidden)], dim=-1))  # [..., hidden]
        cos, sin = self.rope_tables(positions, x.dtype)
        return block.layer(x, cos, sin, attention)

    def logits(self, j: int, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [..., hidden] module j's output -> [..., vocab] over x_{t+j+2}."""
        return self.target.lm_head(self.blocks[j].norm(hidden))
