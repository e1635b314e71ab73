"""Lookahead decoding (Fu et al. 2024, "Break the Sequential Dependency of LLM Inference Using Lookahead Decoding"):
the target drafts for itself by Jacobi iteration, with no head or second model.

Each request keeps a window of W future positions over N - 1 levels (its last N - 1 Jacobi iterations) and a pool of
n-grams keyed by their first token. Every step computes, beside the verify rows (one target pass):
- the lookahead branch, as lookahead rows of the request's tree: level 0 at offsets 1 .. W - 1 after the newest token
  (which is its column 0), then levels 1 .. N - 2 of W tokens, level j's column i at offset j + i. A row sees the
  context, level 0 up to its column, then its column at levels 1 .. j: the Jacobi trajectory behind it (the paper's
  mask). The argmaxes of the last level are the next iteration: column i's diagonal (levels 0 .. N - 2, then its new
  token) is an n-gram, pooled under its first token, and every level moves one up.
- the verification branch: the pool's n-grams after the newest token (at most G, the most recent first) merged into a
  trie, the tree's nodes, verified greedily or by exact multi-draft rejection sampling as any tree (serving/spec_decode/
  verify.py); lookahead rows are never accepted.
Per first token the pool keeps the G n-grams seen most recently (seeing one again makes it the most recent), as the
reference implementation (hao-ai-lab/LookaheadDecoding) does, and it also holds the n-grams of the prompt and of the
emitted tokens (the reference's POOL_FROM_PROMPT), so text that repeats is found as prompt lookup finds it.

This version starts the window filled with tokens drawn from the prompt (the reference's initialization) and iterates
every level from the first step instead of adding one level per step; n-grams enter the pool once every level above
level 0 holds iterated tokens. The window moves one level per step whatever was accepted (the reference's default).
A step whose budget cannot hold the whole window verifies candidates only, and the window waits.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from serving.drafters.base import Drafter
from serving.spec_decode.tree import DraftTree, LookaheadRows


class NgramPool:
    """n-grams by first token: the `max_per_key` followers (n - 1 tokens each) seen most recently, oldest first."""

    def __init__(self, n: int, max_per_key: int):
        self.n, self.max_per_key = n, max_per_key
        self.followers: dict[int, list[tuple[int, ...]]] = {}
        self.num_pooled = 0  # the request's tokens whose n-gram starting there is pooled

    def add(self, first: int, rest: tuple[int, ...]) -> None:
        kept = self.followers.setdefault(first, [])
        if rest in kept:
            kept.remove(rest)
        elif len(kept) == self.max_per_key:
            del kept[0]
        kept.append(rest)

    def extend(self, tokens: list[int]) -> None:
        """Pools the n-grams of the request's tokens not pooled yet."""
        for s in range(self.num_pooled, len(tokens) - self.n + 1):
            self.add(tokens[s], tuple(tokens[s + 1:s + self.n]))
        self.num_pooled = max(self.num_pooled, len(tokens) - self.n + 1)

    def candidates(self, first: int) -> list[tuple[int, ...]]:
        """The followers of `first`, the most recent first."""
        return self.followers.get(first, [])[::-1]


@dataclass
class Window:
    """levels[0]: columns 1 .. W - 1 of level 0 (column 0 is the newest token); levels[1 ..]: W tokens each."""
    levels: list[list[int]]
    num_iterations: int = 0

    def advance(self, newest: int, outputs: list[int], pool: NgramPool) -> None:
        """One Jacobi iteration: `outputs` are the target's argmaxes at the last level's columns, after `newest`."""
        if self.num_iterations >= len(self.levels) - 1:
            for i, token in enumerate(outputs):
                first = newest if i == 0 else self.levels[0][i - 1]
                pool.add(first, tuple(level[i] for level in self.levels[1:]) + (token,))
        self.levels = [self.levels[1][1:], *self.levels[2:], list(outputs)]
        self.num_iterations += 1


@dataclass
class RequestState:
    window: Window
    pool: NgramPool
    newest: int = -1  # the newest token when `proposed` was drafted
    proposed: LookaheadRows | None = None  # the window's rows in the tree last drafted


class LookaheadDrafter(Drafter):
    kinds = ("lookahead",)

    def __init__(self, config):
        self.width, self.n, self.max_candidates = config.window, config.ngram, config.max_candidates
        w, n = self.width, self.n
        row = lambda level, column: column - 1 if level == 0 else w - 1 + (level - 1) * w + column
        offsets, sees = [], []
        for level in range(n - 1):
            for column in range(1 if level == 0 else 0, w):
                offsets.append(level + column)
                trajectory = [row(0, c) for c in range(1, column + 1)] + [row(l, column) for l in range(1, level + 1)]
                sees.append(tuple(trajectory))
        self.offsets, self.sees = tuple(offsets), tuple(sees)
        self.num_lookups = self.num_hits = 0  # hits: lookups whose newest token had n-grams pooled

    def propose(self, ctx, requests, budgets):
        trees = {}
        for request in requests:
            state = request.spec.slots.get(self) or self._start(request)
            request.spec.slots[self] = state
            state.pool.extend(request.token_ids)
            budget = budgets[request.request_id]
            lookahead = None
            if budget.num_nodes >= len(self.offsets):
                lookahead = LookaheadRows(tuple(t for level in state.window.levels for t in level), self.offsets,
                                          self.sees, self.width)
            newest = request.token_ids[-1]
            candidates = state.pool.candidates(newest)
            self.num_lookups += 1
            self.num_hits += bool(candidates)
            tokens, parents = trie(candidates, budget.num_nodes - (len(lookahead) if lookahead else 0), budget.depth)
            state.newest, state.proposed = newest, lookahead
            trees[request.request_id] = DraftTree(tokens, parents, lookahead=lookahead)
        return trees

    def observe(self, ctx) -> None:
        """Reads the last level's argmaxes of every request whose window the step computed, and iterates it."""
        step = ctx.step
        for i, request in enumerate(step.batch.requests):
            state, lookahead = request.spec.slots.get(self), step.batch.trees[i].lookahead
            if state is None or lookahead is None or lookahead is not state.proposed:
                continue
            first = step.batch.logits_start[i] + 1 + len(step.batch.trees[i])
            outputs = step.out.logits[first:first + lookahead.num_outputs].argmax(-1).tolist()
            state.window.advance(state.newest, outputs, state.pool)
            state.proposed = None

    def summary(self) -> dict:
        """The pool's hit rate: of the steps drafted for, those whose newest token had n-grams pooled."""
        lookups, hits = self.num_lookups, self.num_hits
        return {"pool_lookups": lookups, "pool_hits": hits, "pool_hit_rate": hits / lookups if lookups else 0.0}

    def _start(self, request) -> RequestState:
        rng = random.Random(0)
        tokens = request.token_ids
        levels = [[rng.choice(tokens) for _ in range(self.width - (level == 0))] for level in range(self.n - 1)]
        return RequestState(Window(levels), NgramPool(self.n, self.max_candidates))


def trie(candidates: list[tuple[int, ...]], max_nodes: int, max_depth: int) -> tuple[list[int], list[int]]:
    """The candidates (each cut to `max_depth` tokens) merged into a tree of at most `max_nodes` nodes, in topological
    order, earlier candidates first: (tokens, parents)."""
    tokens, parents, index = [], [], {}
    for candidate in candidates:
        parent = -1
        for token in candidate[:max_depth]:
            node = index.get((parent, token))
            if node is None:
                if len(tokens) == max_nodes:
                    return tokens, parents
                node = index[(parent, token)] = len(tokens)
                tokens.append(token)
                parents.append(parent)
            parent = node
    return tokens, parents
