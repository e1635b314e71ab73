"""DFlash (heads/dflash.py) as a drafter: a whole block of drafts from one forward of the head per step.

The head's context is K/V of every drafter layer projected from the target's fused features, the context K/V at
position p depending only on the target's states at p (no drafter recurrence). They live in a pool of the head's own
addressed by the target's block tables, filled as EAGLE's is (drafters/deferred.py): each step notes the kept
tokens' feature rows, and the head projects a request's pending rows into the pool, in one call with every other
request drafted, only when the request drafts next; rows of blocks the prefix cache registers move to the blocks,
and whoever shares them projects them first. Since nothing but the target's
features enters the context, the catch-up is the fusion and the layers' k/v projections alone.

The block `[newest token, MASK x (B-1)]` sits at positions newest..newest+B-1 and attends to the context (positions
before the newest token) and to itself (every slot, or with a causal head the slots up to its own): its rows are
tree rows of the paged attention over scratch slots past the target's blocks, each row's own slot last (where its
K/V is written), never kept. One forward drafts every request's block; slot d's distribution is depth d's marginal:
a chain takes each depth's most likely token, a tree (topk > 1) grows from the marginals by best-first search on the
product of calibrated probabilities (drafters/tree_search.py, `grow_from_marginals`), cut at num_draft_tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from serving.attention import KVCache, PagedAttention
from serving.drafters.deferred import DeferredDrafter, DeferredState
from serving.drafters.confidence import Confidence, top_log_probs
from serving.drafters.tree_search import grow_from_marginals


@dataclass
class ContextState(DeferredState):
    """One request's slot: the kept rows whose context K/V are not in the pool yet, and the position up to which
    they are."""
    end: int = 0


class DFlashDrafter(DeferredDrafter):
    kinds = ("dflash",)
    State = ContextState
    needs_hidden = False
    is_calibrated = True
    num_lookahead = 0  # the context K/V at position p read the target's states at p alone

    @classmethod
    def check(cls, config, ctx, head=None):
        if config.num_speculative_tokens > head.config.block_size - 1:
            raise ValueError(f"num_speculative_tokens={config.num_speculative_tokens} exceeds the {head.config.block_size - 1} "
                             f"drafts of this DFlash head's block (block_size={head.config.block_size}): draft fewer "
                             "tokens, or train a head with longer blocks")

    def __init__(self, ctx, head, token_map, config):
        c = head.config
        self.head, self.token_map = head, token_map
        self.confidence, self.topk = Confidence(head, config.confidence_threshold), config.topk
        self.aux_layers = tuple(dict.fromkeys(c.target_layers))
        runner = ctx.runner
        super().__init__(ctx)
        self.num_slots = c.block_size  # scratch slots of one request's block
        self.scratch_start = runner.cache.num_blocks * runner.block_size
        num_scratch_blocks = -(-self.max_requests * self.num_slots // runner.block_size)
        layer = c.layer_config()
        self.cache = KVCache(c.num_layers, runner.cache.num_blocks + num_scratch_blocks, runner.block_size,
                             layer.num_kv_heads, layer.head_dim, runner.dtype, runner.device)

    def feature_rows(self, step, rows: torch.Tensor) -> torch.Tensor:
        return torch.cat([step.out.aux[layer][rows] for layer in self.head.config.target_layers], dim=-1)

    @torch.inference_mode()
    def catch_up(self, ctx, requests) -> int:
        """Writes the context K/V of the pending rows of `requests` (those of their shared blocks first) into the pool:
        one fusion and one k/v projection per layer over all of them."""
        taken = self.take_pending(requests)
        if not taken:
            return 0
        chunks = [(tokens, start, request.block_ids) for request, tokens, start, _ in taken]
        for request, tokens, start, _ in taken:
            self.state(request).end = start + len(tokens)
        features = [f for *_, request_features in taken for f in request_features]
        _, positions, meta, _ = ctx.runner.flatten(chunks)
        context = self.head.fuse(torch.cat(features))
        for layer, (k, v) in enumerate(self.head.context_kv(context, positions)):
            self.cache.k[layer].index_copy_(0, meta.slot_mapping, k)
            self.cache.v[layer].index_copy_(0, meta.slot_mapping, v)
        return len(positions)

    def is_ready(self, request) -> bool:
        return self.state(request).end == request.num_tokens - 1  # its whole context in the pool

    def block_paths(self, index: int) -> list[list[int]]:
        """The scratch slots each row of the `index`-th request's block attends to, its own last."""
        slots = [self.scratch_start + index * self.num_slots + j for j in range(self.num_slots)]
        if self.head.config.causal:
            return [slots[:j + 1] for j in range(self.num_slots)]
        return [slots[:j] + slots[j + 1:] + [slots[j]] for j in range(self.num_slots)]

    def block_outputs(self, ctx, requests, newest: torch.Tensor) -> torch.Tensor:
        """newest: [R] each request's newest token -> [R, B, hidden] the outputs of its block's slots."""
        ids = self.head.block_ids(newest)  # [R, B]
        positions = torch.tensor([r.num_tokens - 1 for r in requests], device=self.device)[:, None] + torch.arange(
            self.num_slots, device=self.device)
        meta = ctx.runner.metadata([0] * len(requests), [r.num_tokens - 1 for r in requests],
                                   [r.block_ids for r in requests], [self.block_paths(i) for i in range(len(requests))])
        out = self.head(ids.flatten(), positions.flatten(), PagedAttention(self.cache, meta))
        return out.view(len(requests), self.num_slots, -1)

    @torch.inference_mode()
    def _draft(self, ctx, requests, budgets):
        newest = torch.tensor([r.token_ids[-1] for r in requests], device=self.device)
        out = self.block_outputs(ctx, requests, newest)
        num_depths = min(self.num_slots - 1, max(budgets[r.request_id].depth for r in requests))
        logits = self.head.logits(out[:, 1:1 + num_depths])  # [R, D, vocab]
        temperatures = torch.tensor([self.confidence.temperature(d + 1) for d in range(num_depths)], device=self.device)
        log_probs, tokens = top_log_probs(logits, self.topk, temperatures[:, None])  # [R, D, topk] each
        if self.token_map is not None:
            tokens = self.token_map[tokens]
        depths = [budgets[r.request_id].depth for r in requests]
        found = grow_from_marginals([lp[:d] for lp, d in zip(log_probs.tolist(), depths)],
                                    [t[:d] for t, d in zip(tokens.tolist(), depths)], self.topk,
                                    [self.confidence.log_threshold_for(budgets[r.request_id]) for r in requests])
        return {r.request_id: candidates.within(budgets[r.request_id]) for r, candidates in zip(requests, found)}
