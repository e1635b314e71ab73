"""Verification of drafts against the target.

Greedy: accept while the target's argmax equals the draft. Sampled: exact rejection sampling
(Leviathan et al. 2023; Chen et al. 2023): accept draft d with probability min(1, p(d) / q(d)); on
rejection sample from max(p - q, 0) renormalised; when every draft is accepted, sample a bonus token
from the next distribution. Deterministic drafts are q = one-hot: accept with probability p(d), on
rejection sample from p with d removed. Either way the emitted tokens follow p exactly. Leaves (alternatives to
the first draft, each verified in a row of its own) are more deterministic drafts for the same token: tried in
turn, each against p with the ones rejected before removed, they draw the token from p without replacement.
"""
from __future__ import annotations

import torch

from serving.sampler import sample


def verify_greedy(target_tokens: list[int], drafts: list[int]) -> tuple[int, list[int]]:
    """target_tokens: the target's argmax at each of 1 + len(drafts) rows. Returns (accepted, emitted)."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == target_tokens[accepted]:
        accepted += 1
    return accepted, drafts[:accepted] + [target_tokens[accepted]]


def verify_sampled(probs: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None,
                   generator: torch.Generator) -> tuple[int, list[int]]:
    """probs: [1 + len(drafts), vocab] the target's filtered distributions; draft_probs: [len(drafts), vocab]
    or None for deterministic drafts."""
    for i, token in enumerate(drafts):
        p = probs[i]
        q_token = 1.0 if draft_probs is None else float(draft_probs[i, token])
        ratio = min(1.0, float(p[token]) / q_token) if q_token > 0 else 0.0
        if float(torch.rand((), generator=generator, device="cpu")) < ratio:
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[token] = 0.0
        else:
            residual = (p - draft_probs[i]).clamp_min(0.0)
        if float(residual.sum()) <= 0:  # p == q up to rounding: rejection had probability ~0, so the draft stands
            continue
        return i, drafts[:i] + [sample(residual, generator)]  # sample renormalises
    return len(drafts), drafts + [sample(probs[len(drafts)], generator)]


def verify_greedy_leaves(target_tokens: list[int], chain: list[int], leaves: list[int]) -> tuple[int | None, int, list[int]]:
    """target_tokens: the target's argmax at the first row, at each of the chain's drafts, then at each leaf.
    Returns (the accepted leaf's index or None, accepted, emitted)."""
    accepted, emitted = verify_greedy(target_tokens[:1 + len(chain)], chain)
    if accepted or emitted[0] not in leaves:
        return None, accepted, emitted
    leaf = leaves.index(emitted[0])
    return leaf, 1, [emitted[0], target_tokens[1 + len(chain) + leaf]]


def verify_sampled_leaves(probs: torch.Tensor, chain: list[int], leaves: list[int],
                          generator: torch.Generator) -> tuple[int | None, int, list[int]]:
    """probs: [1 + len(chain) + len(leaves), vocab], rows as in verify_greedy_leaves; deterministic drafts.
    Returns (the accepted leaf's index or None, accepted, emitted)."""
    residual = probs[0].clone()
    for i, token in enumerate([chain[0]] + leaves):
        total = float(residual.sum())
        rest = total - float(residual[token])
        # rest <= 0: p is this token up to rounding, so rejecting it had probability ~0
        if rest <= 0 or float(torch.rand((), generator=generator, device="cpu")) * total < float(residual[token]):
            if i == 0:
                accepted, emitted = verify_sampled(probs[1:1 + len(chain)], chain[1:], None, generator)
                return None, 1 + accepted, [token] + emitted
            return i - 1, 1, [token, sample(probs[len(chain) + i], generator)]
        residual[token] = 0.0
    return None, 0, [sample(residual, generator)]
