"""EAGLE-2's dynamic draft tree (Li et al. 2024, "EAGLE-2: Faster Inference of Language Models with Dynamic Draft
Trees"), written once for every head that drafts one.

Each node is scored by the sum of the head's log-probabilities along its path (their product: the head's estimate
that the target accepts the whole path). Depth 1 holds the topk most likely children of the newest token; then for
each further depth the topk best-scored nodes of the depth before are expanded (`expand` gives their children's
log-probabilities, one batched call per depth over every request), each into its topk most likely children. Nodes
whose score falls below the confidence threshold are neither expanded nor kept. Finally the best `num_nodes` of every
node made are kept: a child never scores above its parent, so a kept node's parent is kept too. topk 1 is a chain.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from serving.spec_decode.tree import DraftTree


@dataclass
class Candidates:
    """Every node the search made for one request, in the order made."""
    tokens: list[int] = field(default_factory=list)  # target token ids
    parents: list[int] = field(default_factory=list)  # -1: a child of the newest token
    depths: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)  # log path probability

    def add(self, token: int, parent: int, depth: int, score: float) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(depth)
        self.scores.append(score)
        return len(self.tokens) - 1

    def within(self, budget) -> DraftTree:
        """The best nodes a DraftBudget keeps (`num_kept` over their path probabilities), as `best` gives them."""
        order = sorted(self.scores, reverse=True)[:budget.num_nodes]
        return self.best(budget.num_kept([math.exp(score) for score in order]))

    def best(self, num_nodes: int) -> DraftTree:
        """The `num_nodes` best-scored nodes (shallower first on ties), as a tree in topological order: by depth, then
        best first."""
        order = sorted(range(len(self.tokens)), key=lambda i: (-self.scores[i], self.depths[i], i))[:num_nodes]
        order.sort(key=lambda i: (self.depths[i], -self.scores[i], i))
        index = {node: n for n, node in enumerate(order)}
        return DraftTree(tuple(self.tokens[i] for i in order),
                         tuple(-1 if self.parents[i] < 0 else index[self.parents[i]] for i in order),
                         survivals=tuple(math.exp(self.scores[i]) for i in order))


def grow(first: tuple[list, list], expand, topk: int, max_depths: list[int],
         log_thresholds: list[float], budgets: list | None = None) -> list[Candidates]:
    """first: (log-probabilities, target ids), each a list per request of its topk most likely first drafts' (nested
    Python lists: the search reads them one by one); expand(depth, nodes, candidates) -> the same pair for the children of
    `nodes`, a list of (request index, candidate index) at depth `depth`; max_depths: each request's deepest depth;
    log_thresholds: each request's confidence cut (-inf: none); budgets: each request's DraftBudget, whose
    `expands` says which nodes are worth expanding, for drafters whose expand runs a forward (None: every node).
    Returns each request's candidates."""
    found = [Candidates() for _ in max_depths]
    log_probs, tokens = first
    frontier = _add(found, [(r, -1) for r in range(len(max_depths))], log_probs, tokens, 1, topk, log_thresholds)
    for depth in range(1, max(max_depths, default=0)):
        nodes = [(r, c) for r, c in frontier if max_depths[r] > depth
                 and (budgets is None or budgets[r].expands(depth, found[r].scores[c]))]
        if not nodes:
            break
        log_probs, tokens = expand(depth, nodes, found)
        frontier = _add(found, nodes, log_probs, tokens, depth + 1, topk, log_thresholds)
    return found


def _add(found, parents, log_probs, tokens, depth, topk, log_thresholds) -> list[tuple[int, int]]:
    """Adds each parent's children; returns the next frontier, each request's topk best new nodes above the
    threshold, best first."""
    made: dict[int, list[int]] = {}
    for (r, parent), row_log_probs, row_tokens in zip(parents, log_probs, tokens):
        base = found[r].scores[parent] if parent >= 0 else 0.0
        for log_p, token in zip(row_log_probs, row_tokens):
            score = base + log_p
            if score >= log_thresholds[r]:
                made.setdefault(r, []).append(found[r].add(token, parent, depth, score))
    frontier = []
    for r, nodes in made.items():
        nodes.sort(key=lambda c: -found[r].scores[c])
        frontier += [(r, c) for c in nodes[:topk]]
    return frontier


def grow_from_marginals(log_probs: list, tokens: list, topk: int, log_thresholds: list[float]) -> list[Candidates]:
    """The same search for drafters that draft a whole block in one forward (P-EAGLE, DFlash): the children of
    every node at depth d are depth d + 1's topk most likely tokens, whatever the path above, so a node's score is the
    product of the per-depth marginals along its path. log_probs[r][d], tokens[r][d]: request r's topk
    log-probabilities and target ids at depth d + 1 of its block, as many depths as it drafts. Needs no further
    forward."""
    def expand(depth, nodes, found):
        return [log_probs[r][depth] for r, _ in nodes], [tokens[r][depth] for r, _ in nodes]

    return grow(([lp[0] for lp in log_probs], [t[0] for t in tokens]), expand, topk, [len(lp) for lp in log_probs],
                log_thresholds)
