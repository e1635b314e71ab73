"""The engine's `Model` over `PagedAttention` against Hugging Face transformers, logits and hidden states.

Every test runs the same token sequences through transformers once (whole sequences, dense causal
attention) and through the engine's model in steps: whole-prompt prefill, chunked prefill split at odd
points, decode steps, and several sequences in one flattened batch at different stages, with block
tables made of shuffled, non-contiguous block ids. A causal model's logits at position p depend only
on tokens 0..p, so the dense forward is the reference for every row of every step.

Hidden-state conventions checked here: `return_hidden=True` gives the final hidden state after the final
norm (HF `hidden_states[-1]`), `aux_layers=(i,)` gives the input of layer i (HF `hidden_states[i]`).
"""
from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from serving.attention import KVCache, PagedAttention, PagedMetadata
from serving.model import Model


DENSE = ["tiny_llama", "tiny_qwen2", "tiny_qwen3", "tiny_llama_rope3"]  # the C layers' families
TINY = [*DENSE, "tiny_qwen3_moe", "tiny_gemma3", "tiny_gpt_oss"]
# Long enough that llama3 rope scaling (original context 64) matters, and that every sequence spans many blocks.
SEQ_LENS = (90, 75, 83)


@pytest.fixture(scope="module", params=TINY)
def pair(request):
    """(engine model, HF model, fixture name) for one tiny family, both float32."""
    folder = request.getfixturevalue(request.param)
    model = Model.from_folder(folder, torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, hf, request.param


def make_sequences(lengths, seed=0, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


@torch.no_grad()
def hf_reference(hf, seqs):
    """Per sequence: (logits [len, vocab], hidden_states tuple of [len, hidden]) from one dense forward."""
    refs = []
    for ids in seqs:
        out = hf(ids[None], output_hidden_states=True)
        refs.append((out.logits[0].float(), [h[0] for h in out.hidden_states]))
    return refs


class PagedRun:
    """Drives `Model.forward` step by step over a shared K/V pool, the way the model runner does, but with
    hand-built block tables: every sequence gets a shuffled, non-contiguous set of block ids."""

    def __init__(self, model, seqs, block_size, dtype=torch.float32, seed=0, num_spare_blocks=7):
        c = model.config
        self.model, self.seqs, self.block_size = model, seqs, block_size
        needed = [-(-len(s) // block_size) for s in seqs]
        num_blocks = sum(needed) + num_spare_blocks
        ids = list(range(num_blocks))
        random.Random(seed).shuffle(ids)
        self.tables, start = [], 0
        for n in needed:
            self.tables.append(ids[start:start + n])
            start += n
        assert any(t != sorted(t) for t in self.tables)  # really non-contiguous
        self.cache = KVCache(c.num_layers, num_blocks, block_size, c.layer.num_kv_heads, c.layer.head_dim, dtype, "cpu",
                             c.windows, c.layer.attention_scale, model.attention_sinks())
        self.computed = [0] * len(seqs)

    def step(self, plan, logits_rows=None, **kwargs):
        """plan: [(sequence index, number of new tokens)] in batch order. Returns (ModelOutput, [(seq, positions)])."""
        ids, positions, query_lens, context_lens, tables, where = [], [], [], [], [], []
        for s, n in plan:
            start = self.computed[s]
            assert start + n <= len(self.seqs[s])
            ids.append(self.seqs[s][start:start + n])
            positions.append(torch.arange(start, start + n))
            query_lens.append(n)
            context_lens.append(start + n)
            tables.append(self.tables[s])
            where.append((s, list(range(start, start + n))))
            self.computed[s] += n
        meta = PagedMetadata.build(query_lens, context_lens, tables, self.block_size, "cpu")
        out = self.model(torch.cat(ids), torch.cat(positions), PagedAttention(self.cache, meta), logits_rows, **kwargs)
        return out, where


def expected_logits(refs, where):
    return torch.cat([refs[s][0][positions] for s, positions in where])


def expected_hidden(refs, where, index):
    return torch.cat([refs[s][1][index][positions] for s, positions in where])


def chunked_plan(length, chunks):
    """Prefill in the given chunk sizes, then the rest as decode steps of one token."""
    plan, done = [], 0
    for c in chunks:
        plan.append(c)
        done += c
    plan.extend([1] * (length - done))
    return plan


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_whole_prompt_prefill_then_decode(pair, block_size):
    model, hf, _ = pair
    seqs = make_sequences(SEQ_LENS[:1])
    refs = hf_reference(hf, seqs)
    run = PagedRun(model, seqs, block_size)
    prompt_len = 70  # > 64: past the llama3 original context inside the prompt already
    out, where = run.step([(0, prompt_len)])
    torch.testing.assert_close(out.logits, expected_logits(refs, where))
    for _ in range(len(seqs[0]) - prompt_len):
        out, where = run.step([(0, 1)])
        torch.testing.assert_close(out.logits, expected_logits(refs, where))


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_chunked_prefill_at_odd_points(pair, block_size):
    model, hf, _ = pair
    seqs = make_sequences(SEQ_LENS[:1], seed=1)
    refs = hf_reference(hf, seqs)
    run = PagedRun(model, seqs, block_size, seed=1)
    # 7 and 13 run in the padded short-query path, 1 is a lone token mid-prompt, 20 and 17 are long chunks
    # over earlier context (their own masked path), then decode.
    for n in chunked_plan(len(seqs[0]), [7, 13, 1, 20, 17, 5]):
        out, where = run.step([(0, n)])
        torch.testing.assert_close(out.logits, expected_logits(refs, where))


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_mixed_batch_of_sequences_at_different_stages(pair, block_size):
    """Three sequences in one flattened batch: one prefilling in chunks while the others prefill whole or decode."""
    model, hf, _ = pair
    seqs = make_sequences(SEQ_LENS, seed=2)
    refs = hf_reference(hf, seqs)
    run = PagedRun(model, seqs, block_size, seed=2)
    steps = [
        [(0, 40), (1, 7)],  # a whole prompt beside a first chunk
        [(1, 13), (0, 1), (2, 30)],  # chunk over context, decode, a long whole prompt
        [(2, 1), (0, 1), (1, 1)],  # three decodes: the pure-decode fast path
        [(0, 1), (1, 25), (2, 1)],  # long chunk over context between two decodes
        [(1, 9), (2, 3), (0, 1)],  # several short queries of different lengths
    ]
    for plan in steps:
        out, where = run.step(plan)
        torch.testing.assert_close(out.logits, expected_logits(refs, where))
    while any(run.computed[s] < len(seqs[s]) for s in range(len(seqs))):
        plan = [(s, 1) for s in (2, 0, 1) if run.computed[s] < len(seqs[s])]
        out, where = run.step(plan)
        torch.testing.assert_close(out.logits, expected_logits(refs, where))
    assert run.computed == [len(s) for s in seqs]


@pytest.mark.parametrize("block_size", [1, 16])
def test_batch_of_sequences_at_equal_lengths(pair, block_size):
    """Equal context lengths: decode rows that see every key (no mask needed), and equal short chunks."""
    model, hf, _ = pair
    seqs = make_sequences((80, 80, 80), seed=6)
    refs = hf_reference(hf, seqs)
    run = PagedRun(model, seqs, block_size, seed=6)
    steps = [[(0, 40), (1, 40), (2, 40)]]
    steps += [[(2, 1), (0, 1), (1, 1)]] * 5
    steps += [[(1, 4), (0, 4), (2, 4)], [(0, 1), (1, 1)], [(2, 1)]]
    steps += [[(0, 1), (1, 1), (2, 1)]] * 30
    for plan in steps:
        out, where = run.step(plan)
        torch.testing.assert_close(out.logits, expected_logits(refs, where))


def test_logits_rows_selects_rows(pair):
    model, hf, _ = pair
    seqs = make_sequences(SEQ_LENS[:2], seed=3)
    refs = hf_reference(hf, seqs)
    run = PagedRun(model, seqs, 3, seed=3)
    out, where = run.step([(0, 20), (1, 11)], logits_rows=torch.tensor([19, 30]))
    torch.testing.assert_close(out.logits, torch.stack([refs[0][0][19], refs[1][0][10]]))
    out, where = run.step([(0, 1), (1, 1)], logits_rows=torch.tensor([], dtype=torch.long))
    assert out.logits is None


# Gemma scales its embedding by sqrt(hidden) and its norms by 1 + w: a residual stream ~10x larger than the other
# families', whose float32 rounding (transformers' op order against ours) reaches ~3e-5 by the last layer.
HIDDEN_TOLERANCE = {"tiny_gemma3": dict(rtol=1e-5, atol=1e-4)}


@pytest.mark.parametrize("block_size", [3, 16])
def test_hidden_state_taps_match_hf_hidden_states(pair, block_size):
    model, hf, fixture = pair
    tolerance = HIDDEN_TOLERANCE.get(fixture, {})
    num_layers = model.config.num_layers
    seqs = make_sequences(SEQ_LENS[:2], seed=4)
    refs = hf_reference(hf, seqs)
    run = PagedRun(model, seqs, block_size, seed=4)
    aux_layers = (0, 2, num_layers - 1)
    for plan in ([(0, 30), (1, 5)], [(1, 21), (0, 1)], [(0, 1), (1, 1)]):
        num_tokens = sum(n for _, n in plan)
        last_rows = torch.tensor([num_tokens - 1])
        out, where = run.step(plan, logits_rows=last_rows, return_hidden=True, aux_layers=aux_layers)
        # hidden covers every scheduled token, whatever rows get logits
        assert out.hidden.shape == (num_tokens, model.config.layer.hidden_size)
        torch.testing.assert_close(out.hidden, expected_hidden(refs, where, -1), **tolerance)
        assert sorted(out.aux) == sorted(aux_layers)
        for layer in aux_layers:
            torch.testing.assert_close(out.aux[layer], expected_hidden(refs, where, layer), msg=f"aux layer {layer}",
                                       **tolerance)
        torch.testing.assert_close(out.logits, expected_logits(refs, where)[-1:])
    # Without asking, nothing extra comes back.
    out, _ = run.step([(0, 1)])
    assert out.hidden is None and out.aux == {}


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3"])
def test_bfloat16_runs_and_stays_close_to_float32(fixture, request):
    folder = request.getfixturevalue(fixture)
    model32 = Model.from_folder(folder, torch.float32)
    model16 = Model.from_folder(folder, torch.bfloat16)
    assert model16.embed.weight.dtype == torch.bfloat16 and model16.layers[0].qkv.weight_t.dtype == torch.bfloat16
    seqs = make_sequences(SEQ_LENS, seed=5)
    run32, run16 = PagedRun(model32, seqs, 3), PagedRun(model16, seqs, 3, dtype=torch.bfloat16)
    for plan in ([(0, 40), (1, 7)], [(1, 13), (0, 1), (2, 30)], [(2, 1), (0, 1), (1, 1)]):
        out32, _ = run32.step(plan, return_hidden=True)
        out16, _ = run16.step(plan, return_hidden=True)
        assert out16.logits.dtype == torch.float32  # logits are always returned in float32
        assert out16.hidden.dtype == torch.bfloat16
        assert torch.isfinite(out16.logits).all()
        scale = out32.logits.abs().max().item()
        torch.testing.assert_close(out16.logits, out32.logits, atol=0.05 * scale, rtol=0.05)
        # Loose, but not vacuous: the two agree on the top token for the large majority of rows.
        agree = (out16.logits.argmax(-1) == out32.logits.argmax(-1)).float().mean().item()
        assert agree >= 0.8, agree


# ---- loading errors ------------------------------------------------------------------------------------


@pytest.fixture
def llama_copy(tiny_llama, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama, folder)
    return folder


def rewrite_weights(folder, edit):
    file = folder / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_missing_tensor_is_a_clear_error(llama_copy):
    rewrite_weights(llama_copy, lambda t: t.pop("model.layers.2.mlp.down_proj.weight"))
    with pytest.raises(ValueError, match=r"missing weights.*layers\.2\.down\.weight"):
        Model.from_folder(llama_copy)


def test_missing_shard_of_a_fused_tensor_is_a_clear_error(llama_copy):
    """Dropping k_proj must not silently load a qkv tensor of q and v only."""
    rewrite_weights(llama_copy, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"layers\.1\.qkv\.weight"):
        Model.from_folder(llama_copy)


def test_wrong_shape_is_a_clear_error(llama_copy):
    def edit(t):
        t["model.layers.0.mlp.down_proj.weight"] = torch.zeros(64, 96)

    rewrite_weights(llama_copy, edit)
    with pytest.raises(ValueError, match=r"layers\.0\.down\.weight has shape \(64, 96\), expected \(64, 128\)"):
        Model.from_folder(llama_copy)


def test_unexpected_tensor_is_a_clear_error(llama_copy):
    def edit(t):
        t["model.layers.0.self_attn.rotary_emb.something"] = torch.zeros(3)

    rewrite_weights(llama_copy, edit)
    with pytest.raises(ValueError, match=r"unexpected tensor model\.layers\.0\.self_attn\.rotary_emb\.something"):
        Model.from_folder(llama_copy)


def test_unsupported_architecture_is_a_clear_error(llama_copy):
    config = json.loads((llama_copy / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (llama_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"engine does not run GPT2LMHeadModel \(it runs LlamaForCausalLM.*--capture transformers"):
        Model.from_folder(llama_copy)


def test_a_multimodal_checkpoints_language_model_runs_as_transformers_runs_it(tiny_gemma3_multimodal):
    """Gemma3ForConditionalGeneration on text alone: its language model's logits, chunked prefill then decode; the
    vision tower's tensors are left unread."""
    model = Model.from_folder(tiny_gemma3_multimodal, torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(tiny_gemma3_multimodal, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Gemma3ForConditionalGeneration" and model.config.architecture == "Gemma3ForCausalLM"
    seqs = make_sequences(SEQ_LENS[:1], seed=7, vocab=250)  # below the image tokens' ids
    refs = hf_reference(hf, seqs)
    run = PagedRun(model, seqs, 3, seed=7)
    for n in chunked_plan(len(seqs[0]), [7, 20, 13]):
        out, where = run.step([(0, n)])
        torch.testing.assert_close(out.logits, expected_logits(refs, where))


def test_a_multimodal_checkpoint_of_a_language_model_the_engine_does_not_load_is_a_clear_error(llama_copy):
    config = json.loads((llama_copy / "config.json").read_text())
    top = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "text_config": config}
    (llama_copy / "config.json").write_text(json.dumps(top))
    with pytest.raises(ValueError, match=r"does not run LlavaForConditionalGeneration \(the language model of this "
                                         r"multimodal checkpoint is 'llama'; the engine runs the language model of "
                                         r"gemma3_text checkpoints\).*--capture transformers"):
        Model.from_folder(llama_copy)


def test_unsupported_rope_scaling_is_a_clear_error(llama_copy):
    config = json.loads((llama_copy / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 64}
    config.pop("rope_parameters", None)
    (llama_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"rope_type 'longrope' is not supported \(supported: default, llama3, yarn\)"):
        Model.from_folder(llama_copy)


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fixture", DENSE)
def test_forward_in_one_call_equals_the_layer_loop(fixture, weights, request):
    """KernelForward (embedding, rope, every layer, aux taps, final norm, LM head and argmax in one C call, for decode
    and verify steps) against the model's layer loop, bit for bit: logits, final hidden states, aux taps, early exit
    and each logits row's argmax, over decode rows, several-row queries and draft-tree rows that branch off the
    context, with every row's logits and with a subset."""
    model = Model.from_folder(request.getfixturevalue(fixture), torch.float32, weights=weights)
    if model.fused is None:
        pytest.skip("serving/kernels.c does not run here")
    fused_forward, calls = model.fused, []
    counted = lambda *args: calls.append(args[-1]) or fused_forward(*args)  # noqa: E731
    seqs = make_sequences((40, 33), seed=7)
    runs = [PagedRun(model, seqs, 4, seed=7) for _ in range(2)]
    num_layers = model.config.num_layers
    steps = (([(0, 20), (1, 17)], False, None), ([(0, 1), (1, 1)], False, None), ([(0, 5), (1, 3)], False, [4, 7]),
             ([(0, 1), (1, 2)], True, None), ([(0, 1), (1, 1)], True, [1, 3, 5]))
    for plan, tree, rows in steps:
        outs, num_calls = [], len(calls)
        for run, fused in zip(runs, (True, False)):
            model.fused = counted if fused else None
            kwargs = dict(return_hidden=bool(rows is None), aux_layers=(1, num_layers - 1, 0))
            logits_rows = None if rows is None else torch.tensor(rows)
            if not tree:
                outs.append(run.step(plan, logits_rows, **kwargs)[0])
                continue
            # two tree rows per sequence hang off its newest row: their keys follow the context in fresh slots
            ids, positions, query_lens, context_lens, tables, paths = [], [], [], [], [], []
            for s, n in plan:
                start = run.computed[s]
                ids += [seqs[s][start:start + n], seqs[s][start + n:start + n + 2]]
                positions += [torch.arange(start, start + n), torch.full((2,), start + n)]
                query_lens.append(n)
                context_lens.append(start + n)
                tables.append(run.tables[s])
                spare = [run.tables[s][-1] * 4 + 3 - i for i in range(2)]  # the table's last slots, past the context
                paths.append([[slot] for slot in spare])
                run.computed[s] += n
            meta = PagedMetadata.build(query_lens, context_lens, tables, 4, "cpu", tree_paths=paths)
            outs.append(model(torch.cat(ids), torch.cat(positions), PagedAttention(run.cache, meta), logits_rows,
                              **kwargs))
        fused, looped = outs
        assert torch.equal(fused.logits, looped.logits)
        one_call = len(calls) > num_calls  # prefill chunks of 20 and 17 rows take the loop
        assert fused.argmax == (fused.logits.argmax(-1).tolist() if one_call else None) and looped.argmax is None
        assert (fused.hidden is None) == (looped.hidden is None)
        assert fused.hidden is None or torch.equal(fused.hidden, looped.hidden)
        assert sorted(fused.aux) == sorted(looped.aux) == [0, 1, num_layers - 1]
        for i in fused.aux:
            assert torch.equal(fused.aux[i], looped.aux[i])
    for run in runs:
        run.computed = [0, 0]
    early = []
    for run, forward in zip(runs, (counted, None)):
        model.fused = forward
        run.step([(0, 3), (1, 2)])
        early.append(run.step([(0, 1), (1, 1)], num_layers=2)[0])
    model.fused = fused_forward
    assert torch.equal(early[0].logits, early[1].logits) and early[0].argmax == early[1].logits.argmax(-1).tolist()
    # the prefill chunks of 20 and 17 rows take the loop; the short steps each take one call, over their layers
    assert calls == [num_layers] * 5 + [2]


def test_the_forward_in_one_call_refuses_ids_outside_the_vocabulary_before_writing_anything(pair):
    model = pair[0]
    if model.fused is None:
        pytest.skip("no forward in one call: serving/kernels.c does not run here, or its layers are not this model's")
    seqs = make_sequences((6,), seed=1)
    run = PagedRun(model, seqs, 4)
    run.step([(0, 4)])
    k, v = run.cache.k.clone(), run.cache.v.clone()
    seqs[0][4] = model.config.vocab_size
    with pytest.raises(ValueError, match=r"token ids outside \[0, \d+\)"):
        run.step([(0, 1)])
    assert torch.equal(run.cache.k, k) and torch.equal(run.cache.v, v)
