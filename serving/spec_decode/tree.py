"""The token tree: what a drafter proposes for one request, and the one unit of speculation.

Node i holds `tokens[i]` and hangs off `parents[i]`: -1 for a child of the request's newest token, else an earlier
node, so the nodes are in topological order and any prefix of them is a tree too (budgets cut a tree that way). A
chain is the tree whose node i hangs off node i - 1. `q[i]`, for drafters that sample, is the distribution node i
was drawn from; without it every node is a deterministic draft (q one-hot). `forced[i]` marks a node the request's
grammar forced (serving/spec_decode/grammar.py), counted apart from the drafter's own; empty when none is.
`survivals[i]`, for drafters with a calibrated confidence, is their estimate that node i and every node above it are
accepted (its path probability), which the adaptive policy holds against what verification finds; empty when none
is given.

`lookahead`, for lookahead decoding, holds rows the step computes after the nodes whose logits the drafter reads and
that are never accepted: `len(tree)` counts the nodes (what verification sees), `num_rows` every row the step computes
after the newest token (what slots and budgets count).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class LookaheadRows:
    """Rows computed beside a tree's nodes, never accepted. Row r holds `tokens[r]` at position (newest token's) +
    `offsets[r]` and attends to the whole context, then to rows `sees[r]` (in position order, r itself last); the
    logits of the last `num_outputs` rows are read."""
    tokens: tuple[int, ...]
    offsets: tuple[int, ...]
    sees: tuple[tuple[int, ...], ...]
    num_outputs: int

    def __post_init__(self):
        if not len(self.tokens) == len(self.offsets) == len(self.sees):
            raise ValueError(f"lookahead rows need an offset and a list of rows seen per token: {len(self.tokens)} "
                             f"tokens, {len(self.offsets)} offsets, {len(self.sees)} lists")
        for r, seen in enumerate(self.sees):
            in_order = all(a < b and self.offsets[a] < self.offsets[b] for a, b in zip(seen, seen[1:]))
            if not seen or seen[-1] != r or not in_order:
                raise ValueError(f"lookahead row {r} sees rows {list(seen)}: earlier rows in position order, "
                                 "itself last")
        if not 0 <= self.num_outputs <= len(self.tokens):
            raise ValueError(f"{self.num_outputs} outputs read from {len(self.tokens)} lookahead rows")

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    q: torch.Tensor | None = None  # [num_nodes, vocab]
    lookahead: LookaheadRows | None = None
    forced: tuple[bool, ...] = ()
    survivals: tuple[float, ...] = field(default=(), compare=False)  # estimates: two trees are equal without them

    def __post_init__(self):
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))
        object.__setattr__(self, "parents", tuple(int(p) for p in self.parents))
        object.__setattr__(self, "forced", tuple(bool(f) for f in self.forced) if any(self.forced) else ())
        if self.forced and len(self.forced) != len(self.tokens):
            raise ValueError(f"a draft tree's forced flags are {len(self.forced)} for {len(self.tokens)} nodes")
        if self.survivals and len(self.survivals) != len(self.tokens):
            raise ValueError(f"a draft tree's survivals are {len(self.survivals)} for {len(self.tokens)} nodes")
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"a draft tree needs one parent per token: {len(self.tokens)} tokens, {len(self.parents)} parents")
        for i, parent in enumerate(self.parents):
            if not -1 <= parent < i:
                raise ValueError(f"node {i} of a draft tree has parent {parent}: a parent is -1 (the newest token) "
                                 "or an earlier node")
        if self.q is not None and self.q.shape[0] != len(self.tokens):
            raise ValueError(f"a draft tree's q has {self.q.shape[0]} rows for {len(self.tokens)} nodes")

    @classmethod
    def chain(cls, tokens, q: torch.Tensor | None = None, survivals=()) -> "DraftTree":
        tokens = list(tokens)
        return cls(tuple(tokens), tuple(range(-1, len(tokens) - 1)), q, survivals=tuple(survivals))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_rows(self) -> int:
        """The rows a step computes for this tree after the newest token: its nodes, then its lookahead rows."""
        return len(self.tokens) + (len(self.lookahead) if self.lookahead else 0)

    def __bool__(self) -> bool:
        return self.num_rows > 0

    @functools.cached_property
    def depths(self) -> tuple[int, ...]:
        """Each node's depth: 1 for a child of the newest token."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return tuple(depths)

    @functools.cached_property
    def is_chain(self) -> bool:
        """One child per node: node i hangs off node i - 1."""
        return self.parents == tuple(range(-1, len(self) - 1))

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)

    @functools.cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """children[node + 1]: the nodes hanging off `node` (-1: the newest token), in node order."""
        children: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, parent in enumerate(self.parents):
            children[parent + 1].append(i)
        return tuple(tuple(c) for c in children)

    def path(self, node: int) -> list[int]:
        """The nodes from depth 1 down to `node`."""
        return path_to(self.parents, node)

    def prefix(self, num_rows: int, max_depth: int | None = None) -> "DraftTree":
        """At most `num_rows` rows: the lookahead rows if they fit whole (else none), then the first nodes that fit,
        without those deeper than `max_depth`: a tree again."""
        lookahead = self.lookahead if self.lookahead and len(self.lookahead) <= num_rows else None
        num_nodes = num_rows - (len(lookahead) if lookahead else 0)
        keep = [i for i in range(min(num_nodes, len(self))) if max_depth is None or self.depths[i] <= max_depth]
        if len(keep) == len(self) and lookahead is self.lookahead:
            return self
        index = {node: n for n, node in enumerate(keep)}
        parents = [-1 if self.parents[i] < 0 else index[self.parents[i]] for i in keep]
        q = None if self.q is None else self.q[keep]
        forced = tuple(self.forced[i] for i in keep) if self.forced else ()
        survivals = tuple(self.survivals[i] for i in keep) if self.survivals else ()
        return DraftTree(tuple(self.tokens[i] for i in keep), tuple(parents), q, lookahead, forced, survivals)

    @property
    def num_forced(self) -> int:
        return sum(self.forced)


def path_to(parents, node: int) -> list[int]:
    """The nodes from depth 1 down to `node`, given each node's parent (-1: a child of the newest token)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]
