"""Prompt lookup (n-gram) drafting: find an earlier occurrence of the sequence's last n tokens (longest n
first, from prompt_lookup_max down to prompt_lookup_min) and propose what followed it: the most recent
occurrence followed by a full run of drafts, else the one followed by the longest run."""
from __future__ import annotations


class NgramDrafter:
    def __init__(self, config):
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self.draft_probs = {}

    def propose(self, engine, requests, budgets, step=None):
        return {r.request_id: self.lookup(r.token_ids, budgets[r.request_id]) for r in requests}

    def lookup(self, tokens: list[int], num_drafts: int) -> list[int]:
        num_tokens = len(tokens)
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            suffix = tokens[num_tokens - n:]
            best = []
            for start in range(num_tokens - n - 1, -1, -1):
                if tokens[start:start + n] == suffix:
                    follow = tokens[start + n:start + n + num_drafts]
                    if len(follow) == num_drafts:
                        return follow
                    best = max(best, follow, key=len)
            if best:
                return best
        return []

    def reset(self, request):
        pass
