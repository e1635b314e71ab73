"""EAGLE-3 (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test").

EAGLE-3 drops feature prediction and reads low, middle and high target layers instead of the last one. The
aux states at position t are the inputs of target layers `aux_layers` (default 2, L//2, L-3; Hugging Face's
`output_hidden_states[i]`); `fc` (3h -> h, no bias) fuses them into g_t. One decoder layer attends over
`concat(input_norm(embed(x_{t+1})), hidden_norm(g_t))` (2h wide) with g_t as its residual stream; its output
goes through the head's own final `norm` and `lm_head` to logits for x_{t+2} over a reduced draft vocabulary.
The next draft step feeds that output (before the final norm) back in place of g, at position t+1: training
unrolls the same way (training-time test). Positions are those of g_t, as in EAGLE-3 and vLLM.

EAGLE 3.1 (arXiv 2605.09992) adds norms that keep the fused feature and the fed-back output at one scale across
draft depths, as speculators and vLLM name them (all off by default, which is EAGLE-3):
- `norm_before_fc`: one RMSNorm over the concatenated aux states before `fc` (3h wide; `input_norm` in their files).
- `fc_norm`: one RMSNorm per aux state before concatenation, concat(Norm(a), Norm(b), Norm(c)) (`fc_norm.{i}`);
  it and norm_before_fc exclude each other.
- `norm_output`: the output goes through the final `norm` before it is fed back as the next step's g (training
  unrolls over it too) and before `lm_head`, which then reads it as is.

`norm_before_residual` (speculators' and vLLM's name; its trainer's default) makes hidden_norm(g), not g, the
layer's residual stream: the attention and MLP outputs are added to the normed g.

The draft vocabulary is stored as EAGLE-3 and vLLM store it: `d2t[draft_id]` is the offset to the target id
(`target_id = draft_id + d2t[draft_id]`, draft ids in ascending target-id order) and `t2d` marks the target
ids that are in it. A new head takes its `norm` and its `lm_head` rows from the target's (the rows of the
draft vocabulary's tokens). The embedding of x_{t+1} is the target's, frozen, unless `own_embedding`: then the head
keeps an embedding of its own (`embed_tokens`, over the whole vocabulary), started from the target's and trained with
it, as speculators trains P-EAGLE by default (embed_requires_grad) and as vLLM serves a draft whose file carries an
embedding unlike the target's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from heads.config import HeadConfig, require_positive_int
from heads.draft_head import DraftHead
from heads.layer import DecoderLayer, RMSNorm


@dataclass
class Eagle3Config(HeadConfig):
    kind = "eagle3"

    aux_layers: tuple[int, ...] = ()  # () derives (2, L // 2, L - 3) from the target's L layers
    draft_vocab_size: int = 0  # 0 means the target's whole vocabulary
    norm_before_fc: bool = False  # EAGLE 3.1's norms, as speculators and vLLM name them (module docstring)
    fc_norm: bool = False
    norm_output: bool = False
    norm_before_residual: bool = False  # the layer's residual stream is hidden_norm(g) (module docstring)
    own_embedding: bool = False  # the head embeds its input tokens with embed_tokens of its own (module docstring)

    def __post_init__(self):
        super().__post_init__()
        for name in ("norm_before_fc", "fc_norm", "norm_output", "norm_before_residual", "own_embedding"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be true or false")
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("norm_before_fc and fc_norm exclude each other (one norm over the concatenated aux "
                             "states, or one per aux state): set one of them")
        num_layers = self.num_target_layers
        self.aux_layers = tuple(self.aux_layers) or (2, num_layers // 2, num_layers - 3)
        if not all(isinstance(i, int) and 0 <= i < num_layers for i in self.aux_layers):
            raise ValueError(f"aux_layers={self.aux_layers} must be target layer ids in [0, {num_layers}); "
                             "the default (2, L // 2, L - 3) needs a target of at least 3 layers")
        if self.token_map_size:
            raise ValueError("an EAGLE-3 head drafts over its own draft vocabulary (draft_vocab_size, d2t and t2d), "
                             "not a token map: token_map_size must be 0")
        self.draft_vocab_size = self.draft_vocab_size or self.vocab_size
        require_positive_int(self, "draft_vocab_size")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size} exceeds the target's vocab_size={self.vocab_size}")


class Eagle3(DraftHead):
    config_class = Eagle3Config

    def __init__(self, config: Eagle3Config):
        super().__init__(config)
        c = config
        h = c.hidden_size
        num_aux = len(c.aux_layers)
        self.fc = nn.Linear(num_aux * h, h, bias=False)
        if c.norm_before_fc:
            self.fc_input_norm = RMSNorm(num_aux * h, c.rms_norm_eps)
        if c.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(h, c.rms_norm_eps) for _ in range(num_aux))
        if c.own_embedding:
            self.embed_tokens = nn.Embedding(c.vocab_size, h)
        self.input_norm = RMSNorm(h, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, c.rms_norm_eps)
        self.layer = DecoderLayer(c.layer_config(attention_input_size=2 * h), layer_idx=0, input_norm=False)
        self.norm = RMSNorm(h, c.rms_norm_eps)
        self.lm_head = nn.Linear(h, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.arange(c.vocab_size) < c.draft_vocab_size)
        self.rope = c.rope()

    @classmethod
    def from_target(cls, parts, draft_token_ids: Sequence[int] | torch.Tensor | None = None, **kind_fields) -> "Eagle3":
        """A new head for `parts` whose draft vocabulary is `draft_token_ids` (e.g. the most frequent answer
        tokens), or the first draft_vocab_size target ids when not given."""
        if draft_token_ids is not None:
            kind_fields["draft_vocab_size"] = len(draft_token_ids)
        # vLLM, SGLang and speculators draft EAGLE-3 with Llama's layer whatever the target: no q/k norms (Qwen3's)
        kind_fields.setdefault("qk_norm", False)
        head = cls(cls.config_class.from_target(parts, **kind_fields)).bind_target(parts)
        if draft_token_ids is not None:
            head.set_draft_vocab(draft_token_ids)
        return head.init_from_target()

    def set_draft_vocab(self, token_ids: Sequence[int] | torch.Tensor) -> None:
        """Make `token_ids` (distinct target ids, draft_vocab_size of them) the draft vocabulary; call
        init_from_target afterwards for a new head."""
        ids = torch.as_tensor(token_ids, dtype=torch.int64).flatten().sort().values
        c = self.config
        if len(ids) != c.draft_vocab_size:
            raise ValueError(f"{len(ids)} draft token ids given, draft_vocab_size is {c.draft_vocab_size}")
        if len(ids) and (ids[0] < 0 or ids[-1] >= c.vocab_size):
            raise ValueError(f"draft token ids must lie in [0, {c.vocab_size}), got {ids[0].item()}..{ids[-1].item()}")
        if ids.unique().numel() != len(ids):
            raise ValueError("draft token ids must be distinct")
        self.d2t.copy_(ids - torch.arange(len(ids)))
        self.t2d.zero_()
        self.t2d[ids.to(self.t2d.device)] = True

    @property
    def draft_token_ids(self) -> torch.Tensor:
        """[draft_vocab] the target id of each draft id, ascending."""
        return self.to_target_ids(torch.arange(self.config.draft_vocab_size, device=self.d2t.device))

    @property
    def draft_index(self) -> torch.Tensor:
        """[vocab] the draft id of each target id (meaningful where t2d holds)."""
        return self.t2d.cumsum(0) - 1

    def input_embedding(self) -> nn.Embedding:
        """Its own embedding with own_embedding, else the target's."""
        return self.embed_tokens if self.config.own_embedding else self.target.embed

    def init_from_target(self) -> "Eagle3":
        with torch.no_grad():
            if self.config.own_embedding:
                self.embed_tokens.weight.copy_(self.target.embed.weight)
            self.norm.weight.copy_(self.target.norm.weight)
            self.lm_head.weight.copy_(self.target.lm_head.weight[self.draft_token_ids.to(self.target.lm_head.weight.device)])
        return self

    def fuse(self, aux: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
        """aux: the inputs of the target layers aux_layers, in that order, as a sequence of [..., hidden] or
        already concatenated [..., num_aux * hidden] -> g: [..., hidden]."""
        if not isinstance(aux, torch.Tensor):
            aux = torch.cat(list(aux), dim=-1)
        if self.config.norm_before_fc:
            aux = self.fc_input_norm(aux)
        if self.config.fc_norm:
            aux = torch.cat([norm(part) for norm, part in zip(self.fc_norm, aux.chunk(len(self.fc_norm), dim=-1))], dim=-1)
        return self.fc(aux)

    def forward(self, input_ids: torch.Tensor, g: torch.Tensor, positions: torch.Tensor, attention) -> torch.Tensor:
        """input_ids: [...] x_{t+1}; g: [..., hidden] fuse(aux) at the first step, the previous output after;
        positions: [...] t -> out: [..., hidden], what the next step reads as g (before the final norm, or after it
        with norm_output)."""
        embeds = self.input_norm(self.input_embedding()(input_ids))  # [..., hidden]
        normed = self.hidden_norm(g)
        attention_input = torch.cat([embeds, normed], dim=-1)  # [..., 2 * hidden]
        cos, sin = self.rope_tables(positions, g.dtype)
        residual = normed if self.config.norm_before_residual else g
        out = self.layer(residual, cos, sin, attention, attention_input=attention_input)
        return self.norm(out) if self.config.norm_output else out

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """out: [..., hidden] forward's output -> [..., draft_vocab] over x_{t+2}; map the chosen ids with
        to_target_ids."""
        return self.lm_head(out if self.config.norm_output else self.norm(out))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]
