"""BlockManager: slots, prefix hits by chained block hashes, drafts kept out of the cache, trim, LRU eviction."""
from serving.blocks import BlockManager, slot
from serving.request import Request, SamplingParams

SYSTEM_PROMPT = [101, 102, 103, 104, 105, 106, 107, 108, 109, 110]


def make_request(request_id, token_ids):
    return Request(request_id, token_ids, SamplingParams())


def compute(manager, request):
    """What an engine does for a whole prompt: take cached blocks, allocate the rest, compute, register."""
    request.num_computed_tokens = manager.get_computed_tokens(request)
    assert manager.allocate_slots(request, request.num_tokens - request.num_computed_tokens)
    request.num_computed_tokens = request.num_tokens
    manager.cache_blocks(request, request.num_computed_tokens)


def test_slot_addresses_blocks():
    manager = BlockManager(num_blocks=8, block_size=4)
    request = make_request("a", list(range(6)))
    assert manager.allocate_slots(request, 6)
    assert request.block_ids == [0, 1]
    assert [slot(request.block_ids, p, manager.block_size) for p in (0, 3, 4, 5)] == [0, 3, 4, 5]
    assert manager.num_free_blocks == 6


def test_shared_system_prompt_is_computed_once():
    manager = BlockManager(num_blocks=16, block_size=4)
    first = make_request("first", SYSTEM_PROMPT + [1, 2, 3])
    compute(manager, first)
    assert manager.num_cached_blocks == 3  # 13 tokens: three full blocks

    second = make_request("second", SYSTEM_PROMPT + [7, 8, 9, 10, 11])
    num_cached = manager.get_computed_tokens(second)
    assert num_cached == 8  # the third block mixes the system prompt with first's own tokens
    assert second.block_ids == first.block_ids[:2]
    assert second.block_hashes == first.block_hashes[:2]
    assert [manager.ref_counts[b] for b in first.block_ids] == [2, 2, 1, 1]
    second.num_computed_tokens = num_cached
    assert manager.allocate_slots(second, second.num_tokens - num_cached)
    assert len(second.block_ids) == 4
    assert second.block_ids[2] not in first.block_ids


def test_prefix_hit_never_covers_the_whole_prompt():
    manager = BlockManager(num_blocks=16, block_size=4)
    compute(manager, make_request("first", SYSTEM_PROMPT + [1, 2, 3]))

    same = make_request("same", SYSTEM_PROMPT + [1, 2, 3])
    assert manager.get_computed_tokens(same) == 12  # 13 tokens: the last one is computed again

    block_aligned = make_request("aligned", SYSTEM_PROMPT + [1, 2])
    assert manager.get_computed_tokens(block_aligned) == 8  # 12 tokens: the last full block is dropped

    one_block = make_request("one", SYSTEM_PROMPT[:4])
    assert manager.get_computed_tokens(one_block) == 0


def test_a_hit_on_a_free_block_takes_it_out_of_the_free_queue():
    manager = BlockManager(num_blocks=4, block_size=2)
    first = make_request("first", [1, 2, 3, 4, 5])
    compute(manager, first)
    manager.free(first)
    assert manager.num_free_blocks == 4 and manager.num_cached_blocks == 2

    second = make_request("second", [1, 2, 3, 4, 9])
    assert manager.get_computed_tokens(second) == 4
    assert manager.num_free_blocks == 2
    assert all(block_id not in manager.free_queue for block_id in second.block_ids)
    assert [manager.ref_counts[b] for b in second.block_ids] == [1, 1]


def test_drafts_are_never_hashed():
    manager = BlockManager(num_blocks=8, block_size=2)
    request = make_request("a", [1, 2, 3])
    request.num_computed_tokens = manager.get_computed_tokens(request)
    request.spec_token_ids = [4, 5, 6]
    assert manager.allocate_slots(request, request.num_tokens_with_spec)
    request.num_computed_tokens = request.num_tokens_with_spec
    manager.cache_blocks(request, request.num_computed_tokens)
    assert len(request.block_hashes) == 1 and manager.num_cached_blocks == 1  # only [1, 2]

    follower = make_request("b", [1, 2, 3, 4, 5, 6, 7])
    assert manager.get_computed_tokens(follower) == 2


def test_identical_blocks_keep_the_first_registration():
    manager = BlockManager(num_blocks=8, block_size=2)
    first, twin = make_request("first", [1, 2, 3]), make_request("twin", [1, 2, 3])
    for request in (first, twin):  # both admitted before either registers its blocks
        assert manager.get_computed_tokens(request) == 0
        assert manager.allocate_slots(request, 3)
    for request in (first, twin):
        request.num_computed_tokens = 3
        manager.cache_blocks(request, 3)
    assert manager.cached_blocks == {first.block_hashes[0]: first.block_ids[0]}
    assert twin.block_hashes == first.block_hashes
    manager.free(twin)
    manager.free(first)
    assert manager.num_free_blocks == 8 and manager.num_cached_blocks == 1


def test_trim_frees_only_blocks_past_the_kept_tokens():
    manager = BlockManager(num_blocks=8, block_size=2)
    request = make_request("a", [1, 2, 3, 4, 5])
    assert manager.allocate_slots(request, 4)
    request.num_computed_tokens = 4
    manager.cache_blocks(request, 4)
    request.spec_token_ids = [6, 7, 8, 9]
    assert manager.allocate_slots(request, 5)  # the last token and four drafts: positions 4..8
    assert len(request.block_ids) == 5
    kept = request.block_ids[:4]
    dropped = request.block_ids[4:]

    request.num_computed_tokens = 4 + 1 + 2  # two drafts accepted
    manager.trim(request, request.num_computed_tokens)
    assert request.block_ids == kept
    assert [manager.ref_counts[b] for b in dropped] == [0]
    assert manager.num_free_blocks == 4
    assert len(request.block_hashes) == 2

    manager.trim(request, 7)
    assert request.block_ids == kept


def test_trim_inside_a_registered_block_unregisters_it():
    manager = BlockManager(num_blocks=8, block_size=2)
    request = make_request("a", [1, 2, 3, 4, 5])
    compute(manager, request)
    assert manager.num_cached_blocks == 2
    manager.trim(request, 3)
    assert len(request.block_ids) == 2 and len(request.block_hashes) == 1
    assert manager.num_cached_blocks == 1
    assert manager.get_computed_tokens(make_request("b", [1, 2, 3, 4, 5])) == 2


def test_allocate_failure_changes_nothing():
    manager = BlockManager(num_blocks=3, block_size=2)
    request = make_request("a", [1, 2, 3, 4, 5, 6, 7])
    assert not manager.allocate_slots(request, 7)
    assert request.block_ids == [] and manager.num_free_blocks == 3
    assert list(manager.free_queue) == [0, 1, 2]
    assert manager.allocate_slots(request, 6) and manager.num_free_blocks == 0


def test_eviction_is_least_recently_freed_first_and_prefix_last():
    manager = BlockManager(num_blocks=6, block_size=2)
    older, newer = make_request("older", [1, 2, 3, 4, 5]), make_request("newer", [6, 7, 8, 9, 10])
    compute(manager, older)
    compute(manager, newer)
    manager.free(older)
    manager.free(newer)
    assert list(manager.free_queue) == [2, 1, 0, 5, 4, 3]  # each request's tail first, its prefix last

    taker = make_request("taker", [0] * 6)
    assert manager.allocate_slots(taker, 6)
    assert taker.block_ids == [2, 1, 0]
    assert manager.num_cached_blocks == 2  # older's registrations were dropped on reuse
    assert manager.get_computed_tokens(make_request("older again", [1, 2, 3, 4, 5])) == 0
    assert manager.get_computed_tokens(make_request("newer again", [6, 7, 8, 9, 10])) == 4


def test_free_releases_shared_blocks_only_when_the_last_user_leaves():
    manager = BlockManager(num_blocks=8, block_size=2)
    first = make_request("first", [1, 2, 3, 4, 5])
    compute(manager, first)
    second = make_request("second", [1, 2, 3, 4, 6])
    compute(manager, second)
    manager.free(first)
    assert first.block_ids == [] and first.block_hashes == []
    assert [manager.ref_counts[b] for b in second.block_ids] == [1, 1, 1]
    manager.free(second)
    assert manager.num_free_blocks == 8 and all(count == 0 for count in manager.ref_counts)


def test_prefix_caching_off_and_reset():
    manager = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    compute(manager, make_request("first", [1, 2, 3, 4, 5]))
    assert manager.num_cached_blocks == 0
    assert manager.get_computed_tokens(make_request("second", [1, 2, 3, 4, 5])) == 0

    manager = BlockManager(num_blocks=8, block_size=2)
    compute(manager, make_request("first", [1, 2, 3, 4, 5]))
    manager.reset_prefix_cache()
    assert manager.get_computed_tokens(make_request("second", [1, 2, 3, 4, 5])) == 0
