"""Paged attention: K/V read through block tables from a pool of fixed-size blocks.

Sequences with short queries (decode, verification of a few drafts, draft-tree rows: `ShortQueries`) run as one
batch, through serving/kernels.c's `paged_attention` where it runs, else padded through torch; longer queries
(prefill chunks: `LongQuery`) run one at a time through torch. Everything derived from the block tables is built once
per step in `PagedMetadata.build` and shared by every layer; `AttentionPath` names the four ways a step attends and
`PagedAttention.path` picks one.
"""
from __future__ import annotations

import array
import ctypes
import enum
import functools
import itertools
from dataclasses import dataclass, field

import torch

from heads.attention import sdpa_gqa
from serving.blocks import slot
from serving.kernel_abi import AttentionArgs, AttentionBatch, PagedKV
from serving.kernels import library

MAX_BATCHED_QUERY_LEN = 16


class KVCache:
    """One allocation for every layer: k and v are [num_layers, num_blocks * block_size, num_kv_heads, head_dim].
    How its layers attend over it: `windows`, each layer's sliding window (keys a row sees back from itself, itself
    included; 0: all), `scale`, what scores are scaled by (None: head_dim ** -0.5; Gemma's differs), and `sinks`,
    each layer's [heads] sink logits where it has them (gpt-oss; heads.attention.sdpa_gqa)."""

    def __init__(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device,
                 windows: tuple[int, ...] = (), scale: float | None = None,
                 sinks: tuple[torch.Tensor | None, ...] = ()):
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.windows = windows or (0,) * num_layers
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.sinks = sinks or (None,) * num_layers

    def move(self, block_table: list[int], source: int, target: int) -> None:
        """Copies the K/V of a sequence's position `source` into position `target`, in every layer."""
        source, target = slot(block_table, source, self.block_size), slot(block_table, target, self.block_size)
        self.k[:, target] = self.k[:, source]
        self.v[:, target] = self.v[:, source]

    @staticmethod
    def bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


def kv_cache_groups(windows: tuple[int, ...]) -> list[tuple[int, tuple[int, ...]]]:
    """The model's layers grouped by how far back they attend: [(window, its layers)], the full-attention group
    (window 0) first, however many layers it has (none when every layer has a window), then one group per distinct
    window, narrowest first. Each group keeps its own pool and block tables (serving.blocks)."""
    groups = [(0, tuple(i for i, w in enumerate(windows) if not w))]
    for window in sorted(set(windows) - {0}):
        groups.append((window, tuple(i for i, w in enumerate(windows) if w == window)))
    return groups


class GroupedAttention:
    """The attention of a model whose layers fall into several KV cache groups: a layer attends through its group's
    PagedAttention (its pool, and metadata built from its group's block tables), at its index within the group."""

    def __init__(self, attentions: list[PagedAttention], layer_groups: tuple[tuple[int, int], ...]):
        self.attentions, self.layer_groups = attentions, layer_groups  # layer -> (group, index within the group)

    def __call__(self, layer_idx, q, k, v):
        group, index = self.layer_groups[layer_idx]
        return self.attentions[group](index, q, k, v)


@dataclass
class LongQuery:
    """A sequence whose query is longer than MAX_BATCHED_QUERY_LEN rows (a prefill chunk), attended on its own."""
    start: int
    end: int
    key_slots: torch.Tensor | None  # [context]; None when the chunk is the whole sequence so far
    mask: torch.Tensor | None  # [1, query, context]
    context: int
    device: torch.device | str
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def window_mask(self, window: int) -> torch.Tensor:
        """[1, query, context]: a sliding-window layer's causal mask (row i at position p sees key j where
        p - window < j <= p), made once per window."""
        if window not in self.window_masks:
            rows = torch.arange(self.context - (self.end - self.start), self.context, device="cpu")[:, None]
            keys = torch.arange(self.context, device="cpu")[None]
            self.window_masks[window] = ((keys <= rows) & (keys > rows - window))[None].to(self.device)
        return self.window_masks[window]


def context_slots(table: list[int], context: int, block_size: int) -> list[int]:
    """The pool slots of a sequence's first `context` positions, in position order."""
    slots = []
    for block in table[:-(-context // block_size)]:
        slots.extend(range(block * block_size, (block + 1) * block_size))
    del slots[context:]
    return slots


class ShortQueries:
    """The sequences with short queries or tree rows, attended as one batch of B sequences. A sequence's rows
    are its query rows (causal: query row i sees keys 0 .. context - query rows + i, in table order), then its tree
    rows: each sees the whole context, then the keys of its path (its ancestors' slots and its own, in position
    order), so it reads the keys a decode step at its position would, in the same order.

    The C kernel reads an AttentionBatch over one host tensor (PagedMetadata.kernel_arrays);
    torch's path reads the padded row indices, its own key list and mask; each is built the first time it is asked
    for (per-step metadata costs more than a draft layer's arithmetic, and each torch call ~20 us after a forward has
    evicted the caches)."""

    def __init__(self, short, slots: list[list[int]], device):
        # short: (first row, query rows, context length, paths: a slot list per tree row); slots: each sequence's
        # context's slots in position order
        self.short, self.slots, self.device = short, slots, device
        self.window_masks: dict[int, torch.Tensor] = {}
        self.max_q = max(q + len(paths) for _, q, _, paths in short)
        self.max_c = max(c for _, _, c, _ in short)

    def host_arrays(self, slot_mapping: list[int]) -> tuple[torch.Tensor, AttentionBatch]:
        """(host tensor, the AttentionBatch over it): new_slots, then seqs [B] Sequences, then slots [B][Cmax], each
        context's then zeros that nothing reads, then paths [tree rows][1 + longest path] = (path length, its slots)."""
        all_paths = [path for *_, paths in self.short for path in paths]
        stride = 1 + max(map(len, all_paths), default=0)
        seqs, first_path = [], 0
        for start, q, c, paths in self.short:
            seqs += [start, q, c, len(paths), first_path]  # Sequence's fields, in its order
            first_path += len(paths)
        flat = slot_mapping + seqs
        for row in self.slots:
            flat += row
            flat += [0] * (self.max_c - len(row))
        for path in all_paths:
            flat += [len(path), *path, *[0] * (stride - 1 - len(path))]
        if not all_paths:
            flat += [0] * stride
        # through an array: torch.tensor reads a list of Python ints several times slower (16 sequences of 300 keys)
        host = torch.frombuffer(array.array("q", flat), dtype=torch.long)
        base, size = host.data_ptr(), host.element_size()
        num_slots = len(self.slots) * self.max_c
        at = [base + size * n for n in itertools.accumulate((len(slot_mapping), len(seqs), num_slots), initial=0)]
        return host, AttentionBatch(new_slots=at[0], num_new=len(slot_mapping), seqs=at[1], num_seqs=len(self.short),
                                    slots=at[2], slot_stride=self.max_c, paths=at[3], path_stride=stride)

    @functools.cached_property
    def query_index(self) -> torch.Tensor:
        """[B, Qmax] rows of the flat batch (padding repeats a valid row)."""
        index = torch.tensor([list(range(start, start + q + len(paths))) + [start] * (self.max_q - q - len(paths))
                              for start, q, _, paths in self.short], device="cpu")
        return index.to(self.device)

    @functools.cached_property
    def valid(self) -> torch.Tensor:
        """[B * Qmax] bool: which padded rows are real."""
        num_rows = torch.tensor([[q + len(paths)] for _, q, _, paths in self.short], device="cpu")
        return (torch.arange(self.max_q, device="cpu")[None] < num_rows).flatten().to(self.device)

    @functools.cached_property
    def rows(self) -> torch.Tensor:
        """[num real rows] the real padded rows' rows in the flat batch."""
        return self.query_index.flatten()[self.valid]

    @functools.cached_property
    def torch_keys(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """torch's path: ([B * K] key slots, each sequence's context then the slots its tree rows add, padded;
        [B, Qmax, K] mask, or None when every row may see every key)."""
        tails = [list(dict.fromkeys(slot for path in paths for slot in path)) for *_, paths in self.short]
        num_keys = max(c + len(tail) for (_, _, c, _), tail in zip(self.short, tails))
        keys = torch.zeros(len(self.short), num_keys, dtype=torch.long, device="cpu")
        mask = torch.zeros(len(self.short), self.max_q, num_keys, dtype=torch.bool, device="cpu")
        for i, ((_, q, c, paths), tail) in enumerate(zip(self.short, tails)):
            keys[i, :c + len(tail)] = torch.tensor(self.slots[i] + tail, dtype=torch.long, device="cpu")
            mask[i, :q] = torch.arange(num_keys, device="cpu")[None] <= torch.arange(c - q, c, device="cpu")[:, None]
            where = {slot: c + n for n, slot in enumerate(tail)}
            for t, path in enumerate(paths):
                mask[i, q + t, :c] = True
                mask[i, q + t, [where[slot] for slot in path]] = True
            mask[i, q + len(paths):, 0] = True  # padding rows see one key, so that their softmax stays finite
        return keys.flatten().to(self.device), None if bool(mask.all()) else mask.to(self.device)

    @property
    def mask(self) -> torch.Tensor | None:
        return self.torch_keys[1]

    @functools.cached_property
    def torch_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, Qmax] each row's position, padding rows 0; [B, K] the position of each of torch_keys' keys: a
        context key's index, a path's k-th slot context + k)."""
        key_positions = torch.zeros(len(self.short), len(self.torch_keys[0]) // len(self.short), dtype=torch.long)
        row_positions = torch.zeros(len(self.short), self.max_q, dtype=torch.long)
        for i, (_, q, c, paths) in enumerate(self.short):
            row_positions[i, :q] = torch.arange(c - q, c)
            depths = {slot: k for path in paths for k, slot in enumerate(path)}
            key_positions[i, :c] = torch.arange(c)
            key_positions[i, c:c + len(depths)] = torch.tensor([c + depth for depth in depths.values()], dtype=torch.long)
            for t, path in enumerate(paths):
                row_positions[i, q + t] = c + len(path) - 1
        return row_positions.to(self.device), key_positions.to(self.device)

    def window_mask(self, window: int) -> torch.Tensor | None:
        """torch's path's mask of a layer with a sliding window (0: `mask`): `mask` less the keys before each row's
        window (row at position p sees key at j > p - window), made once per window."""
        if not window:
            return self.mask
        if window not in self.window_masks:
            rows, keys = self.torch_positions
            visible = keys[:, None, :] > rows[:, :, None] - window  # [B, Qmax, K]
            self.window_masks[window] = visible if self.mask is None else visible & self.mask
        return self.window_masks[window]

    @functools.cached_property
    def key_range(self) -> tuple[int, int] | None:
        """(first slot, count) when a lone sequence's keys lie in consecutive slots (concurrency 1, usually): its
        keys are then a view of the pool."""
        keys = self.torch_keys[0]
        first = int(keys[0])
        if len(self.short) == 1 and bool((keys == torch.arange(first, first + len(keys), device=self.device)).all()):
            return first, len(keys)
        return None


class PagedMetadata:
    """The attention metadata of one flat forward: where each scheduled token's K/V is written (`new_slots`, and as a
    tensor on the device, `slot_mapping`), the long queries attended one at a time (`long`) and the short ones as
    one batch (`short`)."""

    def __init__(self, new_slots: list[int], long: list[LongQuery], short: ShortQueries | None, device):
        self.new_slots, self.long, self.short, self.device = new_slots, long, short, device

    @functools.cached_property
    def kernel_arrays(self) -> tuple[torch.Tensor, AttentionBatch]:
        """The C kernel's metadata of the short sequences (ShortQueries.host_arrays), made once however many
        PagedAttentions read them (the cost model times one step's forward over and over)."""
        return self.short.host_arrays(self.new_slots)

    @functools.cached_property
    def slot_mapping(self) -> torch.Tensor:
        """[num_tokens] where each scheduled token's K/V is written, on the device."""
        return torch.tensor(self.new_slots, dtype=torch.long, device="cpu").to(self.device)

    @classmethod
    def build(cls, query_lens, context_lens, block_tables, block_size, device, tree_paths=None, batch_every_query=False):
        """query_lens[i] tokens of sequence i are scheduled, causal; context_lens[i] = its keys in table order
        after this step (its last query row is key context - 1). tree_paths[i], when given, has one list per
        further row of sequence i (a draft tree's nodes): the pool slots of the keys that row sees after the
        context, in position order, its own last (where its K/V is written). batch_every_query: prefill chunks
        too go with the short queries (where the C kernel attends them: `kernel_attends`), so that every row's sums
        run over its keys in the order a decode step at its position reads them, whatever chunk it is computed in
        (torch's sdpa sums a row differently in chunks of other lengths: a preempted request prefilled again would
        not give back its bits)."""
        slot_mapping, long, short, short_slots = [], [], [], []
        start = 0
        for i, (query_len, context_len, table) in enumerate(zip(query_lens, context_lens, block_tables)):
            if len(table) * block_size < context_len:
                raise ValueError(f"a block table of {len(table)} blocks cannot hold {context_len} tokens of {block_size}")
            paths = tree_paths[i] if tree_paths else []
            slots = context_slots(table, context_len, block_size)
            slot_mapping.extend(slots[context_len - query_len:])
            slot_mapping.extend(path[-1] for path in paths)
            if query_len > MAX_BATCHED_QUERY_LEN and not paths and not batch_every_query:
                if query_len == context_len:
                    long.append(LongQuery(start, start + query_len, None, None, context_len, device))
                else:
                    mask = torch.ones(query_len, context_len, dtype=torch.bool, device="cpu")
                    mask = mask.tril(context_len - query_len)[None]
                    long.append(LongQuery(start, start + query_len, torch.tensor(slots, device="cpu").to(device),
                                          mask.to(device), context_len, device))
            else:
                short.append((start, query_len, context_len, paths))
                short_slots.append(slots)
            start += query_len + len(paths)
        return cls(slot_mapping, long, ShortQueries(short, short_slots, device) if short else None, device)


class AttentionPath(enum.Enum):
    """How a step attends, the same in every layer (PagedAttention.path chooses). The C kernel reads keys in place and
    runs where the pool is float32 on CPU with head_dim a multiple of 8 and kernels.c is built; torch gathers keys."""
    # Every sequence short, the C kernel: one call per layer writes the step's K/V and attends (decode and verify
    # steps on CPU); the only path the target's forward runs in one C call (serving.kernels.KernelForward).
    KERNEL = "kernel"
    # Long queries too: torch writes every K/V and attends the long ones, then the C kernel the short ones.
    KERNEL_AND_LONG = "kernel and long"
    # Without the kernel, one row per sequence (decode): the padded batch is the flat batch, no gather of rows.
    TORCH_DECODE = "torch decode"
    # Without the kernel otherwise: the long queries one at a time, the short ones as one padded batch.
    TORCH = "torch"


def kernel_attends(cache: KVCache) -> bool:
    """Whether serving/kernels.c's paged_attention attends over this pool: float32 on a CPU, head_dim a multiple of 8,
    the library built for this CPU."""
    k = cache.k
    return k.device.type == "cpu" and k.dtype == torch.float32 and k.shape[-1] % 8 == 0 and library() is not None


class PagedAttention:
    """Writes this step's K/V into the pool, then attends over each sequence's blocks, along `path`."""

    def __init__(self, cache: KVCache, meta: PagedMetadata, use_kernel: bool = True):
        """use_kernel=False attends through torch even where the C kernel runs (the tests' and benchmarks' reference)."""
        self.cache, self.meta = cache, meta
        k = cache.k
        self.lib = library() if use_kernel and kernel_attends(cache) else None
        self.path = self.choose_path()
        if self.path in (AttentionPath.KERNEL, AttentionPath.KERNEL_AND_LONG):  # read once per step, used by every layer
            self.attend = self.lib.paged_attention
            self.layer_bytes = k[0].numel() * k.element_size()
            self.pools = (k.data_ptr(), cache.v.data_ptr())
            self.batch = meta.kernel_arrays[1]  # the metadata holds the host tensor it points into
            if self.path is AttentionPath.KERNEL_AND_LONG:  # torch wrote the step's K/V
                self.batch = AttentionBatch.from_buffer_copy(self.batch)
                self.batch.new_slots, self.batch.num_new = None, 0

    def choose_path(self) -> AttentionPath:
        short, long = self.meta.short, self.meta.long
        if self.lib is not None and short is not None:
            return AttentionPath.KERNEL_AND_LONG if long else AttentionPath.KERNEL
        if short is not None and not long and all(q + len(paths) == 1 for _, q, _, paths in short.short):
            return AttentionPath.TORCH_DECODE
        return AttentionPath.TORCH

    def paged_kv(self) -> PagedKV | None:
        """On AttentionPath.KERNEL: model_forward's attention fields (every layer's pools, the batch), so that the
        target's forward runs in one call (serving.kernels.KernelForward); else None."""
        if self.path is not AttentionPath.KERNEL:
            return None
        return PagedKV(k_pool=self.pools[0], v_pool=self.pools[1], layer_floats=self.layer_bytes // 4,
                       batch=ctypes.pointer(self.batch))

    def __call__(self, layer_idx, q, k, v):
        path, short, window = self.path, self.meta.short, self.cache.windows[layer_idx]
        sinks = self.cache.sinks[layer_idx]
        if path is AttentionPath.KERNEL:
            return self._kernel(layer_idx, q, k, v, q.new_empty(q.shape))
        if path is AttentionPath.KERNEL_AND_LONG:
            return self._kernel(layer_idx, q, k, v, self._write_and_attend_long(layer_idx, q, k, v))
        if path is AttentionPath.TORCH_DECODE:
            k_pool, v_pool = self._write(layer_idx, k, v)
            return sdpa_gqa(q.unsqueeze(1), *self._gather(k_pool, v_pool, short), short.window_mask(window),
                            scale=self.cache.scale, sinks=sinks).view(q.shape)
        out = self._write_and_attend_long(layer_idx, q, k, v)
        if short is not None:
            k_pool, v_pool = self.cache.k[layer_idx], self.cache.v[layer_idx]
            o = sdpa_gqa(q[short.query_index], *self._gather(k_pool, v_pool, short), short.window_mask(window),
                         scale=self.cache.scale, sinks=sinks)
            out.index_copy_(0, short.rows, o.flatten(0, 1)[short.valid])
        return out

    def _write(self, layer_idx, k, v):
        k_pool, v_pool = self.cache.k[layer_idx], self.cache.v[layer_idx]
        k_pool.index_copy_(0, self.meta.slot_mapping, k)
        v_pool.index_copy_(0, self.meta.slot_mapping, v)
        return k_pool, v_pool

    def _write_and_attend_long(self, layer_idx, q, k, v) -> torch.Tensor:
        k_pool, v_pool = self._write(layer_idx, k, v)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        window, sinks = self.cache.windows[layer_idx], self.cache.sinks[layer_idx]
        for s in self.meta.long:
            mask = s.window_mask(window) if window else s.mask
            if s.key_slots is None:
                o = sdpa_gqa(q[None, s.start:s.end], k[None, s.start:s.end], v[None, s.start:s.end], mask,
                             is_causal=mask is None, scale=self.cache.scale, sinks=sinks)
            else:
                o = sdpa_gqa(q[None, s.start:s.end], k_pool[s.key_slots][None], v_pool[s.key_slots][None], mask,
                             scale=self.cache.scale, sinks=sinks)
            out[s.start:s.end] = o[0]
        return out

    def _kernel(self, layer_idx, q, k, v, out):
        """The short sequences through the C kernel, into `out`; it also writes the step's K/V on
        AttentionPath.KERNEL (on KERNEL_AND_LONG torch wrote them with the long sequences')."""
        # the kernel steps tokens by stride(0) and needs each token's heads dense
        q, k, v = (x if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] else x.contiguous() for x in (q, k, v))
        offset = layer_idx * self.layer_bytes
        self.attend(AttentionArgs(q=q.data_ptr(), q_stride=q.stride(0), out=out.data_ptr(),
                                  k_pool=self.pools[0] + offset, v_pool=self.pools[1] + offset, k_new=k.data_ptr(),
                                  v_new=v.data_ptr(), k_stride=k.stride(0), v_stride=v.stride(0), heads=q.shape[1],
                                  kv_heads=k.shape[1], dim=q.shape[2], scale=self.cache.scale,
                                  window=self.cache.windows[layer_idx], sinks=self._sinks_pointer(layer_idx),
                                  batch=ctypes.pointer(self.batch)))
        return out

    def _sinks_pointer(self, layer_idx: int) -> int | None:
        sinks = self.cache.sinks[layer_idx]
        return None if sinks is None else sinks.data_ptr()

    @staticmethod
    def _gather(k_pool, v_pool, b: ShortQueries):
        shape = (b.query_index.shape[0], -1, *k_pool.shape[1:])  # [B, keys, kv_heads, head_dim]
        if b.key_range is not None:
            return k_pool.narrow(0, *b.key_range).view(shape), v_pool.narrow(0, *b.key_range).view(shape)
        keys = b.torch_keys[0]
        return k_pool.index_select(0, keys).view(shape), v_pool.index_select(0, keys).view(shape)
