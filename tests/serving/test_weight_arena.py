"""The target's packed weights in one arena (serving/weight_arena.py): the same products bit for bit, every panel of
the model inside it in the order a step reads them, the arena on 2 MB boundaries and advised for huge pages."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from serving import kernels, weight_arena
from serving.model import Model

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="the kernels do not build here")


def vm_flags(address: int) -> set[str]:
    """The flags of this process's mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            inside = int(span.group(1), 16) <= address < int(span.group(2), 16)
        elif inside and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("weights,compute", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                             (torch.bfloat16, torch.bfloat16)])
def test_placed_panels_compute_what_they_computed(weights, compute):
    torch.manual_seed(0)
    linears = [kernels.PackedLinear(nn.Linear(k, n), weights, compute) for k, n in [(33, 17), (576, 960), (64, 1537)]]
    xs = [torch.randn(5, layer.in_features) for layer in linears]
    before = [layer(x) for layer, x in zip(linears, xs)]
    matrices = [layer.matrix() for layer in linears]
    arena = weight_arena.place(linears)
    assert arena.data_ptr() % weight_arena.HUGE_PAGE == 0
    starts = [layer.panels.data_ptr() for layer in linears]
    assert starts == sorted(starts) and starts[0] == arena.data_ptr()
    assert all(layer.panels.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr() for layer in linears)
    assert all(layer.panels_ptr == layer.panels.data_ptr() for layer in linears)
    for layer, x, out, matrix in zip(linears, xs, before, matrices):
        assert torch.equal(layer(x), out) and torch.equal(layer.matrix(), matrix)


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage").exists(), reason="no transparent huge pages here")
def test_the_arena_is_advised_for_huge_pages():
    arena = weight_arena.huge_page_bytes(5 * weight_arena.HUGE_PAGE + 100)
    assert arena.data_ptr() % weight_arena.HUGE_PAGE == 0 and arena.numel() == 5 * weight_arena.HUGE_PAGE + 100
    assert "hg" in vm_flags(arena.data_ptr())
    assert "sh" not in vm_flags(arena.data_ptr())  # private memory: shared anonymous memory is shmem, whose THP differs
    assert "hg" not in vm_flags(torch.empty(8 * weight_arena.HUGE_PAGE, dtype=torch.uint8).data_ptr())


def test_a_loaded_model_reads_every_panel_from_its_arena_in_step_order(tiny_llama):
    model = Model.from_folder(tiny_llama, weights=torch.bfloat16, compute=torch.bfloat16)
    arena = model.weight_arena.untyped_storage().data_ptr()
    packed = [m for m in model.layers.modules() if isinstance(m, kernels.PackedLinear)] + [model.packed_lm_head]
    assert len(packed) == 4 * model.config.num_layers + 1
    assert all(m.panels.untyped_storage().data_ptr() == arena for m in packed)
    starts = [m.panels.data_ptr() for m in packed]
    assert starts == sorted(starts)
    table = model.layers[0].scratch.layer_table
    assert [table[i].qkv for i in range(model.config.num_layers)] == [layer.reference.qkv.panels.data_ptr()
                                                                      for layer in model.layers]
