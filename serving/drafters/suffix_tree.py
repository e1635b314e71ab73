"""Suffix trees for suffix decoding (serving/drafters/suffix.py), as Arctic Inference's `SuffixDecodingCache` keeps
them: one tree per running request over its prompt and its answer so far, and one global tree over the answers of
at most `max_cached_requests` requests (the oldest evicted first).

A `SuffixTree` holds every suffix of its sequences cut at `max_depth` tokens as a trie (one node per token, no path
compression): a node's `count` is the number of (sequence, start) whose next tokens spell the node's path, so the
estimated probability of token t after path s is count(s + t) / count(s), and a suffix that ends at s (the sequence's
last tokens) counts at s and at no child. Costs, with D = max_depth and N the tokens held:
- appending a token: O(D) (each of the D suffixes still growing gains its next node);
- removing a sequence of n tokens: O(n D);
- matching a pattern of m tokens: O(m); a draft (`speculate`): the matches of every length up to D - 1, free for
  the suffixes of the request's own tokens in the tree (the nodes its appends keep), O(m) each beyond them,
  plus O(b log b) per match for a best-first tree of b nodes, longest match first, skipping matches whose node cap
  cannot beat the best score so far;
- memory: O(N D) nodes at most (suffixes that share a path share its nodes).
Nodes are integer ids into flat lists, with each node's children a dict of token -> child id: containers of integers
only, which Python's garbage collector does not track, so that millions of nodes neither slow their own creation
nor every collection of the process that serves (node objects did, 5x, in a 20,000-token tree).

`speculate` follows Arctic Inference's rule (`SuffixTree::speculate`, tree mode): for each match length m from 1 up
to the longest suffix of the context (at most D - 1 tokens) found in the tree, grow a tree best first from the
match's node by estimated path probability (the product of count(child) / count(parent) along it), never taking a
node below `min_token_prob`, up to min(max_spec_tokens, floor(max_spec_factor * m)) nodes; the draft with the
highest score (the sum of its nodes' probabilities) wins, the longer match among equal scores. Ties in probability
go to the child of the node drafted first, then to the lower token id.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field


ROOT = 0


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # -1: a child of the context's last token
    probs: list[float] = field(default_factory=list)  # each node's estimated path probability, non-increasing
    score: float = 0.0  # the sum of probs: the tokens the draft expects accepted
    match_len: int = 0


class SuffixTree:
    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.counts: list[int] = [0]  # node id -> the suffixes through it (the root's is unused)
        self.children: list[dict[int, int]] = [{}]  # node id -> token -> child id
        # node id -> (token, child id) by decreasing count: made when drafted, dropped when a child changes
        self.rankings: list[list | None] = [None]
        self.free: list[int] = []  # ids of removed nodes, for reuse
        self.seqs: dict = {}  # key -> its tokens
        self.growing: dict = {}  # key -> the deepest nodes of its suffixes shorter than max_depth, oldest first

    def new_node(self) -> int:
        if self.free:
            return self.free.pop()
        self.counts.append(0)
        self.children.append({})
        self.rankings.append(None)
        return len(self.counts) - 1

    def extend(self, key, tokens) -> None:
        seq = self.seqs.setdefault(key, [])
        growing = self.growing.get(key, [])
        counts, children, rankings = self.counts, self.children, self.rankings
        for token in tokens:
            token = int(token)
            seq.append(token)
            nodes = []
            for node in (*growing, ROOT):  # the suffixes so far, then the one this token starts
                child = children[node].get(token)
                if child is None:
                    child = children[node][token] = self.new_node()
                counts[child] += 1
                rankings[node] = None
                nodes.append(child)
            growing = nodes[len(nodes) - self.max_depth + 1:] if len(nodes) >= self.max_depth else nodes  # < max_depth deep
        self.growing[key] = growing

    def remove(self, key) -> None:
        seq = self.seqs.pop(key)
        del self.growing[key]
        for start in range(len(seq)):
            node = ROOT
            for token in seq[start:start + self.max_depth]:
                child = self.children[node][token]
                self.counts[child] -= 1
                self.rankings[node] = None
                if self.counts[child] == 0:  # nothing else passes through it, nor below it
                    del self.children[node][token]
                    self.release(child)
                    break
                node = child

    def release(self, node: int) -> None:
        """Frees a node that no suffix passes through, and its subtree."""
        stack = [node]
        while stack:
            node = stack.pop()
            stack.extend(self.children[node].values())
            self.children[node], self.rankings[node], self.counts[node] = {}, None, 0
            self.free.append(node)

    def ranked(self, node: int) -> list:
        if self.rankings[node] is None:
            counts = self.counts
            self.rankings[node] = sorted(self.children[node].items(), key=lambda item: -counts[item[1]])
        return self.rankings[node]

    def match(self, pattern) -> int | None:
        node = ROOT
        for token in pattern:
            node = self.children[node].get(token)
            if node is None:
                return None
        return node

    def suffix_nodes(self, key, context) -> list[int]:
        """The nodes of the context's last 1, 2, ... tokens (at most len(context) - 1), while the tree has them. The
        context ends with the tokens this tree holds under `key`, whose suffixes' nodes `growing` keeps: those come
        free, and only longer suffixes are walked from the root."""
        nodes = self.growing.get(key, [])[::-1][:len(context) - 1]
        for m in range(len(nodes) + 1, len(context)):
            node = self.match(context[len(context) - m:])
            if node is None:
                break
            nodes.append(node)
        return nodes

    def speculate(self, key, context, max_spec_tokens: int, max_spec_factor: float, min_token_prob: float) -> Draft:
        """The best draft after `context`, which ends with the tokens this tree holds under `key` (if any)."""
        matches = self.suffix_nodes(key, context)
        best, children, counts = Draft(), self.children, self.counts
        for m in range(len(matches), 0, -1):  # longest first: a shorter match must score higher to win
            node = matches[m - 1]
            if not children[node]:
                continue
            num = min(max_spec_tokens, int(m * max_spec_factor + 1e-6))
            if num <= 0 or num < best.score - 1e-9:  # num nodes score at most num
                continue
            # no node of its draft is likelier than its likeliest child, so num of those bound its score
            if num * counts[self.ranked(node)[0][1]] / counts[node] < best.score - 1e-9:
                continue
            draft = self.grow(node, num, min_token_prob)
            if draft.score > best.score:
                best, best.match_len = draft, m
        return best

    def grow(self, node: int, max_nodes: int, min_prob: float) -> Draft:
        """The best-first tree of at most `max_nodes` nodes under `node`, none below `min_prob`."""
        draft, heap, counts = Draft(), [], self.counts

        def push(parent_node: int, prob: float, parent: int) -> None:
            # ties in probability: the child of the node drafted first, then the lower token id (siblings tie only
            # where their counts do)
            for token, child in self.ranked(parent_node):
                p = prob * counts[child] / counts[parent_node]
                if p < min_prob:
                    break
                heapq.heappush(heap, (-p, parent, token, child))

        push(node, 1.0, -1)
        while heap and len(draft.tokens) < max_nodes:
            neg, parent, token, child = heapq.heappop(heap)
            draft.tokens.append(token)
            draft.parents.append(parent)
            draft.probs.append(-neg)
            draft.score += -neg
            push(child, -neg, len(draft.tokens) - 1)
        return draft


class SuffixCache:
    """The request trees and the global tree of answers. Keys are the caller's, unique per request."""

    def __init__(self, max_depth: int, max_cached_requests: int):
        self.max_depth, self.max_cached_requests = max_depth, max_cached_requests
        self.global_tree = SuffixTree(max_depth)
        self.local_trees: dict = {}
        self.cached: dict = {}  # keys whose answers the global tree holds, oldest first (dicts keep insertion order)

    def start(self, key, prompt) -> None:
        if key in self.local_trees:
            raise ValueError(f"request {key!r} is already active")
        self.local_trees[key] = SuffixTree(self.max_depth)
        self.local_trees[key].extend(key, prompt)
        if self.max_cached_requests > 0:
            while len(self.cached) >= self.max_cached_requests:
                self.evict(next(iter(self.cached)))
            self.cached[key] = None
            self.global_tree.extend(key, [])

    def add(self, key, tokens) -> None:
        """Tokens of the request's answer: its own tree, and the global tree while it holds the answer."""
        self.local_trees[key].extend(key, tokens)
        if key in self.cached:
            self.global_tree.extend(key, tokens)

    def stop(self, key) -> None:
        del self.local_trees[key]

    def evict(self, key) -> None:
        del self.cached[key]
        self.global_tree.remove(key)

    def speculate(self, key, context, max_spec_tokens: int, max_spec_factor: float, min_token_prob: float) -> Draft:
        """The better draft of the request's tree and the global tree (the request's at equal scores)."""
        context = list(context[-self.max_depth:])
        local = self.local_trees[key].speculate(key, context, max_spec_tokens, max_spec_factor, min_token_prob)
        if not self.cached:
            return local
        found = self.global_tree.speculate(key, context, max_spec_tokens, max_spec_factor, min_token_prob)
        return local if local.score >= found.score else found
