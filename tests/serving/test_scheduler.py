"""Scheduler: token budget, chunked prefill, preemption by recompute, admission, draft budgets that fit,
and a randomized run of a fake engine that must end with every block free."""
import random

import pytest

from serving.blocks import BlockManager, slot
from serving.request import Request, RequestStatus, SamplingParams
from serving.scheduler import Scheduler


def make_request(request_id, token_ids, max_tokens=128):
    return Request(request_id, token_ids, SamplingParams(max_tokens=max_tokens))


def run_step(scheduler, next_token=0):
    """One engine step without speculation: every request whose scheduled tokens reach its end emits one token."""
    output = scheduler.schedule()
    for request, num_tokens in output.scheduled:
        request.num_computed_tokens += num_tokens
        if request.num_computed_tokens == request.num_tokens:
            request.token_ids.append(next_token)
        scheduler.block_manager.cache_blocks(request, request.num_computed_tokens)
        if request.num_output_tokens >= request.params.max_tokens:
            scheduler.finish(request, "length")
    return output


def test_chunked_prefill_splits_a_long_prompt_under_a_small_budget():
    scheduler = Scheduler(BlockManager(num_blocks=16, block_size=4), max_model_len=64, max_num_batched_tokens=8)
    request = make_request("long", list(range(20)), max_tokens=2)
    scheduler.add(request)
    chunks = []
    while scheduler.has_unfinished():
        output = run_step(scheduler)
        chunks.append([num_tokens for _, num_tokens in output.scheduled])
    assert chunks == [[8], [8], [4], [1]]
    assert request.output_token_ids == [0, 0] and request.finish_reason == "length"
    assert scheduler.block_manager.num_free_blocks == 16


def test_budget_goes_to_running_requests_in_order():
    scheduler = Scheduler(BlockManager(num_blocks=32, block_size=4), max_model_len=64, max_num_batched_tokens=10)
    first, second, third = (make_request(name, list(range(8))) for name in ("first", "second", "third"))
    for request in (first, second, third):
        scheduler.add(request)
    output = scheduler.schedule()
    assert [(r.request_id, n) for r, n in output.scheduled] == [("first", 8), ("second", 2)]
    assert sum(n for _, n in output.scheduled) == 10
    assert list(scheduler.waiting) == [third]

    first.num_computed_tokens, second.num_computed_tokens = 8, 2
    first.token_ids.append(0)
    first.spec_token_ids = [5] * 9  # wants 10: the whole budget, so second gets nothing and stays running
    output = scheduler.schedule()
    assert [(r.request_id, n) for r, n in output.scheduled] == [("first", 10)]
    assert scheduler.running == [first, second] and second.status is RequestStatus.RUNNING


def test_admission_respects_max_num_seqs():
    scheduler = Scheduler(BlockManager(num_blocks=32, block_size=4), max_model_len=64, max_num_seqs=2)
    requests = [make_request(str(i), [i, i + 1]) for i in range(3)]
    for request in requests:
        scheduler.add(request)
    output = scheduler.schedule()
    assert [r for r, _ in output.scheduled] == requests[:2]
    assert list(scheduler.waiting) == requests[2:] and requests[2].status is RequestStatus.WAITING


def test_admission_uses_prefix_hits():
    scheduler = Scheduler(BlockManager(num_blocks=32, block_size=4), max_model_len=64)
    system_prompt = list(range(100, 110))
    first = make_request("first", system_prompt + [1], max_tokens=1)
    scheduler.add(first)
    run_step(scheduler)
    assert first.is_finished

    second = make_request("second", system_prompt + [2, 3])
    scheduler.add(second)
    output = scheduler.schedule()
    assert output.scheduled == [(second, 4)]
    assert second.num_computed_tokens == second.num_cached_tokens == 8
    assert (scheduler.num_prefix_query_tokens, scheduler.num_prefix_hit_tokens) == (23, 8)


def test_preempted_request_waits_at_the_front_and_restarts_from_zero():
    manager = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    scheduler = Scheduler(manager, max_model_len=8, max_num_seqs=2)
    first, second = make_request("first", [1, 2, 3], max_tokens=4), make_request("second", [4, 5, 6], max_tokens=4)
    third = make_request("third", [7])
    for request in (first, second, third):
        scheduler.add(request)
    run_step(scheduler)
    assert scheduler.running == [first, second] and manager.num_free_blocks == 0
    run_step(scheduler)  # first's fourth token fits its second block

    output = run_step(scheduler)  # first's fifth token needs a third block: second gives its two back
    assert output.preempted == [second]
    assert [r for r, _ in output.scheduled] == [first]
    assert list(scheduler.waiting) == [second, third]
    assert second.status is RequestStatus.WAITING and second.num_preemptions == 1
    assert second.num_computed_tokens == 0 and second.block_ids == []
    assert second.token_ids == [4, 5, 6, 0, 0]

    while not first.is_finished:
        run_step(scheduler)
    output = scheduler.schedule()
    assert output.scheduled[0] == (second, 5)  # its prompt and its outputs are computed again


def test_a_request_that_cannot_grow_alone_preempts_itself_and_nothing_is_admitted():
    manager = BlockManager(num_blocks=4, block_size=2)
    scheduler = Scheduler(manager, max_model_len=8)
    first = make_request("first", [1, 2, 3])
    scheduler.add(first)
    run_step(scheduler)
    assert manager.allocate_slots(make_request("other", [9]), 4)  # the two blocks first leaves free
    scheduler.add(make_request("late", [5]))
    first.spec_token_ids = [0, 0]  # positions 3..5 need a third block
    output = scheduler.schedule()
    assert output.preempted == [first] and output.scheduled == []
    assert first.spec_token_ids == [] and scheduler.waiting[0] is first
    assert len(scheduler.waiting) == 2


def test_admission_that_cannot_allocate_is_undone():
    manager = BlockManager(num_blocks=4, block_size=2)
    scheduler = Scheduler(manager, max_model_len=8)
    first = make_request("first", [1, 2, 3, 4, 5], max_tokens=1)
    scheduler.add(first)
    run_step(scheduler)
    hog = make_request("hog", [0])
    assert manager.allocate_slots(hog, 4)  # two blocks held outside the scheduler
    follower = make_request("follower", [1, 2, 3, 4, 6, 7, 8])
    scheduler.add(follower)
    output = scheduler.schedule()
    assert output.scheduled == [] and list(scheduler.waiting) == [follower]
    assert follower.block_ids == [] and follower.num_computed_tokens == follower.num_cached_tokens == 0
    assert manager.num_free_blocks == 2 and manager.num_cached_blocks == 2


def budget_of(scheduler, request, max_drafts):
    """draft_room for one request alone."""
    budgets = scheduler.draft_room([request], max_drafts)
    assert list(budgets) == [request.request_id]
    return budgets[request.request_id]


def test_draft_room_leave_room_for_every_running_request():
    manager = BlockManager(num_blocks=6, block_size=4)
    scheduler = Scheduler(manager, max_model_len=24, max_num_batched_tokens=8)
    first, second = make_request("first", [1, 2, 3]), make_request("second", [4, 5, 6])
    scheduler.add(first)
    scheduler.add(second)
    run_step(scheduler)  # each holds one block with 4 tokens, 3 computed; 4 blocks free
    assert manager.num_free_blocks == 4

    assert budget_of(scheduler, first, 3) == 3
    assert budget_of(scheduler, first, 10) == 6  # budget 8 minus second's token and first's own
    # in one call the grants share the budget in running order: first takes the 6 spare tokens, second gets none
    assert scheduler.draft_room([first, second], 10) == {"first": 6, "second": 0}
    assert scheduler.draft_room([first, second], 3) == {"first": 3, "second": 3}
    first.spec_token_ids = [0] * 6
    assert budget_of(scheduler, second, 5) == 0  # the budget is spent
    first.spec_token_ids = [0] * 2
    assert budget_of(scheduler, second, 5) == 4

    tight = Scheduler(manager, max_model_len=24, max_num_batched_tokens=64)
    tight.running = [first, second]
    first.spec_token_ids = []
    hog = make_request("hog", [0])
    assert manager.allocate_slots(hog, 12)  # three of the four free blocks
    assert budget_of(tight, first, 10) == 4  # first's block is full: one block left, four slots
    assert budget_of(tight, second, 10) == 4  # alone, second could take that block too
    # together, first's grant takes the last block: second's block is full, so it gets nothing
    assert tight.draft_room([first, second], 10) == {"first": 4, "second": 0}
    assert tight.draft_room([first, second], 2) == {"first": 2, "second": 0}  # a part of the block is the block
    first.spec_token_ids = [0] * 4
    assert budget_of(tight, second, 10) == 0
    assert budget_of(tight, first, 10) == 4  # a tree first already holds is replaced by the new one: not counted

    output = tight.schedule()
    assert output.preempted == [] and output.scheduled == [(first, 5), (second, 1)]


def test_draft_room_respect_max_model_len_and_prefill_chunks():
    manager = BlockManager(num_blocks=16, block_size=4)
    scheduler = Scheduler(manager, max_model_len=10, max_num_batched_tokens=4)
    request = make_request("a", list(range(8)))
    scheduler.add(request)
    scheduler.schedule()
    request.num_computed_tokens = 2
    assert budget_of(scheduler, request, 3) == 0  # six prompt tokens to go: this step is a chunk
    request.num_computed_tokens = 7
    assert budget_of(scheduler, request, 5) == 2


def test_finish_releases_blocks_from_either_queue():
    manager = BlockManager(num_blocks=4, block_size=2)
    scheduler = Scheduler(manager, max_model_len=8, max_num_seqs=1)
    running, waiting = make_request("running", [1, 2, 3]), make_request("waiting", [4])
    scheduler.add(running)
    scheduler.add(waiting)
    scheduler.schedule()
    scheduler.finish(waiting, "abort")
    scheduler.finish(running, "stop")
    assert not scheduler.has_unfinished()
    assert (running.status, running.finish_reason) == (RequestStatus.FINISHED, "stop")
    assert waiting.finish_reason == "abort" and manager.num_free_blocks == 4


def test_max_model_len_must_fit_the_pool():
    with pytest.raises(ValueError, match="max_model_len"):
        Scheduler(BlockManager(num_blocks=2, block_size=4), max_model_len=9)


def check_blocks(scheduler):
    manager = scheduler.block_manager
    holders = [0] * manager.num_blocks
    for request in scheduler.running:
        for block_id in request.block_ids:
            holders[block_id] += 1
    assert all(not request.block_ids for request in scheduler.waiting)
    assert manager.ref_counts == holders
    assert set(manager.free_queue) == {b for b in range(manager.num_blocks) if holders[b] == 0}
    assert {b: h for h, b in manager.cached_blocks.items()} == manager.cached_hashes


def base_plan_fits(scheduler):
    """Would the running requests, without their drafts, get their tokens and blocks this step?"""
    num_spare_tokens = scheduler.max_num_batched_tokens
    num_spare_blocks = scheduler.block_manager.num_free_blocks
    for request in scheduler.running:
        num_new = min(request.num_tokens - request.num_computed_tokens, num_spare_tokens)
        num_spare_tokens -= num_new
        num_spare_blocks -= scheduler.block_manager.num_new_blocks(request, num_new)
    return num_spare_blocks >= 0


@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("speculate", [False, True])
def test_random_engine_run_ends_with_every_block_free(block_size, speculate):
    rng = random.Random(block_size * 2 + speculate)
    max_model_len = 48
    num_min_blocks = -(-max_model_len // block_size)
    manager = BlockManager(num_blocks=rng.randint(num_min_blocks, 2 * num_min_blocks), block_size=block_size)
    scheduler = Scheduler(manager, max_model_len=max_model_len, max_num_seqs=rng.randint(2, 8),
                          max_num_batched_tokens=rng.randint(4, 32))
    system_prompts = [[], [7] * 5, [rng.randrange(4) for _ in range(20)]]
    pending = []
    for i in range(40):
        prompt = rng.choice(system_prompts) + [rng.randrange(4) for _ in range(rng.randint(1, 15))]
        pending.append(make_request(str(i), prompt, max_tokens=rng.randint(1, max_model_len - len(prompt))))
    kv = {}  # slot -> the token whose K/V it holds
    num_preemptions = 0

    for _ in range(5000):
        if not (pending or scheduler.has_unfinished()):
            break
        for _ in range(rng.choice([0, 0, 1, 3])):
            if pending:
                scheduler.add(pending.pop(0))
        must_not_preempt = base_plan_fits(scheduler)
        output = scheduler.schedule()
        if must_not_preempt:
            assert output.preempted == [], "a preemption the requests' own tokens did not need"
        num_preemptions += len(output.preempted)
        check_blocks(scheduler)
        assert sum(n for _, n in output.scheduled) <= scheduler.max_num_batched_tokens
        assert len(scheduler.running) <= scheduler.max_num_seqs

        for request, num_tokens in output.scheduled:
            start = request.num_computed_tokens
            assert all(kv[slot(request.block_ids, p, manager.block_size)] == request.token_ids[p] for p in range(start))
            tokens = request.token_ids + request.spec_token_ids
            for position in range(start, start + num_tokens):
                kv[slot(request.block_ids, position, manager.block_size)] = tokens[position]
            request.num_computed_tokens += num_tokens
            if request.num_computed_tokens < request.num_tokens_with_spec:
                continue
            drafts, request.spec_token_ids = request.spec_token_ids, []
            num_accepted = rng.randint(0, len(drafts))
            request.num_computed_tokens = request.num_tokens + num_accepted
            manager.trim(request, request.num_computed_tokens)
            request.token_ids += drafts[:num_accepted] + [rng.randrange(4)]
            manager.cache_blocks(request, request.num_computed_tokens)
            if request.num_output_tokens >= request.params.max_tokens or request.num_tokens >= max_model_len:
                scheduler.finish(request, "length")

        if speculate:
            ready = [r for r in scheduler.running if r.num_computed_tokens == r.num_tokens - 1]
            budgets = scheduler.draft_room(ready, rng.randint(0, 4)) if ready else {}
            for request in ready:
                num_drafts = rng.randint(0, budgets[request.request_id])
                request.spec_token_ids = [rng.randrange(4) for _ in range(num_drafts)]
    else:
        pytest.fail("the engine did not finish")

    assert manager.num_free_blocks == manager.num_blocks
    assert all(count == 0 for count in manager.ref_counts)
    assert num_preemptions > 0 and scheduler.num_prefix_hit_tokens > 0
