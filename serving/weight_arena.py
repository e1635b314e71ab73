"""The target's packed weights in one allocation, in the order a step reads them, on 2 MB pages where Linux gives
them.

A decode step streams every weight once. Allocated one by one, the panels sit on 4 KB pages: each 4 KB of the
~270 MB a step reads (bfloat16) takes a TLB miss and a page walk, and the streams restart at every layer's separate
allocation. In one arena asked for transparent huge pages (madvise MADV_HUGEPAGE before its pages are first
touched), a step reads one stream of 2 MB pages, in order. Where the kernel gives none (THP set to never, memory
too fragmented) the arena is still one ordered allocation and every result is the same.
"""
from __future__ import annotations

import mmap
import sys

import torch

from serving.kernels import PackedLinear

HUGE_PAGE = 2 * 2**20
ALIGN = 64  # each tensor's start: a cache line, as torch's own allocations


def huge_page_bytes(num_bytes: int) -> torch.Tensor:
    """An untouched uint8 CPU tensor of num_bytes starting on a 2 MB boundary, asked for huge pages (on Linux).
    A mapping of its own, not torch's allocator: glibc may serve a large allocation from its heap, where the advice
    would outlive the arena and cover whatever the heap reuses that range for."""
    # private: Linux backs a shared anonymous mapping with shmem, whose huge pages a system's THP "madvise" leaves off
    mapping = mmap.mmap(-1, num_bytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping: unmapped when the tensor goes
    start = -raw.data_ptr() % HUGE_PAGE
    if num_bytes and sys.platform == "linux":
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE, start, -(-num_bytes // HUGE_PAGE) * HUGE_PAGE)
        except OSError:  # a kernel without transparent huge pages: advice, no result depends on it
            pass
    return raw[start:start + num_bytes]


def place(linears: list[PackedLinear]) -> torch.Tensor | None:
    """Moves the panels of these PackedLinears (those the kernels run) into one arena in this order, each one's
    pointers read anew; returns the arena (None when none runs the kernels). The modules must not have given their
    pointers to anything else yet (KernelLayer, KernelForward read them after)."""
    packed = [linear for linear in linears if linear.lib is not None]
    if not packed:
        return None
    offsets, total = [], 0
    for linear in packed:
        offsets.append(total)
        total += -(-linear.panels.numel() * linear.panels.element_size() // ALIGN) * ALIGN
    arena = huge_page_bytes(total)
    for linear, offset in zip(packed, offsets):
        panels = linear.panels
        size = panels.numel() * panels.element_size()
        moved = arena[offset:offset + size].view(panels.dtype).view(panels.shape)
        moved.copy_(panels)
        linear.panels = moved
        linear.read_pointers()
    return arena
