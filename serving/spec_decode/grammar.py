"""A request's grammar in speculation: the drafts it forbids, the drafts it forces, and the mask of every verified row.

A node's grammar state is its parent's advanced by the node's token. One matcher, the request's own (in the state
after its newest token), walks a tree depth first: it consumes a node's token on the way down and rolls it back on
the way up, so a tree needs no copies of the matcher and leaves it as it found it. For a tree of n nodes, on the host:
- `constrain` (when drafting): one bitmask per node that has drafted children (the newest token included), to check
  them; a consume and a rollback per node kept; with grammar drafts, one forced-token query at the newest token and
  one per leaf of the drafter's tree;
- `row_masks` (when verifying): n + 1 bitmasks (one per verified row), n consumes and n rollbacks.
What that costs beside a step: docs/benchmarks/structured-outputs.md.

Forbidden drafts: a node whose token its parent's state forbids is cut with its subtree before the tree is
scheduled, so it is never verified nor counted as proposed; the nodes cut are the step's `num_invalid_spec_tokens`.

Grammar drafts (`SamplingParams.grammar_drafts`): the tokens the grammar forces are drafts that cost no drafter
work. llguidance's fast-forward tokens are the canonical tokenization of the bytes every continuation of the state
starts with (JSON keys and punctuation a schema fixes, the rest of a choice). They are drafted as a chain from the
newest token, first in node order so that budgets keep them, and the drafter's tree is merged into it where it
drafted the same tokens; every leaf of the drafter's tree is then extended by the tokens forced after it. Where the
grammar allows a single token the masked target accepts it surely; where the forced bytes have several
tokenizations verification decides, as for any draft.

Exactness: every verified row's target law is masked by the grammar state after that row's path (`row_masks`), so
greedy verification follows the masked argmax, and sampled verification draws from the masked law as plain
decoding under the grammar would. For a drafter that samples, each node carries the law q it was drawn from; a node
kept gets q restricted to the tokens its parent's state allows and that no forced sibling before it holds,
renormalised: the kept children are then independent draws from that law (the draws of forbidden or forced tokens
dropped), which is what SpecInfer's rule in serving/spec_decode/verify.py needs. Forced nodes are deterministic
(q one-hot). A node holding an end-of-sequence token ends the request where it is accepted: it has no children, and
its own row (whose token is never emitted) is left unmasked.
"""
from __future__ import annotations

import numpy as np
import torch

from serving.spec_decode.tree import DraftTree
from serving.structured_output import Grammars, is_allowed, mask_logits


def constrain(grammars: Grammars, matcher, tree: DraftTree, num_rows: int, depth: int,
              grammar_drafts: bool) -> tuple[DraftTree, int]:
    """The drafter's `tree` for a request whose grammar is in `matcher`'s state: forbidden nodes cut, forced tokens
    added (with `grammar_drafts`), at most `num_rows` rows and depth `depth`. Returns (the tree, nodes cut)."""
    trie = _Trie()
    if grammar_drafts:
        parent = -1
        for token in matcher.compute_ff_tokens()[:depth]:
            parent = trie.add(parent, token, forced=True, source=-1)
    for i, token in enumerate(tree.tokens):
        parent = -1 if tree.parents[i] < 0 else trie.of_source[tree.parents[i]]
        same = next((c for c in trie.children[parent + 1] if trie.forced[c] and trie.tokens[c] == token), None)
        trie.of_source.append(same if same is not None else trie.add(parent, token, forced=False, source=i))

    keep = [True] * len(trie.tokens)
    vocab = None if tree.q is None else tree.q.shape[1]
    q_rows: dict[int, torch.Tensor] = {}

    def visit(node: int, node_depth: int) -> None:  # the matcher is in `node`'s state
        if not trie.children[node + 1] and grammar_drafts and node >= 0 and not trie.forced[node]:
            parent = node
            for token in matcher.compute_ff_tokens()[:depth - node_depth]:
                parent = trie.add(parent, token, forced=True, source=-1)
                keep.append(True)
        kids = trie.children[node + 1]
        bitmask = None
        if any(not trie.forced[c] for c in kids):
            bitmask = grammars.new_bitmask(1)
            grammars.fill(matcher, bitmask, 0)
        forced_tokens = [trie.tokens[c] for c in kids if trie.forced[c]]
        for kid in kids:
            token = trie.tokens[kid]
            if not trie.forced[kid] and not is_allowed(bitmask, 0, token):
                _cut(trie, kid, keep)
                continue
            if not trie.forced[kid] and tree.q is not None:
                q_rows[kid] = _restricted(tree.q[trie.source[kid]], bitmask, forced_tokens)
            if token in grammars.eos_token_ids:
                for grandchild in trie.children[kid + 1]:
                    _cut(trie, grandchild, keep)
                continue
            if not matcher.consume_token(token):
                raise RuntimeError(f"the grammar refused token {token} it allowed: {matcher.get_error()}")
            visit(kid, node_depth + 1)
            matcher.rollback(1)

    visit(-1, 0)
    num_invalid = sum(1 for node, kept in enumerate(keep) if not kept and not trie.forced[node])
    order = [node for node, kept in enumerate(keep) if kept]
    index = {node: n for n, node in enumerate(order)}
    q = None
    if tree.q is not None:
        q = torch.stack([q_rows[node] if node in q_rows else
                         torch.nn.functional.one_hot(torch.tensor(trie.tokens[node]), vocab).to(tree.q)
                         for node in order]) if order else tree.q[:0]
    constrained = DraftTree(tuple(trie.tokens[n] for n in order),
                            tuple(-1 if trie.parents[n] < 0 else index[trie.parents[n]] for n in order),
                            q, tree.lookahead, tuple(trie.forced[n] for n in order))
    return constrained.prefix(num_rows, depth), num_invalid


def row_masks(grammars: Grammars, matcher, tree: DraftTree) -> np.ndarray:
    """[1 + len(tree), words]: row 0 the bitmask of the newest token's state, row 1 + i that of node i's path."""
    bitmask = grammars.new_bitmask(1 + len(tree))

    def visit(node: int) -> None:
        grammars.fill(matcher, bitmask, node + 1)
        for kid in tree.children[node + 1]:
            token = tree.tokens[kid]
            if token in grammars.eos_token_ids:
                continue  # the request ends at it: the token after it is never emitted
            if not matcher.consume_token(token):
                raise RuntimeError(f"a verified draft {token} is not allowed by the grammar: {matcher.get_error()}")
            visit(kid)
            matcher.rollback(1)

    visit(-1)
    return bitmask


class _Trie:
    """The merged tree while it is built: nodes in creation order (topological), children per node (-1 first)."""

    def __init__(self):
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.forced: list[bool] = []
        self.source: list[int] = []  # the drafter's node each came from (-1: forced)
        self.children: list[list[int]] = [[]]
        self.of_source: list[int] = []  # the drafter's node i -> its node here

    def add(self, parent: int, token: int, forced: bool, source: int) -> int:
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.forced.append(forced)
        self.source.append(source)
        self.children.append([])
        self.children[parent + 1].append(len(self.tokens) - 1)
        return len(self.tokens) - 1


def _cut(trie: _Trie, node: int, keep: list[bool]) -> None:
    keep[node] = False
    for kid in trie.children[node + 1]:
        _cut(trie, kid, keep)


def _restricted(q: torch.Tensor, bitmask: np.ndarray, forced_tokens: list[int]) -> torch.Tensor:
    """q: [vocab] a drafter's law, restricted to the tokens the bitmask's row 0 allows, less `forced_tokens`, and
    renormalised."""
    allowed = torch.isfinite(mask_logits(torch.zeros(1, q.shape[0]), bitmask)[0]).to(q.device)
    if forced_tokens:
        allowed[forced_tokens] = False
    restricted = torch.where(allowed, q, 0.0)
    return restricted / restricted.sum()
