"""`draftheads import` and `fit --model.init_args.init_from`: every export reads back into the same head (tensors,
config, and drafts in the engine); checkpoints laid out as the EAGLE repository, SpecForge and the Medusa repository
publish them (built here from their tensor names, at tiny sizes) import with each tensor where it belongs; a wrong
tensor is named with both shapes; a fit starts from a head folder's weights and refuses one of another kind, shape
or target."""
from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_fit import fit_args

import heads
from heads.token_map import lm_head_rows
from serving import targets
from serving.config import EngineConfig
from serving.engine import Engine
from serving.request import SamplingParams
from training.cli import main as cli_main
from training.export import export
from training.import_head import import_head
from training.fit import build_cli

H, I, Q, KV, VOCAB = 64, 128, 64, 32, 256  # the conftest targets: hidden, MLP, 4 x 16 query and 2 x 16 KV widths
CASES = {  # case: (kind, layout)
    "eagle-vllm": ("eagle", "vllm"), "eagle-sglang": ("eagle", "sglang"), "eagle3-vllm": ("eagle3", "vllm"),
    "eagle3-sglang": ("eagle3", "sglang"), "medusa-token-map": ("medusa", "vllm"), "medusa-own": ("medusa", "vllm"),
    "eagle-speculators": ("eagle", "speculators"), "eagle3-speculators": ("eagle3", "speculators"),
    "eagle31-vllm": ("eagle3", "vllm"), "eagle31-speculators": ("eagle3", "speculators"),
    "peagle-speculators": ("peagle", "speculators"), "eagle3-residual-vllm": ("eagle3", "vllm"),
    "eagle3-own-embedding-vllm": ("eagle3", "vllm"), "peagle-own-embedding-speculators": ("peagle", "speculators"),
    "eagle3-window-vllm": ("eagle3", "vllm"), "eagle3-window-speculators": ("eagle3", "speculators"),
    "peagle-window-speculators": ("peagle", "speculators"),
}
EAGLE3_OPTIONS = {"eagle31-vllm": {"norm_before_fc": True, "norm_output": True},  # EAGLE 3.1's norms
                  "eagle31-speculators": {"fc_norm": True, "norm_output": True},
                  "eagle3-residual-vllm": {"norm_before_residual": True},  # speculators' default
                  # an embedding of the head's own (speculators' embed_requires_grad, P-EAGLE's default there)
                  "eagle3-own-embedding-vllm": {"own_embedding": True},
                  "peagle-own-embedding-speculators": {"own_embedding": True, "norm_before_residual": True},
                  "eagle3-window-vllm": {"draft_window": 6}, "eagle3-window-speculators": {"draft_window": 6},
                  "peagle-window-speculators": {"draft_window": 6}}


def target_parts(folder):
    return heads.load_target_parts(folder, fingerprint=targets.fingerprint(folder))


@torch.no_grad()
def perturbed(head, seed: int):
    generator = torch.Generator().manual_seed(seed)
    for param in head.parameters():
        param.add_(torch.randn(param.shape, generator=generator) / param.shape[-1] ** 0.5)
    return head


def new_head(case: str, folder):
    """A perturbed head for each exported layout: EAGLE-1 with and without fc's bias, EAGLE-3 over a third of the
    vocabulary (aux layers >= 1, as SGLang needs; eagle31: with EAGLE 3.1's norms), Medusa sharing the target's LM head over a token map, or with its
    own LM heads."""
    parts = target_parts(folder)
    if case == "eagle-vllm":
        return perturbed(heads.Eagle.from_target(parts, fc_bias=False), 1)
    if case in ("eagle-sglang", "eagle-speculators"):  # speculators keeps fc's bias (its fusion_bias, HASS)
        return perturbed(heads.Eagle.from_target(parts), 2)
    if case.startswith("peagle"):
        ids = torch.arange(1, VOCAB, 3)
        return perturbed(heads.Peagle.from_target(parts, draft_token_ids=ids, aux_layers=(1, 2, 3), mask_token_id=7,
                                                  num_depths=5, **EAGLE3_OPTIONS.get(case, {})), 7)
    if case.startswith("eagle3"):
        ids = torch.arange(1, VOCAB, 3)
        return perturbed(heads.Eagle3.from_target(parts, draft_token_ids=ids, aux_layers=(1, 2, 3),
                                                  **EAGLE3_OPTIONS.get(case, {})), 3)
    if case == "medusa-token-map":
        token_map = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(4))[:40]
        parts.lm_head = lm_head_rows(parts.lm_head, token_map)
        return perturbed(heads.Medusa.from_target(parts, token_map, num_heads=3, num_layers=2), 5)
    return perturbed(heads.Medusa.from_target(parts, num_heads=2, own_lm_head=True), 6)


def import_args(src, kind, target, out, *extra) -> list[str]:
    return ["import", str(src), "--format", kind, "--target", str(target), "--out", str(out), *extra]


def assert_same_head(imported, original) -> None:
    own, back = original.state_dict(), imported.state_dict()
    assert own.keys() == back.keys()
    for name in own:
        assert own[name].dtype == back[name].dtype and torch.equal(own[name], back[name]), name
    assert {**imported.config.to_dict(), "metadata": {}} == {**original.config.to_dict(), "metadata": {}}


# ---- round trips ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_an_export_imports_back_into_the_same_head(case, tiny_llama, tmp_path, capsys):
    """Without --from: the export says what wrote it."""
    kind, layout = CASES[case]
    head = new_head(case, tiny_llama)
    exported = export(head, layout, tmp_path / "exported", verifier=tiny_llama)
    written = json.loads((exported / "config.json").read_text())["draftheads"]
    assert (written["kind"], written["format"]) == (kind, layout) and written["version"]
    assert cli_main(import_args(exported, kind, tiny_llama, tmp_path / "back")) == 0
    assert f"wrote the {layout} {kind} head" in capsys.readouterr().out
    imported = heads.load(tmp_path / "back", targets.fingerprint(tiny_llama))
    assert_same_head(imported, head)
    assert imported.config.metadata == {"imported": {"from": str(exported), "layout": layout}}


def record_drafts(engine) -> list:
    """Wraps the engine's drafter so that every proposed tree is recorded with the request's tokens then."""
    records, propose = [], engine.speculator.drafter.propose

    def spy(ctx, requests, budgets):
        trees = propose(ctx, requests, budgets)
        records.extend((tuple(r.token_ids), trees[r.request_id].tokens, trees[r.request_id].parents)
                       for r in requests if r.request_id in trees)
        return trees

    engine.speculator.drafter.propose = spy
    return records


def without_own_embedding(head):
    """`head` reading the target's embedding instead of its own: everything else the same."""
    other = type(head)(type(head).config_class.from_dict({**head.config.to_dict(), "own_embedding": False}))
    other.load_state_dict({name: t for name, t in head.state_dict().items() if name != "embed_tokens.weight"})
    return other.bind_target(head.target)


def served_drafts(target, kind, folder, spec) -> tuple:
    """The engine serving head folder `folder` on two prompts: (its drafts, the outputs, tau and the counts)."""
    prompts = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 13)]
    engine = Engine(EngineConfig(str(target), block_size=4, num_blocks=64, max_model_len=64, speculative_config={
        "method": kind, "model": str(folder), "num_speculative_tokens": 3, **spec}))
    drafts = record_drafts(engine)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    stats = engine.speculator.stats
    return drafts, [o.token_ids for o in outputs], (stats.tau, stats.proposed, stats.accepted)


@pytest.mark.parametrize("case, spec", [("eagle-sglang", {"topk": 2, "num_draft_tokens": 6}), ("eagle3-vllm", {}),
                                        ("medusa-token-map", {}), ("eagle31-vllm", {}),
                                        ("eagle3-residual-vllm", {}), ("eagle3-own-embedding-vllm", {}),
                                        ("peagle-own-embedding-speculators", {}),
                                        ("eagle3-window-vllm", {})])
def test_a_reimported_head_drafts_as_the_original_in_the_engine(case, spec, tiny_llama, tmp_path):
    kind, layout = CASES[case]
    head = new_head(case, tiny_llama)
    original = heads.save(head, tmp_path / "original")
    exported = export(head, layout, tmp_path / "exported", verifier=tiny_llama)
    assert cli_main(import_args(exported, kind, tiny_llama, tmp_path / "back", "--from", layout)) == 0
    runs = [served_drafts(tiny_llama, kind, folder, spec) for folder in (original, tmp_path / "back")]
    assert len(runs[0][0]) >= 8 and any(len(set(parents)) < len(parents) for _, _, parents in runs[0][0]) == bool(spec)
    assert runs[1] == runs[0]
    if "own-embedding" in case:  # the engine drafts with the head's own embedding, not the target's
        target_embedding = heads.save(without_own_embedding(head), tmp_path / "target-embedding")
        assert served_drafts(tiny_llama, kind, target_embedding, spec)[0] != runs[0][0]


# ---- published layouts ----------------------------------------------------------------------------------------


def llama_layer(prefix: str, generator, attention_input: int = H) -> dict[str, torch.Tensor]:
    """A Llama decoder layer's tensors under `prefix`, without input_layernorm (EAGLE's first layer has none)."""
    shapes = {"self_attn.q_proj.weight": (Q, attention_input), "self_attn.k_proj.weight": (KV, attention_input),
              "self_attn.v_proj.weight": (KV, attention_input), "self_attn.o_proj.weight": (H, Q),
              "post_attention_layernorm.weight": (H,), "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H),
              "mlp.down_proj.weight": (H, I)}
    return {prefix + name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def llama_config(**fields) -> dict:
    return {"hidden_size": H, "intermediate_size": I, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_hidden_layers": 1, "vocab_size": VOCAB, "rms_norm_eps": 1e-6, **fields}


def write_checkpoint(folder, config: dict, tensors: dict, file: str = "model.safetensors"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if file.endswith(".safetensors"):
        save_file(tensors, str(folder / file))
    else:
        torch.save(tensors, folder / file)
    return folder


def eagle_repo_checkpoint(folder, change=None):
    """EAGLE-1 as SafeAILab/EAGLE saves its Model (eagle/model/cnets1.py): embed_tokens, layers.0 without
    input_layernorm, fc with a bias (config "bias"), in pytorch_model.bin under a LlamaForCausalLM config."""
    g = torch.Generator().manual_seed(7)
    tensors = {"embed_tokens.weight": torch.randn(VOCAB, H, generator=g), **llama_layer("layers.0.", g),
               "fc.weight": torch.randn(H, 2 * H, generator=g), "fc.bias": torch.randn(H, generator=g)}
    config = llama_config(architectures=["LlamaForCausalLM"], bias=True)
    if change is not None:
        change(config, tensors)
    return write_checkpoint(folder, config, tensors, "pytorch_model.bin"), tensors


def test_an_eagle_repository_checkpoint_imports_each_tensor_where_it_belongs(tiny_llama, tmp_path):
    src, t = eagle_repo_checkpoint(tmp_path / "eagle")
    assert cli_main(import_args(src, "eagle", tiny_llama, tmp_path / "head")) == 0  # the layout read from config.json
    head = heads.load(tmp_path / "head", target=target_parts(tiny_llama))
    assert head.config.metadata["imported"]["layout"] == "eagle-repo" and head.config.fc_bias
    layer = head.layer
    assert torch.equal(head.fc.weight, t["fc.weight"]) and torch.equal(head.fc.bias, t["fc.bias"])
    assert torch.equal(layer.qkv.weight, torch.cat([t[f"layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]))
    assert torch.equal(layer.gate_up.weight, torch.cat([t["layers.0.mlp.gate_proj.weight"], t["layers.0.mlp.up_proj.weight"]]))
    assert torch.equal(layer.o.weight, t["layers.0.self_attn.o_proj.weight"])
    assert torch.equal(layer.down.weight, t["layers.0.mlp.down_proj.weight"])
    assert torch.equal(layer.post_norm.weight, t["layers.0.post_attention_layernorm.weight"])


def test_an_eagle3_checkpoint_as_specforge_writes_it_imports(tiny_llama, tmp_path):
    """SpecForge's and the EAGLE repository's LlamaForCausalLMEagle3: midlayer.* (q/k/v over 2h), fc over the three aux
    layers, norm, lm_head over the draft vocabulary, d2t (target id - draft id) and t2d (bool) buffers."""
    g = torch.Generator().manual_seed(8)
    ids = torch.randperm(VOCAB, generator=g)[:32].sort().values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[ids] = True
    tensors = {"embed_tokens.weight": torch.randn(VOCAB, H, generator=g), "fc.weight": torch.randn(H, 3 * H, generator=g),
               **llama_layer("midlayer.", g, attention_input=2 * H), "midlayer.input_layernorm.weight": torch.randn(H, generator=g),
               "midlayer.hidden_norm.weight": torch.randn(H, generator=g), "norm.weight": torch.randn(H, generator=g),
               "lm_head.weight": torch.randn(32, H, generator=g), "d2t": ids - torch.arange(32), "t2d": t2d}
    src = write_checkpoint(tmp_path / "e3", llama_config(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=32),
                           tensors)
    assert cli_main(import_args(src, "eagle3", tiny_llama, tmp_path / "head")) == 0
    head = heads.load(tmp_path / "head", target=target_parts(tiny_llama))
    assert head.config.aux_layers == (2, 2, 1)  # no ids named: (2, L // 2, L - 3) of the 4-layer target
    assert torch.equal(head.draft_token_ids, ids) and torch.equal(head.t2d, t2d)
    assert torch.equal(head.input_norm.weight, tensors["midlayer.input_layernorm.weight"])
    assert torch.equal(head.hidden_norm.weight, tensors["midlayer.hidden_norm.weight"])
    assert torch.equal(head.layer.qkv.weight, torch.cat([tensors[f"midlayer.self_attn.{p}_proj.weight"] for p in "qkv"]))
    for name in ("fc.weight", "norm.weight", "lm_head.weight"):
        assert torch.equal(head.state_dict()[name], tensors[name]), name


@pytest.mark.parametrize("file, prefix", [("medusa_lm_head.safetensors", ""), ("model.safetensors", "medusa_head.")])
def test_a_medusa_repository_checkpoint_imports_with_its_own_lm_heads(file, prefix, tiny_llama, tmp_path):
    """FasterDecoding/Medusa's MedusaModel.medusa_head: head i is a Sequential of num_layers ResBlocks ({i}.{j}.linear)
    and an LM head ({i}.{num_layers}), saved on its own (medusa_lm_head.*) or inside the model (medusa_head.*)."""
    g = torch.Generator().manual_seed(9)
    tensors = {}
    for i in range(3):
        for j in range(2):
            tensors[f"{prefix}{i}.{j}.linear.weight"] = torch.randn(H, H, generator=g)
            tensors[f"{prefix}{i}.{j}.linear.bias"] = torch.randn(H, generator=g)
        tensors[f"{prefix}{i}.2.weight"] = torch.randn(VOCAB, H, generator=g)
    config = {"medusa_num_heads": 3, "medusa_num_layers": 2, "base_model_name_or_path": "lmsys/vicuna-7b-v1.3"}
    src = write_checkpoint(tmp_path / "medusa", config, tensors, file)
    assert cli_main(import_args(src, "medusa", tiny_llama, tmp_path / "head")) == 0
    head = heads.load(tmp_path / "head", target=target_parts(tiny_llama))
    assert (head.config.num_heads, head.config.num_layers, head.config.own_lm_head) == (3, 2, True)
    for i in range(3):
        for j in range(2):
            assert torch.equal(head.heads[i][j].linear.weight, tensors[f"{prefix}{i}.{j}.linear.weight"])
            assert torch.equal(head.heads[i][j].linear.bias, tensors[f"{prefix}{i}.{j}.linear.bias"])
        assert torch.equal(head.lm_heads[i].weight, tensors[f"{prefix}{i}.2.weight"])


def wrong(name, shape):
    def change(config, tensors):
        tensors[name] = torch.zeros(shape)
    return change


@pytest.mark.parametrize("change, message", [
    (wrong("layers.0.self_attn.k_proj.weight", (Q, H)),
     r"tensor layers.0.self_attn.k_proj.weight has shape \(64, 64\), expected \(32, 64\)"),
    (wrong("embed_tokens.weight", (VOCAB + 1, H)),
     r"tensor embed_tokens.weight \(the target's\) has shape \(257, 64\), expected \(256, 64\)"),
    (lambda config, tensors: tensors.pop("fc.bias"), r"has no tensor fc.bias, which this head needs"),
    (wrong("layers.0.input_layernorm.weight", (H,)), r"has tensor\(s\) \['layers.0.input_layernorm.weight'\] that this "
                                                     "eagle head has no place for"),
    (lambda config, tensors: config.update(hidden_size=128), r"made for another target: hidden_size: checkpoint 128, "
                                                             "target 64"),
    (lambda config, tensors: config.update(num_hidden_layers=2), r"num_hidden_layers is 2, but this project's EAGLE heads"),
    (lambda config, tensors: config.update(architectures=["LlamaForCausalLMEagle3"]),
     r"names LlamaForCausalLMEagle3 \(kind eagle3\): import it with --format eagle3"),
])
def test_a_checkpoint_that_does_not_fit_is_a_clear_error_naming_what(change, message, tiny_llama, tmp_path, capsys):
    src, _ = eagle_repo_checkpoint(tmp_path / "eagle", change)
    assert cli_main(import_args(src, "eagle", tiny_llama, tmp_path / "head", "--from", "eagle-repo")) == 2
    error = capsys.readouterr().err
    assert error.startswith("draftheads import: error: ") and "Traceback" not in error
    assert re.search(message, error), error
    assert not (tmp_path / "head").exists()


def test_eagle3_aux_layer_ids_need_the_engine_they_were_written_for(tiny_llama, tmp_path, capsys):
    """A published EAGLE-3 file (no "draftheads" key: nothing says which engine it was written for)."""
    exported = export(new_head("eagle3-sglang", tiny_llama), "sglang", tmp_path / "exported")
    config = json.loads((exported / "config.json").read_text())
    del config["draftheads"]
    (exported / "config.json").write_text(json.dumps(config))
    assert cli_main(import_args(exported, "eagle3", tiny_llama, tmp_path / "head")) == 2
    assert "SGLang numbers one lower than vLLM" in capsys.readouterr().err
    assert cli_main(import_args(exported, "eagle3", tiny_llama, tmp_path / "head", "--from", "vllm")) == 0
    assert heads.load(tmp_path / "head").config.aux_layers == (0, 1, 2)  # read as vLLM's: each one lower
    stored = load_file(str(exported / "model.safetensors"))
    assert "midlayer.hidden_norm.weight" in stored and "layers.0.hidden_norm.weight" not in stored


# ---- fits that start from a head folder --------------------------------------------------------------------------


def fit(kind, store, *extra):
    cli = build_cli(fit_args(kind, "debug", store, "--trainer.max_steps=1", "--data.batch_size=4",
                             "--model.init_args.warmup_steps=0", *extra), run=False)
    cli.trainer.fit(cli.model, cli.datamodule)
    return cli


def test_a_fit_starts_from_an_imported_head(debug_store, tmp_path, in_tmp_path):
    debug = targets.resolve("debug")
    head = perturbed(heads.Eagle.from_target(target_parts(debug), fc_bias=False), 10)  # configs/eagle.yaml's
    exported = export(head, "vllm", tmp_path / "exported")
    assert cli_main(import_args(exported, "eagle", "debug", tmp_path / "imported")) == 0
    frozen = fit("eagle", debug_store, "--model.init_args.learning_rate=0",
                 f"--model.init_args.init_from={tmp_path / 'imported'}")
    assert frozen.trainer.global_step == 1
    for name, tensor in head.state_dict().items():
        assert torch.equal(frozen.model.head.state_dict()[name], tensor), name
    fresh = fit("eagle", debug_store, "--model.init_args.learning_rate=0")
    assert not torch.equal(fresh.model.head.fc.weight, head.fc.weight)
    trained = fit("eagle", debug_store, f"--model.init_args.init_from={tmp_path / 'imported'}")
    moved = trained.model.head.fc.weight - head.fc.weight
    assert 0 < float(moved.detach().abs().max()) < 0.1  # one step away from the folder's weights


@pytest.mark.parametrize("kind", ["eagle3", "peagle"])
def test_embed_requires_grad_trains_an_embedding_of_the_heads_own(kind, debug_store, tmp_path, in_tmp_path):
    """speculators' option: the head's embedding starts as the target's and moves with training, the target's stays
    frozen, and the head folder keeps it."""
    cli = fit(kind, debug_store, "--model.init_args.embed_requires_grad=true")
    head, start = cli.model.head, target_parts(targets.resolve("debug")).embed.weight
    assert head.config.own_embedding and head.embed_tokens.weight.requires_grad
    assert torch.equal(cli.model.target_parts.embed.weight.cpu(), start)
    moved = (head.embed_tokens.weight.detach().cpu() - start).abs().amax(-1)
    assert 0 < int((moved > 0).sum()) < len(moved)  # the rows of the batch's tokens
    saved = heads.load(heads.save(head, tmp_path / "saved"))
    assert torch.equal(saved.embed_tokens.weight, head.embed_tokens.weight.detach().cpu())


def test_a_fit_refuses_a_head_folder_of_another_kind_shape_or_target(debug_store, tiny_llama, tmp_path, in_tmp_path):
    debug = target_parts(targets.resolve("debug"))
    folders = {"medusa": heads.save(heads.Medusa.from_target(debug, num_heads=4), tmp_path / "medusa"),
               "wide": heads.save(heads.Eagle.from_target(debug, intermediate_size=96, fc_bias=False), tmp_path / "wide"),
               "other": heads.save(heads.Eagle.from_target(target_parts(tiny_llama), fc_bias=False), tmp_path / "other")}
    refusals = {"medusa": "holds a head of kind medusa, but this config trains kind eagle (EagleModule)",
                "wide": "whose settings differ from this config's: intermediate_size: folder 96, config 256",
                "other": "made for another target"}
    for name, message in refusals.items():
        cli = build_cli(fit_args("eagle", "debug", debug_store, "--trainer.max_steps=1",
                                 f"--model.init_args.init_from={folders[name]}"), run=False)
        with pytest.raises(ValueError, match=re.escape(message)):
            cli.trainer.fit(cli.model, cli.datamodule)
        assert cli.trainer.global_step == 0


def test_a_speculators_export_has_the_fields_vllms_loader_reads(tiny_llama, tmp_path):
    """vLLM's SpeculatorsConfig: speculators_model_type, speculators_config (proposal_methods[0].speculative_tokens,
    verifier.name_or_path) and transformer_layer_config; EAGLE-3's residual is g itself (norm_before_residual false,
    which vLLM defaults to true for this format)."""
    head = new_head("eagle3-speculators", tiny_llama)
    config = json.loads((export(head, "speculators", tmp_path / "out", verifier=tiny_llama,
                                num_speculative_tokens=3) / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert config["speculators_config"]["verifier"] == {"name_or_path": str(tiny_llama),
                                                         "architectures": ["LlamaForCausalLM"]}
    assert config["transformer_layer_config"]["hidden_size"] == H and "hidden_size" not in config
    assert config["norm_before_residual"] is False and config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    stored = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert "layers.0.hidden_norm.weight" in stored and "fc.weight" in stored
    eagle = export(new_head("eagle-speculators", tiny_llama), "speculators", tmp_path / "eagle", verifier=tiny_llama)
    config = json.loads((eagle / "config.json").read_text())
    assert (config["speculators_model_type"], config["fusion_bias"], config["layernorms"]) == ("eagle", True, False)
    assert {"fusion_fc.weight", "fusion_fc.bias", "transformer.mlp.down_proj.weight"} <= load_file(
        str(eagle / "model.safetensors")).keys()


def test_a_speculators_peagle_export_is_what_vllm_serves_as_eagle3_with_parallel_drafting(tiny_llama, tmp_path):
    """vLLM reads speculators_model_type peagle as method eagle3 with parallel_drafting, mask_token_id as its pard
    token and mask_hidden [1, 1, num_aux * hidden] as fc's input; aux layers named out of order are exported sorted,
    fc's blocks and mask_hidden's in the same order, and import back into a head that computes the same."""
    parts = target_parts(tiny_llama)
    head = perturbed(heads.Peagle.from_target(parts, aux_layers=(3, 1, 2), mask_token_id=9, num_depths=3), 8)
    exported = export(head, "speculators", tmp_path / "out", verifier=tiny_llama, num_speculative_tokens=3)
    config = json.loads((exported / "config.json").read_text())
    assert (config["speculators_model_type"], config["architectures"]) == ("peagle", ["PEagleSpeculator"])
    assert config["speculators_config"]["algorithm"] == "peagle" and config["mask_token_id"] == 9
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3] and config["num_depths"] == 3
    stored = load_file(str(exported / "model.safetensors"))
    assert stored["mask_hidden"].shape == (1, 1, 3 * H)
    imported, _ = import_head(exported, "peagle", tiny_llama)
    assert imported.config.aux_layers == (1, 2, 3) and imported.config.mask_token_id == 9
    aux = torch.randn(5, 3, H, generator=torch.Generator().manual_seed(0))  # by layer 1, 2, 3
    ours = dict(zip((1, 2, 3), aux.unbind(1)))
    with torch.no_grad():
        torch.testing.assert_close(imported.fuse(aux.flatten(1)), head.fuse([ours[i] for i in head.config.aux_layers]))
        torch.testing.assert_close(imported.mask_feature(), head.mask_feature())
    del config["mask_token_id"]
    (exported / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="its config.json has no mask_token_id, which a P-EAGLE head needs"):
        import_head(exported, "peagle", tiny_llama)


@pytest.mark.parametrize("layout", ["speculators", "vllm"])
def test_norm_before_residual_round_trips_and_makes_the_output_blind_to_gs_scale(layout, tiny_llama, tmp_path):
    """speculators' default (its trainer's norm_before_residual true), which vLLM reads: the layer's residual stream
    is hidden_norm(g), so scaling g changes nothing; it exports to the formats whose layer has it and back."""
    parts = target_parts(tiny_llama)
    head = perturbed(heads.Eagle3.from_target(parts, aux_layers=(1, 2, 3), norm_before_residual=True), 11)
    plain = perturbed(heads.Eagle3.from_target(parts, aux_layers=(1, 2, 3)), 11)
    ids, g = torch.tensor([[5, 6, 7]]), torch.randn(1, 3, H, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(3)[None]
    attention = lambda i, q, k, v: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        q.transpose(-2, -3), k.repeat_interleave(2, -2).transpose(-2, -3), v.repeat_interleave(2, -2).transpose(-2, -3),
        is_causal=True).transpose(-2, -3)
    with torch.no_grad():
        torch.testing.assert_close(head(ids, 3 * g, positions, attention), head(ids, g, positions, attention))
        assert not torch.allclose(plain(ids, 3 * g, positions, attention), plain(ids, g, positions, attention))
    exported = export(head, layout, tmp_path / "out", verifier=tiny_llama)
    assert json.loads((exported / "config.json").read_text())["norm_before_residual"] is True
    imported, _ = import_head(exported, "eagle3", tiny_llama)
    assert imported.config.norm_before_residual
    with pytest.raises(ValueError, match=r"has norm_before_residual \(its residual stream is hidden_norm\(g\)\), "
                                         "which sglang's EAGLE-3 layer does not have"):
        export(head, "sglang", tmp_path / "sglang")


def speculators_trainer_checkpoint(folder, tiny_llama, head, change):
    """`head`'s speculators export, changed by `change(config, tensors)` as speculators' trainer writes it."""
    exported = export(head, "speculators", folder, verifier=tiny_llama)
    config = json.loads((exported / "config.json").read_text())
    tensors = load_file(str(exported / "model.safetensors"))
    change(config, tensors)
    (exported / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(exported / "model.safetensors"))
    return exported


def test_what_speculators_trainer_writes_imports(tiny_llama, tmp_path):
    """target_hidden_size null (vLLM: the layer's hidden size), no d2t or t2d over the whole vocabulary (vLLM: the
    identity), t2d alone missing (vLLM never reads it), the verifier named by a hub id not present here."""
    def as_trained(config, tensors):
        config["target_hidden_size"] = None
        config["speculators_config"]["verifier"] = {"name_or_path": "org/verifier-not-here", "architectures": []}
        del tensors["d2t"], tensors["t2d"]

    parts = target_parts(tiny_llama)
    full = perturbed(heads.Eagle3.from_target(parts, aux_layers=(1, 2, 3), norm_before_residual=True), 12)
    imported, _ = import_head(speculators_trainer_checkpoint(tmp_path / "full", tiny_llama, full, as_trained),
                              "eagle3", tiny_llama)
    assert_same_head(imported, full)
    reduced = new_head("eagle3-speculators", tiny_llama)
    src = speculators_trainer_checkpoint(tmp_path / "reduced", tiny_llama, reduced,
                                         lambda config, tensors: tensors.pop("t2d"))
    assert_same_head(import_head(src, "eagle3", tiny_llama)[0], reduced)
    src = speculators_trainer_checkpoint(tmp_path / "no-d2t", tiny_llama, reduced, as_trained)
    with pytest.raises(ValueError, match=r"draft_vocab_size is 85, below the target's vocabulary 256, but the file has "
                                         "no d2t tensor"):
        import_head(src, "eagle3", tiny_llama)


def test_a_verifier_present_here_must_be_the_target(tiny_llama, tiny_qwen2, tmp_path):
    head = new_head("eagle3-speculators", tiny_llama)
    exported = export(head, "speculators", tmp_path / "out", verifier=tiny_qwen2)
    with pytest.raises(ValueError, match=rf"names its verifier {re.escape(str(tiny_qwen2))}, which is not the target "
                                         rf".*architecture: verifier 'qwen2', target 'llama'.* --target"):
        import_head(exported, "eagle3", tiny_llama)
    assert_same_head(import_head(export(head, "speculators", tmp_path / "same", verifier=tiny_llama), "eagle3",
                                 tiny_llama)[0], head)


def test_a_draft_window_is_written_as_vllms_llama_attention_reads_it_and_refused_where_a_layer_has_none(
        tiny_llama, tmp_path):
    """vLLM's EAGLE-3 drafter windows its Llama attention where layer_types says sliding_attention (of sliding_window
    keys): the export says so, at the top level (vllm) or in transformer_layer_config (speculators). A windowed head
    has no layer to go to in vLLM's EAGLE-1 drafter or SGLang's; a file asking for a window imports only where its
    layer runs one."""
    windowed = new_head("eagle3-window-vllm", tiny_llama)
    for layout in ("vllm", "speculators"):
        config = json.loads((export(windowed, layout, tmp_path / layout, verifier=tiny_llama) / "config.json").read_text())
        layer = config.get("transformer_layer_config", config)
        assert (layer["sliding_window"], layer["layer_types"]) == (6, ["sliding_attention"])
    plain = json.loads((export(new_head("eagle3-vllm", tiny_llama), "vllm", tmp_path / "plain") / "config.json").read_text())
    assert "layer_types" not in plain and "sliding_window" not in plain
    with pytest.raises(ValueError, match="draft_window=6, which the sglang eagle3 layer does not run"):
        export(windowed, "sglang", tmp_path / "sglang")
    eagle = heads.Eagle.from_target(target_parts(tiny_llama), fc_bias=False, draft_window=6)
    with pytest.raises(ValueError, match="vLLM's EAGLE-1 drafter reads layer_types at its layer's id after the target's"):
        export(eagle, "vllm", tmp_path / "eagle")
    sglang = export(new_head("eagle3-sglang", tiny_llama), "sglang", tmp_path / "sglang-plain")
    config = json.loads((sglang / "config.json").read_text())
    (sglang / "config.json").write_text(json.dumps({**config, "sliding_window": 6, "layer_types": ["sliding_attention"]}))
    with pytest.raises(ValueError, match="asks for a sliding window, which the sglang eagle3 layer does not run"):
        import_head(sglang, "eagle3", tiny_llama)
    vllm = tmp_path / "vllm"
    config = json.loads((vllm / "config.json").read_text())
    (vllm / "config.json").write_text(json.dumps({**config, "sliding_window": None}))
    with pytest.raises(ValueError, match="layer_types .* with sliding_window None"):
        import_head(vllm, "eagle3", tiny_llama)


def test_a_vllm_medusa_without_biases_imports_with_zero_ones(tiny_llama, tmp_path):
    head = new_head("medusa-own", tiny_llama)
    with torch.no_grad():
        for block in head.heads:
            for layer in block:
                layer.linear.bias.zero_()
    exported = export(head, "vllm", tmp_path / "medusa")
    config = json.loads((exported / "config.json").read_text())
    config["medusa_fc_bias"] = False
    (exported / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(exported / "model.safetensors"))
    save_file({name: t for name, t in tensors.items() if not name.endswith(".bias")}, str(exported / "model.safetensors"))
    assert_same_head(import_head(exported, "medusa", tiny_llama)[0], head)


def with_embedding(src, weight):
    tensors = load_file(str(src / "model.safetensors"))
    save_file({**tensors, "embed_tokens.weight": weight.detach().contiguous()}, str(src / "model.safetensors"))
    return src


@pytest.mark.parametrize("kind, layout", [("eagle3", "speculators"), ("eagle3", "vllm"), ("peagle", "speculators")])
def test_an_embedding_unlike_the_targets_imports_as_the_heads_own_where_vllm_reads_it(kind, layout, tiny_llama,
                                                                                      tmp_path):
    """vLLM embeds an EAGLE-3 (P-EAGLE) draft's tokens with the file's embed_tokens unless it equals the target's:
    a file's other embedding (speculators trains P-EAGLE's by default) becomes the head's own, the target's (in the
    file's dtype) is left out; speculators' files carry the target's for a head without one (its loader does not
    always fill it from the verifier), with embed_requires_grad saying which."""
    own = new_head(f"{kind}-own-embedding-speculators" if kind == "peagle" else "eagle3-own-embedding-vllm", tiny_llama)
    target_embedding = target_parts(tiny_llama).embed.weight
    assert not torch.equal(own.embed_tokens.weight, target_embedding)
    exported = export(own, layout, tmp_path / "own", verifier=tiny_llama)
    assert torch.equal(load_file(str(exported / "model.safetensors"))["embed_tokens.weight"], own.embed_tokens.weight)
    imported, _ = import_head(exported, kind, tiny_llama)
    assert imported.config.own_embedding
    assert_same_head(imported, own)
    plain = without_own_embedding(own)
    exported = export(plain, layout, tmp_path / "plain", verifier=tiny_llama)
    stored = load_file(str(exported / "model.safetensors"))
    if layout == "speculators":
        assert torch.equal(stored["embed_tokens.weight"], target_embedding)
        assert json.loads((exported / "config.json").read_text())["embed_requires_grad"] is False
    else:  # vLLM shares the target's embedding with a draft whose file has none
        assert "embed_tokens.weight" not in stored
    assert_same_head(import_head(exported, kind, tiny_llama)[0], plain)
    as_bfloat16 = with_embedding(exported, target_embedding.to(torch.bfloat16))
    assert not import_head(as_bfloat16, kind, tiny_llama)[0].config.own_embedding
    changed = target_embedding.clone()
    changed[3, 0] += 1e-3
    assert import_head(with_embedding(exported, changed), kind, tiny_llama)[0].config.own_embedding


def test_sglang_reads_the_targets_embedding_so_a_heads_own_is_refused_and_a_files_left_out(tiny_llama, tmp_path):
    own = new_head("eagle3-own-embedding-vllm", tiny_llama)
    with pytest.raises(ValueError, match="has an embedding of its own .* sglang's engine embeds the draft's tokens "
                                         "with the target's: export it --format vllm or --format speculators"):
        export(own, "sglang", tmp_path / "own")
    plain = without_own_embedding(own)
    exported = with_embedding(export(plain, "sglang", tmp_path / "plain"), own.embed_tokens.weight)
    assert_same_head(import_head(exported, "eagle3", tiny_llama)[0], plain)


@pytest.mark.parametrize("kind, layout", [("eagle3", "vllm"), ("eagle3", "speculators"), ("eagle3", "sglang"),
                                          ("peagle", "speculators"), ("eagle", "vllm")])
def test_a_head_with_qkv_biases_exports_the_zero_o_proj_bias_llama_attention_loads(kind, layout, tiny_qwen2, tmp_path):
    """A Qwen2 target's heads have q/k/v biases (attention_bias): Llama attention, in transformers, vLLM and SGLang,
    then also gives o_proj a bias and loads it from the file. The export writes it as zeros (our layer has none);
    import drops a zero one and refuses any other, naming it."""
    parts = target_parts(tiny_qwen2)
    assert parts.layer.qkv_bias
    if kind == "eagle":
        head = heads.Eagle.from_target(parts, fc_bias=False)
    else:
        options = {"mask_token_id": 7} if kind == "peagle" else {}
        head = {"eagle3": heads.Eagle3, "peagle": heads.Peagle}[kind].from_target(
            parts, draft_token_ids=torch.arange(1, VOCAB, 3), aux_layers=(1, 2, 3), **options)
    head = perturbed(head, 11)
    exported = export(head, layout, tmp_path / "exported", verifier=tiny_qwen2)
    assert json.loads((exported / "config.json").read_text()).get("attention_bias", True)
    tensors = load_file(exported / "model.safetensors")
    biases = [name for name in tensors if name.endswith("self_attn.o_proj.bias")]
    assert len(biases) == 1 and not tensors[biases[0]].any()
    assert cli_main(import_args(exported, kind, tiny_qwen2, tmp_path / "back")) == 0
    assert_same_head(heads.load(tmp_path / "back", targets.fingerprint(tiny_qwen2)), head)
    tensors[biases[0]] = torch.full_like(tensors[biases[0]], 0.5)
    save_file(tensors, exported / "model.safetensors", {"format": "pt"})
    with pytest.raises(ValueError, match=rf"{re.escape(biases[0])} is not zero.*no bias on the attention's output"):
        import_head(exported, kind, tiny_qwen2, source=layout)
