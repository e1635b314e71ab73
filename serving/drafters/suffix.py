"""Suffix decoding (Oliaro et al. 2024, "SuffixDecoding", arXiv 2411.04975; vLLM's `"method": "suffix"`): a
training-free drafter that matches the sequence's last tokens in suffix trees and proposes the continuations seen
most often after them.

Two kinds of tree (serving/drafters/suffix_tree.py, as Arctic Inference's, which vLLM calls, keeps them; its costs
there): one per running request over its prompt and its answer so far, and one global tree over the answers of
earlier and running requests, at most `suffix_decoding_max_cached_requests` of them (the oldest evicted first; 0: no
global tree). Each holds every suffix of its sequences cut at `suffix_decoding_max_tree_depth` tokens, with a count
per node of the suffixes through it. Arctic Inference itself is not used: PyPI has only its source, whose build
needs torch >= 2.10 and a CMake that finds Python's headers, which this project's machines and CI cannot count on.

A proposal (`speculate`): for each match length m from 1 up to the longest suffix of the sequence found in a tree
(at most max_tree_depth - 1), walk the continuations best first by estimated probability, the product along the path
of count(child) / count(parent), dropping those below `suffix_decoding_min_token_prob`, and keep at most
min(the step's nodes, `suffix_decoding_max_spec_factor` * m) nodes; of all match lengths and both trees, the tree with
the highest score wins (the sum of its nodes' probabilities: the tokens it expects accepted). Nodes come out best
first, so a parent precedes its children and any prefix is a tree: the step's budget cuts it as any tree
(`num_draft_tokens - 1` nodes, `num_speculative_tokens` deep). vLLM verifies the best path alone (Arctic's path
mode), at most num_speculative_tokens tokens; here the same number of rows holds the best-first tree, whose best path
is its first nodes where the path's probabilities lead.

The trees learn as the target keeps tokens (`observe`, every request of every step, finishing ones included, so
that a finished answer is whole in the global tree). A preempted request's partial answer leaves the global tree and
comes back as it is recomputed. With the adaptive policy each node's estimated probability is its confidence: nodes
whose path probability is below the budget's `min_log_survival` are dropped (`is_calibrated`).
"""
from __future__ import annotations

import itertools
import math
import time
from typing import NamedTuple

from serving.drafters.base import DraftBudget, Drafter
from serving.drafters.suffix_tree import SuffixCache
from serving.spec_decode.tree import DraftTree


class Suffix(NamedTuple):
    """A request's draft: its tree, whose survivals are each node's estimated path probability (non-increasing in
    node order), and its score (their sum: the tokens the tree expects accepted)."""
    tree: DraftTree
    score: float

    @property
    def probs(self) -> tuple[float, ...]:
        return self.tree.survivals

    def cut(self, budget: DraftBudget) -> "Suffix":
        """The draft within `budget`: its first nodes whose probability is at least exp(min_log_survival) (a
        prefix, as probabilities only fall), at most num_nodes of them and those that repay their rows
        (DraftBudget.num_kept), none deeper than its depth."""
        least = math.exp(budget.min_log_survival)
        num = budget.num_kept([p for p in self.probs if p >= least])
        tree = self.tree.prefix(num, budget.depth)
        return self if tree is self.tree else Suffix(tree, sum(tree.survivals))


class SuffixState:
    """A request's place in the cache: its key there (unique for the drafter's life, so that a request id used again
    never evicts an earlier answer) and how many of its tokens the trees hold."""

    def __init__(self, key: int):
        self.key, self.num_added = key, 0


class SuffixDrafter(Drafter):
    kinds = ("suffix",)
    is_calibrated = True

    def __init__(self, config):
        self.max_depth = config.suffix_decoding_max_tree_depth
        self.max_spec_factor = config.suffix_decoding_max_spec_factor
        self.min_token_prob = config.suffix_decoding_min_token_prob
        self.cache = SuffixCache(self.max_depth, config.suffix_decoding_max_cached_requests)
        self.keys = itertools.count()
        # engine steps observed, drafts made, the seconds spent updating the trees and drafting
        self.num_steps, self.num_drafts, self.seconds = 0, 0, 0.0

    def state(self, request) -> SuffixState:
        """The request's state, its prompt and answer so far added to the trees: every token it holds."""
        slots = request.spec.slots
        if self not in slots:
            slots[self] = SuffixState(next(self.keys))
            self.cache.start(slots[self].key, request.token_ids[:request.num_prompt_tokens])
            slots[self].num_added = request.num_prompt_tokens
        state = slots[self]
        if state.num_added < request.num_tokens:
            self.cache.add(state.key, request.token_ids[state.num_added:])
            state.num_added = request.num_tokens
        return state

    def observe(self, ctx):
        start = time.perf_counter()
        for request in ctx.step.batch.requests:
            self.state(request)
        self.num_steps += 1
        self.seconds += time.perf_counter() - start

    def speculate(self, request, num_nodes: int) -> Suffix:
        """The best draft of at most `num_nodes` nodes after the request's tokens."""
        start = time.perf_counter()
        key = self.state(request).key
        draft = self.cache.speculate(key, request.token_ids[-self.max_depth:], num_nodes, self.max_spec_factor,
                                     self.min_token_prob)
        self.num_drafts += 1
        self.seconds += time.perf_counter() - start
        return Suffix(DraftTree(draft.tokens, draft.parents, survivals=tuple(draft.probs)), draft.score)

    def propose(self, ctx, requests, budgets):
        return {r.request_id: self.speculate(r, budgets[r.request_id].num_nodes).cut(budgets[r.request_id]).tree
                for r in requests}

    def reset(self, request):
        """A request that leaves: its own tree goes; its answer stays in the global tree if it finished, and leaves
        it if it was preempted (it comes back as the request is recomputed)."""
        state = request.spec.slots.get(self)
        if state is None:
            return
        self.cache.stop(state.key)
        if not request.is_finished and state.key in self.cache.cached:
            self.cache.evict(state.key)

    @property
    def num_cached_requests(self) -> int:
        return len(self.cache.cached)

    def summary(self):
        """The drafter's own time per engine step (updating the trees and drafting) and per draft made, in
        microseconds, and the answers the global tree holds."""
        return {"suffix_us_per_step": self.seconds / max(self.num_steps, 1) * 1e6,
                "suffix_us_per_draft": self.seconds / max(self.num_drafts, 1) * 1e6,
                "suffix_cached_requests": self.num_cached_requests}


class SuffixFirstChoice(SuffixDrafter):
    """Suffix decoding as the primary of suffix-first drafting (drafters/fallback.py): it drafts for a request where its
    draft's score, the tokens its own frequencies expect accepted, is at least `suffix_first_min_score`.

    The choice is made on the request's draft within the config's whole budget (num_draft_tokens - 1 nodes,
    num_speculative_tokens deep), before the step's budget cuts it, so that it does not depend on the budget. With the
    adaptive policy the draft chosen still honours the budget's cut, by its nodes' estimated probabilities."""

    def __init__(self, config):
        super().__init__(config)
        self.min_score = config.suffix_first_min_score
        self.whole = DraftBudget(config.max_draft_nodes, config.num_speculative_tokens)
        self.drafts: dict[str, tuple[int, Suffix | None]] = {}  # request id -> (its tokens, the draft chosen)

    def chosen(self, request) -> Suffix | None:
        """The draft where it clears the bar for this request at its current tokens, else None; made once per step."""
        num_tokens, draft = self.drafts.get(request.request_id, (-1, None))
        if num_tokens != request.num_tokens:
            draft = self.speculate(request, self.whole.num_nodes).cut(self.whole)
            draft = draft if draft.tree and draft.score >= self.min_score else None
            self.drafts[request.request_id] = (request.num_tokens, draft)
        return draft

    def clears_bar(self, request) -> bool:
        return self.chosen(request) is not None

    def propose(self, ctx, requests, budgets):
        """The chosen drafts of `requests` (each clears the bar), cut to each one's budget."""
        trees = {r.request_id: self.chosen(r).cut(budgets[r.request_id]).tree for r in requests}
        self.drafts.clear()
        return trees

    def reset(self, request):
        super().reset(request)
        self.drafts.pop(request.request_id, None)
