"""Drafters propose tokens for the target to verify. One interface:

- `propose(engine, requests, budgets, step) -> {request_id: [token ids]}`: at most `budgets[request_id]`
  drafts for each request, which has just emitted its last token (K/V computed for all but that one).
  `step` is the target pass that just ran (`StepOutputs`), for drafters that read its hidden states.
- `draft_probs: {request_id: [num_drafts, vocab]}` for drafters that sample (the q of rejection sampling);
  absent means the drafts are deterministic.
- `reset(request)`: forget a request (finished or preempted).
"""
from __future__ import annotations

from serving.spec.config import SpeculativeConfig


def make_drafter(engine, config: SpeculativeConfig):
    if config.method == "ngram":
        from serving.drafters.ngram import NgramDrafter

        return NgramDrafter(config)
    if config.method == "draft_model":
        from serving.drafters.draft_model import DraftModelDrafter

        return DraftModelDrafter(engine, config)
    if config.method == "early_exit":
        from serving.drafters.early_exit import EarlyExitDrafter

        return EarlyExitDrafter(engine, config)
    from serving.drafters.heads import make_head_drafter

    drafter = make_head_drafter(engine, config)
    if config.prompt_lookup_first:
        from serving.drafters.lookup_first import LookupFirst
        from serving.drafters.ngram import NgramDrafter

        return LookupFirst(NgramDrafter(config), drafter)
    return drafter
