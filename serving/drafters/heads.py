"""Drafters for trained heads (Medusa, EAGLE-1, EAGLE-3, MTP): loading a head folder against the engine's target.

Medusa reads the target's hidden state of the newest computed token and needs no K/V. EAGLE-1, EAGLE-3 and
MTP run a decoder layer of their own over a pool with the target's block count and block size, addressed by
the target's block tables. Every step they catch up over the tokens the target computed and kept in that
step (reading the target's hidden rows of the verify pass), then draft one token per batched forward,
feeding their own output back as the next feature.
"""
from __future__ import annotations

import torch

import heads
from serving import targets
from serving.attention import KVCache, PagedAttention, PagedMetadata


def make_head_drafter(engine, config):
    head = heads.load(config.model, targets.fingerprint(engine.folder))
    parts = heads.load_target_parts(engine.folder, engine.dtype, fingerprint=targets.fingerprint(engine.folder))
    parts.embed, parts.norm, parts.lm_head = engine.model.embed, engine.model.norm, engine.model.lm_head
    head = head.bind_target(parts).to(engine.dtype).eval().requires_grad_(False)
    kind = head.config.kind
    if kind != config.method:
        raise ValueError(f"{config.model} holds a {kind} head, but the speculative config says method {config.method!r}: "
                         f"use \"method\": \"{kind}\"")
    if kind == "medusa":
        if config.num_speculative_tokens > head.config.num_heads:
            raise ValueError(f"num_speculative_tokens={config.num_speculative_tokens} exceeds this Medusa head's "
                             f"{head.config.num_heads} heads")
        return MedusaDrafter(head)
    return FeatureDrafter(engine, head)


def _last_rows(step, request) -> tuple[int, int, int]:
    """(first row of the request in the flat batch, first position computed this step, positions kept)."""
    i = step.index[request.request_id]
    first_row = step.batch.token_start[i]
    start = int(step.batch.positions[first_row])
    return first_row, start, request.num_computed_tokens - start


class MedusaDrafter:
    def __init__(self, head):
        self.head = head
        self.aux_layers = ()
        self.draft_probs = {}

    @torch.inference_mode()
    def propose(self, engine, requests, budgets, step):
        requests = [r for r in requests if r.request_id in step.index]
        if not requests:
            return {}
        rows = []
        for r in requests:
            first_row, _, num_kept = _last_rows(step, r)
            rows.append(first_row + num_kept - 1)
        logits = self.head(step.out.hidden[torch.tensor(rows)])  # [num_heads, requests, vocab]
        tokens = logits.argmax(-1).T.tolist()
        return {r.request_id: tokens[n][:budgets[r.request_id]] for n, r in enumerate(requests)}

    def reset(self, request):
        pass


class FeatureDrafter:
    """EAGLE-1, EAGLE-3 and MTP (module 0 reused autoregressively). Stateless between steps: the pool is
    rewritten from each step's kept tokens, so rollback and preemption need nothing."""

    def __init__(self, engine, head):
        self.head, self.kind = head, head.config.kind
        if self.kind == "mtp" and head.config.serve_mode != "reuse_first":
            raise ValueError("the engine serves MTP heads with serve_mode 'reuse_first' (module 0 drafts every token); "
                             "set it in the head's config.json")
        layer = head.config.layer_config()
        self.cache = KVCache(1, engine.cache.num_blocks, engine.block_size, layer.num_kv_heads, layer.head_dim, engine.dtype)
        self.block_size = engine.block_size
        self.aux_layers = tuple(head.config.aux_layers) if self.kind == "eagle3" else ()
        self.draft_probs = {}
        self.newest: dict[str, torch.Tensor] = {}

    def _features(self, step, rows: torch.Tensor) -> torch.Tensor:
        if self.kind == "eagle3":
            return self.head.fuse([step.out.aux[layer][rows] for layer in self.aux_layers])
        return step.out.hidden[rows]

    def _forward(self, ids, features, positions, meta):
        attention = PagedAttention(self.cache, meta)
        if self.kind == "mtp":
            return self.head.forward_module(0, ids, features, positions, attention)
        return self.head(ids, features, positions, attention)

    def _tokens(self, out: torch.Tensor) -> list[int]:
        if self.kind == "mtp":
            return self.head.logits(0, out).argmax(-1).tolist()
        if self.kind == "eagle3":
            return self.head.to_target_ids(self.head.logits(out).argmax(-1)).tolist()
        return self.head.logits(out).argmax(-1).tolist()

    @torch.inference_mode()
    def observe(self, engine, step):
        """Catch up over every token the target computed and kept this step: the pair (h_p, x_{p+1}) at
        position p. Keeps each request's newest output, which its first draft reads."""
        ids, positions, rows, query_lens, context_lens, tables, last = [], [], [], [], [], [], {}
        for request in step.batch.requests:
            if request.is_finished:
                continue
            first_row, start, num_kept = _last_rows(step, request)
            ids.extend(request.token_ids[start + 1:start + 1 + num_kept])
            positions.extend(range(start, start + num_kept))
            rows.extend(range(first_row, first_row + num_kept))
            query_lens.append(num_kept)
            context_lens.append(start + num_kept)
            tables.append(request.block_ids)
            last[request.request_id] = len(ids) - 1
        self.newest = {}
        if not ids:
            return
        meta = PagedMetadata.build(query_lens, context_lens, tables, self.block_size)
        out = self._forward(torch.tensor(ids), self._features(step, torch.tensor(rows)), torch.tensor(positions), meta)
        self.newest = {rid: out[row] for rid, row in last.items()}  # [hidden] each

    @torch.inference_mode()
    def propose(self, engine, requests, budgets, step):
        requests = [r for r in requests if r.request_id in self.newest]
        if not requests:
            return {}
        features = torch.stack([self.newest[r.request_id] for r in requests])  # [requests, hidden]
        drafts = {r.request_id: [] for r in requests}
        active = list(range(len(requests)))
        for s in range(max(budgets[r.request_id] for r in requests)):
            for n, token in zip(active, self._tokens(features)):
                drafts[requests[n].request_id].append(token)
            still = [j for j, n in enumerate(active) if budgets[requests[n].request_id] > s + 1]
            if not still:
                break
            features = features[torch.tensor(still)]
            active = [active[j] for j in still]
            step_requests = [requests[n] for n in active]
            positions = [r.num_tokens - 1 + s for r in step_requests]  # the draft just made sits at num_tokens + s
            meta = PagedMetadata.build([1] * len(active), [p + 1 for p in positions], [r.block_ids for r in step_requests],
                                       self.block_size)
            ids = torch.tensor([drafts[r.request_id][-1] for r in step_requests])
            features = self._forward(ids, features, torch.tensor(positions), meta)
        return drafts

    def reset(self, request):
        pass
