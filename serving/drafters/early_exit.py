"""Early-exit self-drafting: the target's first `num_layers` layers, then its final norm and LM head.

Those layers are the target's own, so the K/V they need for every accepted token is already in the
target's pool, written by the verify pass: nothing to catch up. Drafting writes K/V for the newest token
and the drafts into the same slots the next verify pass overwrites with identical or corrected values."""
from __future__ import annotations

from serving.drafters.base import Drafter
from serving.spec_decode.tree import DraftTree


class EarlyExitDrafter(Drafter):
    kinds = ("early_exit",)

    @classmethod
    def check(cls, config, ctx, head=None):
        num_target_layers = ctx.runner.model.config.num_layers
        if config.num_layers >= num_target_layers:
            raise ValueError(f"early_exit num_layers={config.num_layers} must be below the target's {num_target_layers} layers")

    def __init__(self, config):
        self.num_layers = config.num_layers

    def propose(self, ctx, requests, budgets):
        budgets = {rid: budget.chain_length for rid, budget in budgets.items()}  # a chain
        runner = ctx.runner
        drafts = {r.request_id: [] for r in requests}
        chunks = [([r.token_ids[-1]], r.num_tokens - 1, r) for r in requests]
        active = list(requests)
        for i in range(max(budgets.values())):
            logits = runner.forward_target_chunks(chunks, num_layers=self.num_layers)
            for r, token in zip(active, logits.argmax(-1).tolist()):
                drafts[r.request_id].append(token)
            active = [r for r in active if budgets[r.request_id] > i + 1]
            chunks = [([drafts[r.request_id][-1]], r.num_tokens + i, r) for r in active]
            if not active:
                break
        return {rid: DraftTree.chain(chain) for rid, chain in drafts.items()}
