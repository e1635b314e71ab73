"""A head that drafts by prompt lookup first: where the sequence's last n tokens occurred before (n from
prompt_lookup_max down to prompt_lookup_min, as the ngram drafter), the tokens that followed are the chain;
the head drafts (its tree, when it drafts one) only for the requests where the lookup finds nothing.

The two fail in different places. Lookup proposes long runs that are accepted whole when the answer copies
earlier text (code, names, lists) and nothing elsewhere; a head trained on little data predicts one or two tokens
of ordinary prose. Requests drafted by lookup skip the head's draft forwards and its catch-up: a head with a pool of
its own keeps their pending tokens until it drafts for them again.
"""
from __future__ import annotations

from serving.drafters.base import Drafter, PooledDrafter
from serving.drafters.ngram import NgramDrafter


class LookupFirst(PooledDrafter):
    """Prompt lookup's chain where the sequence's last tokens occurred before, the head's tree elsewhere."""

    def __init__(self, lookup: NgramDrafter, head: Drafter):
        self.lookup, self.head = lookup, head
        self.pooled_head = head if isinstance(head, PooledDrafter) else None
        self.needs_hidden, self.aux_layers, self.num_lookahead = head.needs_hidden, head.aux_layers, head.num_lookahead
        self.is_calibrated = head.is_calibrated

    def observe(self, ctx):
        self.head.observe(ctx)

    def propose(self, ctx, requests, budgets):
        trees = self.lookup.propose(ctx, requests, budgets)
        rest = [r for r in requests if not trees[r.request_id]]
        if rest:
            trees.update(self.head.propose(ctx, rest, budgets))
        return trees

    def catch_up(self, ctx, requests):
        """The head's catch-up for the requests that lookup leaves to it (whether lookup drafts does not depend on
        the budget: a match is followed by a token at least)."""
        if self.pooled_head is None:
            return 0
        return self.pooled_head.catch_up(ctx, [r for r in requests if not self.lookup.has_match(r.token_ids)])

    def registered(self, request, first_block):
        if self.pooled_head is not None:
            self.pooled_head.registered(request, first_block)

    def reset(self, request):
        self.head.reset(request)
