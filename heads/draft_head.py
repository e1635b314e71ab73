"""What every draft head shares: its config, the frozen target parts it is bound to, and rope tables.

A head holds the target's embedding, final norm and LM head by reference only (never as submodules), so its
state_dict, optimizer and checkpoint carry just its own tensors. Heads run over any leading dims: `[B, S]`
training batches with dense causal attention, flat `[num_tokens]` batches with the engine's paged attention.
A head trained over a token map (heads/token_map.py) keeps its ids in `token_map` and is bound to parts whose LM
head holds just those rows, in that order.
"""
from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from heads.config import HeadConfig
from heads.target_parts import TargetParts
from heads.token_map import check_token_ids


class DraftHead(nn.Module):
    config_class: ClassVar[type[HeadConfig]] = HeadConfig

    def __init__(self, config: HeadConfig):
        if not isinstance(config, self.config_class):
            raise TypeError(f"{type(self).__name__} takes a {self.config_class.__name__}, got {type(config).__name__}")
        super().__init__()
        self.config = config
        size = config.token_map_size
        self.register_buffer("token_map", torch.zeros(size, dtype=torch.int64) if size else None)
        object.__setattr__(self, "_target", None)

    @classmethod
    def from_target(cls, parts: TargetParts, token_map: torch.Tensor | None = None, **kind_fields) -> "DraftHead":
        """A new head for `parts`: config copied from the target, bound, and initialised from it. With `token_map`
        (target ids) it drafts among those tokens, and `parts.lm_head` must hold those rows of the target's."""
        if token_map is not None:
            token_map = check_token_ids(token_map, parts.vocab_size, "token_map")
            kind_fields["token_map_size"] = len(token_map)
        head = cls(cls.config_class.from_target(parts, **kind_fields))
        if token_map is not None:
            head.token_map.copy_(token_map)
        return head.bind_target(parts).init_from_target()

    def bind_target(self, parts: TargetParts) -> "DraftHead":
        mismatches = self.config.mismatches(parts.describe())
        if mismatches:
            raise ValueError(f"this {self.config.kind} head was made for another target: {'; '.join(mismatches)}. "
                             "Bind it to the target it was trained on, or train a head for this target.")
        rows = self.config.token_map_size
        if rows and parts.lm_head.out_features != rows:
            raise ValueError(f"this {self.config.kind} head drafts among the {rows} tokens of its token map, but the "
                             f"target parts' LM head has {parts.lm_head.out_features} rows: give it those rows "
                             "(parts.lm_head = heads.token_map.lm_head_rows(parts.lm_head, head.token_map))")
        object.__setattr__(self, "_target", parts)  # a plain attribute: never a submodule, never saved
        return self

    @property
    def target(self) -> TargetParts:
        if self._target is None:
            raise RuntimeError(f"this {self.config.kind} head is not bound to a target: "
                               "call head.bind_target(heads.load_target_parts(folder)) first")
        return self._target

    def input_embedding(self) -> nn.Embedding:
        """The embedding the head reads its input tokens with: the target's (a kind with an embedding of its own
        returns that one)."""
        return self.target.embed

    def init_from_target(self) -> "DraftHead":
        """Copy the target tensors a new head starts from into its own; heads that start from scratch copy none."""
        return self

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [..., 1, head_dim] for positions [...] of any shape."""
        if self.rope.cos.device != positions.device:
            self.rope.to(torch.float32, positions.device)
        return self.rope.tables(positions, dtype)
