"""The target's packed weights in one allocation, in the order a step reads them, on 2 MB pages where Linux gives
them.

A decode step streams every weight once. Allocated one by one, the panels sit on 4 KB pages: each 4 KB of the
~270 MB a step reads (bfloat16) takes a TLB miss and a page walk, and the streams restart at every layer's separate
allocation. In one arena asked for transparent huge pages (madvise MADV_HUGEPAGE before its pages are first
touched), a step reads one stream of 2 MB pages, in order. Where the kernel gives none (THP set to never, memory
too fragmented) the arena is still one ordered allocation and every result is the same.
"""
from __future__ import annotations

import ctypes
import functools
import sys

import torch

from serving.kernels import PackedLinear

HUGE_PAGE = 2 * 2**20
ALIGN = 64  # each tensor's start: a cache line, as torch's own allocations
MADV_HUGEPAGE = 14


@functools.cache
def _madvise():
    if sys.platform != "linux":
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes, libc.madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return libc.madvise


def huge_page_bytes(num_bytes: int) -> torch.Tensor:
    """An untouched uint8 CPU tensor of num_bytes starting on a 2 MB boundary, asked for huge pages (on Linux)."""
    raw = torch.empty(num_bytes + HUGE_PAGE, dtype=torch.uint8, device="cpu")
    start = -raw.data_ptr() % HUGE_PAGE
    arena = raw[start:start + num_bytes]
    madvise = _madvise()
    if madvise is not None and num_bytes:
        madvise(arena.data_ptr(), -(-num_bytes // HUGE_PAGE) * HUGE_PAGE, MADV_HUGEPAGE)  # advice: failure is harmless
    return arena


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
