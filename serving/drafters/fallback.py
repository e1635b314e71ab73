"""A head that drafts after another drafter first: the primary drafts for a request where its draft's score clears
its bar, the secondary (the head) everywhere else.

- prompt lookup first (`prompt_lookup_first`): the primary is prompt lookup (drafters/ngram.py), whose bar is a match
  of the sequence's last tokens. Lookup proposes long runs that are accepted whole when the answer copies earlier text
  (code, names, lists) and nothing elsewhere; a head trained on little data predicts one or two tokens of ordinary
  prose, so the two fail in different places.
- suffix decoding first (`suffix_first`): the primary is suffix decoding (drafters/suffix.py, `SuffixFirstChoice`),
  whose bar is `suffix_first_min_score` tokens that its own frequencies expect accepted. Arctic Inference's hybrid of
  suffix decoding and its speculator decides the same way, against the head's draft length.

Whether the primary drafts for a request does not depend on the step's budget, so the head's catch-up, which runs
before drafting, is paid only for the requests the head drafts for, and a head with a pool of its own keeps the
others' pending tokens until it drafts for them again.
"""
from __future__ import annotations

from serving.drafters.base import Drafter


class Fallback(Drafter):
    """The primary's drafts where they clear its bar (`primary.clears_bar(request)`), the secondary's elsewhere."""

    def __init__(self, primary: Drafter, secondary: Drafter, share_name: str | None = None):
        """share_name: the summary's key for the share of trees the primary drafted (None: not reported)."""
        self.primary, self.head, self.share_name = primary, secondary, share_name
        self.needs_hidden, self.aux_layers, self.num_lookahead = (secondary.needs_hidden, secondary.aux_layers,
                                                                  secondary.num_lookahead)
        self.is_calibrated = secondary.is_calibrated
        self.num_primary, self.num_secondary = 0, 0  # trees drafted by each

    def observe(self, ctx):
        self.primary.observe(ctx)
        self.head.observe(ctx)

    def propose(self, ctx, requests, budgets):
        chosen = [r for r in requests if self.primary.clears_bar(r)]
        trees = self.primary.propose(ctx, chosen, budgets)
        rest = [r for r in requests if r.request_id not in trees]
        if rest:
            trees.update(self.head.propose(ctx, rest, budgets))
        self.num_primary += len(chosen)
        self.num_secondary += len(rest)
        return trees

    def catch_up(self, ctx, requests):
        """The secondary's catch-up for the requests that the primary leaves to it."""
        return self.head.catch_up(ctx, [r for r in requests if not self.primary.clears_bar(r)])

    def registered(self, request, first_block):
        self.head.registered(request, first_block)

    def reset(self, request):
        self.primary.reset(request)
        self.head.reset(request)

    def summary(self):
        """The primary's summary, and the share of trees it drafted."""
        if self.share_name is None:
            return self.primary.summary()
        share = self.num_primary / max(self.num_primary + self.num_secondary, 1)
        return {**self.primary.summary(), self.share_name: share}
