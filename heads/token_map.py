"""Token maps (FR-Spec; SGLang's --speculative-token-map): the target ids a Medusa, EAGLE-1 or MTP head drafts
among, reading only those rows of the target's LM head. A file is a 1-D integer tensor saved with torch.save; a
head trained over a map keeps its ids as the `token_map` tensor of its checkpoint, row i of its logits being
token `token_map[i]`."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


def check_token_ids(ids, vocab_size: int, source: str) -> torch.Tensor:
    """`ids` as int64 when they are a non-empty 1-D integer tensor of distinct ids in [0, vocab_size); otherwise a
    ValueError naming `source`."""
    if not isinstance(ids, torch.Tensor) or ids.ndim != 1 or ids.is_floating_point() or ids.is_complex() or not len(ids):
        raise ValueError(f"{source} must hold a non-empty 1-D integer tensor of token ids")
    ids = ids.to(torch.int64)
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size or len(ids.unique()) != len(ids):
        raise ValueError(f"{source} must hold distinct token ids in [0, {vocab_size}) (the target's vocabulary)")
    return ids


def load_token_map(path, vocab_size: int) -> torch.Tensor:
    """The token ids of a token map file."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"token_map {path} does not exist: write one with `draftheads token-map --store STORE --out {path}`")
    try:
        ids = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"token_map {path} is not a torch.save file of token ids ({e})") from None
    return check_token_ids(ids, vocab_size, f"token_map {path}")


def lm_head_rows(lm_head: nn.Linear, ids: torch.Tensor) -> nn.Linear:
    """A frozen LM head over the rows `ids` only (a token map's), without initialising a new weight."""
    rows = nn.Linear(lm_head.in_features, len(ids), bias=False, device="meta")
    rows.weight = nn.Parameter(lm_head.weight[ids], requires_grad=False)
    return rows
