"""A head that drafts by prompt lookup first: where the sequence's last n tokens occurred before (n from
prompt_lookup_max down to prompt_lookup_min, as the ngram drafter), the tokens that followed are the chain;
the head drafts only for the requests where the lookup finds nothing.

The two fail in different places. Lookup proposes long runs that are accepted whole when the answer copies
earlier text (code, names, lists) and nothing elsewhere; a head trained on little data predicts one or two tokens
of ordinary prose. Requests drafted by lookup also skip the head's draft forwards. The head still catches up over
every kept token each step, so it can draft at the next step whichever drafted this one.
"""
from __future__ import annotations


class LookupFirst:
    def __init__(self, lookup, head):
        self.lookup, self.head = lookup, head
        self.aux_layers = head.aux_layers
        self.num_lookahead = getattr(head, "num_lookahead", 0)
        self.draft_probs = head.draft_probs  # both draft deterministically: always empty
        self.leaves = {}

    def observe(self, engine, step):
        if hasattr(self.head, "observe"):
            self.head.observe(engine, step)

    def propose(self, engine, requests, budgets, step):
        drafts = self.lookup.propose(engine, requests, budgets)
        rest = [r for r in requests if not drafts[r.request_id]]
        self.leaves = {}  # a lookup chain has none
        if rest:
            drafts.update(self.head.propose(engine, rest, budgets, step))
            self.leaves = getattr(self.head, "leaves", {})
        return drafts

    def reset(self, request):
        self.head.reset(request)
