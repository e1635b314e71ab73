"""The target with bfloat16 weights (EngineConfig.weights): its logits are transformers' float32 forward over the
same bf16-rounded weights, and speculative greedy outputs (ngram, a draft model, EAGLE and EAGLE-3 heads, chains
and trees, alone and under preemption) equal plain decoding's with those weights, token for token: the kernels sum
every output in float32 in one order whatever the batch, so verify rows compute what decode steps do."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from serving.config import EngineConfig
from serving.kernels import PackedLinear
from serving.model import Model
from test_head_drafters import (PROMPTS, SCENARIOS, assert_pool_idle, greedy, make_engine, random_head_dir,
                                spec_config)
from test_model import SEQ_LENS, PagedRun, expected_logits, hf_reference, make_sequences
from test_spec import noisy_llama  # noqa: F401 (a fixture)

MAX_TOKENS = 24


@torch.no_grad()
def hf_with_rounded_weights(folder) -> nn.Module:
    """transformers' float32 model whose decoder linear layers and LM head hold bf16-rounded weights (the LM head
    untied: the engine rounds its packed copy, never the embedding)."""
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for module in hf.model.layers.modules():
        if isinstance(module, nn.Linear):
            module.weight.copy_(module.weight.bfloat16().float())
    hf.lm_head.weight = nn.Parameter(hf.lm_head.weight.detach().bfloat16().float())
    return hf


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
def test_logits_are_transformers_over_the_rounded_weights(fixture, request):
    folder = request.getfixturevalue(fixture)
    model = Model.from_folder(folder, weights=torch.bfloat16)
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert len(linears) == 4 * model.config.num_layers + 1
    assert all(m.weight_dtype == torch.bfloat16 for m in linears)
    if linears[0].lib is not None:
        assert all(m.panels.dtype == torch.bfloat16 for m in linears)
    assert model.embed.weight.dtype == torch.float32
    seqs = make_sequences(SEQ_LENS, seed=3)
    rounded = hf_reference(hf_with_rounded_weights(folder), seqs)
    exact = hf_reference(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), seqs)
    run = PagedRun(model, seqs, 3)
    for plan in ([(0, 40), (1, 7)], [(1, 13), (0, 1), (2, 30)], [(2, 1), (0, 1), (1, 1)]):
        out, where = run.step(plan)
        # float32 sums in another order than transformers': the same tolerance as the float32 engine's test
        torch.testing.assert_close(out.logits, expected_logits(rounded, where), atol=2e-5, rtol=2e-5)
        # not vacuous: the rounding moves the logits far past that tolerance
        assert (out.logits - expected_logits(exact, where)).abs().max() > 1e-3


def bf16_engine(folder, spec=None, **kwargs):
    return make_engine(folder, spec, weights="bfloat16", **kwargs)


_PLAIN: dict = {}


def plain_bf16(folder) -> list[list[int]]:
    if str(folder) not in _PLAIN:
        _PLAIN[str(folder)] = [o.token_ids for o in bf16_engine(folder).generate(PROMPTS, greedy(MAX_TOKENS))]
    return _PLAIN[str(folder)]


def test_bf16_weights_decode_otherwise_than_float32(tiny_llama):
    """The identity tests below compare against outputs of their own: the rounding changes greedy tokens."""
    float32 = [o.token_ids for o in make_engine(tiny_llama).generate(PROMPTS, greedy(MAX_TOKENS))]
    assert float32 != plain_bf16(tiny_llama)


SPECS = {
    "ngram": lambda folder, root, noisy: {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                   "prompt_lookup_max": 2},
    # a noisy copy of the target drafting: often right, not always
    "draft-model": lambda folder, root, noisy: {"method": "draft_model", "model": str(noisy), "num_speculative_tokens": 3},
    "eagle": lambda folder, root, noisy: spec_config("eagle", random_head_dir("eagle", folder, root)),
    "eagle3-tree": lambda folder, root, noisy: dict(spec_config("eagle3", random_head_dir("eagle3", folder, root)), topk=3,
                                             num_draft_tokens=8),
}


@pytest.mark.parametrize("concurrency", [1, 8])
@pytest.mark.parametrize("drafter", list(SPECS))
def test_speculation_reproduces_plain_greedy_with_bf16_weights(drafter, concurrency, tiny_llama, noisy_llama,
                                                              tmp_path_factory):
    engine = bf16_engine(tiny_llama, SPECS[drafter](tiny_llama, tmp_path_factory.mktemp("heads"), noisy_llama),
                         **SCENARIOS[concurrency])
    assert engine.model.packed_lm_head.weight_dtype == torch.bfloat16
    outputs = engine.generate(PROMPTS, greedy(MAX_TOKENS))
    assert [o.token_ids for o in outputs] == plain_bf16(tiny_llama)
    assert_pool_idle(engine)
    stats = engine.speculator.stats
    assert sum(stats.proposed) > 0, "nothing was drafted: the case tests nothing"
    if drafter == "draft-model":
        assert 0 < stats.acceptance_rate < 1, "the noisy drafter should be right often, not always"
    if concurrency == 8:
        assert sum(o.metrics["num_preemptions"] for o in outputs) > 0


@pytest.mark.parametrize("options, message", [
    (dict(weights="float16"), "weights='float16' is not supported"),
    (dict(weights="bfloat16", dtype="bfloat16"), "applies to a float32 target"),
])
def test_bad_weights_are_clear_errors(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)
