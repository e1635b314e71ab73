"""P-EAGLE (heads/peagle.py) as a drafter: the whole block of drafts from one head forward per step.

It is an EAGLE-3 drafter (drafters/eagle.py) for everything but drafting: the same pool sharing the target's block
tables, the same lazy catch-up over the kept pairs (drafters/deferred.py: noted each step, run only when the request
drafts, handed to the blocks the prefix cache registers). What differs is that the catch-up and the drafts are one
forward: for every drafting request, its pending pairs (causal, their K/V kept in the pool) and then depth - 1
placeholder rows (the mask token and fc(mask_hidden) at positions anchor + 1 .. anchor + depth - 1, the anchor being
its newest pair), each a tree row that sees the context and the placeholder rows before it, their K/V in scratch slots
past the target's blocks and never kept. The pool takes every row's K/V before any row attends, so the placeholders
read the catch-up written in the same call. The newest pair's output gives depth 1's distribution, placeholder d's
depth d + 1's; `catch_up` does nothing of its own, so the adaptive policy prices drafting as that one call (its rows
grow with the depth drafted).

The drafts are a chain, or (topk > 1) the tree of the per-depth marginals: best-first by the product of the
calibrated probabilities along a path, cut at num_draft_tokens (tree_search.grow_from_marginals). A head with a
Markov head (markov_rank > 0) drafts depth by depth after the forward instead: a node's children come from its depth's
logits plus the Markov head's bias from the node's own token (tree_search.grow, one batched call per depth).
"""
from __future__ import annotations

import itertools

import torch

from serving.drafters.eagle import EagleDrafter
from serving.drafters.confidence import top_log_probs
from serving.drafters.tree_search import grow, grow_from_marginals


class PeagleDrafter(EagleDrafter):
    kinds = ("peagle",)

    @classmethod
    def check(cls, config, ctx, head=None):
        if config.num_speculative_tokens > head.config.num_depths:
            raise ValueError(f"num_speculative_tokens={config.num_speculative_tokens} exceeds the "
                             f"{head.config.num_depths} depths {config.model} was trained for: draft at most "
                             f"{head.config.num_depths} tokens, or train the head with --model.init_args.num_depths "
                             f"{config.num_speculative_tokens}")

    def __init__(self, ctx, head, token_map, config):
        """token_map: None (a P-EAGLE head drafts over its own draft vocabulary)."""
        super().__init__(ctx, head, None, config)
        with torch.inference_mode():
            self.mask_row = head.mask_feature()[None]  # fc(mask_hidden): every placeholder's g, fixed once loaded
        self.temperatures = torch.tensor([self.confidence.temperature(d + 1) for d in range(head.config.num_depths)],
                                         device=self.device)

    def scratch_rows(self, config) -> int:
        """One slot per placeholder row."""
        return config.num_speculative_tokens - 1

    def catch_up(self, ctx, requests) -> int:
        """Nothing apart: the pending pairs run in the drafting forward (`_draft`)."""
        return 0

    def is_ready(self, request) -> bool:
        return True  # every drafting request: its pending pairs run in the drafting forward

    def drafted(self, requests) -> None:
        """Nothing: it keeps no output between steps."""

    @torch.inference_mode()
    def _draft(self, ctx, requests, budgets):
        taken = self.take_pending(requests)
        if not taken:
            return {}
        mask_id = self.head.config.mask_token_id
        ids, positions, query_lens, context_lens, tables, paths, features = [], [], [], [], [], [], []
        sources = []  # per row: its pair's feature row, or -1 (the last row of g below) for a placeholder
        drafted = []  # the rows whose outputs draft, each request's depth 1, 2, ... (its newest pair's, then placeholders')
        max_depths, num_rows, num_pairs = [], 0, 0
        for r, (request, tokens, start, noted) in enumerate(taken):
            max_depths.append(budgets[request.request_id].depth)
            num_masks = max_depths[-1] - 1
            anchor = start + len(tokens) - 1
            scratch = [self.scratch_start + r * self.num_scratch + d for d in range(num_masks)]
            ids += tokens + [mask_id] * num_masks
            positions += list(range(start, anchor + 1 + num_masks))
            query_lens.append(len(tokens))
            context_lens.append(anchor + 1)
            tables.append(request.block_ids)
            paths.append([scratch[:d + 1] for d in range(num_masks)])
            sources += list(range(num_pairs, num_pairs + len(tokens))) + [-1] * num_masks
            num_pairs += len(tokens)
            features += noted
            num_rows += len(tokens) + num_masks
            drafted += range(num_rows - num_masks - 1, num_rows)
        g = self.input_features(features)  # [catch-up rows, hidden]
        g = torch.cat([g, self.mask_row])[torch.tensor(sources, device=self.device)]
        meta = ctx.runner.metadata(query_lens, context_lens, tables, paths)
        out = self._forward(torch.tensor(ids, device=self.device), g, torch.tensor(positions, device=self.device), meta)
        logits = self.head.logits(out[torch.tensor(drafted, device=self.device)])  # every request's depths, one LM head
        thresholds = [self.confidence.log_threshold_for(budgets[request.request_id]) for request, *_ in taken]
        if self.head.config.markov_rank:
            found = self._grow_markov(logits, max_depths, thresholds)
        else:
            found = self._grow_marginals(logits, max_depths, thresholds)
        return {request.request_id: candidates.within(budgets[request.request_id])
                for (request, *_), candidates in zip(taken, found)}

    def _grow_marginals(self, logits, max_depths, thresholds):
        """The tree of the per-depth marginals: one top-k over every request's rows at every depth, each at its
        depth's temperature. logits: [rows, draft_vocab], each request's depths in turn."""
        temperatures = torch.cat([self.temperatures[:depth] for depth in max_depths])
        log_probs, best = top_log_probs(logits, self.topk, temperatures[:, None])
        log_probs, tokens = log_probs.tolist(), self.head.to_target_ids(best).tolist()
        ends = list(itertools.accumulate(max_depths))
        return grow_from_marginals([log_probs[end - depth:end] for depth, end in zip(max_depths, ends)],
                                   [tokens[end - depth:end] for depth, end in zip(max_depths, ends)], self.topk, thresholds)

    def _grow_markov(self, logits, max_depths, thresholds):
        """Depth by depth: a node's children are the top-k of its depth's logits plus the Markov head's bias from
        the node's token (a draft: its draft id is its row of the Markov head)."""
        first = torch.tensor(list(itertools.accumulate([0] + max_depths[:-1])), device=self.device)  # depth 1's rows
        draft_ids = {}  # target id -> draft id of every token drafted so far

        def top(depth, depth_logits):
            log_probs, best = top_log_probs(depth_logits, self.topk, self.confidence.temperature(depth + 1))
            tokens = self.head.to_target_ids(best).tolist()
            draft_ids.update(zip((t for row in tokens for t in row), (b for row in best.tolist() for b in row)))
            return log_probs.tolist(), tokens

        def expand(depth, nodes, found):
            rows = torch.tensor([r for r, _ in nodes], device=self.device)
            previous = torch.tensor([draft_ids[found[r].tokens[c]] for r, c in nodes], device=self.device)
            return top(depth, logits[first[rows] + depth] + self.head.markov_bias(previous).to(logits.dtype))

        return grow(top(0, logits[first]), expand, self.topk, max_depths, thresholds)
