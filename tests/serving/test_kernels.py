"""The inference layers of serving/kernels.py against torch's: PackedLinear against F.linear, FusedRMSNorm
against heads' RMSNorm, at the row counts and odd sizes the engine meets; the kernel's batch invariance; and
the fallback to torch's operators when the kernels cannot be built."""
from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from heads.layer import DecoderLayer, LayerConfig, RMSNorm
from heads.rope import Rope
from serving import kernels

HAS_AVX2 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@pytest.fixture
def no_kernels(monkeypatch):
    monkeypatch.setenv("DRAFTHEADS_KERNELS", "torch")
    kernels.library.cache_clear()
    yield
    monkeypatch.undo()
    kernels.library.cache_clear()


def linear(in_features, out_features, bias):
    torch.manual_seed(in_features * 1000 + out_features)
    return nn.Linear(in_features, out_features, bias=bias).requires_grad_(False)


@pytest.mark.skipif(not HAS_AVX2 or shutil.which("cc") is None, reason="needs AVX2 and a C compiler")
def test_kernels_build_on_this_machine():
    assert kernels.library() is not None
    assert kernels.PackedLinear(linear(8, 8, False)).lib is not None


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 16, 33])
@pytest.mark.parametrize("in_features,out_features", [(1, 1), (7, 23), (64, 24), (64, 25), (64, 40), (37, 100)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows, in_features, out_features, bias):
    layer = linear(in_features, out_features, bias)
    x = torch.randn(rows, in_features)
    torch.testing.assert_close(kernels.PackedLinear(layer)(x), F.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("rows", [1, 2, 5, 7, 12, 13, 25])
@pytest.mark.parametrize("in_features,out_features", [(1, 1), (7, 23), (64, 25), (64, 40), (37, 100), (576, 100),
                                                        (96, 150)])
@pytest.mark.parametrize("kernels_run", [True, False])
def test_bfloat16_weights_compute_in_float32_over_the_rounded_weights(rows, in_features, out_features, kernels_run,
                                                                       monkeypatch):
    if not kernels_run:
        monkeypatch.setenv("DRAFTHEADS_KERNELS", "torch")
    kernels.library.cache_clear()
    try:
        layer = linear(in_features, out_features, True)
        packed = kernels.PackedLinear(layer, torch.bfloat16)
        x = torch.randn(rows, in_features)
        rounded = layer.weight.to(torch.bfloat16).float()
        assert not torch.equal(rounded, layer.weight)  # the rounding is visible ...
        out = packed(x)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, F.linear(x, rounded, layer.bias))  # ... and the layer computes with it
        if packed.lib is not None:
            assert packed.panels.dtype == torch.bfloat16
            assert packed.panels.nbytes * 2 == kernels.PackedLinear(layer).panels.nbytes
            for i in range(rows):  # still one in-order sum per output
                assert torch.equal(out[i:i + 1], packed(x[i:i + 1]))
    finally:
        monkeypatch.undo()
        kernels.library.cache_clear()


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 13, 25])
@pytest.mark.parametrize("in_features,out_features", [(1, 1), (7, 23), (64, 25), (37, 100), (576, 100), (96, 150)])
@pytest.mark.parametrize("kernels_run", [True, False])
def test_int8_weights_compute_over_each_row_s_scale(rows, in_features, out_features, kernels_run, monkeypatch):
    """draft_weights "int8": each output's int8 weights over a float32 scale of its own, the largest magnitude of its
    row at 127; the layer computes with those values, in float32, still one in-order sum per output."""
    if not kernels_run:
        monkeypatch.setenv("DRAFTHEADS_KERNELS", "torch")
    kernels.library.cache_clear()
    try:
        layer = linear(in_features, out_features, True)
        layer.weight[0] = 0.0  # a row of zeros keeps scale 1 and its zeros
        quantized, scale = kernels.quantize_int8(layer.weight)
        assert quantized.dtype == torch.int8 and quantized.abs().amax(1).tolist() == [0] + [127] * (out_features - 1)
        values = quantized * scale[:, None]
        assert (values - layer.weight).abs().max() <= scale.max() / 2 * 1.0001  # rounded to nearest
        packed = kernels.PackedLinear(layer, torch.int8)
        x = torch.randn(rows, in_features)
        out = packed(x)
        torch.testing.assert_close(out, F.linear(x, values, layer.bias), atol=1e-5, rtol=1e-5)
        assert torch.equal(packed.matrix(), values)
        if packed.lib is not None:
            assert packed.panels.dtype == torch.int8
            scales = -(-out_features // kernels.PANEL) * kernels.PANEL * 4
            assert packed.panels.nbytes == kernels.PackedLinear(layer).panels.nbytes // 4 + scales  # a quarter, and scales
            for i in range(rows):
                assert torch.equal(out[i:i + 1], packed(x[i:i + 1]))
    finally:
        monkeypatch.undo()
        kernels.library.cache_clear()


def test_for_inference_stores_every_linear_in_the_weight_dtype():
    layer = kernels.for_inference(DecoderLayer(LayerConfig(hidden_size=64, num_heads=4, num_kv_heads=2,
                                                           intermediate_size=96)), torch.bfloat16)
    linears = [layer.qkv, layer.o, layer.gate_up, layer.down]
    assert all(linear.weight_dtype == torch.bfloat16 for linear in linears)
    with pytest.raises(ValueError, match="float16"):
        kernels.PackedLinear(linear(8, 8, False), torch.float16)


def test_packed_linear_takes_any_leading_shape_and_strides():
    layer = linear(48, 30, True)
    packed = kernels.PackedLinear(layer)
    x = torch.randn(3, 5, 48)
    torch.testing.assert_close(packed(x), F.linear(x, layer.weight, layer.bias))
    wide = torch.randn(6, 100)[:, 10:58]  # rows strided past their length
    torch.testing.assert_close(packed(wide), F.linear(wide, layer.weight, layer.bias))
    transposed = torch.randn(48, 6).t()  # columns not contiguous
    torch.testing.assert_close(packed(transposed), F.linear(transposed, layer.weight, layer.bias))
    assert packed(torch.randn(0, 48)).shape == (0, 30)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_packed_linear_rows_do_not_depend_on_the_batch(weight_dtype):
    """A verify step's logits equal, bit for bit, what one-row decode steps compute (kernels.c sums in order),
    with weights stored in either dtype."""
    packed = kernels.PackedLinear(linear(576, 100, False), weight_dtype)
    if packed.lib is None:
        pytest.skip("the kernels do not run here")
    x = torch.randn(25, 576)
    alone = [packed(x[i:i + 1]) for i in range(len(x))]
    for num_rows in range(2, len(x) + 1):  # every remainder of a tile of 6 or 12 rows, and two tiles and more
        together = packed(x[:num_rows])
        for i in range(num_rows):
            assert torch.equal(together[i:i + 1], alone[i])


@pytest.mark.parametrize("weight_dtype, compute", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                   (torch.bfloat16, torch.bfloat16)])
def test_packed_linear_unpacks_its_stored_weights(weight_dtype, compute):
    """matrix() gives back the [out, in] weights the panels hold (odd sizes: padded panels and pairs)."""
    layer = linear(37, 45, False)
    packed = kernels.PackedLinear(layer, weight_dtype, compute)
    matrix = packed.matrix()
    assert matrix.dtype == weight_dtype and matrix.shape == (45, 37)
    assert torch.equal(matrix, layer.weight.to(weight_dtype))


def test_packed_linear_refuses_other_dtypes():
    packed = kernels.PackedLinear(linear(8, 8, False))
    if packed.lib is None:
        pytest.skip("the kernels do not run here")
    with pytest.raises(TypeError, match="float64"):
        packed(torch.randn(2, 8, dtype=torch.float64))


@pytest.mark.parametrize("shape", [(1, 64), (5, 576), (70, 33), (2, 3, 64)])
def test_fused_rms_norm_matches_rms_norm(shape):
    norm = RMSNorm(shape[-1], 1e-5).requires_grad_(False)
    norm.weight.copy_(torch.randn(shape[-1]))
    x = torch.randn(shape) * 3
    torch.testing.assert_close(kernels.FusedRMSNorm(norm)(x), norm(x))


def test_for_inference_keeps_a_decoder_layer_exact():
    config = LayerConfig(hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96, qkv_bias=True, qk_norm=True)
    torch.manual_seed(0)
    layer = DecoderLayer(config).requires_grad_(False)
    for norm in (layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm):
        norm.weight.copy_(torch.rand_like(norm.weight) + 0.5)
    hidden = torch.randn(2, 9, 64)
    cos, sin = torch.ones(9, 1, 16), torch.zeros(9, 1, 16)
    dense = lambda _, q, k, v: F.scaled_dot_product_attention(  # noqa: E731
        q.transpose(1, 2), k.repeat_interleave(2, 2).transpose(1, 2), v.repeat_interleave(2, 2).transpose(1, 2),
        is_causal=True).transpose(1, 2)
    expected = layer(hidden, cos, sin, dense)
    fast = kernels.for_inference(layer)
    assert all(isinstance(getattr(fast, name), kernels.PackedLinear) for name in ("qkv", "o", "gate_up", "down"))
    assert all(isinstance(getattr(fast, name), kernels.FusedRMSNorm)
               for name in ("input_norm", "post_norm", "q_norm", "k_norm"))
    torch.testing.assert_close(fast(hidden, cos, sin, dense), expected)


def test_without_kernels_the_layers_run_torch(no_kernels):
    assert kernels.library() is None
    layer = linear(40, 30, True)
    packed = kernels.PackedLinear(layer)
    assert packed.lib is None and packed.panels is None
    x = torch.randn(4, 40)
    torch.testing.assert_close(packed(x), F.linear(x, layer.weight, layer.bias))
    assert torch.equal(kernels.PackedLinear(layer, torch.bfloat16).matrix(), layer.weight.to(torch.bfloat16))
    norm = RMSNorm(40, 1e-6)
    assert kernels.FusedRMSNorm(norm)(x).equal(norm(x))


def test_a_failed_build_warns_and_falls_back(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    kernels.library.cache_clear()
    try:
        if not HAS_AVX2:
            pytest.skip("without AVX2 the kernels are never built")
        with caplog.at_level("WARNING"):
            assert kernels.library() is None
        assert "could not compile" in caplog.text and "no-such-compiler" in caplog.text
        assert not list((tmp_path / "kernels").glob("*.so"))
    finally:
        monkeypatch.undo()
        kernels.library.cache_clear()


def shuffled_pool(num_kv, head_dim, query_lens, context_lens, num_blocks, block_size=4):
    """A two-layer K/V pool of random keys and values, and the metadata of sequences of those lengths whose blocks
    are spread over it in a random order."""
    from serving.attention import KVCache, PagedMetadata

    cache = KVCache(2, num_blocks, block_size, num_kv, head_dim, torch.float32, "cpu")
    cache.k.normal_()
    cache.v.normal_()
    order = torch.randperm(num_blocks).tolist()
    tables, used = [], 0
    for context in context_lens:
        count = -(-context // block_size)
        tables.append(order[used:used + count])
        used += count
    return cache, PagedMetadata.build(query_lens, context_lens, tables, block_size, "cpu")


@pytest.mark.parametrize("num_heads,num_kv,head_dim", [(4, 4, 8), (9, 3, 64), (8, 2, 16), (4, 2, 128), (2, 1, 96)])
def test_paged_attention_kernel_matches_torch(num_heads, num_kv, head_dim):
    """Decode and verify rows of sequences at different lengths, over shuffled blocks: the C kernel against
    the torch path on the same pool and metadata."""
    from serving.attention import PagedAttention

    torch.manual_seed(num_heads * head_dim)
    query_lens = [1, 5, 16, 3, 1, 4]
    cache, meta = shuffled_pool(num_kv, head_dim, query_lens, [1, 37, 16, 200, 9, 600], num_blocks=240)
    tokens = sum(query_lens)
    q = torch.randn(tokens, num_heads + num_kv, head_dim)[:, :num_heads]  # strided, as the layer passes it
    k, v = torch.randn(tokens, num_kv, head_dim), torch.randn(tokens, num_kv, head_dim)
    fast = PagedAttention(cache, meta)
    if fast.lib is None:
        pytest.skip("the kernels do not run here")
    reference = PagedAttention(cache, meta, use_kernel=False)
    torch.testing.assert_close(fast(1, q, k, v), reference(1, q, k, v))


@pytest.mark.skipif(kernels.library() is None or kernels.compile_flags() == kernels.FLAGS,
                    reason="the kernels do not build here, or this CPU has no AVX-512 build to compare")
@pytest.mark.parametrize("num_heads,num_kv,head_dim", [(9, 3, 64), (8, 2, 16), (4, 1, 256), (2, 1, 96), (5, 1, 64)])
def test_attention_with_avx512_gives_the_avx2_build_s_bits(num_heads, num_kv, head_dim, monkeypatch, tmp_path):
    """The AVX-512 build's attention (two 8-lane sums to a register, every head of a key-value head at once) adds
    the same numbers in the same order as the AVX2 build (Zen 3): decode rows, verify rows and a sequence long
    enough to split into chunks, bit for bit."""
    from serving.attention import PagedAttention

    torch.manual_seed(head_dim)
    query_lens = [1, 17, 5, 1]
    cache, meta = shuffled_pool(num_kv, head_dim, query_lens, [9, 300, 40, 600], num_blocks=300)
    q = torch.randn(sum(query_lens), num_heads, head_dim)
    k, v = torch.randn(sum(query_lens), num_kv, head_dim), torch.randn(sum(query_lens), num_kv, head_dim)
    avx512 = PagedAttention(cache, meta)
    wide = avx512(1, q, k, v)
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "compile_flags", lambda: kernels.FLAGS)
    kernels.library.cache_clear()
    try:
        narrow = PagedAttention(cache, meta)
        assert narrow.lib is not None and narrow.lib is not avx512.lib
        assert torch.equal(narrow(1, q, k, v), wide)
    finally:
        monkeypatch.undo()
        kernels.library.cache_clear()


@pytest.mark.parametrize("rows", [1, 3, 5, 16])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 23, 4096, 49157])
def test_argmax_matches_torch_with_ties_and_nans(rows, n):
    """The first index of the largest value on ties, the first NaN when a row has one, on strided rows."""
    if kernels.library() is None:
        pytest.skip("the kernels do not run here")
    torch.manual_seed(rows * n)
    cases = [torch.randn(rows, n), torch.randint(0, 3, (rows, n)).float(), torch.full((rows, n), -float("inf")),
             torch.randn(rows, n + 5)[:, 2:2 + n]]
    with_nans = torch.randn(rows, n)
    with_nans[0, n // 2] = with_nans[-1, n - 1] = float("nan")
    cases.append(with_nans)
    for x in cases:
        assert kernels.argmax(x) == x.argmax(-1).tolist()
    # the largest value where a lane's later entries are all smaller and the row's tail holds the maximum
    x = torch.zeros(rows, n)
    x[:, -1] = 1.0
    assert kernels.argmax(x) == [n - 1] * rows


def test_argmax_falls_back_to_torch(no_kernels):
    x = torch.randn(3, 50)
    assert kernels.argmax(x) == x.argmax(-1).tolist()
    assert kernels.argmax(x.to(torch.bfloat16)) == x.to(torch.bfloat16).argmax(-1).tolist()


@pytest.mark.parametrize("shape,num", [((1, 4096), 1), ((8, 4096), 8), ((3, 5, 1001), 10), ((2, 13), 13), ((4, 7), 3)])
def test_top_log_probs_match_torch(shape, num):
    """kernels.top_log_probs against log_softmax(x / t).topk: the same indices in the same order, the log-probabilities
    within a few ulps, at one temperature and at one per row (broadcast as [..., 1]), row lengths past and short of
    whole vectors; rows strided past their length."""
    torch.manual_seed(num)
    x = torch.randn(*shape) * 4
    per_row = torch.rand(*shape[:-1], 1) * 2 + 0.25
    for temperature in (0.7, per_row):
        expected = (x / temperature).log_softmax(-1).topk(num, dim=-1)
        log_probs, indices = kernels.top_log_probs(x, num, temperature)
        assert torch.equal(indices, expected.indices)
        torch.testing.assert_close(log_probs, expected.values, atol=2e-6, rtol=0)
    wide = torch.randn(3, shape[-1] + 5)[:, :shape[-1]]
    assert torch.equal(kernels.top_log_probs(wide, num, 1.0)[1], wide.log_softmax(-1).topk(num, dim=-1).indices)


def test_top_log_probs_keep_the_lower_index_first_on_ties():
    x = torch.full((2, 40), -1.0)
    x[0, [3, 17, 30]] = 2.0  # three equal largest
    x[1, [9, 35]] = 1.0
    x[1, 20] = 3.0
    log_probs, indices = kernels.top_log_probs(x, 3, 1.0)
    assert indices.tolist() == [[3, 17, 30], [20, 9, 35]]
    assert log_probs[0, 0] == log_probs[0, 2] and log_probs[1, 1] == log_probs[1, 2]


def test_top_log_probs_fall_back_to_torch(no_kernels):
    x = torch.randn(3, 50)
    expected = (x / 0.5).log_softmax(-1).topk(4, dim=-1)
    log_probs, indices = kernels.top_log_probs(x, 4, 0.5)
    assert torch.equal(indices, expected.indices) and torch.equal(log_probs, expected.values)


def random_tree(num_nodes: int, depth: int, generator: torch.Generator):
    """A random draft tree of `num_nodes` nodes exactly `depth` deep with a node of two children or more (redrawn
    until it is)."""
    from serving.spec_decode.tree import DraftTree

    while True:
        parents, depths = [], []
        for i in range(num_nodes):
            choices = [-1] + [j for j in range(i) if depths[j] < depth]
            parent = choices[int(torch.randint(len(choices), (), generator=generator))]
            parents.append(parent)
            depths.append(1 if parent < 0 else depths[parent] + 1)
        tree = DraftTree(tuple(range(num_nodes)), tuple(parents))
        if tree.depth == depth and max(map(len, tree.children)) >= 2:
            return tree


@pytest.mark.parametrize("contexts", [(43, 20), (254, 520)])
def test_tree_rows_attend_as_decode_steps_at_their_position(contexts):
    """Two sequences verify a random tree each (7 nodes 3 deep after 3 query rows and 43 keys; 5 nodes 2 deep after
    1 query row and 20 keys; and again after 254 and 520 keys, whose rows span the kernel's chunks of 256 keys:
    the first tree's paths cross a chunk's end), over shuffled blocks of 16. Each tree row's kernel output equals, bit for bit, a decode
    step at its node's position whose context holds the same keys (the context, then its path's K/V, written into
    the slots of those positions of another table in a copy of the pool); the query rows are those of the same step
    without trees; the torch path agrees with the kernel; and both agree with dense attention under the explicit
    ancestor mask, computed here in plain torch."""
    from serving.attention import KVCache, PagedAttention, PagedMetadata

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    block_size, num_heads, num_kv, head_dim, layer = 16, 9, 3, 64, 1
    seqs = [(3, contexts[0], random_tree(7, 3, g)), (1, contexts[1], random_tree(5, 2, g))]  # (query rows, context, tree)
    longest = max(-(-(context + tree.depth) // block_size) for _, context, tree in seqs)
    num_blocks = sum(-(-(context + len(tree)) // block_size) for _, context, tree in seqs) + longest
    cache = KVCache(2, num_blocks, block_size, num_kv, head_dim, torch.float32, "cpu")
    cache.k.normal_()
    cache.v.normal_()
    order, tables = torch.randperm(num_blocks).tolist(), []
    for _, context, tree in seqs:
        tables.append(order[:-(-(context + len(tree)) // block_size)])
        order = order[len(tables[-1]):]
    other_table = order[:longest]  # where the decode steps put the same keys: other blocks
    assert len(other_table) == longest and all(len(table) >= 2 for table in tables)

    def slot(table, position):
        return table[position // block_size] * block_size + position % block_size

    tree_paths = [[[slot(table, context + n) for n in tree.path(i)] for i in range(len(tree))]
                  for (_, context, tree), table in zip(seqs, tables)]
    starts = [0]
    for q_len, _, tree in seqs:
        starts.append(starts[-1] + q_len + len(tree))
    rows = starts[-1]
    q = torch.randn(rows, num_heads + num_kv, head_dim)[:, :num_heads]  # strided, as the layer passes it
    k, v = torch.randn(rows, num_kv, head_dim), torch.randn(rows, num_kv, head_dim)

    def attend(start, meta, q, k, v, torch_path=False):
        """(outputs, the pool after the step) of a step from a copy of the pool `start`."""
        pool = KVCache(2, num_blocks, block_size, num_kv, head_dim, torch.float32, "cpu")
        pool.k.copy_(start.k)
        pool.v.copy_(start.v)
        attention = PagedAttention(pool, meta, use_kernel=not torch_path)
        return attention(layer, q, k, v), pool

    query_lens, context_lens = [q_len for q_len, _, _ in seqs], [c for _, c, _ in seqs]
    meta = PagedMetadata.build(query_lens, context_lens, tables, block_size, "cpu", tree_paths)
    torch_out, torch_after = attend(cache, meta, q, k, v, torch_path=True)

    # dense attention over [context, tree nodes] with the ancestor mask, from the keys the step wrote
    dense = torch.empty(rows, num_heads, head_dim)
    group = num_heads // num_kv
    for (q_len, context, tree), table, first in zip(seqs, tables, starts):
        nodes = range(first + q_len, first + q_len + len(tree))
        context_slots = [slot(table, p) for p in range(context)]
        keys = torch.cat([torch_after.k[layer, context_slots], k[nodes]])  # [context + nodes, kv_heads, dim]
        values = torch.cat([torch_after.v[layer, context_slots], v[nodes]])
        mask = torch.zeros(q_len + len(tree), context + len(tree), dtype=torch.bool)
        for r in range(q_len):
            mask[r, :context - q_len + r + 1] = True  # causal
        for i in range(len(tree)):
            mask[q_len + i, :context] = True
            mask[q_len + i, [context + n for n in tree.path(i)]] = True  # its ancestors and itself
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[first:first + q_len + len(tree)], keys) * head_dim ** -0.5
        scores = scores.masked_fill(~mask, -float("inf"))
        dense[first:first + q_len + len(tree)] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    torch.testing.assert_close(torch_out, dense)

    out, after = attend(cache, meta, q, k, v)
    if PagedAttention(after, meta).lib is None:
        pytest.skip("the kernels do not run here (the torch path was checked against dense attention)")
    torch.testing.assert_close(out, torch_out)
    torch.testing.assert_close(out, dense)
    assert torch.equal(after.k, torch_after.k) and torch.equal(after.v, torch_after.v)  # the same writes

    real_rows = [r for (q_len, _, _), first in zip(seqs, starts) for r in range(first, first + q_len)]
    plain_meta = PagedMetadata.build(query_lens, context_lens, tables, block_size, "cpu")
    without_trees, _ = attend(cache, plain_meta, q[real_rows], k[real_rows], v[real_rows])
    assert torch.equal(out[real_rows], without_trees)

    num_checked = 0
    for (q_len, context, tree), table, first in zip(seqs, tables, starts):
        for n in range(len(tree)):  # each node's K/V sits in its slot of the tree step
            assert torch.equal(after.k[layer, slot(table, context + n)], k[first + q_len + n])
        for i in range(len(tree)):
            path, row = tree.path(i), first + q_len + i
            decode_pool = KVCache(2, num_blocks, block_size, num_kv, head_dim, torch.float32, "cpu")
            decode_pool.k.normal_()
            decode_pool.v.normal_()
            for p in range(context):
                decode_pool.k[:, slot(other_table, p)] = after.k[:, slot(table, p)]
                decode_pool.v[:, slot(other_table, p)] = after.v[:, slot(table, p)]
            for depth, node in enumerate(path[:-1]):  # the ancestors, at their positions; the row writes its own
                decode_pool.k[:, slot(other_table, context + depth)] = after.k[:, slot(table, context + node)]
                decode_pool.v[:, slot(other_table, context + depth)] = after.v[:, slot(table, context + node)]
            decode_meta = PagedMetadata.build([1], [context + len(path)], [other_table], block_size, "cpu")
            decode, _ = attend(decode_pool, decode_meta, q[row:row + 1], k[row:row + 1], v[row:row + 1])
            assert torch.equal(out[row:row + 1], decode), (i, path)
            num_checked += 1
    assert num_checked == 12


LAYER_CONFIGS = {
    "llama": dict(),
    "qwen2": dict(qkv_bias=True),
    "qwen3": dict(qk_norm=True),
}


@pytest.mark.skipif(not HAS_AVX2, reason="needs AVX2")
@pytest.mark.parametrize("weight_dtype,compute", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                  (torch.bfloat16, torch.bfloat16), (torch.int8, torch.float32)])
@pytest.mark.parametrize("family", list(LAYER_CONFIGS))
@pytest.mark.parametrize("streams", [True, False])
def test_kernel_layer_computes_the_decoder_layer(family, weight_dtype, compute, streams):
    """layer_pre, attention, layer_post against the module it wraps, at the rows of decode, verify and prefill, one
    scratch for them all (it grows, then serves fewer rows); and each row's output, with an attention that reads
    only that row, equal bit for bit alone and in any batch: 2-5 rows (row groups or tiles, by format and by whether
    the weights stream) and 13 (tiles)."""
    config = LayerConfig(hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=100, head_dim=24,
                         **LAYER_CONFIGS[family])
    torch.manual_seed(1)
    layer = DecoderLayer(config).requires_grad_(False)
    for norm in [m for m in layer.modules() if isinstance(m, RMSNorm)]:
        norm.weight.copy_(torch.rand_like(norm.weight) + 0.5)
    if config.qkv_bias:
        layer.qkv.bias.copy_(torch.randn_like(layer.qkv.bias))
    reference = kernels.for_inference(layer, weight_dtype, compute)
    fast = kernels.KernelLayer(reference, kernels.Scratch(config, 1), streams)
    rope = Rope(config.head_dim, 512)
    dense = lambda _, q, k, v: F.scaled_dot_product_attention(  # noqa: E731
        q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1), v.repeat_interleave(2, 1).transpose(0, 1),
        is_causal=True).transpose(0, 1)
    for rows in (1, 5, 40, 13):
        hidden = torch.randn(rows, 64) * 2
        cos, sin = rope.tables(torch.randint(0, 512, (rows,)))
        torch.testing.assert_close(fast(hidden, cos, sin, dense), reference(hidden, cos, sin, dense),
                                   atol=1e-5, rtol=1e-5)
    own_row = lambda _, q, k, v: v.repeat_interleave(2, 1) + q  # noqa: E731
    hidden = torch.randn(13, 64)
    cos, sin = rope.tables(torch.arange(100, 113))
    alone = [fast(hidden[i:i + 1], cos[i:i + 1], sin[i:i + 1], own_row) for i in range(13)]
    for num_rows in (2, 3, 4, 5, 13):
        together = fast(hidden[:num_rows], cos[:num_rows], sin[:num_rows], own_row)
        for i in range(num_rows):
            assert torch.equal(alone[i], together[i:i + 1])


@pytest.mark.skipif(not HAS_AVX2, reason="needs AVX2")
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head", ["eagle", "eagle3"])
def test_kernel_layer_computes_a_head_s_layer(head, compute):
    """A draft head's layer: EAGLE-1's without an input norm (it multiplies its input as it comes), EAGLE-3's over an
    attention input twice the hidden width that the head builds; batched leading dimensions as the heads pass them.
    Against the module it wraps, and a row's bits alone and in its batch."""
    config = LayerConfig(hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=100, head_dim=24,
                         attention_input_size=128 if head == "eagle3" else 0)
    torch.manual_seed(2)
    layer = DecoderLayer(config, input_norm=False).requires_grad_(False)
    layer.post_norm.weight.copy_(torch.rand(64) + 0.5)
    reference = kernels.for_inference(layer, torch.bfloat16 if compute == torch.bfloat16 else torch.float32, compute)
    fast = kernels.KernelLayer(reference, kernels.Scratch(config, 1), streams=False)
    rope = Rope(config.head_dim, 512)
    own_row = lambda _, q, k, v: v.repeat_interleave(2, -2) + q  # noqa: E731
    hidden = torch.randn(3, 5, 64)
    attention_input = torch.randn(3, 5, 128) if head == "eagle3" else None
    cos, sin = rope.tables(torch.randint(0, 512, (3, 5)))
    together = fast(hidden, cos, sin, own_row, attention_input=attention_input)
    assert together.shape == hidden.shape
    torch.testing.assert_close(together, reference(hidden, cos, sin, own_row, attention_input=attention_input),
                               atol=1e-5, rtol=1e-5)
    alone = fast(hidden[1, 2:3], cos[1, 2:3], sin[1, 2:3], own_row,
                 attention_input=None if attention_input is None else attention_input[1, 2:3])
    assert torch.equal(alone, together[1, 2:3])


def test_kernel_head_makes_every_llama_layer_of_a_head_a_kernel_layer():
    """kernel_head finds a head's layers wherever the head keeps them (one, a list, inside MTP's blocks), as weights
    kept in cache (the target's layers stream theirs), and leaves a head whose layers the kernels do not compute as
    it is."""
    config = LayerConfig(hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96)
    head = nn.Module()
    head.layer = kernels.for_inference(DecoderLayer(config, layer_idx=0, input_norm=False))
    head.layers = nn.ModuleList(kernels.for_inference(DecoderLayer(config, layer_idx=i)) for i in (1, 2))
    kernels.kernel_head(head)
    if kernels.library() is None:
        assert isinstance(head.layer, DecoderLayer)
        return
    assert all(isinstance(layer, kernels.KernelLayer) for layer in (head.layer, *head.layers))
    assert len({id(layer.scratch) for layer in (head.layer, *head.layers)}) == 1
    assert [entry.streams for entry in head.layer.scratch.layer_table] == [0, 0, 0]
    target = kernels.kernel_layers(nn.ModuleList(kernels.for_inference(DecoderLayer(config, layer_idx=i))
                                                 for i in (0, 1)), config)
    assert [entry.streams for entry in target[0].scratch.layer_table] == [1, 1]
    sinks = nn.Module()
    sinks.layer = kernels.for_inference(DecoderLayer(LayerConfig(64, 4, 2, 96, sinks=True)))
    assert isinstance(kernels.kernel_head(sinks).layer, DecoderLayer)


def test_kernel_layers_keep_the_modules_where_the_kernels_do_not_run(no_kernels):
    config = LayerConfig(hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96)
    layers = nn.ModuleList([kernels.for_inference(DecoderLayer(config))])
    assert kernels.kernel_layers(layers, config) is layers


@pytest.mark.skipif(not HAS_AVX2 or shutil.which("cc") is None, reason="needs AVX2 and a C compiler")
def test_the_structs_of_kernel_abi_match_kernels_c():
    """Every struct kernels.c's calls take: the same fields, in the same order, at the same offsets and sizes, and the
    same struct sizes, as serving/kernel_abi.py declares them."""
    c_side, python_side = kernels.struct_layouts(kernels.library()), kernels.python_layouts()
    assert c_side.keys() == python_side.keys()
    for name, fields in python_side.items():
        assert list(c_side[name]) == list(fields), name  # the same names in the same order
        assert c_side[name] == fields, name


def test_the_attention_metadata_reads_back_through_the_structs():
    """ShortQueries.host_arrays writes each sequence in Sequence's field order, and the AttentionBatch points at
    the arrays PagedMetadata.build describes."""
    import ctypes

    from serving.attention import PagedMetadata
    from serving.kernel_abi import Sequence

    tables = [[3, 0], [1], [4, 2]]
    meta = PagedMetadata.build([1, 2, 1], [5, 3, 6], tables, 4, "cpu", tree_paths=[[], [], [[9], [9, 10]]])
    host, batch = meta.kernel_arrays
    seqs = (Sequence * batch.num_seqs).from_address(batch.seqs)
    assert [(s.first_row, s.query_rows, s.context, s.tree_rows, s.first_path) for s in seqs] == [
        (0, 1, 5, 0, 0), (1, 2, 3, 0, 0), (3, 1, 6, 2, 0)]
    longs = lambda address, count: list((ctypes.c_long * count).from_address(address))
    assert longs(batch.new_slots, batch.num_new) == meta.new_slots == [4 * 0 + 0, 4 * 1 + 1, 4 * 1 + 2, 4 * 2 + 1, 9, 10]
    assert longs(batch.slots, batch.num_seqs * batch.slot_stride) == [12, 13, 14, 15, 0, 0,
                                                                      4, 5, 6, 0, 0, 0,
                                                                      16, 17, 18, 19, 8, 9]
    assert longs(batch.paths, 2 * batch.path_stride) == [1, 9, 0, 2, 9, 10]
