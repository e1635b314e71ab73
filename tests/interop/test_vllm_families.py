"""Heads for targets of other families than Llama, served by the real vLLM: an EAGLE-3 head trained on a tiny
Qwen3 target (q/k norms), Qwen3-MoE target (8 experts, top 2), Qwen2 target (q/k/v biases) or Mistral target (a
window on every layer), a Medusa head on a tiny Gemma 3 target (sliding
windows), exported in vLLM's layout, drafts in vLLM what it drafts in this project's engine: the same outputs (those
of plain decoding) and accepted drafts per position."""
from __future__ import annotations

import pytest
import torch

import tiny_heads
from serving.bench.vllm_process import VllmServer
from serving.config import EngineConfig
from serving.engine import Engine
from test_vllm import K, compare, export_for_vllm, ours

pytestmark = pytest.mark.usefixtures("vllm_available")


# gpt-oss stays out: vLLM's CPU build serves a tiny gpt-oss head, but its greedy float32 outputs part from
# transformers' (and this engine's) in one prompt of eight, so drafts cannot be compared verdict for verdict.
# vLLM 0.32's Gemma 3 has no EAGLE-3 aux outputs, so its head is Medusa's (which reads the final hidden state).
# Per family: the head's kind, the tiny target's config overrides, the fit's overrides. Mistral's window applies to
# every layer, and vLLM runs a draft layer that names no window of its own with the target's (its attention falls
# back to the cache config's sliding_window), so the head is trained with that window (draft_window) to draft alike.
# Qwen2's q/k/v biases make its heads' exports carry a zero o_proj bias (Llama attention's pairing).
FAMILIES = {"qwen3": ("eagle3", {}, ()),
            "qwen3_moe": ("eagle3", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64), ()),
            "qwen2": ("eagle3", {}, ()),
            "mistral": ("eagle3", dict(sliding_window=16), ("--model.init_args.draft_window=16",)),
            "gemma3_text": ("medusa", dict(sliding_window=16, layer_types=["sliding_attention"] * 3 + ["full_attention"]),
                            ())}


@pytest.mark.parametrize("arch", FAMILIES)
def test_vllm_serves_a_head_for_another_family_with_our_acceptance(arch, tmp_path):
    kind, overrides, fit_overrides = FAMILIES[arch]
    target = tiny_heads.chaotic_target(tmp_path / "target", arch, **overrides)
    with torch.random.fork_rng():
        trained = tiny_heads.train(kind, target, tiny_heads.store(target, tmp_path / "data"), tmp_path / kind,
                                   extra=fit_overrides)
    engine = Engine(EngineConfig(str(target), max_num_seqs=1))
    prompt_ids = [engine.encode(messages) for messages in tiny_heads.prompts()]
    plain = ours(target, None, prompt_ids)[0]
    spec = {"method": kind, "num_speculative_tokens": K}
    with VllmServer(target, {**spec, "model": str(export_for_vllm(kind, trained, target, tmp_path / "vllm"))}) as server:
        compare(target, trained, spec, server, prompt_ids, plain)
