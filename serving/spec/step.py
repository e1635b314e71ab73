"""The second half of an engine step when speculation is on: verify the drafts scheduled this step,
roll back, then draft for the next step.

Rollback is `num_computed_tokens = before + 1 + accepted` and `trim`: nothing is erased, and the slots of
rejected drafts are overwritten later; only an accepted leaf (an alternative to the first draft, verified in the
slots after the chain's) has its K/V copied into the slot of its position. Drafts are capped so that they fit in
the token budget, the free blocks, max_tokens and the context: speculation never causes a preemption. Requests whose
sampling depends on more than the target's distribution (penalties, biases, logprobs) get no drafts
and decode one token per step beside the others.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from serving.drafters import make_drafter
from serving.request import Request
from serving.sampler import target_probs
from serving.spec.config import HEADS, SpeculativeConfig
from serving.spec.metrics import AcceptanceStats
from serving.spec.verify import verify_greedy_leaves, verify_sampled, verify_sampled_leaves


@dataclass
class StepOutputs:
    """What the target pass of this step computed, for drafters that read it."""
    batch: object  # serving.batch.Batch
    out: object  # serving.model.ModelOutput
    num_accepted: dict[str, int]  # request id -> drafts accepted this step
    kept_leaves: dict[str, int] = field(default_factory=dict)  # request id -> its accepted leaf's row among its rows

    def __post_init__(self):
        self.index = {r.request_id: i for i, r in enumerate(self.batch.requests)}  # request id -> its place in the batch

    def kept_rows(self, request: Request) -> tuple[list[int], int]:
        """(the rows of the flat batch that computed the tokens the request kept this step, in position order; the
        position of the first)."""
        first = self.batch.token_start[self.index[request.request_id]]
        start = int(self.batch.positions[first])
        rows = list(range(first, first + request.num_computed_tokens - start))
        if request.request_id in self.kept_leaves:  # the leaf stands in for the chain's first draft
            rows[1] = first + self.kept_leaves[request.request_id]
        return rows, start


class Speculator:
    def __init__(self, engine, config: SpeculativeConfig):
        self.config = config
        self.drafter = make_drafter(engine, config)
        self.aux_layers = getattr(self.drafter, "aux_layers", ())
        self.needs_hidden = config.method in HEADS
        self.stats = AcceptanceStats(config.num_speculative_tokens)

    @staticmethod
    def can_speculate(request: Request) -> bool:
        return not request.params.needs_history

    def verify(self, engine, request: Request, logits: torch.Tensor, best: list[int]) -> tuple[int, list[int], int | None]:
        """logits: [1 + drafts, vocab] at the last real token and at each draft; best: their argmaxes. Rolls the
        request back to its accepted tokens (before + 1 + accepted) and returns (accepted, tokens to emit, the row
        of the accepted leaf among the request's rows or None). An accepted leaf's K/V moves into the slot of the
        position it now holds."""
        drafts, request.spec_token_ids = request.spec_token_ids, []
        num_leaves, request.spec_num_leaves = request.spec_num_leaves, 0
        chain, leaves = drafts[:len(drafts) - num_leaves], drafts[len(drafts) - num_leaves:]
        leaf = None
        if request.params.is_greedy:
            leaf, accepted, emitted = verify_greedy_leaves(best, chain, leaves)
        else:
            probs, generator = target_probs(logits, request.params), engine.generators[request.request_id]
            if leaves:
                leaf, accepted, emitted = verify_sampled_leaves(probs, chain, leaves, generator)
            else:
                draft_probs = self.drafter.draft_probs.pop(request.request_id, None)
                accepted, emitted = verify_sampled(probs, drafts, draft_probs, generator)
        request.num_computed_tokens -= len(drafts) - accepted
        if leaf is not None:
            engine.cache.move(request.block_ids, request.num_computed_tokens - 1 + len(chain) + leaf,
                              request.num_computed_tokens - 1)
        engine.block_manager.trim(request, request.num_computed_tokens)
        return accepted, emitted, None if leaf is None else 1 + len(chain) + leaf

    def record(self, request: Request, num_drafts: int, num_accepted: int, num_emitted: int) -> None:
        if not hasattr(request, "spec_stats"):
            request.spec_stats = AcceptanceStats(self.config.num_speculative_tokens)
        request.spec_stats.record(num_drafts, num_accepted, num_emitted)
        self.stats.record(num_drafts, num_accepted, num_emitted)

    def propose(self, engine, step: StepOutputs) -> None:
        """Drafts for every running request that has just emitted a token and can be speculated for, unless more
        than disable_by_batch_size requests are running."""
        scheduler, k = engine.scheduler, self.config.num_speculative_tokens
        max_leaves = self.config.first_draft_topk - 1
        budgets, leaf_budgets, requests = {}, {}, []
        limit = self.config.disable_by_batch_size
        for request in scheduler.running if limit is None or len(scheduler.running) <= limit else ():
            if request.num_computed_tokens != request.num_tokens - 1 or not self.can_speculate(request):
                continue
            num_left = request.params.max_tokens - request.num_output_tokens - 1
            num_rows = scheduler.fit_drafts(request, k + max_leaves)
            num = min(num_rows, num_left, k)
            num_leaves = min(max_leaves, num_rows - num) if num > 0 else 0
            # Reserve the budget and the blocks before sizing the next request's drafts. When the pool is
            # overcommitted (someone will be preempted next step) the request gets no drafts.
            if num > 0 and engine.block_manager.allocate_slots(request, 1 + num + num_leaves):
                request.spec_token_ids = [0] * (num + num_leaves)
                budgets[request.request_id], leaf_budgets[request.request_id] = num, num_leaves
                requests.append(request)
        if hasattr(self.drafter, "observe"):  # drafters with a pool of their own catch up every step
            self.drafter.observe(engine, step)
        if not requests:
            return
        proposals = self.drafter.propose(engine, requests, budgets, step)
        leaves = getattr(self.drafter, "leaves", {})
        for request in requests:
            drafts = list(proposals.get(request.request_id, []))[:budgets[request.request_id]]
            request_leaves = leaves.get(request.request_id, [])[:leaf_budgets[request.request_id]] if drafts else []
            request.spec_token_ids, request.spec_num_leaves = drafts + request_leaves, len(request_leaves)
            if len(drafts) < budgets[request.request_id] or len(request_leaves) < leaf_budgets[request.request_id]:
                engine.block_manager.trim(request, request.num_tokens + len(request.spec_token_ids))
                probs = self.drafter.draft_probs.get(request.request_id)
                if probs is not None:
                    self.drafter.draft_probs[request.request_id] = probs[:len(drafts)]

    def reset(self, request: Request) -> None:
        self.drafter.reset(request)
