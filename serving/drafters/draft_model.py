"""A smaller model with the target's tokenizer drafts for it. Its K/V pool has the target's number of
blocks and block size, so the target's block tables address both pools. Each step it catches up over the
tokens it has not seen (the prompt at first, then the accepted drafts and the newest token), then drafts
one token per batched forward. It drafts greedily, or samples at `draft_temperature` and supplies q."""
from __future__ import annotations

import torch

from serving import targets
from serving.attention import KVCache
from serving.drafters.base import Drafter
from serving.drafters.runner import num_reusable, paged_forward, pick
from serving.model import Model
from serving.spec_decode.tree import DraftTree


class DraftModelDrafter(Drafter):
    def __init__(self, engine, config):
        folder = targets.resolve(config.model)
        if folder == engine.folder:
            self.model = engine.model  # the target drafting for itself: same weights, its own pool
        else:
            draft_fp, target_fp = targets.fingerprint(folder), engine.fingerprint
            if (draft_fp["vocab_size"], draft_fp["vocab_hash"]) != (target_fp["vocab_size"], target_fp["vocab_hash"]):
                raise ValueError(f"draft model {config.model} has another vocabulary than the target "
                                 f"({draft_fp['vocab_size']} tokens, hash {draft_fp['vocab_hash']} vs "
                                 f"{target_fp['vocab_size']}, {target_fp['vocab_hash']}): it must share the target's tokenizer")
            self.model = Model.from_folder(folder, engine.dtype, engine.device)
        c = self.model.config
        self.cache = KVCache(c.num_layers, engine.cache.num_blocks, engine.block_size, c.layer.num_kv_heads,
                             c.layer.head_dim, engine.dtype, engine.device)
        self.block_size = engine.block_size
        self.temperature = config.draft_temperature
        self.fed: dict[str, tuple[int, list[int]]] = {}  # request id -> (tokens before it all in the pool, drafts fed after)

    def propose(self, engine, requests, budgets, step=None):
        budgets = {rid: budget.chain_length for rid, budget in budgets.items()}  # a chain
        chunks, starts = [], []
        for r in requests:
            start, fed = self.fed.get(r.request_id, (0, []))
            num_valid = num_reusable(fed, start, r.token_ids)
            chunks.append((r.token_ids[num_valid:], num_valid, r.block_ids))
            starts.append(r.num_tokens)
        sampled = [bool(self.temperature) and not r.params.is_greedy for r in requests]
        generators = [engine.generators.get(r.request_id) for r in requests]
        drafts = {r.request_id: [] for r in requests}
        probs = {r.request_id: [] for r in requests}
        active = list(range(len(requests)))
        logits = paged_forward(self.model, self.cache, self.block_size, chunks)
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
            logits = paged_forward(self.model, self.cache, self.block_size, chunks)
        trees = {}
        for r, start in zip(requests, starts):
            rid = r.request_id
            self.fed[rid] = (start, drafts[rid][:-1])
            trees[rid] = DraftTree.chain(drafts[rid], torch.stack(probs[rid]) if probs[rid] else None)
        return trees

    def reset(self, request):
        self.fed.pop(request.request_id, None)
