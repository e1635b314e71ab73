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

Sampled chains with `rejection_sample_method: "block"`, block verification (Sun et al. 2024, "Block Verification
Accelerates Speculative Decoding"; vLLM's option of that name): the chain's prefix is accepted from the joint law of
the whole block rather than stopping at the first rejected draft, still exact, and optimal in the expected number of
accepted tokens among exact verifiers of one chain, so never below the token-by-token rule. With w_0 = 1 and
w_i = min(1, w_{i-1} p_i(x_i) / q_i(x_i)) (the capped ratio of the prefix's joint laws), the residual after i drafts
is m_i = max(w_i p_{i+1} - q_{i+1}, 0) and its mass is M_i; each depth i is accepted with h_i = M_i / (M_i + 1 - w_i)
(h_k = w_k at the last draft), and the chain keeps the deepest accepted i. The next token is drawn from p_{k+1} after a
whole chain, else from m_i. For deterministic drafts (q one-hot) m_i is w_i p_{i+1} without the next draft and w_i is
the prefix's probability under p, the most any exact verifier can accept it with: the expected accepted length then
equals the token-by-token rule's, and the gain needs a drafter that samples (q spread out).
Trees keep the rules above: the block rule, its exactness and its optimality are proven for one drafted chain (one
draft per depth, drawn from q given the drafts before it, which the residual m_i subtracts); siblings that compete at a
depth need another rule (traversal verification, Weng et al. 2025, walks a tree from its leaves), not implemented here.
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


def verify_block(chain: DraftTree, probs: torch.Tensor, generator: torch.Generator) -> tuple[list[int], list[int]]:
    """Block verification of a chain (one child per node). probs: [1 + len(chain), vocab] the target's filtered
    distributions at each row. Returns (accepted path, tokens to emit), as verify_sampled."""
    k = len(chain)
    weights, accepts = block_acceptances(chain, probs)
    accepted = 0
    for i in range(k):  # one uniform per depth, all drawn: the deepest accepted depth is kept
        if _uniform(generator) < accepts[i]:
            accepted = i + 1
    path = list(range(accepted))
    if accepted == k:
        return path, list(chain.tokens) + [sample(probs[k], generator)]
    residual = _residual(chain, probs, accepted, weights[accepted])
    # a residual of no mass was accepted past with probability ~1; p's row is then the residual up to rounding
    row = residual if float(residual.sum()) > 0 else probs[accepted]
    return path, list(chain.tokens[:accepted]) + [sample(row, generator)]


def block_acceptances(chain: DraftTree, probs: torch.Tensor) -> tuple[list[float], list[float]]:
    """The block rule's quantities for a drafted chain of k tokens: (w_0 .. w_k, h_1 .. h_k), as the module's
    docstring defines them."""
    if not chain.is_chain:
        raise ValueError("block verification takes a chain (one child per node); verify trees with verify_sampled")
    k = len(chain)
    weights, accepts = [1.0], []
    for i, token in enumerate(chain.tokens):
        p_token, q_token = float(probs[i, token]), _q_of(chain, i, token)
        joint = weights[-1] * p_token
        # a draft its own q gave no mass: a draw of probability 0 (rounding); accept as the ratio's limit would
        weights.append(min(1.0, joint / q_token) if q_token > 0 else float(joint > 0))
        if i + 1 < k:
            mass = float(_residual(chain, probs, i + 1, weights[-1]).sum())
            denominator = mass + 1.0 - weights[-1]
            accepts.append(mass / denominator if denominator > 0 else 1.0)
        else:
            accepts.append(weights[-1])
    return weights, accepts


def expected_accepted(chain: DraftTree, probs: torch.Tensor) -> tuple[float, float]:
    """The expected number of drafts each rule accepts from this drafted chain, given the target's rows `probs`
    ([1 + len(chain), vocab]): (token by token, block). Averaged over chains drawn from q these are each rule's
    expected accepted length in the chain's context; measured on the same chains they compare the two rules
    without the noise of the accept draws (a conditional expectation of each rule's count, so unbiased for it)."""
    standard, survive = 0.0, 1.0
    for i, token in enumerate(chain.tokens):
        p_token, q_token = float(probs[i, token]), _q_of(chain, i, token)
        survive *= min(1.0, p_token / q_token) if q_token > 0 else 0.0
        standard += survive
    _, accepts = block_acceptances(chain, probs)
    # the deepest accepted depth is i when depth i is accepted and every deeper one rejected
    block, rejected_below = 0.0, 1.0
    for i in range(len(chain), 0, -1):
        block += i * accepts[i - 1] * rejected_below
        rejected_below *= 1.0 - accepts[i - 1]
    return standard, block


def _q_of(chain: DraftTree, node: int, token: int) -> float:
    return 1.0 if chain.q is None else float(chain.q[node, token])


def _residual(chain: DraftTree, probs: torch.Tensor, node: int, weight: float) -> torch.Tensor:
    """max(weight * p - q, 0) at the row before `node` (probs[node]), q the node's draft law (one-hot without q)."""
    scaled = weight * probs[node]
    if chain.q is None:
        scaled = scaled.clone()
        scaled[chain.tokens[node]] = 0.0  # weight * p(x) <= 1 = q(x)
        return scaled
    return (scaled - chain.q[node].to(scaled)).clamp_min(0.0)


def _uniform(generator: torch.Generator) -> float:
    return float(torch.rand((), generator=generator, device="cpu"))
