"""A smaller model with the target's tokenizer drafts for it. Its K/V pool has the target's number of
blocks and block size, so the target's block tables address both pools. Each step it catches up over the
tokens it has not seen (the prompt at first, then the accepted drafts and the newest token), then drafts
one token per batched forward. It drafts greedily, or samples at `draft_temperature` and supplies q."""
from __future__ import annotations

import torch

from serving import targets
from serving.attention import KVCache
from serving.drafters.base import Drafter
from serving.model import Model
from serving.sampler import sample
from serving.spec_decode.tree import DraftTree


class DraftModelDrafter(Drafter):
    """Its slot per request: (tokens before which its pool holds all, the drafts it fed after them)."""

    kinds = ("draft_model",)

    @classmethod
    def build(cls, ctx, config, head=None, token_map=None):
        cls.check(config, ctx)
        return cls(ctx, config)

    def __init__(self, ctx, config):
        runner = ctx.runner
        folder = targets.resolve(config.model)
        if folder == ctx.target:
            self.model = runner.model  # the target drafting for itself: same weights, its own pool
        else:
            draft_fp, target_fp = targets.fingerprint(folder), ctx.fingerprint
            if (draft_fp["vocab_size"], draft_fp["vocab_hash"]) != (target_fp["vocab_size"], target_fp["vocab_hash"]):
                raise ValueError(f"draft model {config.model} has another vocabulary than the target "
                                 f"({draft_fp['vocab_size']} tokens, hash {draft_fp['vocab_hash']} vs "
                                 f"{target_fp['vocab_size']}, {target_fp['vocab_hash']}): it must share the target's tokenizer")
            self.model = Model.from_folder(folder, runner.dtype, runner.device)
        c = self.model.config
        # indexed by the target's full-attention tables, which keep every position: its windowed layers only mask
        self.cache = KVCache(c.num_layers, runner.cache.num_blocks, runner.block_size, c.layer.num_kv_heads,
                             c.layer.head_dim, runner.dtype, runner.device, c.windows, c.layer.attention_scale,
                             self.model.attention_sinks())
        self.temperature = config.draft_temperature

    def propose(self, ctx, requests, budgets):
        budgets = {rid: budget.chain_length for rid, budget in budgets.items()}  # a chain
        runner = ctx.runner
        chunks, starts = [], []
        for r in requests:
            start, fed = r.spec.slots.get(self, (0, []))
            num_valid = num_reusable(fed, start, r.token_ids)
            chunks.append((r.token_ids[num_valid:], num_valid, r.block_ids))
            starts.append(r.num_tokens)
        sampled = [bool(self.temperature) and not r.params.is_greedy for r in requests]
        generators = [r.generator for r in requests]
        drafts = {r.request_id: [] for r in requests}
        probs = {r.request_id: [] for r in requests}
        active = list(range(len(requests)))
        logits = runner.forward_chunks(self.model, self.cache, chunks)
        for i in range(max(budgets[r.request_id] for r in requests)):
            tokens, q = pick(logits, self.temperature if any(sampled[j] for j in active) else None, [generators[j] for j in active])
            if q is not None:  # greedy requests in the batch still draft greedily
                tokens = [t if sampled[j] else int(logits[n].argmax()) for n, (t, j) in enumerate(zip(tokens, active))]
            for n, j in enumerate(active):
                rid = requests[j].request_id
                drafts[rid].append(tokens[n])
                if q is not None and sampled[j]:
                    probs[rid].append(q[n])
            active = [j for j in active if budgets[requests[j].request_id] > i + 1]
            if not active:
                break
            chunks = [([drafts[requests[j].request_id][-1]], starts[j] + i, requests[j].block_ids) for j in active]
            logits = runner.forward_chunks(self.model, self.cache, chunks)
        trees = {}
        for r, start in zip(requests, starts):
            rid = r.request_id
            r.spec.slots[self] = (start, drafts[rid][:-1])
            trees[rid] = DraftTree.chain(drafts[rid], torch.stack(probs[rid]) if probs[rid] else None)
        return trees


def pick(logits: torch.Tensor, temperature: float | None, generators: list) -> tuple[list[int], torch.Tensor | None]:
    """Greedy drafts, or sampled drafts with their distributions q when `temperature` is set (> 0)."""
    if not temperature:
        return logits.argmax(-1).tolist(), None
    probs = torch.softmax(logits / temperature, dim=-1)
    tokens = [sample(p, g) for p, g in zip(probs, generators)]
    return tokens, probs


def num_reusable(fed: list[int], start: int, tokens: list[int]) -> int:
    """How many leading tokens of `tokens` a drafter's pool still holds, when it holds every token before
    `start` and last fed the drafts `fed` from there: those drafts count while the target accepted them."""
    num = start
    while num - start < len(fed) and num < len(tokens) - 1 and tokens[num] == fed[num - start]:
        num += 1
    return num  # never past the newest token: its logits give the first draft
