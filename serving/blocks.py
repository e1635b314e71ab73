"""The block manager: the K/V pool as fixed-size blocks, handed to requests and shared by prefix.

A request's K/V for position p lives in slot `slot(block_ids, p, block_size)`.
Free blocks wait in an LRU queue: the block freed longest ago is reused first. A full block whose
tokens are final is registered under a chained hash, hash((parent hash, its token ids)), so a later
request with the same prefix takes the block instead of recomputing it. A registered block whose
last user leaves stays registered while it sits in the free queue, and loses its registration only
when it is handed out again. Only `request.token_ids` are ever hashed: drafts never enter the cache.

With `num_lookahead` > 0 a block's hash also covers the tokens after it, and a block is shared only when
they match: a drafter whose K/V at position p depends on token p + 1 (EAGLE, MTP) sets it to 1.
"""
from __future__ import annotations

from collections import OrderedDict

from serving.request import Request


def slot(block_ids: list[int], position: int, block_size: int) -> int:
    """The pool slot that holds position `position` of the sequence with this block table."""
    return block_ids[position // block_size] * block_size + position % block_size


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockManager needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_blocks: dict[int, int] = {}  # block hash -> block id
        self.cached_hashes: dict[int, int] = {}  # block id -> block hash, for registered blocks
        self.num_lookahead = 0  # tokens after a block that its hash covers too

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, including registered ones that are only kept for reuse."""
        return len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached_blocks)

    def num_new_blocks(self, request: Request, num_new_tokens: int) -> int:
        """Blocks `request` still lacks to hold its computed tokens plus `num_new_tokens` more."""
        num_needed = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, num_needed - len(request.block_ids))

    def get_computed_tokens(self, request: Request) -> int:
        """At admission: take the longest chain of cached full blocks that starts `request.token_ids`
        and return how many tokens it covers. The last token is always left to compute, because
        its logits are what the step needs."""
        assert not request.block_ids, f"request {request.request_id} already holds blocks"
        if not self.enable_prefix_caching:
            return 0
        parent_hash = None
        for start in range(0, request.num_tokens - self.block_size - max(self.num_lookahead, 1) + 1, self.block_size):
            block_hash = self._hash(parent_hash, request.token_ids, start)
            block_id = self.cached_blocks.get(block_hash)
            if block_id is None:
                break
            if self.ref_counts[block_id] == 0:
                del self.free_queue[block_id]
            self.ref_counts[block_id] += 1
            request.block_ids.append(block_id)
            request.block_hashes.append(block_hash)
            parent_hash = block_hash
        return len(request.block_ids) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Give `request` slots for `num_new_tokens` tokens after its computed ones. On failure
        nothing changes and it returns False."""
        num_new_blocks = self.num_new_blocks(request, num_new_tokens)
        if num_new_blocks > self.num_free_blocks:
            return False
        for _ in range(num_new_blocks):
            block_id, _ = self.free_queue.popitem(last=False)
            block_hash = self.cached_hashes.pop(block_id, None)
            if block_hash is not None:
                del self.cached_blocks[block_hash]
            self.ref_counts[block_id] = 1
            request.block_ids.append(block_id)
        return True

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register every full block within the first `num_tokens` tokens of `request.token_ids`
        not registered yet. `num_tokens` must count only tokens whose K/V are computed and final
        (after any rollback). A block whose hash another block already holds stays unregistered."""
        if not self.enable_prefix_caching:
            return
        num_full_blocks = min(num_tokens, request.num_tokens - self.num_lookahead) // self.block_size
        assert num_full_blocks <= len(request.block_ids), f"request {request.request_id} caches past its blocks"
        for index in range(len(request.block_hashes), num_full_blocks):
            parent_hash = request.block_hashes[-1] if request.block_hashes else None
            start = index * self.block_size
            block_hash = self._hash(parent_hash, request.token_ids, start)
            request.block_hashes.append(block_hash)
            if block_hash not in self.cached_blocks:
                block_id = request.block_ids[index]
                self.cached_blocks[block_hash] = block_id
                self.cached_hashes[block_id] = block_hash

    def _hash(self, parent_hash, token_ids: list[int], start: int) -> int:
        return hash((parent_hash, tuple(token_ids[start:start + self.block_size + self.num_lookahead])))

    def trim(self, request: Request, num_tokens: int) -> None:
        """Keep only the blocks holding the first `num_tokens` positions of `request` (rolls back
        rejected drafts). A kept block cut in the middle will be rewritten, so it loses its hash."""
        num_kept = -(-num_tokens // self.block_size)
        num_full_blocks = num_tokens // self.block_size
        for index in range(num_full_blocks, min(num_kept, len(request.block_hashes))):
            block_id = request.block_ids[index]
            if self.cached_hashes.get(block_id) == request.block_hashes[index]:
                del self.cached_blocks[self.cached_hashes.pop(block_id)]
        del request.block_hashes[num_full_blocks:]
        self._release(request.block_ids[num_kept:])
        del request.block_ids[num_kept:]

    def free(self, request: Request) -> None:
        """Release every block of `request`; registered ones stay reusable until evicted."""
        self._release(request.block_ids)
        request.block_ids = []
        request.block_hashes = []

    def reset_prefix_cache(self) -> None:
        """Forget every registered prefix; blocks in use keep their contents."""
        self.cached_blocks.clear()
        self.cached_hashes.clear()

    def _release(self, block_ids: list[int]) -> None:
        # The tail of a sequence goes back first, so it is evicted before the prefix other requests may share.
        for block_id in reversed(block_ids):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_queue[block_id] = None
