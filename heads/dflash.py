"""DFlash (Chen, Liang, Liu 2026, "DFlash: Block Diffusion for Flash Speculative Decoding"; z-lab/dflash).

A few Qwen3-style decoder layers (q/k norm) draft a whole block in one forward. The block is `[x_a, MASK x (B-1)]`
at positions a..a+B-1, x_a the newest token (the one the target has not run yet) and MASK the embedding of
`mask_token_id`; the layer outputs at slots 1..B-1, through the head's `norm` and the target's LM head, are the
drafts of x_{a+1}..x_{a+B-1}. The target is read only through its hidden states at the positions before the block:
the states of `target_layers` at p < a, concatenated, projected by `fc` and normed by `hidden_norm` into one context
feature c_p. Every drafter layer attends, besides the block's own K/V, to K/V it projects from c_p with its own
k/v projections and k norm, rotated to position p: the context enters as extra K/V of every layer, never as an input
embedding, and depends on the target's state at p alone (no drafter recurrence), so a served drafter keeps it in a
K/V pool as the target's blocks grow. Within the block, slots attend to each other bidirectionally (DFlash's
choice) or, with `causal`, each to the slots before it.

`target_layers` numbers a layer by its input, as EAGLE-3's aux layers, vLLM and speculators'
aux_hidden_state_layer_ids do: z-lab's `target_layer_ids` name the layer whose output is read, one lower. The
default is z-lab's spacing, one layer per drafter layer evenly over z-lab's [1, L-3] (the middle one for a single
drafter layer), renumbered. The embedding and the LM head are the target's, frozen; a head trained over a token
map (heads/token_map.py) drafts among its tokens.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from heads.config import HeadConfig, require_positive_int
from heads.draft_head import DraftHead
from heads.layer import DecoderLayer, RMSNorm


def spaced_layers(num_target_layers: int, num_layers: int) -> tuple[int, ...]:
    """z-lab's default target layers for `num_layers` drafter layers, as inputs of layers (z-lab's id + 1)."""
    if num_layers == 1:
        return (num_target_layers // 2 + 1,)
    start, end = 1, num_target_layers - 3
    return tuple(int(round(start + i * (end - start) / (num_layers - 1))) + 1 for i in range(num_layers))


@dataclass
class DFlashConfig(HeadConfig):
    kind = "dflash"
    takes_draft_window = False

    num_layers: int = 1  # drafter decoder layers
    target_layers: tuple[int, ...] = ()  # inputs of these target layers, fused; (): z-lab's spacing
    block_size: int = 8  # B: the anchor and B - 1 masks, drafting B - 1 tokens
    mask_token_id: int | None = None  # the token whose embedding fills the block's slots 1..B-1
    causal: bool = False  # slots attend to the slots before them only (False: to the whole block)

    def __post_init__(self):
        super().__post_init__()
        require_positive_int(self, "num_layers")
        num_target = self.num_target_layers
        self.target_layers = tuple(self.target_layers) or spaced_layers(num_target, self.num_layers)
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_target for i in self.target_layers):
            raise ValueError(f"target_layers={list(self.target_layers)} must be target layer ids in [0, {num_target}) "
                             f"(the input of each layer; this target has {num_target} layers)")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 2:
            raise ValueError(f"block_size={self.block_size!r} must be an integer >= 2: a block is the anchor and "
                             "block_size - 1 mask slots, one per draft")
        mask = self.mask_token_id
        if isinstance(mask, bool) or not isinstance(mask, int) or not 0 <= mask < self.vocab_size:
            raise ValueError(f"mask_token_id={mask!r} lies outside the target's vocabulary [0, {self.vocab_size}): set "
                             "it to a token id the target never writes (a reserved or special token)")
        if not isinstance(self.causal, bool):
            raise ValueError(f"causal={self.causal!r} must be true or false")

    @property
    def num_drafts(self) -> int:
        """Drafts one block makes: its mask slots."""
        return self.block_size - 1

    def draft_slot(self, j: int) -> int:
        """The block slot whose output drafts x_{a+j} (j >= 1): the mask at a+j."""
        return j

    @classmethod
    def from_target(cls, parts, intermediate_size: int | None = None, **kind_fields) -> "DFlashConfig":
        """As HeadConfig's, with Qwen3-style layers whatever the target's: q/k norm, no attention bias."""
        config = super().from_target(parts, intermediate_size, **kind_fields)
        return dataclasses.replace(config, qk_norm=True, attention_bias=False)


class DFlash(DraftHead):
    config_class = DFlashConfig

    def __init__(self, config: DFlashConfig):
        super().__init__(config)
        c = config
        h = c.hidden_size
        self.fc = nn.Linear(len(c.target_layers) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, c.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(c.layer_config(), layer_idx=i) for i in range(c.num_layers))
        self.norm = RMSNorm(h, c.rms_norm_eps)
        self.rope = c.rope()

    def init_from_target(self) -> "DFlash":
        with torch.no_grad():
            self.norm.weight.copy_(self.target.norm.weight)
        return self

    def fuse(self, states: torch.Tensor) -> torch.Tensor:
        """states: [..., len(target_layers) * hidden], the target layers' inputs side by side -> context features
        [..., hidden]."""
        return self.hidden_norm(self.fc(states))

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """context: [..., hidden] fused features at positions [...] -> (k, v) [..., kv_heads, head_dim] per layer:
        what every block after those positions attends to besides itself."""
        cos, sin = self.rope_tables(positions, context.dtype)
        return [layer.project(context, cos, sin)[1:] for layer in self.layers]

    def block_ids(self, anchors: torch.Tensor) -> torch.Tensor:
        """anchors: [...] the newest tokens -> [..., block_size] blocks [anchor, MASK x (B-1)]."""
        ids = anchors.new_full((*anchors.shape, self.config.block_size), self.config.mask_token_id)
        ids[..., 0] = anchors
        return ids

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention,
                context: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """input_ids, positions: [...] the blocks' tokens and positions -> out [..., hidden] (before the final norm).
        attention(layer_idx, q, k, v) attends to the block's own K/V and to the context's, which the caller holds
        (the engine's pool); with `context` = (features [..., C, hidden] fused, their positions), the context's K/V
        are made here and given as attention(layer_idx, q, k, v, context_k, context_v)."""
        hidden = self.input_embedding()(input_ids)
        cos, sin = self.rope_tables(positions, hidden.dtype)
        context_kv = self.context_kv(*context) if context is not None else [None] * len(self.layers)
        for layer, kv in zip(self.layers, context_kv):
            layer_attention = attention if kv is None else (
                lambda i, q, k, v, kv=kv: attention(i, q, k, v, *kv))
            hidden = layer(hidden, cos, sin, layer_attention)
        return hidden

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """out: [..., hidden] -> [..., vocab] (the token map's rows, with one) over the slot's token."""
        return self.target.lm_head(self.norm(out))
