"""The bfloat16 compute mode's AMX path (kernels.c: amx_panels, amx_block) checked on any CPU: the library built with
DRAFTHEADS_EMULATE_AMX does each tile instruction in C as Intel's manual defines it, so the loops around them (the
tiles' shapes and strides, the zero rows and pairs they read past the data, the groups of panels, the blocks of
rows) run here. Each output of a tile product is one in-order sum over the pairs, the even product then the odd one,
which is what the widened path computes: the two agree bit for bit. The instructions themselves run in
test_bf16_compute.py's "amx" cases, on a CPU that has AMX (skipped elsewhere)."""
from __future__ import annotations

import pytest
import torch

from serving import kernels
from serving.cpu_features import BF16_PATH_ENV
from serving.request import SamplingParams
from test_bf16_compute import SHAPES, bf16_engine, bf16_linear, reference
from test_head_drafters import PROMPTS, random_head_dir, spec_config
from engine_helpers import greedy

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="the kernels do not build here")


@pytest.fixture(scope="module")
def emulated_library():
    return kernels.build_library(kernels.compile_flags() + ["-DDRAFTHEADS_EMULATE_AMX"])


@pytest.fixture
def emulated_amx(emulated_library, monkeypatch):
    """Kernel modules made under this fixture run the AMX path on the emulated tiles."""
    monkeypatch.setattr(kernels, "library", lambda: emulated_library)
    monkeypatch.setattr(kernels, "bf16_path", lambda: "amx")


@pytest.fixture
def widened(monkeypatch):
    monkeypatch.setenv(BF16_PATH_ENV, "widened")


ROWS = (1, 2, 5, 15, 16, 17, 33, 67)


@pytest.mark.parametrize("in_features,out_features", SHAPES + [(64, 80), (1536, 576)])
def test_tile_products_are_the_widened_path_s_bit_for_bit(in_features, out_features, request):
    x = torch.randn(67, in_features)
    request.getfixturevalue("widened")
    layer, wide = bf16_linear(in_features, out_features)
    request.getfixturevalue("emulated_amx")
    _, tiles = bf16_linear(in_features, out_features)
    assert tiles.format == kernels.PAIR_PATHS["amx"] and wide.format == kernels.PAIR_PATHS["widened"]
    exact, scale = reference(layer, x)
    for rows in ROWS:
        out = tiles(x[:rows])
        assert torch.equal(out, wide(x[:rows])), rows
        assert ((out.double() - exact[:rows]).abs() <= 2e-6 * scale[:rows] + 1e-30).all(), rows


def test_a_row_s_bits_do_not_depend_on_its_batch(emulated_amx):
    _, tiles = bf16_linear(577, 100, bias=False)
    x = torch.randn(40, 577)
    alone = torch.cat([tiles(x[i:i + 1]) for i in range(len(x))])
    for num_rows in range(2, len(x) + 1):
        assert torch.equal(tiles(x[:num_rows]), alone[:num_rows]), num_rows
    assert torch.equal(tiles(x[19:37]), alone[19:37])


def test_the_engine_on_tiles_decodes_as_on_the_widened_path(tiny_llama, tmp_path, request):
    """The whole mode on the AMX path (every product of the target, its LM head and a head's): the same logprobs as
    the widened path, bit for bit, and an EAGLE-3 tree's greedy outputs equal to plain decoding's."""
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=True)
    request.getfixturevalue("widened")
    expected = bf16_engine(tiny_llama).generate(PROMPTS, params)
    request.getfixturevalue("emulated_amx")
    engine = bf16_engine(tiny_llama)
    assert engine.model.packed_lm_head.format == kernels.PAIR_PATHS["amx"] and "AMX" in engine.products
    outputs = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    assert [o.logprobs for o in outputs] == [o.logprobs for o in expected]
    tree = dict(spec_config("eagle3", random_head_dir("eagle3", tiny_llama, tmp_path)), topk=3, num_draft_tokens=8)
    speculative = bf16_engine(tiny_llama, tree)
    assert speculative.speculator.drafter.head.layer.reference.qkv.format == kernels.PAIR_PATHS["amx"]
    assert [o.token_ids for o in speculative.generate(PROMPTS, greedy(12))] == [o.token_ids for o in expected]
    assert sum(speculative.speculator.stats.proposed) > 0
