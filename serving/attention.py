"""Paged attention in plain torch, the engine's reference backend.

It reads K/V through block tables from a pool of fixed-size blocks. Sequences with short
queries (decode, verification of a few drafts) run as one padded batch; longer queries (prefill chunks)
run one at a time. Everything derived from the block tables is built once per step in
`PagedMetadata.build` and shared by every layer.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from heads.attention import sdpa_gqa
from serving.kernels import library

MAX_BATCHED_QUERY_LEN = 16


class KVCache:
    """One allocation for every layer: k and v are [num_layers, num_blocks * block_size, num_kv_heads, head_dim]."""

    def __init__(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device):
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks, self.block_size = num_blocks, block_size

    def move(self, block_table: list[int], source: int, target: int) -> None:
        """Copies the K/V of a sequence's position `source` into position `target`, in every layer."""
        size = self.block_size
        slot = lambda position: block_table[position // size] * size + position % size
        self.k[:, slot(target)] = self.k[:, slot(source)]
        self.v[:, slot(target)] = self.v[:, slot(source)]

    @staticmethod
    def bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


@dataclass
class _Single:
    start: int
    end: int
    key_slots: torch.Tensor | None  # [context]; None when the chunk is the whole sequence so far
    mask: torch.Tensor | None  # [1, query, context]


class _Batched:
    """The sequences with short queries, attended as one padded batch of B sequences. The C kernel reads `seqs`
    and `key_slots`, built with the step; torch's path also reads the padded row indices and mask, built the
    first time it asks (per-step metadata costs more than a draft layer's arithmetic)."""

    def __init__(self, short, device):
        # short: (first row, query rows, context length, slots [context + leaves], leaves); a sequence's rows are its
        # query rows, then its leaves (PagedMetadata.build)
        self.short, self.device = short, device
        self.max_q = max(q + leaves for _, q, _, _, leaves in short)
        self.max_c = max(c + leaves for _, _, c, _, leaves in short)
        if len(short) == 1:
            key_slots = short[0][3]
        else:
            key_slots = torch.zeros(len(short), self.max_c, dtype=torch.long, device="cpu")
            for i, (_, _, _, slots, _) in enumerate(short):
                key_slots[i, :len(slots)] = slots
        self.key_slots = key_slots.flatten().to(device)  # [B * Cmax], for index_select
        # [B, 4] (first row in the flat batch, query rows, context length, leaves)
        self.seqs = torch.tensor([(start, q, c, leaves) for start, q, c, _, leaves in short], device=device)

    @functools.cached_property
    def query_index(self) -> torch.Tensor:
        """[B, Qmax] rows of the flat batch (padding repeats a valid row)."""
        index = torch.tensor([list(range(start, start + q + leaves)) + [start] * (self.max_q - q - leaves)
                              for start, q, _, _, leaves in self.short], device="cpu")
        return index.to(self.device)

    @functools.cached_property
    def valid(self) -> torch.Tensor:
        """[B * Qmax] bool: which padded rows are real."""
        num_rows = self.seqs[:, 1:2].cpu() + self.seqs[:, 3:4].cpu()
        return (torch.arange(self.max_q, device="cpu")[None] < num_rows).flatten().to(self.device)

    @functools.cached_property
    def rows(self) -> torch.Tensor:
        """[num real rows] the real padded rows' rows in the flat batch."""
        return self.query_index.flatten()[self.valid]

    @functools.cached_property
    def mask(self) -> torch.Tensor | None:
        """[B, Qmax, Cmax]; None when every row may see every key (decode at equal lengths). A leaf sees the keys up
        to its sequence's first query row and its own."""
        # the last key position each row may see
        limit = torch.zeros(len(self.short), self.max_q, dtype=torch.long, device="cpu")
        own_keys = []  # (sequence, row, key) of each leaf's own key
        for i, (_, query_len, context_len, _, leaves) in enumerate(self.short):
            limit[i, :query_len] = torch.arange(context_len - query_len, context_len, device="cpu")
            limit[i, query_len:query_len + leaves] = context_len - query_len
            own_keys += [(i, query_len + j, context_len + j) for j in range(leaves)]
        mask = torch.arange(self.max_c, device="cpu")[None, None, :] <= limit[:, :, None]
        if own_keys:
            mask[tuple(torch.tensor(own_keys, device="cpu").T)] = True
        return None if bool(mask.all()) else mask.to(self.device)

    @functools.cached_property
    def key_range(self) -> tuple[int, int] | None:
        """(first slot, count) when a lone sequence's keys lie in consecutive slots (concurrency 1, usually): its
        keys are then a view of the pool."""
        first = int(self.key_slots[0])
        if len(self.short) == 1 and bool((self.key_slots == torch.arange(first, first + self.max_c, device=self.device)).all()):
            return first, self.max_c
        return None


@dataclass
class PagedMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each scheduled token's K/V is written
    singles: list[_Single]
    batched: _Batched | None

    @classmethod
    def build(cls, query_lens, context_lens, block_tables, block_size, device, num_leaves=None):
        """query_lens[i] tokens of sequence i are scheduled; context_lens[i] = tokens with K/V after this step.
        num_leaves[i] more rows follow them: drafts that branch off the sequence's first scheduled token (at the
        position after it), each in the slot after the last before it. A leaf sees the keys up to that first token
        and its own, in position order, so it is attended as a decode step at its position would be."""
        slot_parts, singles, short = [], [], []
        start = 0
        offsets = torch.arange(block_size, device="cpu")  # metadata is built on the host, then moved
        for i, (query_len, context_len, table) in enumerate(zip(query_lens, context_lens, block_tables)):
            leaves = num_leaves[i] if num_leaves else 0
            num_blocks = -(-(context_len + leaves) // block_size)
            if len(table) < num_blocks:
                raise ValueError(f"a block table of {len(table)} blocks cannot hold {context_len + leaves} tokens of {block_size}")
            blocks = torch.tensor(table[:num_blocks], dtype=torch.long, device="cpu")
            slots = (blocks[:, None] * block_size + offsets).flatten()
            leaf_slots, slots = slots[context_len:context_len + leaves], slots[:context_len]
            slot_parts.append(slots[context_len - query_len:])
            if leaves:
                slot_parts.append(leaf_slots)
            if query_len > MAX_BATCHED_QUERY_LEN:
                assert not leaves, "leaves branch off a short query"
                if query_len == context_len:
                    singles.append(_Single(start, start + query_len, None, None))
                else:
                    mask = torch.ones(query_len, context_len, dtype=torch.bool, device="cpu")
                    mask = mask.tril(context_len - query_len)[None]
                    singles.append(_Single(start, start + query_len, slots.to(device), mask.to(device)))
            else:
                short.append((start, query_len, context_len, torch.cat([slots, leaf_slots]) if leaves else slots, leaves))
            start += query_len + leaves
        slot_mapping = slot_parts[0] if len(slot_parts) == 1 else torch.cat(slot_parts)
        return cls(slot_mapping.to(device), singles, _Batched(short, device) if short else None)


class PagedAttention:
    """Writes this step's K/V into the pool, then attends over each sequence's blocks. Short queries run
    through serving/kernels.c's `paged_attention` where it runs (float32 on CPU, head_dim a multiple of 8),
    which reads keys in place instead of gathering them; when every sequence of the step is short, that one
    call also writes the new K/V."""

    def __init__(self, cache: KVCache, meta: PagedMetadata):
        self.cache, self.meta = cache, meta
        k = cache.k
        self.lib = library() if k.device.type == "cpu" and k.dtype == torch.float32 and k.shape[-1] % 8 == 0 else None
        b = meta.batched
        if self.lib is not None and b is not None:  # read once per step, used by every layer
            self.attend = self.lib.paged_attention
            self.layer_bytes = k[0].numel() * k.element_size()
            self.pools = (k.data_ptr(), cache.v.data_ptr())
            self.batched_args = (b.seqs.data_ptr(), len(b.seqs), b.key_slots.data_ptr(), len(b.key_slots) // len(b.seqs))
            self.new_args = (meta.slot_mapping.data_ptr(), len(meta.slot_mapping))

    def __call__(self, layer_idx, q, k, v):
        meta, b = self.meta, self.meta.batched
        if self.lib is not None and b is not None:
            return self._kernel(layer_idx, q, k, v, self._write_and_attend_singles(layer_idx, q, k, v) if meta.singles else None)
        if self.lib is None and b is not None and not meta.singles and b.query_index.shape == (q.shape[0], 1):
            # decode only: one row per sequence, already in order
            k_pool, v_pool = self._write(layer_idx, k, v)
            return sdpa_gqa(q.unsqueeze(1), *self._gather(k_pool, v_pool, b), b.mask).view(q.shape)
        out = self._write_and_attend_singles(layer_idx, q, k, v)
        if b is not None:
            k_pool, v_pool = self.cache.k[layer_idx], self.cache.v[layer_idx]
            o = sdpa_gqa(q[b.query_index], *self._gather(k_pool, v_pool, b), b.mask)
            out.index_copy_(0, b.rows, o.flatten(0, 1)[b.valid])
        return out

    def _write(self, layer_idx, k, v):
        k_pool, v_pool = self.cache.k[layer_idx], self.cache.v[layer_idx]
        k_pool.index_copy_(0, self.meta.slot_mapping, k)
        v_pool.index_copy_(0, self.meta.slot_mapping, v)
        return k_pool, v_pool

    def _write_and_attend_singles(self, layer_idx, q, k, v) -> torch.Tensor:
        k_pool, v_pool = self._write(layer_idx, k, v)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for s in self.meta.singles:
            if s.key_slots is None:
                o = sdpa_gqa(q[None, s.start:s.end], k[None, s.start:s.end], v[None, s.start:s.end], is_causal=True)
            else:
                o = sdpa_gqa(q[None, s.start:s.end], k_pool[s.key_slots][None], v_pool[s.key_slots][None], s.mask)
            out[s.start:s.end] = o[0]
        return out

    def _kernel(self, layer_idx, q, k, v, out=None):
        """The short sequences through the C kernel, into `out` (a new tensor when None); it also writes the step's
        K/V unless `out` is given (the torch path wrote them with the long sequences')."""
        # the kernel steps tokens by stride(0) and needs each token's heads dense
        q, k, v = (x if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] else x.contiguous() for x in (q, k, v))
        new = self.new_args if out is None else (None, 0)
        if out is None:
            out = q.new_empty(q.shape)
        offset = layer_idx * self.layer_bytes
        self.attend(q.data_ptr(), q.stride(0), out.data_ptr(), self.pools[0] + offset, self.pools[1] + offset,
                    k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), *new, *self.batched_args,
                    q.shape[1], k.shape[1], q.shape[2], q.shape[2] ** -0.5)
        return out

    @staticmethod
    def _gather(k_pool, v_pool, b: _Batched):
        shape = (b.query_index.shape[0], -1, *k_pool.shape[1:])  # [B, Cmax, kv_heads, head_dim]
        if b.key_range is not None:
            return k_pool.narrow(0, *b.key_range).view(shape), v_pool.narrow(0, *b.key_range).view(shape)
        return k_pool.index_select(0, b.key_slots).view(shape), v_pool.index_select(0, b.key_slots).view(shape)
