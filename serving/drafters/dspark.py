"""DSpark (heads/dspark.py) as a drafter: DFlash's drafter (drafters/dflash.py: the context pool, one forward of the
block per step) with the Markov head's left-to-right pass over the block's outputs.

The block's forward gives every draft slot's backbone logits at once; the drafts then follow one another, each
node's children scored by the backbone logits of the next slot plus the transition bias of the node's own token
(W2 @ W1[token]), the newest token's for depth 1. A chain (topk 1) is the sequential greedy pass vLLM's DSpark
speculator makes; a tree (topk > 1) grows by the same best-first search as every head's (drafters/tree_search.py,
`grow`), expanding each depth's best nodes in one batched call: each node's children come from its own conditional
distribution, which is exactly the head's first-order law, not a product of per-depth marginals.

A node's score, its estimate of surviving verification, is where the confidence head enters: a head with one scores
the most likely child of a node sigmoid(confidence(slot output, W1[node's token])), the learned probability that the
target accepts it, and each other child that times its probability relative to the most likely one (the confidence
head judges the position, the head's distribution ranks the candidates there). The adaptive policy's price of a row
(`DraftBudget.min_log_survival`) and `confidence_threshold` cut a path whose product falls below them, so the learned
estimate sizes each request's draft as the calibrated probability does for other heads. A head without a confidence
head scores children by their calibrated probabilities, as DFlash's drafter does.

Those relative scores need no normaliser over the vocabulary, so with a confidence head the Markov step
(drafters/markov.py) finds a node's best children from the rows of W2 of the backbone's shortlist, computing the full
product over W2 only for a node whose bias could reach past it: the same children, without reading all of W2 at every
depth. A head without one needs the normaliser and takes the full product.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from serving.drafters.confidence import top_log_probs
from serving.drafters.dflash import DFlashDrafter
from serving.drafters.markov import MarkovStep, Shortlist
from serving.drafters.tree_search import grow


class DSparkDrafter(DFlashDrafter):
    kinds = ("dspark",)

    def __init__(self, ctx, head, token_map, config):
        super().__init__(ctx, head, token_map, config)
        self.markov = MarkovStep(head.markov_w1, head.markov_w2) if head.confidence is not None else None  # scoring that needs no normaliser

    @classmethod
    def check(cls, config, ctx, head=None):
        c = head.config
        if config.num_speculative_tokens > c.num_drafts:
            raise ValueError(f"num_speculative_tokens={config.num_speculative_tokens} exceeds the {c.num_drafts} drafts "
                             f"of this DSpark head's block (block_size={c.block_size}, sample_from_anchor="
                             f"{str(c.sample_from_anchor).lower()}): draft fewer tokens, or train a head with longer "
                             "blocks")

    def children(self, rows: torch.Tensor, base: torch.Tensor, shortlist: Shortlist | None, index: torch.Tensor,
                 depth: int, previous: torch.Tensor):
        """rows: [R, D, hidden] the draft slots' outputs, base: [R, D, rows] their backbone logits, shortlist their
        shortlists (drafters/markov.py; None without a confidence head); index: [N] the requests of N nodes at depth
        `depth` (0: the newest token), previous: [N] those nodes' target ids -> (their topk children's log-scores,
        their target ids) as nested lists."""
        embed = self.head.markov_embed(previous)
        temperature = self.confidence.temperature(depth + 1)
        if shortlist is not None:  # scores relative to the best child: no normaliser over every row
            logits, tokens = self.markov.top(base, index, depth, shortlist, previous, embed, self.topk)
            accept = F.logsigmoid(self.head.confidence_logit(rows[index, depth], embed).float())
            log_probs = accept[:, None] + (logits - logits[:, :1]) / temperature
        else:
            log_probs, tokens = top_log_probs(base[index, depth] + self.head.markov_w2(embed), self.topk, temperature)
        if self.token_map is not None:
            tokens = self.token_map[tokens]
        return log_probs.tolist(), tokens.tolist()

    @torch.inference_mode()
    def _draft(self, ctx, requests, budgets):
        c = self.head.config
        newest = torch.tensor([r.token_ids[-1] for r in requests], device=self.device)
        depths = [min(c.num_drafts, budgets[r.request_id].depth) for r in requests]
        first = c.draft_slot(1)
        rows = self.block_outputs(ctx, requests, newest)[:, first:first + max(depths)]  # [R, D, hidden]
        base = self.head.logits(rows)  # [R, D, rows]: the backbone's part of every draft's logits
        shortlist = self.markov.shortlist(base, self.topk) if self.markov is not None else None

        def expand(depth, nodes, found):
            index = torch.tensor([r for r, _ in nodes], device=self.device)
            previous = torch.tensor([found[r].tokens[node] for r, node in nodes], device=self.device)
            return self.children(rows, base, shortlist, index, depth, previous)

        first_nodes = torch.arange(len(requests), device=self.device)
        found = grow(self.children(rows, base, shortlist, first_nodes, 0, newest), expand, self.topk, depths,
                     [self.confidence.log_threshold_for(budgets[r.request_id]) for r in requests])
        return {r.request_id: candidates.best(budgets[r.request_id].num_nodes) for r, candidates in zip(requests, found)}
