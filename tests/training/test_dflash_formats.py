"""DFlash in other layouts: z-lab's (Qwen3 config with dflash_config; target_layer_ids one lower than ours) and the
speculators format (aux_hidden_state_layer_ids as ours; the target's embedding and LM head in the file). Each export
imports back into the same head and drafts as it did in the engine; the fields vLLM's loaders read are there; what a
layout cannot say (a causal block in speculators, layer 0 in z-lab's numbering); a token map goes out as vLLM's
draft vocabulary (d2t) and a checkpoint missing
a layer its config counts are clear errors."""
from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

import heads
from serving import targets
from serving.config import EngineConfig
from serving.engine import Engine
from serving.request import SamplingParams
from training.cli import main as cli_main
from heads.token_map import lm_head_rows
from training.export import export
from training.import_head import import_head

from test_import import assert_same_head, import_args, perturbed, target_parts


def new_dflash(folder, causal=False, target_layers=(1, 3)):
    parts = target_parts(folder)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        head = heads.DFlash.from_target(parts, num_layers=2, target_layers=target_layers, block_size=4,
                                        mask_token_id=9, causal=causal)
    return perturbed(head, 7).bind_target(parts)


@pytest.mark.parametrize("layout, causal", [("z-lab", False), ("z-lab", True), ("speculators", False)])
def test_an_export_imports_back_into_the_same_head(layout, causal, tiny_llama, tmp_path, capsys):
    head = new_dflash(tiny_llama, causal)
    exported = export(head, layout, tmp_path / "exported", verifier=tiny_llama)
    assert cli_main(import_args(exported, "dflash", tiny_llama, tmp_path / "back")) == 0
    assert f"wrote the {layout} dflash head" in capsys.readouterr().out
    assert_same_head(heads.load(tmp_path / "back", targets.fingerprint(tiny_llama)), head)


def test_the_layouts_name_what_zlab_and_vllm_read(tiny_llama, tmp_path):
    head = new_dflash(tiny_llama)
    zlab = export(head, "z-lab", tmp_path / "zlab")
    config = json.loads((zlab / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["num_hidden_layers"] == 2 and config["block_size"] == 4 and config["is_causal"] is False
    assert config["dflash_config"] == {"mask_token_id": 9, "target_layer_ids": [0, 2], "block_size": 4}
    stored = load_file(str(zlab / "model.safetensors"))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight",
            "layers.1.self_attn.q_proj.weight", "layers.0.input_layernorm.weight", "layers.1.mlp.gate_proj.weight"} <= stored.keys()
    assert not any(name.startswith(("embed_tokens", "lm_head")) for name in stored)
    speculators = export(head, "speculators", tmp_path / "spec", verifier=tiny_llama)
    config = json.loads((speculators / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["architectures"] == ["DFlashSpeculator"]
    assert config["aux_hidden_state_layer_ids"] == [1, 3] and config["mask_token_id"] == 9
    assert config["block_size"] == 4 and config["sample_from_anchor"] is False
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert config["transformer_layer_config"]["model_type"] == "qwen3"
    stored = load_file(str(speculators / "model.safetensors"))
    torch.testing.assert_close(stored["lm_head.weight"], head.target.lm_head.weight)
    torch.testing.assert_close(stored["embed_tokens.weight"], head.target.embed.weight)


def test_a_reimported_head_drafts_as_the_original_in_the_engine(tiny_llama, tmp_path):
    head = new_dflash(tiny_llama)
    heads.save(head, tmp_path / "original")
    export(head, "z-lab", tmp_path / "exported")
    assert cli_main(import_args(tmp_path / "exported", "dflash", tiny_llama, tmp_path / "back")) == 0
    prompts = [[5, 17, 33, 2, 9, 41], [7, 7, 100, 3]]
    drafts = []
    for folder in ("original", "back"):
        spec = {"method": "dflash", "model": str(tmp_path / folder), "num_speculative_tokens": 3, "topk": 2,
                "num_draft_tokens": 5}
        engine = Engine(EngineConfig(str(tiny_llama), block_size=4, num_blocks=64, max_model_len=128,
                                     speculative_config=spec))
        records, propose = [], engine.speculator.drafter.propose
        engine.speculator.drafter.propose = lambda ctx, requests, budgets: records.append(
            {rid: t.tokens for rid, t in propose(ctx, requests, budgets).items()}) or {}  # recorded, not verified
        engine.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
        drafts.append(records)
    assert drafts[0] == drafts[1] and drafts[0]


@pytest.mark.parametrize("change, layout, message", [
    (dict(causal=True), "speculators", r"blocks are causal, and the speculators format \(vLLM\) attends"),
    (dict(target_layers=(0, 2)), "z-lab", r"target layer 0 \(the embeddings\) cannot be named in z-lab's layout"),
    (None, "vllm", r"vLLM and SGLang load DFlash drafters in z-lab's layout: export it --format z-lab"),
])
def test_what_a_layout_cannot_say_is_a_clear_error(change, layout, message, tiny_llama, tmp_path):
    head = new_dflash(tiny_llama, **(change or {}))
    with pytest.raises(ValueError, match=message):
        export(head, layout, tmp_path / "out", verifier=tiny_llama)


def test_a_checkpoint_missing_a_layer_its_config_counts_is_a_clear_error(tiny_llama, tmp_path, capsys):
    exported = export(new_dflash(tiny_llama), "z-lab", tmp_path / "exported")
    tensors = load_file(str(exported / "model.safetensors"))
    save_file({name: t for name, t in tensors.items() if not name.startswith("layers.1.")}, str(exported / "model.safetensors"))
    assert cli_main(import_args(exported, "dflash", tiny_llama, tmp_path / "head")) == 2
    error = capsys.readouterr().err
    assert re.search(r"config.json counts num_hidden_layers 2 but its weights hold layers 0\.\.0", error), error


@pytest.mark.parametrize("layout", ["z-lab", "speculators"])
def test_a_head_over_a_token_map_exports_as_the_draft_vocabulary_vllm_reads(layout, tiny_llama, tmp_path):
    """vLLM's DFlash drafts over draft_vocab_size rows of its lm_head and scatters their logits to the target ids
    arange + d2t, -inf elsewhere: the export writes the map ascending as d2t (and t2d) with the target's rows, so
    vLLM's argmax is the head's draft; it imports back into a head that drafts the same."""
    parts = target_parts(tiny_llama)
    token_map = torch.randperm(parts.vocab_size, generator=torch.Generator().manual_seed(2))[:50]
    parts.lm_head = lm_head_rows(parts.lm_head, token_map)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        head = heads.DFlash.from_target(parts, token_map, num_layers=2, target_layers=(1, 3), block_size=4,
                                        mask_token_id=9)
    head = perturbed(head, 8).bind_target(parts)
    saved = heads.save(head, tmp_path / "head")
    assert cli_main(["export", str(saved), "--format", layout, "--out", str(tmp_path / "out"),
                     "--target", str(tiny_llama)]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    stored = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert config["draft_vocab_size"] == 50 and stored["lm_head.weight"].shape == (50, 64)
    targets_of = torch.arange(50) + stored["d2t"]
    assert torch.equal(targets_of, token_map.sort().values) and int(stored["t2d"].sum()) == 50
    out = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = head.logits(out)  # [2, 5, 50] in the map's order
        theirs = torch.full((2, 5, parts.vocab_size), float("-inf"))
        theirs[..., targets_of] = head.norm(out) @ stored["lm_head.weight"].T
        assert torch.equal(theirs.argmax(-1), token_map[ours.argmax(-1)])
        assert cli_main(import_args(tmp_path / "out", "dflash", tiny_llama, tmp_path / "back")) == 0
        full = target_parts(tiny_llama)
        back = heads.load(tmp_path / "back")
        full.lm_head = lm_head_rows(full.lm_head, back.token_map)
        back.bind_target(full)
        assert torch.equal(back.token_map, token_map.sort().values)
        torch.testing.assert_close(back.logits(out), ours[..., token_map.argsort()])


def test_a_speculators_checkpoint_whose_lm_head_is_not_the_targets_is_refused(tiny_llama, tmp_path):
    exported = export(new_dflash(tiny_llama), "speculators", tmp_path / "exported", verifier=tiny_llama)
    tensors = load_file(str(exported / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1
    save_file(tensors, str(exported / "model.safetensors"))
    with pytest.raises(ValueError, match="its lm_head.weight is not the target's LM head over its draft vocabulary"):
        import_head(exported, "dflash", tiny_llama)
