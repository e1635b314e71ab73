"""EAGLE-1, EAGLE-3 and MTP with serve_mode 'reuse_first' (module 0 drafts every token) as drafters: a decoder layer
of their own over a K/V pool addressed by the target's block tables, drafting EAGLE-2's dynamic tree
(drafters/tree_search.py; topk 1 is a chain).

The head catches up over the tokens the target computed and kept (the pair (h_p, x_{p+1}) at position p, reading the
target's hidden rows of the verify pass, the accepted path's among them), which rewrites its pool from the kept
tokens, so rollback needs nothing. It does so lazily: each step notes the kept pairs with their feature rows, and the
head runs over a request's pending pairs, in one forward with the others drafted, only when the request drafts next.
A request that does not draft, as the adaptive policy often chooses at larger batches, costs the head nothing.
When the prefix cache registers a block whose pairs are pending, they move to the block (`unrun`, by block id,
with the block's hash): a request that shares the block and drafts runs the head over them first, in the same
forward (the head is one layer, whose K/V depend on its inputs alone, and the pool takes every row's K/V before any
row attends). The blocks the head has not run over are always the last of any chain it shares, as whoever runs it
over a block runs it over every unrun block before.

Its newest output gives the first depth of the tree; each further depth runs the head once over the nodes being
expanded, every node at its position and attending to the context and its own path, whose K/V sit in a scratch
region of the pool past the target's blocks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from heads.eagle3 import Eagle3
from serving.attention import KVCache, PagedAttention
from serving.drafters.base import PooledDrafter
from serving.drafters.head import Confidence, top_log_probs
from serving.drafters.tree_search import grow
from serving.spec_decode.tree import path_to


@dataclass
class Pending:
    start: int  # position of the first pair
    tokens: list[int]  # x_{p+1} of each pair
    features: list[torch.Tensor]  # [pairs, features] per step that kept some

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass
class HeadState:
    """One request's slot: the kept pairs the head has not run over yet, and its output at the newest pair (what the
    first depth of the next tree reads), until drafted from."""
    pending: Pending | None = None
    last_output: torch.Tensor | None = None  # [hidden]


@dataclass
class Unrun:
    """A registered block's pairs the head has not run over: its last ones (the head may have run over the first)."""
    block_hash: int
    pairs: Pending


class EagleDrafter(PooledDrafter):
    needs_hidden = True
    is_calibrated = True
    num_lookahead = 1  # its K/V at position p depends on token p + 1

    def __init__(self, ctx, head, token_map, config):
        self.head, self.kind, self.token_map = head, head.config.kind, token_map
        self.confidence, self.topk = Confidence(head, config.confidence_threshold), config.topk
        self.fuses_aux = isinstance(head, Eagle3)  # EAGLE-3's body (P-EAGLE's too): reads the aux layers through fc
        self.aux_layers = tuple(head.config.aux_layers) if self.fuses_aux else ()
        layer = head.config.layer_config()
        runner = ctx.runner
        self.block_size, self.device = runner.block_size, runner.device
        # scratch: one run of slots for each of up to max_num_seqs requests drafted at once
        self.num_scratch = self.scratch_rows(config)
        self.scratch_start = runner.cache.num_blocks * runner.block_size
        self.max_requests = ctx.max_num_seqs
        num_scratch_blocks = -(-self.max_requests * self.num_scratch // runner.block_size)
        self.cache = KVCache(1, runner.cache.num_blocks + num_scratch_blocks, runner.block_size, layer.num_kv_heads,
                             layer.head_dim, runner.dtype, runner.device)
        self.unrun: dict[int, Unrun] = {}  # block id -> the pairs moved there when the prefix cache registered it

    def scratch_rows(self, config) -> int:
        """Scratch slots per request drafted: one per node expanded."""
        return config.topk * max(config.num_speculative_tokens - 1, 0)

    def state(self, request) -> HeadState:
        """The request's slot, made on first use."""
        return request.spec.slots.setdefault(self, HeadState())

    def _features(self, step, rows: torch.Tensor) -> torch.Tensor:
        """The target's rows the head reads, as noted: EAGLE-3's aux layers side by side, fused only at catch-up (one
        call over every pending row instead of one per step)."""
        if self.fuses_aux:
            return torch.cat([step.out.aux[layer][rows] for layer in self.aux_layers], dim=-1)
        return step.out.hidden[rows]

    def _forward(self, ids, features, positions, meta):
        attention = PagedAttention(self.cache, meta)
        if self.kind == "mtp":
            return self.head.forward_module(0, ids, features, positions, attention)
        return self.head(ids, features, positions, attention)

    def _top(self, out: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probabilities, target ids) of the topk most likely drafts after each row of head outputs."""
        logits = self.head.logits(0, out) if self.kind == "mtp" else self.head.logits(out)
        log_probs, best = top_log_probs(logits, self.topk, self.confidence.temperature(depth))
        if self.fuses_aux:
            return log_probs, self.head.to_target_ids(best)
        return log_probs, best if self.token_map is None else self.token_map[best]

    @torch.inference_mode()
    def observe(self, ctx):
        """Notes every token the target computed and kept this step: the pair (h_p, x_{p+1}) at position p, with its
        feature row. The head runs over them when the request drafts next (`catch_up`). A finishing request's last
        pairs are noted too while the prefix cache is on: the blocks it registers hold them."""
        step, rows, owners = ctx.step, [], []
        keep_finishing = ctx.enable_prefix_caching
        for request in step.batch.requests:
            if request.finish_reason and not keep_finishing:
                continue
            kept, start = step.kept_rows(request)
            if kept:
                rows.extend(kept)
                owners.append((request, start, len(kept)))
        if not rows:
            return
        features = self._features(step, torch.tensor(rows, device=self.device))  # [rows, features]
        first = 0
        for request, start, num in owners:
            state = self.state(request)
            if state.pending is None:
                state.pending = Pending(start, [], [])
            chunk = state.pending
            assert chunk.end == start, "kept tokens follow the pending ones"
            chunk.tokens += request.token_ids[start + 1:start + 1 + num]
            chunk.features.append(features[first:first + num])
            first += num

    def registered(self, request, first_block):
        """Moves the pending pairs of the request's newly registered blocks to those blocks; a block's pairs from an
        earlier registration are dropped (its K/V were rewritten since)."""
        num_blocks = len(request.block_hashes)
        for index in range(first_block, num_blocks):
            self.unrun.pop(request.block_ids[index], None)
        state = self.state(request)
        chunk, end = state.pending, num_blocks * self.block_size
        if chunk is None or chunk.start >= end:
            return
        features = torch.cat(chunk.features)
        position = chunk.start
        while position < end:
            index, upto = position // self.block_size, min(end, (position // self.block_size + 1) * self.block_size)
            offset = slice(position - chunk.start, upto - chunk.start)
            self.unrun[request.block_ids[index]] = Unrun(request.block_hashes[index],
                                                         Pending(position, chunk.tokens[offset], [features[offset]]))
            position = upto
        if chunk.end > end:
            state.pending = Pending(end, chunk.tokens[end - chunk.start:], [features[end - chunk.start:]])
        else:
            state.pending = None

    def _unrun_pairs(self, request) -> list[Pending]:
        """Takes the pairs of the request's registered blocks the head has not run over (the last of them)."""
        first = len(request.block_hashes)
        while first and (entry := self.unrun.get(request.block_ids[first - 1])) is not None \
                and entry.block_hash == request.block_hashes[first - 1]:
            first -= 1
        return [self.unrun.pop(request.block_ids[index]).pairs for index in range(first, len(request.block_hashes))]

    def take_pending(self, requests) -> list[tuple]:
        """Takes the pairs the head has not run over for `requests` (those of their shared blocks first): for each
        request that has some, (request, their tokens x_{p+1}, the position of the first, their feature rows as
        noted)."""
        taken = []
        for request in requests:
            parts = self._unrun_pairs(request)
            state = self.state(request)
            own, state.pending = state.pending, None
            parts += [own] if own else []
            if not parts:
                continue
            assert all(a.end == b.start for a, b in zip(parts, parts[1:])), "pending pairs follow each other"
            taken.append((request, [token for part in parts for token in part.tokens], parts[0].start,
                          [f for part in parts for f in part.features]))
        return taken

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

    def propose(self, ctx, requests, budgets):
        self.catch_up(ctx, requests)
        requests = [r for r in requests if self.state(r).last_output is not None]
        trees = {}
        for first in range(0, len(requests), self.max_requests):  # more only if max_num_seqs grew since
            trees.update(self._draft(ctx, requests[first:first + self.max_requests], budgets))
        for request in requests:
            self.state(request).last_output = None  # it is drafted from once
        return trees

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
                     [self.confidence.log_threshold_for(budgets[r.request_id]) for r in requests])
        return {r.request_id: candidates.best(budgets[r.request_id].num_nodes) for r, candidates in zip(requests, found)}

