"""Medusa heads as a drafter (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple
Decoding Heads"): head i reads the target's final hidden state of the newest computed token and proposes the token
i + 1 places after the next one, independently of the drafts before it, so the heads' top-k lists span a tree:
- `medusa_choices` (Medusa's static tree): node [r_1, ..., r_d] is head d - 1's r_d-th most likely token after the
  node [r_1, ..., r_{d-1}];
- otherwise EAGLE-2's dynamic tree over the same lists (drafters/tree_search.py; topk 1 is a chain): a node is scored
  by the product of its heads' probabilities along its path.
Medusa needs no K/V and no catch-up.
"""
from __future__ import annotations

import torch

from serving.drafters.base import Drafter
from serving.drafters.confidence import Confidence, top_log_probs
from serving.drafters.tree_search import Candidates, grow


class MedusaDrafter(Drafter):
    kinds = ("medusa",)
    needs_hidden = True
    is_calibrated = True

    @classmethod
    def check(cls, config, ctx, head=None):
        if config.num_speculative_tokens > head.config.num_heads:
            raise ValueError(f"num_speculative_tokens={config.num_speculative_tokens} exceeds this Medusa head's "
                             f"{head.config.num_heads} heads")

    @classmethod
    def build(cls, ctx, config, head=None, token_map=None):
        cls.check(config, ctx, head)
        return cls(head, token_map, config)

    def __init__(self, head, token_map, config):
        self.head, self.token_map = head, token_map
        self.confidence, self.topk = Confidence(head, config.confidence_threshold), config.topk
        # in topological order, or None; no deeper than num_speculative_tokens, itself at most the head's heads
        self.choices = config.medusa_choices
        self.num_ranks = 1 + max(r for path in self.choices for r in path) if self.choices is not None else self.topk

    def _top(self, logits: torch.Tensor, depth: int) -> tuple[list, list]:
        """(log-probabilities, target ids) of each request's num_ranks most likely drafts, as lists per request."""
        log_probs, best = top_log_probs(logits, self.num_ranks, self.confidence.temperature(depth))
        return log_probs.tolist(), (best if self.token_map is None else self.token_map[best]).tolist()

    @torch.inference_mode()
    def propose(self, ctx, requests, budgets):
        step = ctx.step
        requests = [r for r in requests if r.request_id in step.index]
        if not requests:
            return {}
        rows = [step.kept_rows(r)[0][-1] for r in requests]
        hidden = step.out.hidden[torch.tensor(rows, device=step.out.hidden.device)]
        max_depth = max(budgets[r.request_id].depth for r in requests)
        logits = self.head(hidden)[:max_depth]  # [depths, requests, vocab]
        # per depth: log-probabilities and target ids of each request's ranked drafts, [requests, ranks]
        ranked = [self._top(logits[d], d + 1) for d in range(max_depth)]
        if self.choices is not None:
            found = [self._static(ranked, n, budgets[r.request_id]) for n, r in enumerate(requests)]
        else:
            found = grow(ranked[0], lambda depth, nodes, _: ([ranked[depth][0][r] for r, _ in nodes],
                                                             [ranked[depth][1][r] for r, _ in nodes]),
                         self.topk, [budgets[r.request_id].depth for r in requests],
                         [self.confidence.log_threshold_for(budgets[r.request_id]) for r in requests])
        return {r.request_id: candidates.within(budgets[r.request_id]) for r, candidates in zip(requests, found)}

    def _static(self, ranked, n: int, budget) -> Candidates:
        """Request n's nodes of medusa_choices, within its budget's depth and the confidence threshold."""
        found, index = Candidates(), {}
        max_depth, log_threshold = budget.depth, self.confidence.log_threshold_for(budget)
        for path in self.choices:
            parent = index.get(path[:-1], -1)
            if len(path) > max_depth or (len(path) > 1 and path[:-1] not in index):
                continue
            log_probs, tokens = ranked[len(path) - 1]
            score = (found.scores[parent] if parent >= 0 else 0.0) + log_probs[n][path[-1]]
            if score >= log_threshold:
                index[path] = found.add(tokens[n][path[-1]], parent, len(path), score)
        return found
