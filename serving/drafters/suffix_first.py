"""A head that drafts by suffix decoding first (`suffix_first`): each step, for each request, the suffix trees' draft
(serving/drafters/suffix.py) where its score, the tokens its own frequencies expect accepted, is at least
`suffix_first_min_score`, and the head's draft elsewhere. Arctic Inference's hybrid of suffix decoding and its
speculator decides the same way, against the head's draft length.

The choice is made on the request's draft within the config's whole budget (num_draft_tokens - 1 nodes,
num_speculative_tokens deep), before the step's budget cuts it, so that it does not depend on the budget: the
head's catch-up, which runs before drafting, is then paid only for the requests the head drafts for, and a head
with a pool of its own keeps the others' pending tokens until it drafts for them again. With the adaptive policy
both honour the budget's cut: the suffix draft by its nodes' estimated probabilities, the head by its calibrated
confidence.
"""
from __future__ import annotations

from serving.drafters.base import DraftBudget, Drafter, PooledDrafter
from serving.drafters.suffix import Suffix, SuffixDrafter


class SuffixFirst(PooledDrafter):
    """Suffix decoding's tree where it expects at least `min_score` accepted tokens, the head's draft elsewhere."""

    def __init__(self, suffix: SuffixDrafter, head: Drafter, config):
        self.suffix, self.head = suffix, head
        self.pooled_head = head if isinstance(head, PooledDrafter) else None
        self.needs_hidden, self.aux_layers, self.num_lookahead = head.needs_hidden, head.aux_layers, head.num_lookahead
        self.is_calibrated = head.is_calibrated
        self.min_score = config.suffix_first_min_score
        self.whole = DraftBudget(config.max_draft_nodes, config.num_speculative_tokens)
        self.drafts: dict[str, tuple[int, Suffix | None]] = {}  # request id -> (its tokens, the suffix draft chosen)
        self.num_suffix, self.num_head = 0, 0  # trees drafted by each

    def chosen(self, request) -> Suffix | None:
        """The suffix draft where it beats the head for this request at its current tokens, else None."""
        num_tokens, draft = self.drafts.get(request.request_id, (-1, None))
        if num_tokens != request.num_tokens:
            draft = self.suffix.speculate(request, self.whole.num_nodes).cut(self.whole)
            draft = draft if draft.tree and draft.score >= self.min_score else None
            self.drafts[request.request_id] = (request.num_tokens, draft)
        return draft

    def observe(self, ctx):
        self.suffix.observe(ctx)
        self.head.observe(ctx)

    def propose(self, ctx, requests, budgets):
        trees, rest = {}, []
        for request in requests:
            draft = self.chosen(request)
            if draft is None:
                rest.append(request)
            else:
                trees[request.request_id] = draft.cut(budgets[request.request_id]).tree
        self.drafts.clear()
        if rest:
            trees.update(self.head.propose(ctx, rest, budgets))
        self.num_suffix += len(requests) - len(rest)
        self.num_head += len(rest)
        return trees

    def catch_up(self, ctx, requests):
        """The head's catch-up for the requests that suffix decoding leaves to it."""
        if self.pooled_head is None:
            return 0
        return self.pooled_head.catch_up(ctx, [r for r in requests if self.chosen(r) is None])

    def registered(self, request, first_block):
        if self.pooled_head is not None:
            self.pooled_head.registered(request, first_block)

    def reset(self, request):
        self.suffix.reset(request)
        self.head.reset(request)
        self.drafts.pop(request.request_id, None)

    def summary(self):
        """The suffix drafter's summary, and the share of trees it drafted."""
        return {**self.suffix.summary(), "suffix_share": self.num_suffix / max(self.num_suffix + self.num_head, 1)}
