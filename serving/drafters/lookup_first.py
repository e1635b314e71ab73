"""A head that drafts by prompt lookup first: where the sequence's last n tokens occurred before (n from
prompt_lookup_max down to prompt_lookup_min, as the ngram drafter), the tokens that followed are the chain;
the head drafts (its tree, when it drafts one) only for the requests where the lookup finds nothing.

The two fail in different places. Lookup proposes long runs that are accepted whole when the answer copies
earlier text (code, names, lists) and nothing elsewhere; a head trained on little data predicts one or two tokens
of ordinary prose. Requests drafted by lookup also skip the head's draft forwards (and its catch-up, until the head
drafts for them again).
"""
from __future__ import annotations

from serving.drafters.base import Drafter
from serving.drafters.ngram import NgramDrafter


class LookupFirst(Drafter):
    """Prompt lookup's chain where the sequence's last tokens occurred before, the head's tree elsewhere."""

    def __init__(self, lookup: NgramDrafter, head: Drafter):
        self.lookup, self.head = lookup, head
        self.needs_hidden, self.aux_layers, self.num_lookahead = head.needs_hidden, head.aux_layers, head.num_lookahead
        self.is_calibrated = head.is_calibrated

    def observe(self, engine, step):
        self.head.observe(engine, step)

    def propose(self, engine, requests, budgets, step):
        trees = self.lookup.propose(engine, requests, budgets)
        rest = [r for r in requests if not trees[r.request_id]]
        if rest:
            trees.update(self.head.propose(engine, rest, budgets, step))
        return trees

    def catch_up(self, engine, requests):
        return self.head.catch_up(engine, requests)

    def registered(self, request, first_block):
        self.head.registered(request, first_block)

    def reset(self, request):
        self.head.reset(request)
