"""The scheduler: which requests run this step, and how many of their tokens.

Prefill and decode are one thing: a request wants every token it has that is not computed yet
(the rest of its prompt, the last emitted token, and any drafts behind it), and each step grants
wanted tokens under a token budget, running requests first, in order. A prompt longer than the
budget left is computed in chunks over several steps. When the pool runs out of blocks, the last
running request is preempted by recompute: it gives back its blocks and drafts and waits at the
front of the queue to start over from its prefix cache hits. Waiting requests are admitted in
arrival order while budget, sequence slots and blocks last, and never in a step that preempted.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from serving.blocks import BlockManager
from serving.request import Request, RequestStatus
from serving.spec_decode.tree import DraftTree


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # running first, then admitted
    preempted: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_model_len: int, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 512):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs} and max_num_batched_tokens={max_num_batched_tokens} must be >= 1")
        num_pool_tokens = block_manager.num_blocks * block_manager.block_size
        if max_model_len > num_pool_tokens:
            # A request longer than the pool could never run, even alone.
            raise ValueError(f"max_model_len={max_model_len} exceeds the K/V pool ({num_pool_tokens} tokens)")
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_prefix_query_tokens = 0  # prompt tokens looked up in the prefix cache at admission
        self.num_prefix_hit_tokens = 0

    def add(self, request: Request) -> None:
        assert request.num_tokens <= self.max_model_len, f"request {request.request_id} exceeds max_model_len"
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        num_budget_tokens = self.max_num_batched_tokens
        index = 0
        while index < len(self.running) and num_budget_tokens > 0:
            request = self.running[index]
            num_new = min(self._num_wanted(request), num_budget_tokens)
            if request.spec.tree and num_new < self._num_wanted(request):
                request.spec.tree = DraftTree()  # a tree is verified whole or not at all
                num_new = min(self._num_wanted(request), num_budget_tokens)
            while not self.block_manager.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                output.preempted.append(victim)
                if victim is request:
                    break
            else:
                output.scheduled.append((request, num_new))
                num_budget_tokens -= num_new
                index += 1

        while (self.waiting and num_budget_tokens > 0 and len(self.running) < self.max_num_seqs
               and not output.preempted):
            request = self.waiting[0]
            assert request.num_computed_tokens == 0 and not request.spec.tree
            # a request asking for its prompt's logprobs computes every prompt row, so it takes no cached blocks
            request.num_computed_tokens = request.num_cached_tokens = 0 if request.params.prompt_logprobs is not None \
                else self.block_manager.get_computed_tokens(request)
            num_new = min(self._num_wanted(request), num_budget_tokens)
            if not self.block_manager.allocate_slots(request, num_new):
                self.block_manager.free(request)
                request.num_computed_tokens = request.num_cached_tokens = 0
                break
            self.waiting.popleft()
            self.num_prefix_query_tokens += request.num_tokens
            self.num_prefix_hit_tokens += request.num_cached_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            output.scheduled.append((request, num_new))
            num_budget_tokens -= num_new
        return output

    def draft_room(self, requests: list[Request], max_drafts: int | Mapping[str, int]) -> dict[str, int]:
        """The room of each of `requests` (running, in running order): how many draft rows it can carry next step, at
        most `max_drafts` (one number, or one per request id), in one pass:
        those that fit in the token budget and the free blocks left once every running request, with the drafts it
        already holds, is served, each request's grant counted against the next one's. Speculation never preempts
        or delays another request."""
        num_spare_tokens = self.max_num_batched_tokens
        groups = self.block_manager.groups  # each KV cache group's blocks are counted on their own
        num_spare_blocks = [group.num_free_blocks for group in groups]
        asked = {request.request_id for request in requests}  # their trees, if any, are replaced: not counted
        cut = set()  # requests whose chunk does not reach the end: they verify nothing
        for other in self.running:
            num_wanted = other.num_tokens - other.num_computed_tokens if other.request_id in asked else self._num_wanted(other)
            num_new = min(num_wanted, num_spare_tokens)
            if num_new < num_wanted:
                cut.add(other.request_id)
            num_spare_tokens -= num_new
            for g, group in enumerate(groups):
                num_spare_blocks[g] -= group.num_new_blocks(other, num_new)
        room = {}
        for request in requests:
            assert request.status is RequestStatus.RUNNING, f"request {request.request_id} is not running"
            if request.request_id in cut:
                room[request.request_id] = 0
                continue
            num_base = request.num_tokens - request.num_computed_tokens
            most = max_drafts if isinstance(max_drafts, int) else max_drafts[request.request_id]
            num = max(0, min(most, num_spare_tokens, self.max_model_len - request.num_tokens))
            for g, group in enumerate(groups):  # a group's table counts every position's block, freed ones too
                num_blocks = (len(request.block_tables[g]) + group.num_new_blocks(request, num_base)
                              + max(0, num_spare_blocks[g]))
                num = max(0, min(num, num_blocks * group.block_size - request.num_tokens))
            room[request.request_id] = num
            num_spare_tokens -= num
            for g, group in enumerate(groups):
                num_spare_blocks[g] -= group.num_new_blocks(request, num_base + num) - group.num_new_blocks(request, num_base)
        return room

    def finish(self, request: Request, reason: str) -> None:
        (self.running if request.status is RequestStatus.RUNNING else self.waiting).remove(request)
        self.block_manager.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def _num_wanted(self, request: Request) -> int:
        assert request.num_tokens_with_spec <= self.max_model_len, f"request {request.request_id} exceeds max_model_len"
        return request.num_tokens_with_spec - request.num_computed_tokens

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.spec.tree = DraftTree()
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.waiting.appendleft(request)
