"""Training-time test: a draft layer unrolled over its own outputs, with the attention it will see when drafting.

The engine drafts with a feature head (serving/drafters/eagle.py, EagleDrafter) like this: a catch-up pass over
the real tokens up to t writes the layer's K/V at positions <= t and its output at t yields draft 1; draft s+1
feeds (draft s, the previous output) at position t+s, whose query attends to the catch-up K/V at positions <= t
and to the K/V the drafting steps themselves wrote at positions t+1..t+s. Nothing else: the drafts of other
anchors never enter.

Training runs every anchor t of a [B, S] batch at once, one call of the layer per unroll step s (0-based):

    step 0:  input (x_{t+1}, f_t) at position t; attends causally over step 0's K/V at positions <= t
    step s:  input (x_{t+s+1}, out^{s-1}_t) at position t+s; attends to step 0's K/V at positions <= t and to
             the K/V of steps 1..s at the same anchor t (their positions t+1..t+s)
    step s predicts x_{t+s+2}

with f_t the real feature (the target's, or fused aux states) and the drafted tokens replaced by the true ones,
so step s is exactly the engine's draft s+1 given that drafts 1..s were right. This is the scheme of EAGLE-3's
training-time test as SpecForge implements it: one K/V list per step, a causal block over step 0 and a diagonal
for every later step, rope positions shifted by the step.

With a draft window W (the head's draft_window) every key also lies in the query's sliding window, by position as
the engine's paged attention has it: step s at position t+s sees step 0's keys at positions in (t+s-W, t] and the
steps j <= s whose positions t+j lie past t+s-W.
"""
from __future__ import annotations

from typing import Callable

import torch

from heads.attention import in_window, sdpa_gqa


class UnrolledAttention:
    """Attention callable for DecoderLayer over [B, S] batches: the first call per layer is step 0 (causal over
    real tokens, `padding_mask` [B, S] True on them); each later call is the next unroll step. `window` > 0: the
    draft layer's sliding window (module docstring)."""

    def __init__(self, padding_mask: torch.Tensor, window: int = 0):
        num_positions = padding_mask.shape[1]
        causal = torch.ones(num_positions, num_positions, dtype=torch.bool, device=padding_mask.device).tril()
        self.mask = causal[None] & padding_mask[:, None, :]  # [B, S, S]
        self.mask[..., 0] |= ~self.mask.any(-1)  # a fully padded row attends somewhere, never NaN
        self.window = window
        self.positions = torch.arange(num_positions, device=padding_mask.device)
        self.steps: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def step_masks(self, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step s's ([B, S, S] mask over step 0's keys, [s] mask over steps 1..s's own keys)."""
        own = torch.arange(1, s + 1, device=self.positions.device)
        if not self.window:
            return self.mask, torch.ones(s, dtype=torch.bool, device=own.device)
        return self.mask & in_window(self.positions + s, self.positions, self.window), own > s - self.window

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [B, S, H, D]; k, v: [B, S, KV, D] -> [B, S, H, D]."""
        steps = self.steps.setdefault(layer_idx, [])
        steps.append((k, v))
        context_mask, own_mask = self.step_masks(len(steps) - 1)
        if len(steps) == 1:
            return sdpa_gqa(q, k, v, context_mask)
        batch, num_positions, num_heads, head_dim = q.shape
        num_kv = k.shape[2]
        qg = q.view(batch, num_positions, num_kv, num_heads // num_kv, head_dim)  # [B, S, KV, G, D]
        k0, v0 = steps[0]
        scale = head_dim ** -0.5
        causal = torch.einsum("bqkgd,bckd->bkgqc", qg, k0) * scale  # [B, KV, G, S, S]
        causal = causal.masked_fill(~context_mask[:, None, None], float("-inf"))
        later_k = torch.stack([ks for ks, _ in steps[1:]])  # [s, B, S, KV, D]
        later_v = torch.stack([vs for _, vs in steps[1:]])
        diagonal = torch.einsum("bqkgd,jbqkd->bkgqj", qg, later_k) * scale  # [B, KV, G, S, s]
        diagonal = diagonal.masked_fill(~own_mask, float("-inf"))
        probs = torch.cat([causal, diagonal], dim=-1).float().softmax(-1).to(v.dtype)
        out = (torch.einsum("bkgqc,bckd->bqkgd", probs[..., :num_positions], v0)
               + torch.einsum("bkgqj,jbqkd->bqkgd", probs[..., num_positions:], later_v))
        return out.reshape(batch, num_positions, num_heads, head_dim)


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """x: [B, S, ...] -> [B, S, ...] with x[:, t + n] at t; the last n positions hold `fill`."""
    out = torch.full_like(x, fill)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out


def unroll(step: Callable, input_ids: torch.Tensor, features: torch.Tensor, padding_mask: torch.Tensor,
           num_steps: int, max_position: int, window: int = 0) -> list[torch.Tensor]:
    """step(input_ids [B, S], features [B, S, hidden], positions [B, S], attention) -> [B, S, hidden], one call of
    the draft layer. input_ids: [B, S] x; features: [B, S, hidden] f_t; padding_mask: [B, S].
    Returns out^0..out^{num_steps-1}, each [B, S, hidden], out^s[:, t] at anchor t (see the module docstring).
    Positions past max_position (only anchors whose labels lie past the sequence) are clamped. window: the draft
    layer's sliding window (0: none)."""
    batch, num_positions = input_ids.shape
    positions = torch.arange(num_positions, device=input_ids.device).expand(batch, num_positions)
    attention = UnrolledAttention(padding_mask, window)
    outs = []
    for s in range(num_steps):
        features = step(shift_left(input_ids, s + 1), features, (positions + s).clamp(max=max_position - 1), attention)
        outs.append(features)
    return outs
