"""The block managers: the K/V pools as fixed-size blocks, handed to requests and shared by prefix.

A request's K/V for position p of a group's layers lives in slot `slot(request.block_tables[group], p, block_size)`.
Free blocks wait in an LRU queue: the block freed longest ago is reused first. A full block whose
tokens are final is registered under a chained hash, hash((parent hash, its token ids)), so a later
request with the same prefix takes the block instead of recomputing it. A registered block whose
last user leaves stays registered while it sits in the free queue, and loses its registration only
when it is handed out again. Only `request.token_ids` are ever hashed: drafts never enter the cache.

With `num_lookahead` > 0 a block's hash also covers the tokens after it, and a block is shared only when
they match: a drafter whose K/V at position p depends on token p + 1 (EAGLE, MTP) sets it to 1.

A model whose layers attend differently keeps one pool per KV cache group (`KVCacheGroups`): the full-attention
layers' group (group 0: every request's whole table, the one drafters index their own pools by) and one group
per distinct sliding window (`SlidingWindowBlockManager`), whose requests give back each block once every row
still to come lies more than a window past it. A model of one group uses a lone `BlockManager`, as before.
"""
from __future__ import annotations

from collections import OrderedDict

from serving.request import Request


def slot(block_ids: list[int], position: int, block_size: int) -> int:
    """The pool slot that holds position `position` of the sequence with this block table."""
    return block_ids[position // block_size] * block_size + position % block_size


class BlockManager:
    """One group's pool; `group` is the index of its table in `request.block_tables`."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, group: int = 0):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockManager needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.group = group
        self.ref_counts = [0] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_blocks: dict[int, int] = {}  # block hash -> block id
        self.cached_hashes: dict[int, int] = {}  # block id -> block hash, for registered blocks
        self.num_lookahead = 0  # tokens after a block that its hash covers too

    @property
    def groups(self) -> tuple[BlockManager, ...]:
        """Every group's manager: this one alone."""
        return (self,)

    @property
    def pool_blocks(self) -> int:
        """Blocks the group's K/V tensors hold (a sliding-window group's null block included)."""
        return self.num_blocks

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
        return max(0, num_needed - len(request.block_tables[self.group]))

    def get_computed_tokens(self, request: Request) -> int:
        """At admission: take the longest chain of cached full blocks that starts `request.token_ids`
        and return how many tokens it covers. The last token is always left to compute, because
        its logits are what the step needs."""
        assert not request.block_tables[self.group], f"request {request.request_id} already holds blocks"
        hashes = self.prefix_hashes(request)
        self.take(request, hashes, len(hashes))
        request.block_hashes = hashes
        return len(hashes) * self.block_size

    def prefix_hashes(self, request: Request) -> list[int]:
        """The hashes of the longest chain of this pool's cached blocks that starts `request.token_ids`, leaving the
        last token (and the lookahead a block's hash covers) to compute."""
        hashes: list[int] = []
        if not self.enable_prefix_caching:
            return hashes
        parent_hash = None
        for start in range(0, request.num_tokens - self.block_size - max(self.num_lookahead, 1) + 1, self.block_size):
            parent_hash = self._hash(parent_hash, request.token_ids, start)
            if parent_hash not in self.cached_blocks:
                break
            hashes.append(parent_hash)
        return hashes

    def longest_hit(self, hashes: list[int], num_blocks: int) -> int:
        """How many of the first `num_blocks` blocks of a chain with these hashes a hit may cover here: all of them, as
        this pool's lookup found them (`prefix_hashes`)."""
        return num_blocks

    def take(self, request: Request, hashes: list[int], num_blocks: int) -> None:
        """Gives `request` the cached blocks of the first `num_blocks` hashes (its table is empty)."""
        table = request.block_tables[self.group]
        for block_hash in hashes[:num_blocks]:
            table.append(self._hold(self.cached_blocks[block_hash]))

    def _hold(self, block_id: int) -> int:
        if self.ref_counts[block_id] == 0:
            del self.free_queue[block_id]
        self.ref_counts[block_id] += 1
        return block_id

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        return self.num_new_blocks(request, num_new_tokens) <= self.num_free_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Give `request` slots for `num_new_tokens` tokens after its computed ones. On failure
        nothing changes and it returns False."""
        num_new_blocks = self.num_new_blocks(request, num_new_tokens)
        if num_new_blocks > self.num_free_blocks:
            return False
        self._allocate(request.block_tables[self.group], num_new_blocks)
        return True

    def _allocate(self, table: list[int], num_new_blocks: int) -> None:
        for _ in range(num_new_blocks):
            block_id, _ = self.free_queue.popitem(last=False)
            block_hash = self.cached_hashes.pop(block_id, None)
            if block_hash is not None:
                del self.cached_blocks[block_hash]
            self.ref_counts[block_id] = 1
            table.append(block_id)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register every full block within the first `num_tokens` tokens of `request.token_ids`
        not registered yet. `num_tokens` must count only tokens whose K/V are computed and final
        (after any rollback). A block whose hash another block already holds stays unregistered."""
        if not self.enable_prefix_caching:
            return
        num_before = len(request.block_hashes)
        self.extend_hashes(request, num_tokens)
        self.register(request, num_before)

    def extend_hashes(self, request: Request, num_tokens: int) -> None:
        """Appends the hashes of the full blocks within the first `num_tokens` tokens that have none yet."""
        num_full_blocks = min(num_tokens, request.num_tokens - self.num_lookahead) // self.block_size
        assert num_full_blocks <= len(request.block_tables[0]), f"request {request.request_id} caches past its blocks"
        for index in range(len(request.block_hashes), num_full_blocks):
            parent_hash = request.block_hashes[-1] if request.block_hashes else None
            request.block_hashes.append(self._hash(parent_hash, request.token_ids, index * self.block_size))

    def register(self, request: Request, first: int) -> None:
        """Registers the request's blocks from index `first` on under the hashes they have."""
        table = request.block_tables[self.group]
        for index in range(first, len(request.block_hashes)):
            block_hash = request.block_hashes[index]
            if block_hash not in self.cached_blocks:
                block_id = table[index]
                self.cached_blocks[block_hash] = block_id
                self.cached_hashes[block_id] = block_hash

    def _hash(self, parent_hash, token_ids: list[int], start: int) -> int:
        return hash((parent_hash, tuple(token_ids[start:start + self.block_size + self.num_lookahead])))

    def trim(self, request: Request, num_tokens: int) -> None:
        """Keep only the blocks holding the first `num_tokens` positions of `request` (rolls back
        rejected drafts). A kept block cut in the middle will be rewritten, so it loses its hash."""
        self.trim_table(request, num_tokens)
        del request.block_hashes[num_tokens // self.block_size:]

    def trim_table(self, request: Request, num_tokens: int) -> None:
        """`trim` of this group's table; the request's hashes stay."""
        table = request.block_tables[self.group]
        num_kept = -(-num_tokens // self.block_size)
        for index in range(num_tokens // self.block_size, min(num_kept, len(request.block_hashes))):
            block_id = table[index]
            if self.cached_hashes.get(block_id) == request.block_hashes[index]:
                del self.cached_blocks[self.cached_hashes.pop(block_id)]
        self._release(table[num_kept:])
        del table[num_kept:]

    def free(self, request: Request) -> None:
        """Release every block of `request`; registered ones stay reusable until evicted."""
        self.free_table(request)
        request.block_hashes = []

    def free_table(self, request: Request) -> None:
        self._release(request.block_tables[self.group])
        request.block_tables[self.group] = []

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


class SlidingWindowBlockManager(BlockManager):
    """The pool of the layers with one sliding window: a row at position p sees keys p - window + 1 .. p, so a block
    whose positions all lie before the window of the next step's first row (position num_computed_tokens; draft
    and chunk rows come after it) is given back, and its table entry becomes the null block: block 0, never handed
    out nor written, so that positions still index the table linearly and masked reads find zeros. A rollback never
    reaches back past that row, so never needs a freed block. `num_blocks` counts the blocks handed out; the K/V
    tensors hold one more, the null block."""

    NULL = 0

    def __init__(self, num_blocks: int, block_size: int, window: int, enable_prefix_caching: bool = True,
                 group: int = 1):
        super().__init__(num_blocks + 1, block_size, enable_prefix_caching, group)
        del self.free_queue[self.NULL]
        self.num_blocks = num_blocks
        self.window = window
        # blocks a row at a block boundary reads behind it: a prefix hit must find them all
        self.num_window_blocks = -(-(window - 1) // block_size)

    @property
    def pool_blocks(self) -> int:
        return self.num_blocks + 1

    def skip_blocks(self, request: Request) -> None:
        """Gives back the blocks wholly before the window of the request's next row (position num_computed_tokens)."""
        table = request.block_tables[self.group]
        num_skipped = min(len(table), max(0, request.num_computed_tokens - self.window + 1) // self.block_size)
        for index in range(num_skipped - 1, -1, -1):  # newest first; the blocks before a null one are null
            if table[index] == self.NULL:
                break
            self._release([table[index]])
            table[index] = self.NULL

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        self.skip_blocks(request)
        return super().allocate_slots(request, num_new_tokens)

    def longest_hit(self, hashes: list[int], num_blocks: int) -> int:
        """The longest prefix of at most `num_blocks` blocks whose last `num_window_blocks` blocks (or every block,
        when it is shorter) are cached here: the blocks its next row reads."""
        num_contiguous = 0
        for index in range(num_blocks - 1, -1, -1):
            if hashes[index] in self.cached_blocks:
                num_contiguous += 1
                if num_contiguous >= self.num_window_blocks:
                    return index + num_contiguous
            else:
                num_contiguous = 0
        return num_contiguous

    def take(self, request: Request, hashes: list[int], num_blocks: int) -> None:
        table = request.block_tables[self.group]
        first = max(0, num_blocks - self.num_window_blocks)
        table.extend([self.NULL] * first)
        for block_hash in hashes[first:num_blocks]:
            table.append(self._hold(self.cached_blocks[block_hash]))

    def register(self, request: Request, first: int) -> None:
        table = request.block_tables[self.group]
        for index in range(first, len(request.block_hashes)):
            block_hash, block_id = request.block_hashes[index], table[index]
            if block_id != self.NULL and block_hash not in self.cached_blocks:
                self.cached_blocks[block_hash] = block_id
                self.cached_hashes[block_id] = block_hash

    def _release(self, block_ids: list[int]) -> None:
        super()._release([block_id for block_id in block_ids if block_id != self.NULL])


class KVCacheGroups:
    """The managers of a model whose layers fall into several KV cache groups, answering as one BlockManager: group
    0 (full attention, perhaps of no target layer when every layer has a window: it still holds every request's
    whole table, which drafters' own pools are indexed by, and the prefix hashes) and a SlidingWindowBlockManager
    per window. A request gets its slots in every group or in none; a prefix hit covers, in each group, what the
    next row reads (the shortest of the groups' hits)."""

    def __init__(self, groups: list[BlockManager]):
        assert len(groups) > 1 and all(g.group == i for i, g in enumerate(groups))
        self.groups = tuple(groups)
        self.full = groups[0]
        self.block_size = self.full.block_size
        self.enable_prefix_caching = self.full.enable_prefix_caching

    @property
    def num_lookahead(self) -> int:
        return self.full.num_lookahead

    @num_lookahead.setter
    def num_lookahead(self, value: int) -> None:
        self.full.num_lookahead = value  # the full group hashes for every group

    @property
    def num_blocks(self) -> int:
        return self.full.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.full.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self.full.num_cached_blocks

    def num_new_blocks(self, request: Request, num_new_tokens: int) -> int:
        """The full group's count (each group's: `groups[g].num_new_blocks`)."""
        return self.full.num_new_blocks(request, num_new_tokens)

    def get_computed_tokens(self, request: Request) -> int:
        request.block_tables = [[] for _ in self.groups]
        hashes = self.full.prefix_hashes(request)
        num_blocks = len(hashes)
        while True:  # each group's hit within the others', until they agree
            hit = num_blocks
            for group in self.groups[1:]:
                hit = group.longest_hit(hashes, hit)
            if hit == num_blocks:
                break
            num_blocks = hit
        for group in self.groups:
            group.take(request, hashes, num_blocks)
        request.block_hashes = hashes[:num_blocks]
        return num_blocks * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        for group in self.groups[1:]:
            group.skip_blocks(request)
        if not all(group.can_allocate(request, num_new_tokens) for group in self.groups):
            return False
        for group in self.groups:
            group.allocate_slots(request, num_new_tokens)
        return True

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_prefix_caching:
            return
        num_before = len(request.block_hashes)
        self.full.extend_hashes(request, num_tokens)
        for group in self.groups:
            group.register(request, num_before)

    def trim(self, request: Request, num_tokens: int) -> None:
        for group in self.groups:
            group.trim_table(request, num_tokens)
        del request.block_hashes[num_tokens // self.block_size:]

    def free(self, request: Request) -> None:
        if len(request.block_tables) == len(self.groups):  # else never admitted: it holds nothing
            for group in self.groups:
                group.free_table(request)
        request.block_tables = [[] for _ in self.groups]
        request.block_hashes = []

    def reset_prefix_cache(self) -> None:
        for group in self.groups:
            group.reset_prefix_cache()
