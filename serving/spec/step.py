"""The second half of an engine step when speculation is on: verify the drafts scheduled this step,
roll back, then draft for the next step.

Rollback is `num_computed_tokens = before + 1 + accepted` and `trim`: nothing is copied or erased; the
slots of rejected drafts are overwritten later. Drafts are capped so that they fit in the token budget,
the free blocks, max_tokens and the context: speculation never causes a preemption. Requests whose
sampling depends on more than the target's distribution (penalties, biases, logprobs) get no drafts
and decode one token per step beside the others.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from serving.drafters import make_drafter
from serving.request import Request
from serving.sampler import target_probs
from serving.spec.config import HEADS, SpeculativeConfig
from serving.spec.metrics import AcceptanceStats
from serving.spec.verify import verify_greedy, verify_sampled


@dataclass
class StepOutputs:
    """What the target pass of this step computed, for drafters that read it."""
    batch: object  # serving.batch.Batch
    out: object  # serving.model.ModelOutput
    num_accepted: dict[str, int]  # request id -> drafts accepted this step

    def __post_init__(self):
        self.index = {r.request_id: i for i, r in enumerate(self.batch.requests)}  # request id -> its place in the batch


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

    def verify(self, engine, request: Request, logits: torch.Tensor, best: list[int]) -> tuple[int, list[int]]:
        """logits: [1 + drafts, vocab] at the last real token and at each draft; best: their argmaxes. Rolls the
        request back to its accepted tokens (before + 1 + accepted) and returns (accepted, tokens to emit)."""
        drafts, request.spec_token_ids = request.spec_token_ids, []
        if request.params.is_greedy:
            accepted, emitted = verify_greedy(best, drafts)
        else:
            probs = target_probs(logits, request.params)
            draft_probs = self.drafter.draft_probs.pop(request.request_id, None)
            accepted, emitted = verify_sampled(probs, drafts, draft_probs, engine.generators[request.request_id])
        request.num_computed_tokens -= len(drafts) - accepted
        engine.block_manager.trim(request, request.num_computed_tokens)
        return accepted, emitted

    def record(self, request: Request, num_drafts: int, num_accepted: int, num_emitted: int) -> None:
        if not hasattr(request, "spec_stats"):
            request.spec_stats = AcceptanceStats(self.config.num_speculative_tokens)
        request.spec_stats.record(num_drafts, num_accepted, num_emitted)
        self.stats.record(num_drafts, num_accepted, num_emitted)

    def propose(self, engine, step: StepOutputs) -> None:
        """Drafts for every running request that has just emitted a token and can be speculated for, unless more
        than disable_by_batch_size requests are running."""
        scheduler, k = engine.scheduler, self.config.num_speculative_tokens
        budgets, requests = {}, []
        limit = self.config.disable_by_batch_size
        for request in scheduler.running if limit is None or len(scheduler.running) <= limit else ():
            if request.num_computed_tokens != request.num_tokens - 1 or not self.can_speculate(request):
                continue
            num_left = request.params.max_tokens - request.num_output_tokens - 1
            num = min(scheduler.fit_drafts(request, k), num_left)
            # Reserve the budget and the blocks before sizing the next request's drafts. When the pool is
            # overcommitted (someone will be preempted next step) the request gets no drafts.
            if num > 0 and engine.block_manager.allocate_slots(request, 1 + num):
                request.spec_token_ids = [0] * num
                budgets[request.request_id] = num
                requests.append(request)
        if hasattr(self.drafter, "observe"):  # drafters with a pool of their own catch up every step
            self.drafter.observe(engine, step)
        if not requests:
            return
        proposals = self.drafter.propose(engine, requests, budgets, step)
        for request in requests:
            drafts = list(proposals.get(request.request_id, []))[:budgets[request.request_id]]
            request.spec_token_ids = drafts
            if len(drafts) < budgets[request.request_id]:
                engine.block_manager.trim(request, request.num_tokens + len(drafts))
                probs = self.drafter.draft_probs.get(request.request_id)
                if probs is not None:
                    self.drafter.draft_probs[request.request_id] = probs[:len(drafts)]

    def reset(self, request: Request) -> None:
        self.drafter.reset(request)
