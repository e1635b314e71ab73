"""The bfloat16 compute mode (EngineConfig.dtype = bfloat16 on CPU): activations rounded to bfloat16 at each product's
input, bfloat16 weights, float32 sums. Its products against a float64 reference over the rounded operands on odd
shapes, on every path this CPU supports (vdpbf16ps, bfloat16 widened to float32 on FMAs); and each row's bits alone
equal to its bits inside any batch, on each path."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from serving import kernels
from serving.cpu_features import BF16_PATH_ENV, BF16_PATHS, cpu_features, parse_cpuinfo

PATHS = [pytest.param(path, marks=pytest.mark.skipif(
    not cpu_features().supports(path) or kernels.library() is None,
    reason=f"this CPU lacks {' or '.join(BF16_PATHS[path])} (or the kernels do not build here)")) for path in BF16_PATHS]
SHAPES = [(1, 1), (7, 23), (33, 17), (64, 40), (577, 100), (96, 150), (575, 1537)]


@pytest.fixture
def on_path(request, monkeypatch):
    """PackedLinears made under this fixture run its path (`request.param`)."""
    monkeypatch.setenv(BF16_PATH_ENV, request.param)
    return request.param


def bf16_linear(in_features, out_features, bias=True):
    torch.manual_seed(in_features * 1000 + out_features)
    layer = nn.Linear(in_features, out_features, bias=bias).requires_grad_(False)
    return layer, kernels.PackedLinear(layer, torch.bfloat16, torch.bfloat16)


def reference(layer: nn.Linear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x.bfloat16() @ W.bfloat16().T (+ bias) in float64, and each output's sum of |products| (its error scale)."""
    xr, wr = x.bfloat16().double(), layer.weight.bfloat16().double()
    bias = 0 if layer.bias is None else layer.bias.double()
    return xr @ wr.T + bias, xr.abs() @ wr.abs().T + (0 if layer.bias is None else layer.bias.double().abs())


def test_pair_panels_hold_each_column_s_pair_side_by_side():
    weight = torch.arange(35 * 5, dtype=torch.float32).view(35, 5).bfloat16()  # 35 columns of 5 inputs
    panels = kernels.to_pair_panels(weight)
    assert panels.shape == (3, 3, 32)
    for c in range(48):
        for k in range(6):
            value = panels[c // 16, k // 2, 2 * (c % 16) + k % 2]
            assert value == (weight[c, k] if c < 35 and k < 5 else 0), (c, k)


@pytest.mark.parametrize("on_path", PATHS, indirect=True)
@pytest.mark.parametrize("in_features,out_features", SHAPES)
def test_products_sum_the_rounded_operands(on_path, in_features, out_features):
    layer, packed = bf16_linear(in_features, out_features)
    assert packed.format == kernels.PAIR_PATHS[on_path] and packed.panels.dtype == torch.bfloat16
    x = torch.randn(67, in_features)
    exact, scale = reference(layer, x)
    for rows in (1, 2, 3, 5, 12, 13, 17, 67):
        out = packed(x[:rows])
        assert out.dtype == torch.float32
        # float32 sums of at most ~1600 exact products (bfloat16 x bfloat16 fits float32's mantissa): within 2e-6 of
        # the sum of their magnitudes, per output (seen: below 1e-7)
        assert ((out.double() - exact[:rows]).abs() <= 2e-6 * scale[:rows] + 1e-30).all(), rows
    if in_features > 16:  # not vacuous: rounding the activations moves the outputs far past that tolerance
        unrounded = x.double() @ layer.weight.bfloat16().double().T + layer.bias.double()
        assert ((packed(x).double() - unrounded).abs() > 1e-4 * scale).any()


@pytest.mark.parametrize("on_path", PATHS, indirect=True)
@pytest.mark.parametrize("in_features,out_features", [(577, 100), (64, 1537)])
def test_a_row_s_bits_do_not_depend_on_its_batch(on_path, in_features, out_features):
    """A verify step's rows compute, bit for bit, what one-row decode steps do: each output one in-order sum over
    the pairs of k whatever the tile (1-12 rows, 1-4 panels) that holds it."""
    _, packed = bf16_linear(in_features, out_features, bias=False)
    x = torch.randn(64, in_features)
    alone = torch.cat([packed(x[i:i + 1]) for i in range(len(x))])
    for num_rows in range(2, len(x) + 1):
        assert torch.equal(packed(x[:num_rows]), alone[:num_rows]), num_rows
    assert torch.equal(packed(x[37:50]), alone[37:50])  # rows in another place of the batch


def test_without_kernels_torch_computes_over_the_rounded_operands(monkeypatch):
    monkeypatch.setenv("DRAFTHEADS_KERNELS", "torch")
    kernels.library.cache_clear()
    try:
        layer, packed = bf16_linear(40, 30)
        assert packed.lib is None
        x = torch.randn(5, 40)
        exact, _ = reference(layer, x)
        torch.testing.assert_close(packed(x).double(), exact, atol=1e-5, rtol=1e-5)
    finally:
        monkeypatch.undo()
        kernels.library.cache_clear()


def test_bfloat16_compute_needs_bfloat16_weights():
    with pytest.raises(ValueError, match="bfloat16 over bfloat16 weights"):
        kernels.PackedLinear(nn.Linear(8, 8), torch.float32, torch.bfloat16)


def test_the_path_follows_the_cpu_s_flags(monkeypatch):
    zen3 = parse_cpuinfo("processor\t: 0\nmodel name\t: AMD EPYC 7763\nflags\t\t: fpu sse avx2 fma\n")
    zen4 = parse_cpuinfo("model name\t: AMD EPYC 9654\nflags\t\t: avx2 fma avx512f avx512_bf16\n")
    assert zen3.model == "AMD EPYC 7763" and zen3.supports("widened") and not zen3.supports("avx512_bf16")
    assert zen4.supports("avx512_bf16")
    import serving.cpu_features as features
    monkeypatch.setattr(features, "cpu_features", lambda: zen3)
    assert features.bf16_path() == "widened"
    assert "bfloat16 products: widened" in zen3.summary()
    monkeypatch.setenv(BF16_PATH_ENV, "avx512_bf16")
    with pytest.raises(ValueError, match="lacks"):
        features.bf16_path()
    monkeypatch.setattr(features, "cpu_features", lambda: zen4)
    monkeypatch.setenv(BF16_PATH_ENV, "auto")
    assert features.bf16_path() == "avx512_bf16"
    monkeypatch.setenv(BF16_PATH_ENV, "amx")
    with pytest.raises(ValueError, match="choose auto or one of"):
        features.bf16_path()
