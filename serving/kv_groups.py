"""KV cache groups: how many blocks each group's pool gets, and the pools and block managers built from that.

A target whose layers all attend to every key has one group, one pool and one BlockManager, as it always had. A
target with sliding windows has the full-attention group (its full layers, perhaps none) and one group per window
(serving.attention.kv_cache_groups), each its own K/V tensors, sized for its layers only, and its own manager.

Sizing. With `num_blocks` set, every group gets that many blocks (a windowed group never holds more of a request's
blocks than the full group, so it never runs out first). Otherwise the memory budget is shared out: the windowed
groups get what `max_num_seqs` requests hold inside their windows while a step's chunk runs,
max_num_seqs * (ceil(window / block_size) + 2) + ceil(max_num_batched_tokens / block_size) blocks each (the window, a
block boundary and a block of draft rows per request, plus one step's tokens), but together at most half the budget
(and each at least what one request needs), and the full group the rest, at least one max_model_len request's blocks.
A windowed group never gets more blocks than the full group. When no layer attends to every key, the full group
holds no K/V of the target and gets the blocks a pool of every layer would have had: its tables (which drafters
index their own pools by) bound the tokens in flight as before.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from serving.attention import KVCache, kv_cache_groups
from serving.blocks import BlockManager, KVCacheGroups, SlidingWindowBlockManager


@dataclass(frozen=True)
class KVGroup:
    window: int  # 0: full attention
    layers: tuple[int, ...]
    num_blocks: int  # blocks handed out (a windowed pool holds one more, its null block)


def plan(windows: tuple[int, ...], *, num_blocks: int | None, memory_bytes: int, layer_block_bytes: int,
         block_size: int, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int) -> list[KVGroup]:
    """Each group's blocks (the module's docstring says how). layer_block_bytes: one layer's K/V of one block."""
    groups = kv_cache_groups(windows)
    min_full = -(-max_model_len // block_size)
    if num_blocks is not None:
        return [KVGroup(window, layers, num_blocks) for window, layers in groups]
    if len(groups) == 1:  # the budget's blocks, as a pool of every layer
        return [KVGroup(0, groups[0][1], max(memory_bytes // (layer_block_bytes * len(windows)), min_full))]
    chunk = -(-max_num_batched_tokens // block_size)
    windowed = {window: max_num_seqs * (-(-window // block_size) + 2) + chunk for window, _ in groups[1:]}
    windowed_bytes = sum(windowed[w] * len(layers) * layer_block_bytes for w, layers in groups[1:])
    if windowed_bytes > memory_bytes // 2:  # scaled down to half the budget, at least one request each
        windowed = {w: max(int(n * memory_bytes // 2 / windowed_bytes), -(-w // block_size) + 2 + chunk)
                    for w, n in windowed.items()}
    full_layers = len(groups[0][1])
    if full_layers:
        left = memory_bytes - sum(windowed[w] * len(layers) * layer_block_bytes for w, layers in groups[1:])
        num_full = max(left // (full_layers * layer_block_bytes), min_full)
    else:
        num_full = max(memory_bytes // (layer_block_bytes * len(windows)), min_full)
    return [KVGroup(0, groups[0][1], num_full)] + [KVGroup(w, layers, min(windowed[w], num_full))
                                                   for w, layers in groups[1:]]


def pool_bytes(groups: list[KVGroup], layer_block_bytes: int) -> int:
    """The K/V bytes of every group's pool (windowed pools' null blocks included)."""
    return sum((g.num_blocks + bool(g.window)) * len(g.layers) * layer_block_bytes for g in groups)


def build_caches(groups: list[KVGroup], block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device, scale: float | None, sinks: tuple) -> tuple[list[KVCache], tuple[tuple[int, int], ...]]:
    """(each group's pool, each layer's (group, index within it)); one group: the pool of every layer."""
    if len(groups) == 1:
        windows = (0,) * len(groups[0].layers)
        return [KVCache(len(windows), groups[0].num_blocks, block_size, num_kv_heads, head_dim, dtype, device, windows,
                        scale, sinks)], ()
    caches, layer_groups = [], {}
    for g, group in enumerate(groups):
        caches.append(KVCache(len(group.layers), group.num_blocks + bool(group.window), block_size, num_kv_heads,
                              head_dim, dtype, device, (group.window,) * len(group.layers), scale,
                              tuple(sinks[layer] for layer in group.layers)))
        layer_groups.update({layer: (g, index) for index, layer in enumerate(group.layers)})
    return caches, tuple(layer_groups[layer] for layer in sorted(layer_groups))


def build_manager(groups: list[KVGroup], block_size: int, enable_prefix_caching: bool) -> BlockManager | KVCacheGroups:
    if len(groups) == 1:
        return BlockManager(groups[0].num_blocks, block_size, enable_prefix_caching)
    return KVCacheGroups([BlockManager(groups[0].num_blocks, block_size, enable_prefix_caching)]
                         + [SlidingWindowBlockManager(g.num_blocks, block_size, g.window, enable_prefix_caching, group=i)
                            for i, g in enumerate(groups) if i])
