"""The bfloat16 compute mode (EngineConfig.dtype = bfloat16 on CPU): activations rounded to bfloat16 at each product's
input, bfloat16 weights, float32 sums. Its products against a float64 reference over the rounded operands on odd
shapes, on every path this CPU supports (vdpbf16ps, bfloat16 widened to float32 on FMAs); each row's bits alone
equal to its bits inside any batch, on each path; the engine's logits against transformers computing the same
products, and against transformers in bfloat16; speculative greedy outputs (every drafter kind, chains and a tree,
alone and under preemption) equal to plain decoding's in the mode, token for token; heads multiplying in the mode;
and a sampled tree's law the target's."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from serving import kernels
from serving.cpu_features import BF16_PATH_ENV, BF16_PATHS, amx_granted, cpu_features, parse_cpuinfo, usable
from serving.model import Model
from serving.request import SamplingParams
from test_dflash_drafter import random_dflash_dir
from test_dspark_drafter import random_dspark_dir
from test_head_drafters import PROMPTS, SCENARIOS, assert_pool_idle, greedy, make_engine, random_head_dir, spec_config
from test_model import SEQ_LENS, PagedRun, expected_logits, hf_reference, make_sequences
from test_peagle_drafter import peagle_head_dir
from test_trees import E2E_PROMPT, assert_two_token_law, two_token_law

PATHS = [pytest.param(path, marks=pytest.mark.skipif(
    not usable(cpu_features(), path) or kernels.library() is None,
    reason=f"this CPU lacks {' or '.join(BF16_PATHS[path])} (or Linux does not grant AMX, or the kernels do not build "
           "here)")) for path in BF16_PATHS]
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
    assert panels.shape == (3, 16, 32)  # 3 pairs of inputs, padded to one AMX weight tile's 16
    for c in range(48):
        for k in range(32):
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


@pytest.mark.parametrize("on_path", PATHS, indirect=True)
def test_the_activations_round_as_torch_rounds_them(on_path):
    """Through an identity layer each output is its input rounded to bfloat16, bit for bit as Tensor.bfloat16():
    halfway cases (to even, up and down) of either sign, the largest values and the scalar tail past the vectorised
    part (not infinities, whose product with the identity's zeros is NaN, nor subnormals, which AMX and vdpbf16ps
    read as zero)."""
    k = 37
    layer = nn.Linear(k, k, bias=False).requires_grad_(False)
    layer.weight.copy_(torch.eye(k))
    packed = kernels.PackedLinear(layer, torch.bfloat16, torch.bfloat16)
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0xBF808000, 0xBF818000, 0x7F7E8000,
                         0xFF7E8000, 0x7F7F7FFF, 0x00818000, 0x00828000], dtype=torch.int64)
    special = bits.to(torch.int32).view(torch.float32)
    x = torch.randn(5, k)
    x[:, :len(special)] = special
    x[3, 20:20 + len(special)] = special  # in the scalar tail of a row (past the 16-wide part)
    assert torch.equal(packed(x), x.bfloat16().float())


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
    with pytest.raises(ValueError, match="lacks"):
        features.bf16_path()
    monkeypatch.setenv(BF16_PATH_ENV, "tiles")
    with pytest.raises(ValueError, match="choose auto or one of"):
        features.bf16_path()
    # a Xeon with AMX: its tiles once Linux grants them, else its dot products
    xeon = parse_cpuinfo("model name\t: Intel Xeon\nflags\t\t: avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile\n")
    monkeypatch.setattr(features, "cpu_features", lambda: xeon)
    monkeypatch.setenv(BF16_PATH_ENV, "auto")
    for granted, path in ((True, "amx"), (False, "avx512_bf16")):
        monkeypatch.setattr(features, "amx_granted", lambda: granted)
        assert features.bf16_path() == path
    monkeypatch.setenv(BF16_PATH_ENV, "amx")
    with pytest.raises(ValueError, match="did not grant"):
        features.bf16_path()


def test_linux_grants_amx_where_the_cpu_has_it_and_only_there():
    assert amx_granted() == cpu_features().has("amx_tile"), "a Linux older than 5.16 grants no tile state"


# ---- the mode in the engine -------------------------------------------------------------------------------------

@torch.no_grad()
def hf_rounding_products(folder) -> nn.Module:
    """transformers' float32 model computing what the mode computes: every linear layer's (the LM head's too)
    weights rounded to bfloat16 once and its input rounded to bfloat16 at each call; all else float32."""
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf.lm_head.weight = nn.Parameter(hf.lm_head.weight.detach().clone())  # untied: the embedding stays unrounded
    for module in [*hf.model.layers.modules(), hf.lm_head]:
        if isinstance(module, nn.Linear):
            module.weight.copy_(module.weight.bfloat16().float())
            module.register_forward_pre_hook(lambda _, args: (args[0].bfloat16().float(),))
    return hf


@pytest.mark.parametrize("on_path", PATHS, indirect=True)
@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
def test_logits_are_transformers_with_bfloat16_products(fixture, on_path, request):
    folder = request.getfixturevalue(fixture)
    model = Model.from_folder(folder, weights=torch.bfloat16, compute=torch.bfloat16)
    linears = [m for m in model.modules() if isinstance(m, kernels.PackedLinear)] + [model.packed_lm_head]
    assert all(m.format == kernels.PAIR_PATHS[on_path] for m in linears)
    seqs = make_sequences(SEQ_LENS, seed=3)
    same_products = hf_reference(hf_rounding_products(folder), seqs)
    hf_bf16 = hf_reference(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval(), seqs)
    run = PagedRun(model, seqs, 3)
    for plan in ([(0, 40), (1, 7)], [(1, 13), (0, 1), (2, 30)], [(2, 1), (0, 1), (1, 1)]):
        out, where = run.step(plan)
        assert out.logits.dtype == torch.float32
        # the same rounded operands, float32 sums in another order: within 1e-7 where no input's rounding to
        # bfloat16 flips on a last-bit difference upstream; a flip moves that input by 2^-8 and what follows it, so
        # over these random models' logits (magnitude ~0.5): at most 5e-3 anywhere, 2.5e-4 on average (seen: 1.8e-3,
        # 1.6e-4 in a 40-token prefill; transformers with bfloat16 weights alone is 3e-4 away on average)
        diff = (out.logits - expected_logits(same_products, where)).abs()
        assert diff.max() <= 5e-3 and diff.mean() <= 2.5e-4
        # transformers in bfloat16 rounds every activation, the residual stream and the logits too: within 2% of the
        # largest logit (seen: below 1%)
        bf16 = expected_logits(hf_bf16, where)
        assert (out.logits - bf16).abs().max() <= 0.02 * max(1.0, bf16.abs().max().item())


def bf16_engine(folder, spec=None, **kwargs):
    return make_engine(folder, spec, dtype="bfloat16", **kwargs)


MAX_TOKENS = 24
_PLAIN: dict = {}


def plain_bf16(folder, path, concurrency=1) -> list[list[int]]:
    """Plain decoding's outputs in the mode, scheduled as the speculative run is (its prefill chunks)."""
    key = (str(folder), path, concurrency)
    if key not in _PLAIN:
        engine = bf16_engine(folder, **SCENARIOS[concurrency])
        _PLAIN[key] = [o.token_ids for o in engine.generate(PROMPTS, greedy(MAX_TOKENS))]
    return _PLAIN[key]


@pytest.mark.parametrize("on_path", PATHS, indirect=True)
def test_the_engine_runs_the_mode_around_a_float32_residual_stream(tiny_llama, on_path):
    engine = bf16_engine(tiny_llama)
    assert engine.compute == torch.bfloat16 and engine.dtype == torch.float32  # residual stream, K/V, logits
    assert engine.cache.k.dtype == torch.float32
    assert engine.model.packed_lm_head.format == kernels.PAIR_PATHS[on_path]
    assert {"amx": "AMX", "avx512_bf16": "vdpbf16ps", "widened": "widened"}[on_path] in engine.products
    first = SamplingParams(max_tokens=1, ignore_eos=True, logprobs=True)  # each prompt's first token: same context
    float32 = [o.logprobs[0] for o in make_engine(tiny_llama).generate(PROMPTS, first)]
    bf16 = [o.logprobs[0] for o in engine.generate(PROMPTS, first)]
    assert float32 != bf16  # the mode computes otherwise than float32 (its tokens may still agree)
    assert max(abs(a - b) for a, b in zip(float32, bf16)) < 0.1  # bfloat16 rounding apart


@pytest.mark.parametrize("on_path", PATHS, indirect=True)
def test_heads_with_bfloat16_weights_multiply_in_the_engines_mode(on_path, tiny_llama, tmp_path):
    """In the mode a head's bfloat16 products run as the target's (pair panels), its layer in kernels.c's layer calls;
    over the whole vocabulary it drafts with the target's own packed LM head. float32 draft weights stay float32
    products."""
    engine = bf16_engine(tiny_llama, spec_config("eagle", random_head_dir("eagle", tiny_llama, tmp_path)))
    head = engine.speculator.drafter.head
    assert isinstance(head.layer, kernels.KernelLayer)
    assert head.fc.format == kernels.PAIR_PATHS[on_path] and head.layer.reference.qkv.format == kernels.PAIR_PATHS[on_path]
    assert head.target.lm_head is engine.model.packed_lm_head
    float32 = bf16_engine(tiny_llama, {**spec_config("eagle", random_head_dir("eagle", tiny_llama, tmp_path)),
                                       "draft_weights": "float32"}).speculator.drafter.head
    assert float32.fc.compute == torch.float32 and float32.fc.format not in kernels.PAIR_PATHS.values()


SPECS = {  # every drafter kind, chains and a tree
    "ngram": lambda folder, root: {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                   "prompt_lookup_max": 2},
    "suffix": lambda folder, root: {"method": "suffix", "num_speculative_tokens": 4},
    "medusa-chain": lambda folder, root: spec_config("medusa", random_head_dir("medusa", folder, root)),
    "eagle-chain": lambda folder, root: spec_config("eagle", random_head_dir("eagle", folder, root)),
    "eagle3-chain": lambda folder, root: spec_config("eagle3", random_head_dir("eagle3", folder, root)),
    "eagle3-tree": lambda folder, root: dict(spec_config("eagle3", random_head_dir("eagle3", folder, root)), topk=3,
                                             num_draft_tokens=8),
    "mtp-chain": lambda folder, root: spec_config("mtp", random_head_dir("mtp", folder, root)),
    "peagle-chain": lambda folder, root: {"method": "peagle", "model": peagle_head_dir(folder, root),
                                          "num_speculative_tokens": 4},
    "dflash-chain": lambda folder, root: {"method": "dflash", "model": random_dflash_dir(folder, root),
                                          "num_speculative_tokens": 3},
    "dspark-chain": lambda folder, root: {"method": "dspark", "model": random_dspark_dir(folder, root),
                                          "num_speculative_tokens": 4},
}


@pytest.mark.parametrize("on_path", PATHS, indirect=True)
@pytest.mark.parametrize("concurrency", [1, 8])
@pytest.mark.parametrize("drafter", list(SPECS))
def test_speculation_reproduces_plain_greedy_in_the_mode(drafter, concurrency, on_path, tiny_llama, tmp_path_factory):
    engine = bf16_engine(tiny_llama, SPECS[drafter](tiny_llama, tmp_path_factory.mktemp("heads")),
                         **SCENARIOS[concurrency])
    outputs = engine.generate(PROMPTS, greedy(MAX_TOKENS))
    assert [o.token_ids for o in outputs] == plain_bf16(tiny_llama, on_path, concurrency)
    assert_pool_idle(engine)
    assert sum(engine.speculator.stats.proposed) > 0, "nothing was drafted: the case tests nothing"
    if concurrency == 8:
        assert sum(o.metrics["num_preemptions"] for o in outputs) > 0


@pytest.mark.skipif(kernels.library() is None, reason="the kernels do not build here")
def test_an_avx2_build_loads_and_widens_as_the_avx512_build_does(monkeypatch, tmp_path):
    """The library built for an AVX2-only CPU (Zen 3: no -mavx512f) still holds the dot products under their own
    target attribute and loads; its widened path sums each output in the same order as the AVX-512 build's (6-row
    tiles instead of 12), so the same bits."""
    monkeypatch.setenv(BF16_PATH_ENV, "widened")
    _, wide512 = bf16_linear(577, 100)
    x = torch.randn(17, 577)
    expected = wide512(x)
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "compile_flags", lambda: kernels.FLAGS)
    kernels.library.cache_clear()
    try:
        layer, wide2 = bf16_linear(577, 100)
        assert wide2.lib is not None and wide2.lib is not wide512.lib
        assert torch.equal(wide2(x), expected)
        for i in (0, 5, 16):
            assert torch.equal(wide2(x[i:i + 1]), expected[i:i + 1])
    finally:
        monkeypatch.undo()
        kernels.library.cache_clear()


@pytest.mark.parametrize("on_path", PATHS, indirect=True)
def test_sampled_trees_in_the_mode_keep_the_target_law(on_path, v8_target, tmp_path):
    """Sampling with an EAGLE-3 tree in the mode: the two tokens after the prefill's follow the target's law within
    the noise floor (6,000 draws). The law is float32 transformers'; the mode's differs from it by bfloat16 rounding
    of the products' inputs, far below the floor at a vocabulary of 8."""
    num = 6000
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=4, ignore_eos=True) for i in range(num)]
    law, _, _ = two_token_law(v8_target, E2E_PROMPT, params[0])
    spec = dict(spec_config("eagle3", random_head_dir("eagle3", v8_target, tmp_path), k=2), topk=2, num_draft_tokens=4)
    engine = bf16_engine(v8_target, spec, block_size=4, num_blocks=1024, max_model_len=64, max_num_seqs=256,
                         max_num_batched_tokens=4096)
    assert engine.compute == torch.bfloat16
    outputs = engine.generate([E2E_PROMPT] * num, params)
    assert_pool_idle(engine)
    stats = engine.speculator.stats
    assert stats.proposed[0] >= num and 0 < stats.accepted[0] < stats.reached[0]
    assert_two_token_law(outputs, law)
