"""EAGLE-1 and EAGLE-3 as drafters (and the base of MTP's reuse-first mode, drafters/mtp.py, and of P-EAGLE): a
decoder layer of their own over a K/V pool addressed by the target's block tables, drafting EAGLE-2's dynamic tree
(drafters/tree_search.py; topk 1 is a chain).

The head catches up over the tokens the target computed and kept (the pair (h_p, x_{p+1}) at position p, reading the
target's hidden rows of the verify pass, the accepted path's among them), which rewrites its pool from the kept
tokens, so rollback needs nothing. It does so lazily (drafters/deferred.py): the head runs over a request's pending
pairs, and those of the registered blocks it shares, in one forward with the others drafted, only when the request
drafts next (the head is one layer, whose K/V depend on its inputs alone).

Its newest output gives the first depth of the tree; each further depth runs the head once over the nodes being
expanded, every node at its position and attending to the context and its own path, whose K/V sit in a scratch
region of the pool past the target's blocks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from heads.eagle3 import Eagle3
from serving.attention import AttentionPath, KVCache, PagedAttention
from serving.drafters.deferred import DeferredDrafter, DeferredState
from serving.drafters.confidence import Confidence, top_log_probs
from serving.drafters.tree_search import grow
from serving.kernels import Eagle3Forward
from serving.spec_decode.tree import path_to


@dataclass
class HeadState(DeferredState):
    """One request's slot: the kept pairs the head has not run over yet, and its output at the newest pair (what the
    first depth of the next tree reads), until drafted from."""
    last_output: torch.Tensor | None = None  # [hidden]


class EagleDrafter(DeferredDrafter):
    kinds = ("eagle", "eagle3")
    State = HeadState
    needs_hidden = True
    is_calibrated = True
    num_lookahead = 1  # its K/V at position p depends on token p + 1

    def __init__(self, ctx, head, token_map, config):
        self.head = head
        self.confidence, self.topk = Confidence(head, config.confidence_threshold), config.topk
        self.fuses_aux = isinstance(head, Eagle3)  # EAGLE-3's body (P-EAGLE's too): reads the aux layers through fc
        # each draft id's target id (EAGLE-3's d2t, EAGLE-1's token map; None: the same), read as a list per draft:
        # a draft's few ids need no torch call, each of which pays for cold caches after the target's forward
        if self.fuses_aux:
            self.target_ids = head.to_target_ids(torch.arange(len(head.d2t), device=head.d2t.device)).tolist()
        else:
            self.target_ids = None if token_map is None else token_map.tolist()
        # EAGLE-3's forward in one C call where the kernels compute its layer (the module elsewhere, and as reference)
        self.one_call = Eagle3Forward(head) if Eagle3Forward.applies(head) else None
        self.aux_layers = tuple(head.config.aux_layers) if self.fuses_aux else ()
        layer = head.config.layer_config()
        runner = ctx.runner
        super().__init__(ctx)
        # scratch: one run of slots for each of up to max_num_seqs requests drafted at once
        self.num_scratch = self.scratch_rows(config)
        self.scratch_start = runner.cache.num_blocks * runner.block_size
        num_scratch_blocks = -(-self.max_requests * self.num_scratch // runner.block_size)
        # the head's draft_window, if any, applies by position to catch-up and tree rows alike, as in training
        self.cache = KVCache(1, runner.cache.num_blocks + num_scratch_blocks, runner.block_size, layer.num_kv_heads,
                             layer.head_dim, runner.dtype, runner.device, windows=(head.config.draft_window,))

    def scratch_rows(self, config) -> int:
        """Scratch slots per request drafted: one per node expanded."""
        return config.topk * max(config.num_speculative_tokens - 1, 0)

    def feature_rows(self, step, rows: torch.Tensor) -> torch.Tensor:
        """The target's rows the head reads, as noted: EAGLE-3's aux layers side by side, fused only at catch-up (one
        call over every pending row instead of one per step)."""
        if self.fuses_aux:
            return torch.cat([step.out.aux[layer][rows] for layer in self.aux_layers], dim=-1)
        return step.out.hidden[rows]

    def _forward(self, ids, features, positions, meta):
        attention = PagedAttention(self.cache, meta)
        if self.one_call is not None and attention.path is AttentionPath.KERNEL:
            return self.one_call(ids, features, positions, attention)
        return self.head(ids, features, positions, attention)

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.head.logits(out)

    def _top(self, out: torch.Tensor, depth: int) -> tuple[list, list]:
        """(log-probabilities, target ids) of the topk most likely drafts after each row of head outputs, as lists
        per row."""
        logits = self._logits(out)
        log_probs, best = top_log_probs(logits, self.topk, self.confidence.temperature(depth))
        best = best.tolist()
        if self.target_ids is not None:
            best = [[self.target_ids[i] for i in row] for row in best]
        return log_probs.tolist(), best

    def input_features(self, features: list[torch.Tensor]) -> torch.Tensor:
        """The noted feature rows as the head's input g: EAGLE-3's aux rows fused by fc (one call over all of them)."""
        features = torch.cat(features)
        return self.head.fuse(features) if self.fuses_aux else features

    @torch.inference_mode()
    def catch_up(self, ctx, requests) -> int:
        """Runs the head over the pending pairs of `requests` (those of their shared blocks first) in one forward,
        writing their K/V into the pool; keeps each one's newest output, which its first draft reads."""
        taken = self.take_pending(requests)
        if not taken:
            return 0
        chunks = [(tokens, start, request.block_ids) for request, tokens, start, _ in taken]
        ids, positions, meta, query_lens = ctx.runner.flatten(chunks)
        out = self._forward(ids, self.input_features([f for *_, features in taken for f in features]), positions, meta)
        last = 0
        for (request, *_), num in zip(taken, query_lens):
            last += num
            self.state(request).last_output = out[last - 1]
        return len(ids)

    def is_ready(self, request) -> bool:
        return self.state(request).last_output is not None

    def drafted(self, requests) -> None:
        for request in requests:
            self.state(request).last_output = None  # it is drafted from once

    @torch.inference_mode()
    def _draft(self, ctx, requests, budgets):
        newest = torch.stack([self.state(r).last_output for r in requests])  # [requests, hidden]
        outputs, slots, num_used = {}, {}, [0] * len(requests)  # (request, node) -> its output, its scratch slot

        def expand(depth, nodes, found):
            """Runs the head at the nodes of `depth` (grouped by request) and returns their children's scores."""
            features, paths = [], {}
            for r, c in nodes:
                parent = found[r].parents[c]
                features.append(newest[r] if parent < 0 else outputs[r, parent])
                slots[r, c] = self.scratch_start + r * self.num_scratch + num_used[r]
                num_used[r] += 1
                paths.setdefault(r, []).append([slots[r, n] for n in path_to(found[r].parents, c)])
            order = list(paths)  # requests in the order their nodes come
            meta = ctx.runner.metadata([0] * len(order), [requests[r].num_tokens - 1 for r in order],
                                       [requests[r].block_ids for r in order], [paths[r] for r in order])
            ids = torch.tensor([found[r].tokens[c] for r, c in nodes], device=self.device)
            # a node at depth d is the input at position (newest token's) + d - 1
            positions = torch.tensor([requests[r].num_tokens - 2 + depth for r, _ in nodes], device=self.device)
            out = self._forward(ids, torch.stack(features), positions, meta)
            for (r, c), row in zip(nodes, out):
                outputs[r, c] = row
            return self._top(out, depth + 1)

        max_depths = [budgets[r.request_id].depth for r in requests]
        found = grow(self._top(newest, 1), expand, self.topk, max_depths,
                     [self.confidence.log_threshold_for(budgets[r.request_id]) for r in requests],
                     [budgets[r.request_id] for r in requests])
        return {r.request_id: candidates.within(budgets[r.request_id]) for r, candidates in zip(requests, found)}

