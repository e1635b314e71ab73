"""Prompt lookup (n-gram) drafting: find an earlier occurrence of the sequence's last n tokens (longest n
first, from prompt_lookup_max down to prompt_lookup_min) and propose what followed it: the most recent
occurrence followed by a full run of drafts, else the one followed by the longest run."""
from __future__ import annotations

import numpy as np

from serving.drafters.base import Drafter
from serving.spec_decode.tree import DraftTree


class NgramDrafter(Drafter):
    kinds = ("ngram",)

    def __init__(self, config):
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, ctx, requests, budgets):
        return {r.request_id: DraftTree.chain(self.lookup(r.token_ids, budgets[r.request_id].chain_length))
                for r in requests}

    def clears_bar(self, request) -> bool:
        """Whether the request's last n tokens occurred before, for some n in [prompt_lookup_min, prompt_lookup_max]:
        whether `propose` drafts anything within any budget (drafters/fallback.py: lookup first, then a head)."""
        return bool(self.lookup(request.token_ids, 1))

    def lookup(self, tokens: list[int], num_drafts: int) -> list[int]:
        num_tokens = len(tokens)
        ids = np.asarray(tokens)
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            found = np.ones(num_tokens - n, dtype=bool)  # starts s < num_tokens - n whose n tokens are the suffix
            for j in range(n):
                found &= ids[j:num_tokens - n + j] == ids[num_tokens - n + j]
            starts = np.flatnonzero(found)
            if len(starts) == 0:
                continue
            full = starts[starts <= num_tokens - n - num_drafts]
            start = int(full[-1] if len(full) else starts[0])  # the latest full run, else the longest partial
            return tokens[start + n:start + n + num_drafts]
        return []
