"""Attention in plain torch shared by the target and the heads: grouped-query SDPA, dense causal attention
(training runs the decoder layers with it; the engine injects paged attention instead) and dense attention over
extra context K/V beside a query's own (DFlash's blocks)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def sdpa_gqa(q, k, v, mask=None, is_causal=False, scale=None, sinks=None):
    """q: [B, Q, H, D]; k, v: [B, C, KV, D]; mask: [B, Q, C] bool (True attends) -> [B, Q, H, D].
    Grouped-query attention without repeating K/V: the query heads sharing a KV head are stacked on the query axis.
    sinks: [H] logits that share each head's softmax with its keys and add no value (gpt-oss)."""
    if sinks is not None:
        return _sdpa_with_sinks(q, k, v, mask, is_causal, scale, sinks)
    batch, num_q, num_heads, head_dim = q.shape
    num_kv = k.shape[2]
    group = num_heads // num_kv
    qg = q.view(batch, num_q, num_kv, group, head_dim).permute(0, 2, 3, 1, 4).reshape(batch, num_kv, group * num_q, head_dim)
    if is_causal and group > 1:
        mask = torch.ones(num_q, k.shape[1], dtype=torch.bool, device=q.device).tril(k.shape[1] - num_q)[None]
        is_causal = False
    if mask is not None:
        mask = mask.unsqueeze(1)  # [B, 1, Q, C]; one query row broadcasts over its group
        if num_q > 1 and group > 1:
            mask = mask.repeat(1, 1, group, 1)  # [B, 1, group * Q, C]
    out = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=is_causal,
                                         scale=scale)
    return out.view(batch, num_kv, group, num_q, head_dim).permute(0, 3, 1, 2, 4).reshape(batch, num_q, num_heads, head_dim)


def _sdpa_with_sinks(q, k, v, mask, is_causal, scale, sinks):
    """sdpa_gqa's scores, softmax and sum written out, each head's sink a further column of its scores."""
    num_q, num_heads, head_dim = q.shape[1:]
    group = num_heads // k.shape[2]
    keys, values = (x.repeat_interleave(group, dim=2).transpose(1, 2) for x in (k, v))  # [B, H, C, D]
    scores = q.transpose(1, 2) @ keys.transpose(-1, -2) * (head_dim ** -0.5 if scale is None else scale)  # [B, H, Q, C]
    if is_causal:
        mask = torch.ones(num_q, k.shape[1], dtype=torch.bool, device=q.device).tril(k.shape[1] - num_q)[None]
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
    scores = torch.cat([scores, sinks.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:-1], 1)], dim=-1)
    weights = scores.softmax(dim=-1)[..., :-1]
    return (weights @ values).transpose(1, 2)


def in_window(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int) -> torch.Tensor:
    """[..., Q, K] bool: True where a key lies in the sliding window of a query, key position > query position -
    window (the query's own position included); every key where window is 0."""
    if not window:
        return torch.ones(query_positions.shape[-1], key_positions.shape[-1], dtype=torch.bool,
                          device=query_positions.device)
    return key_positions[..., None, :] > query_positions[..., :, None] - window


def causal_mask(num_positions: int, window: int = 0, device=None) -> torch.Tensor:
    """[S, S] bool: row i sees key j <= i, and j > i - window where window is set."""
    positions = torch.arange(num_positions, device=device)
    return (positions[None, :] <= positions[:, None]) & in_window(positions, positions, window)


class DenseCausalAttention:
    """Causal attention over [B, S] sequences; `padding_mask` [B, S] (True for real tokens) hides padded keys;
    `window` > 0 limits each row to the keys of its sliding window (in_window)."""

    def __init__(self, padding_mask: torch.Tensor | None = None, window: int = 0):
        self.mask, self.window = None, window
        if padding_mask is not None:
            self.mask = causal_mask(padding_mask.shape[1], window, padding_mask.device)[None] & padding_mask[:, None, :]
            self.mask[..., 0] |= ~self.mask.any(-1)  # fully padded rows attend somewhere, never NaN

    def __call__(self, layer_idx, q, k, v):
        mask = self.mask
        if mask is None and self.window:
            mask = causal_mask(q.shape[1], self.window, q.device)[None]
        return sdpa_gqa(q, k, v, mask, is_causal=mask is None)


class DenseContextAttention:
    """Attention over [context K/V | the queries' own K/V] with an explicit mask: mask [B, Q, C + Q] (True attends),
    C the context's rows. Called as attention(layer_idx, q, k, v, context_k, context_v), context_k/v [B, C, KV, D]."""

    def __init__(self, mask: torch.Tensor):
        self.mask = mask

    def __call__(self, layer_idx, q, k, v, context_k, context_v):
        return sdpa_gqa(q, torch.cat([context_k, k], dim=1), torch.cat([context_v, v], dim=1), self.mask)
