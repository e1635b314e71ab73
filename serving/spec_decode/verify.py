"""Verification of a draft tree against the target: which path the target keeps, and the token after it.

The target's rows for a request are [newest token, node 0 .. n - 1]; row 1 + i holds the target's distribution
after node i's path. Both rules walk down from the newest token and return the accepted path (node indices, depth
1 first) and the tokens to emit: the path's tokens, then one token from the row of its last node.

Greedy: at each node follow the child whose token is the target's argmax there; stop where none is.

Sampled, exact (the emitted tokens follow the target's filtered distribution p at every step): at each node its
children are tried in order against a residual distribution r that starts as the node's p.
- Deterministic children (q one-hot), recursive rejection sampling without replacement: child c is accepted with
  probability r(c) / sum(r); on rejection r(c) = 0. The token emitted at this depth is then a draw from p without
  replacement of the rejected children, which is a draw from p (Leviathan et al. 2023 for one child; SpecInfer,
  Miao et al. 2024, and Jeon et al. 2024, "Recursive Speculative Decoding", for several).
- Children drawn independently from distributions q_c (drafters that sample), SpecInfer's multi-step speculative
  sampling: child c is accepted with probability min(1, r(c) / q_c(c)); on rejection r = norm(max(r - q_c, 0)).
  Exact for children drawn independently (Miao et al. 2024, Theorem 4.2); one child is Leviathan et al.'s rule.
If every child is rejected the token is drawn from r; if the path ends at a leaf, from that leaf's row of p.
"""
from __future__ import annotations

import torch

from serving.sampler import sample
from serving.spec_decode.tree import DraftTree


def verify_greedy(tree: DraftTree, best: list[int]) -> tuple[list[int], list[int]]:
    """best: the target's argmax at each of the 1 + len(tree) rows. Returns (accepted path, tokens to emit)."""
    path, node = [], -1
    while True:
        target = best[node + 1]
        child = next((c for c in tree.children[node + 1] if tree.tokens[c] == target), None)
        if child is None:
            return path, [tree.tokens[n] for n in path] + [target]
        path.append(child)
        node = child


def verify_sampled(tree: DraftTree, probs: torch.Tensor, generator: torch.Generator) -> tuple[list[int], list[int]]:
    """probs: [1 + len(tree), vocab] the target's filtered distributions at each row. Returns (accepted path,
    tokens to emit)."""
    path, node = [], -1
    while True:
        residual = probs[node + 1].clone()  # the caller's probabilities stay as they are
        chosen = None
        for child in tree.children[node + 1]:
            token = tree.tokens[child]
            if tree.q is None:
                total, mass = float(residual.sum()), float(residual[token])
                # nothing else left: p is this token up to rounding, so rejecting it had probability ~0
                if total - mass <= 0 or _uniform(generator) * total < mass:
                    chosen = child
                    break
                residual[token] = 0.0
            else:
                q = tree.q[child]
                r = residual / residual.sum()
                q_token = float(q[token])
                if q_token > 0 and _uniform(generator) < min(1.0, float(r[token]) / q_token):
                    chosen = child
                    break
                rest = (r - q).clamp_min(0.0)
                if float(rest.sum()) <= 0:  # r == q up to rounding: rejection had probability ~0
                    chosen = child
                    break
                residual = rest
        if chosen is None:
            return path, [tree.tokens[n] for n in path] + [sample(residual, generator)]
        path.append(chosen)
        node = chosen


def _uniform(generator: torch.Generator) -> float:
    return float(torch.rand((), generator=generator, device="cpu"))
