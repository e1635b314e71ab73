"""The deferred catch-up of a pooled drafter that reads the target's rows of the tokens it kept (EAGLE, P-EAGLE,
DFlash): each step notes the kept tokens with their feature rows, and the drafter runs over a request's pending rows,
in one call with the others drafted, only when the request drafts next. A request that does not draft, as the
adaptive policy often chooses at larger batches, costs the drafter nothing.

When the prefix cache registers a block whose rows are pending, they move to the block (`unrun`, by block id, with
the block's hash): a request that shares the block and drafts runs the drafter over them first, in the same call (the
pool's entries of a block depend on the block's rows alone, and the pool takes every row's K/V before any row
attends). The blocks the drafter has not run over are always the last of any chain it shares, as whoever runs it
over a block runs it over every unrun block before.

The drafting is the same loop for all of them (`propose`): the catch-up, then the requests it leaves ready, drafted
in batches of at most max_num_seqs (the scratch slots past the target's blocks hold that many requests).
"""
from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from serving.drafters.base import Drafter


@dataclass
class Pending:
    start: int  # position of the first row
    tokens: list[int]  # x_{p+1} of each row p
    features: list[torch.Tensor]  # [rows, features] per step that kept some

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass
class DeferredState:
    """One request's slot, or the part of it this bookkeeping keeps: the kept rows the drafter has not run over yet."""
    pending: Pending | None = None


@dataclass
class Unrun:
    """A registered block's rows the drafter has not run over: its last ones (it may have run over the first)."""
    block_hash: int
    pairs: Pending


class DeferredDrafter(Drafter):
    """Notes the kept rows (`observe`), hands those of registered blocks to the blocks (`registered`), gives a
    drafting request's rows back (`take_pending`) and drafts (`propose`). A head drafter subclass names its slot type
    (`State`, a DeferredState), says which target rows it reads (`feature_rows`), runs over what `take_pending` gives
    in its `catch_up`, says which requests it can draft for after it (`is_ready`) and drafts a batch (`_draft`)."""

    State: type[DeferredState] = DeferredState

    @classmethod
    def build(cls, ctx, config, head=None, token_map=None):
        cls.check(config, ctx, head)
        return cls(ctx, head, token_map, config)

    def __init__(self, ctx):
        runner = ctx.runner
        self.block_size, self.device, self.max_requests = runner.block_size, runner.device, ctx.max_num_seqs
        self.unrun: dict[int, Unrun] = {}  # block id -> the rows moved there when the prefix cache registered it

    def state(self, request) -> DeferredState:
        """The request's slot, made on first use."""
        return request.spec.slots.setdefault(self, self.State())

    @abc.abstractmethod
    def feature_rows(self, step, rows: torch.Tensor) -> torch.Tensor:
        """The target's rows `rows` of `step` as the drafter notes them: [rows, features]."""

    def is_ready(self, request) -> bool:
        """After the catch-up: whether the drafter holds what drafting for the request reads."""
        return True

    @abc.abstractmethod
    def _draft(self, ctx, requests, budgets) -> dict:
        """Trees for at most max_requests ready requests (Drafter.propose's result)."""

    def propose(self, ctx, requests, budgets):
        self.catch_up(ctx, requests)
        requests = [r for r in requests if self.is_ready(r)]
        trees = {}
        for first in range(0, len(requests), self.max_requests):  # more only if max_num_seqs grew since
            trees.update(self._draft(ctx, requests[first:first + self.max_requests], budgets))
        self.drafted(requests)
        return trees

    def drafted(self, requests) -> None:
        """After drafting for `requests`: forget what is drafted from once."""

    @torch.inference_mode()
    def observe(self, ctx):
        """Notes every token the target computed and kept this step: the pair (h_p, x_{p+1}) at position p, with its
        feature row. The drafter runs over them when the request drafts next (`catch_up`). A finishing request's last
        rows are noted too while the prefix cache is on: the blocks it registers hold them."""
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
        features = self.feature_rows(step, torch.tensor(rows, device=self.device))  # [rows, features]
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
        """Moves the pending rows of the request's newly registered blocks to those blocks; a block's rows from an
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
        """Takes the rows of the request's registered blocks the drafter has not run over (the last of them)."""
        first = len(request.block_hashes)
        while first and (entry := self.unrun.get(request.block_ids[first - 1])) is not None \
                and entry.block_hash == request.block_hashes[first - 1]:
            first -= 1
        return [self.unrun.pop(request.block_ids[index]).pairs for index in range(first, len(request.block_hashes))]

    def take_pending(self, requests) -> list[tuple]:
        """Takes the rows the drafter has not run over for `requests` (those of their shared blocks first): for each
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
            assert all(a.end == b.start for a, b in zip(parts, parts[1:])), "pending rows follow each other"
            taken.append((request, [token for part in parts for token in part.tokens], parts[0].start,
                          [f for part in parts for f in part.features]))
        return taken
