"""`draftheads export`: each exported file, read back into transformers' own Llama layers wired the way vLLM and
SGLang wire their draft models, gives the logits our head gives."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

import heads
from heads.attention import DenseCausalAttention
from heads.token_map import lm_head_rows
from training import export as exporting
from training.cli import main as cli_main

NUM_POSITIONS = 11


def perturbed(head, seed: int):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in head.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=generator))
    return head


def inputs(parts, seed: int, width: int | None = None):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, parts.vocab_size, (1, NUM_POSITIONS), generator=generator)
    features = torch.randn(1, NUM_POSITIONS, width or parts.hidden_size, generator=generator)
    return ids, features, torch.arange(NUM_POSITIONS)[None]


def read(folder):
    return json.loads((folder / "config.json").read_text()), load_file(str(folder / "model.safetensors"))


def hf_layer(config: dict, tensors: dict, prefix: str, attention_input_size: int | None = None) -> LlamaDecoderLayer:
    """transformers' Llama decoder layer holding the exported tensors under `prefix`, strictly (every name)."""
    hf_config = LlamaConfig(**config)
    hf_config._attn_implementation = "eager"
    layer = LlamaDecoderLayer(hf_config, layer_idx=0)
    if attention_input_size:  # EAGLE-3's q/k/v read the 2h-wide concatenation
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(attn, name)
            setattr(attn, name, nn.Linear(attention_input_size, old.out_features, bias=old.bias is not None))
    own = {name[len(prefix):]: t for name, t in tensors.items() if name.startswith(prefix) and "hidden_norm" not in name}
    if "input_layernorm.weight" not in own:
        layer.input_layernorm = nn.Identity()
    layer.load_state_dict(own, strict=True)
    return layer.eval()


def rope_and_mask(config: dict, x: torch.Tensor, positions: torch.Tensor):
    cos, sin = LlamaRotaryEmbedding(LlamaConfig(**config))(x, positions)
    causal = torch.full((NUM_POSITIONS, NUM_POSITIONS), float("-inf")).triu(1)[None, None]
    return (cos, sin), causal


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_eagle1_export_runs_in_a_llama_layer_as_ours(engine, tiny_llama, tmp_path):
    parts = heads.load_target_parts(tiny_llama)
    head = perturbed(heads.Eagle.from_target(parts, fc_bias=engine == "sglang"), seed=1).eval()
    config, tensors = read(exporting.export(head, engine, tmp_path / "out"))
    assert config["architectures"] == [{"vllm": "EagleLlamaForCausalLM", "sglang": "LlamaForCausalLMEagle"}[engine]] and config["num_hidden_layers"] == 1
    assert not any(name.startswith(("embed_tokens", "lm_head", "model.")) for name in tensors)
    assert ("fc.bias" in tensors) == (engine == "sglang")
    ids, hidden, positions = inputs(parts, seed=2)
    with torch.no_grad():
        ours = head.logits(head(ids, hidden, positions, DenseCausalAttention()))
        fc = nn.Linear(2 * parts.hidden_size, parts.hidden_size, bias="fc.bias" in tensors)
        fc.load_state_dict({name[3:]: t for name, t in tensors.items() if name.startswith("fc.")})
        x = fc(torch.cat([parts.embed(ids), hidden], dim=-1))  # the embedding first
        position_embeddings, mask = rope_and_mask(config, x, positions)
        out = hf_layer(config, tensors, "layers.0.")(x, attention_mask=mask, position_embeddings=position_embeddings)
        theirs = parts.lm_head(out[0] if isinstance(out, tuple) else out)  # no final norm: the target's LM head
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_eagle3_export_runs_in_a_llama_layer_as_ours(engine, tiny_llama, tmp_path):
    parts = heads.load_target_parts(tiny_llama)
    head = heads.Eagle3.from_target(parts, draft_token_ids=torch.arange(0, parts.vocab_size, 3))
    head = perturbed(head, seed=3).eval()
    config, tensors = read(exporting.export(head, engine, tmp_path / "out"))
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == head.config.draft_vocab_size
    # vLLM captures each aux layer once, ascending: the 4-layer target's default (2, 2, 1) reads as [1, 2], fc's
    # blocks reordered and layer 2's two added. SGLang names the layer before each.
    layers = sorted(set(head.config.aux_layers)) if engine == "vllm" else list(head.config.aux_layers)
    expected_ids = [i - (engine == "sglang") for i in layers]
    assert head.config.aux_layers == (2, 2, 1)
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == expected_ids
    h = parts.hidden_size
    ids, aux, positions = inputs(parts, seed=4, width=len(head.config.aux_layers) * h)
    by_layer = dict(zip(head.config.aux_layers, aux.chunk(len(head.config.aux_layers), dim=-1)))
    with torch.no_grad():
        ours_out = head(ids, head.fuse([by_layer[i] for i in head.config.aux_layers]), positions, DenseCausalAttention())
        ours = head.to_target_ids(head.logits(ours_out).argmax(-1))
        g = torch.cat([by_layer[i] for i in layers], dim=-1) @ tensors["fc.weight"].T
        norm = lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config["rms_norm_eps"]) * w
        attention_input = torch.cat([norm(parts.embed(ids), tensors["midlayer.input_layernorm.weight"]),
                                     norm(g, tensors["midlayer.hidden_norm.weight"])], dim=-1)
        layer = hf_layer({k: v for k, v in config.items()}, tensors, "midlayer.", attention_input_size=2 * h)
        position_embeddings, mask = rope_and_mask(config, g, positions)
        attended = layer.self_attn(attention_input, position_embeddings=position_embeddings, attention_mask=mask)[0]
        out = g + attended  # the residual stream is g, not the concatenation
        out = out + layer.mlp(layer.post_attention_layernorm(out))
        draft = (norm(out, tensors["norm.weight"]) @ tensors["lm_head.weight"].T).argmax(-1)
        theirs = draft + tensors["d2t"][draft]  # target id = draft id + d2t[draft id]
    torch.testing.assert_close(out, ours_out, rtol=1e-4, atol=1e-4)
    assert torch.equal(theirs, ours)
    assert tensors["t2d"].dtype == torch.bool and int(tensors["t2d"].sum()) == head.config.draft_vocab_size


@pytest.mark.parametrize("own_lm_head", [False, True])
def test_medusa_export_gives_each_heads_logits(own_lm_head, tiny_llama, tmp_path):
    parts = heads.load_target_parts(tiny_llama)
    head = perturbed(heads.Medusa.from_target(parts, num_heads=3, num_layers=2, own_lm_head=own_lm_head), seed=5)
    config, tensors = read(exporting.export(head.eval(), "vllm", tmp_path / "out"))
    assert config["architectures"] == ["MedusaModel"] and config["num_heads"] == 3 and config["num_hidden_layers"] == 2
    assert config["original_lm_head"] == (not own_lm_head)
    hidden = inputs(parts, seed=6)[1]
    with torch.no_grad():
        ours = head(hidden)
        for i in range(3):
            x = hidden
            for j in range(2):
                x = x + torch.nn.functional.silu(x @ tensors[f"blocks.{i}.layers.{j}.weight"].T
                                                 + tensors[f"blocks.{i}.layers.{j}.bias"])
            lm_head = tensors[f"lm_heads.{i if own_lm_head else 0}.weight"]
            torch.testing.assert_close(x @ lm_head.T, ours[i], rtol=1e-4, atol=1e-4)


def test_exports_neither_engine_loads_are_clear_errors(tiny_llama, tmp_path):
    parts = heads.load_target_parts(tiny_llama)
    with pytest.raises(ValueError, match="cannot export a mtp head for vllm: neither vLLM nor SGLang loads MTP"):
        exporting.export(heads.Mtp.from_target(parts), "vllm", tmp_path / "mtp")
    with pytest.raises(ValueError, match="SGLang and the speculators format have no Medusa drafter: export it --format vllm"):
        exporting.export(heads.Medusa.from_target(parts), "sglang", tmp_path / "medusa")
    biased = perturbed(heads.Eagle.from_target(parts), seed=7)
    with pytest.raises(ValueError, match="train with --model.init_args.fc_bias false"):
        exporting.export(biased, "vllm", tmp_path / "eagle")
    markov = heads.Peagle.from_target(parts, mask_token_id=0, markov_rank=4)
    with pytest.raises(ValueError, match=r"has a Markov head \(markov_rank=4\).* serve it in this engine"):
        exporting.export(markov, "speculators", tmp_path / "peagle")
    assert not any(tmp_path.iterdir()), "a refused export writes nothing"
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="refusing to replace"):
        exporting.export(biased, "sglang", tmp_path / "busy")
    assert (tmp_path / "busy" / "notes.txt").read_text() == "keep me"


def test_the_cli_exports_a_saved_head(tiny_llama, tmp_path, capsys):
    parts = heads.load_target_parts(tiny_llama)
    saved = heads.save(perturbed(heads.Medusa.from_target(parts, num_heads=2), seed=8), tmp_path / "head")
    assert cli_main(["export", str(saved), "--format", "vllm", "--out", str(tmp_path / "out"),
                     "--target", str(tiny_llama)]) == 0
    assert "wrote the medusa head as a vllm draft model" in capsys.readouterr().out
    _, tensors = read(tmp_path / "out")
    assert torch.equal(tensors["lm_heads.0.weight"], parts.lm_head.weight)
    assert cli_main(["export", str(saved), "--format", "sglang", "--out", str(tmp_path / "other")]) == 2
    assert "draftheads export: error: cannot export a medusa head for sglang" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()
    eagle3 = heads.save(heads.Eagle3.from_target(parts, aux_layers=(1, 2, 3)), tmp_path / "eagle3")
    assert cli_main(["export", str(eagle3), "--format", "speculators", "--out", str(tmp_path / "speculators"),
                     "--target", str(tiny_llama), "--num-speculative-tokens", "3"]) == 0
    config, _ = read(tmp_path / "speculators")
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(tiny_llama)
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert config["draftheads"]["format"] == "speculators"


def medusa_over_a_map(folder, seed: int, own_lm_head: bool):
    """The target's parts, a token map of 40 random ids and a perturbed two-head Medusa over it."""
    full = heads.load_target_parts(folder)
    token_map = torch.randperm(full.vocab_size, generator=torch.Generator().manual_seed(seed))[:40]
    parts = heads.load_target_parts(folder)
    parts.lm_head = lm_head_rows(parts.lm_head, token_map)
    head = perturbed(heads.Medusa.from_target(parts, token_map, num_heads=2, own_lm_head=own_lm_head), seed=seed + 1)
    return full, token_map, head


def vllm_block(hidden, tensors, i: int):
    """vLLM's Medusa ResidualBlock i (one layer) over `hidden`, from the exported tensors."""
    return hidden + torch.nn.functional.silu(hidden @ tensors[f"blocks.{i}.layers.0.weight"].T
                                             + tensors[f"blocks.{i}.layers.0.bias"])


def test_a_medusa_head_with_its_own_lm_heads_over_a_token_map_exports_them_over_the_whole_vocabulary(tiny_llama,
                                                                                                    tmp_path):
    """vLLM 0.32 sizes own LM heads by the whole vocabulary and cuts a file's rows to the map's before loading, so
    it loads neither (assert loaded_weight.shape[output_dim] == self.org_vocab_size): the export writes each head over
    the whole vocabulary, the unmapped rows the mean of the mapped ones, whose logit is the mean of theirs and never
    the largest. vLLM's forward (blocks, then each LM head, argmax) drafts what the head drafts."""
    full, token_map, head = medusa_over_a_map(tiny_llama, 3, own_lm_head=True)
    config, tensors = read(exporting.export(head, "vllm", tmp_path / "out"))
    assert config["truncated_vocab_size"] == full.vocab_size and config["original_lm_head"] is False
    assert "token_map" not in tensors
    hidden = inputs(full, seed=5)[1]
    with torch.no_grad():
        ours = head.eval()(hidden)  # [heads, 1, positions, 40]
        for i in range(2):
            x = vllm_block(hidden, tensors, i)
            theirs = x @ tensors[f"lm_heads.{i}.weight"].T  # [1, positions, vocab]
            assert theirs.shape[-1] == full.vocab_size
            torch.testing.assert_close(theirs[..., token_map], ours[i], rtol=1e-4, atol=1e-4)
            assert torch.equal(theirs.argmax(-1), token_map[ours[i].argmax(-1)])


@pytest.mark.parametrize("own_lm_head", [False])
def test_a_medusa_head_over_a_token_map_exports_it_as_vllm_reads_it(own_lm_head, tiny_llama, tmp_path, capsys):
    """vLLM's Medusa with truncated_vocab_size < vocab_size reads the `token_map` tensor and scatters each head's
    logits over the map's rows into the whole vocabulary (-inf elsewhere)."""
    full, token_map, head = medusa_over_a_map(tiny_llama, 9, own_lm_head)
    saved = heads.save(head, tmp_path / "head")
    assert cli_main(["export", str(saved), "--format", "vllm", "--out", str(tmp_path / "out"),
                     "--target", str(tiny_llama)]) == 0
    config, tensors = read(tmp_path / "out")
    assert config["truncated_vocab_size"] == 40 and config["vocab_size"] == full.vocab_size
    assert torch.equal(tensors["token_map"], token_map)
    hidden = inputs(full, seed=11)[1]
    with torch.no_grad():
        ours = head.eval()(hidden)  # [heads, 1, positions, 40]
        for i in range(2):
            x = vllm_block(hidden, tensors, i)
            theirs = torch.full((*x.shape[:-1], full.vocab_size), float("-inf"))
            theirs[..., tensors["token_map"]] = x @ tensors[f"lm_heads.{i if own_lm_head else 0}.weight"].T
            torch.testing.assert_close(theirs[..., token_map], ours[i], rtol=1e-4, atol=1e-4)
            assert torch.isin(theirs.argmax(-1), token_map).all()


def test_exporting_an_eagle1_head_over_a_token_map_says_where_the_map_applies(tiny_llama, tmp_path, capsys):
    parts = heads.load_target_parts(tiny_llama)
    token_map = torch.arange(40)
    parts.lm_head = lm_head_rows(parts.lm_head, token_map)
    saved = heads.save(heads.Eagle.from_target(parts, token_map, fc_bias=False), tmp_path / "head")
    assert cli_main(["export", str(saved), "--format", "vllm", "--out", str(tmp_path / "out")]) == 0
    assert ("trained to draft among the 40 tokens of a token map: SGLang drafts among them given that file "
            "(--speculative-token-map), vLLM over the whole vocabulary") in capsys.readouterr().out
    assert "token_map" not in read(tmp_path / "out")[1]  # vLLM's EAGLE-1 has no map to load


@pytest.mark.parametrize("engine", ["vllm", "speculators"])
@pytest.mark.parametrize("norms", [{"norm_before_fc": True, "norm_output": True}, {"fc_norm": True}])
def test_eagle31_norms_export_as_vllm_and_speculators_read_them(engine, norms, tiny_llama, tmp_path):
    """EAGLE 3.1's options under their names in config.json, their norms as input_norm.weight (over the aux states
    side by side) and fc_norm.{i}.weight (one per aux state), all in the ascending order vLLM captures the aux
    layers in: fuse(aux) read back through the exported tensors is the head's own."""
    parts = heads.load_target_parts(tiny_llama)
    head = perturbed(heads.Eagle3.from_target(parts, aux_layers=(3, 1, 2), **norms), seed=9).eval()
    config, tensors = read(exporting.export(head, engine, tmp_path / "out", verifier=tiny_llama))
    for name in ("norm_before_fc", "fc_norm", "norm_output"):
        assert config[name] is norms.get(name, False)
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    h, eps = parts.hidden_size, parts.layer.rms_norm_eps
    aux = {layer: torch.randn(4, h, generator=torch.Generator().manual_seed(layer)) * 10 for layer in (1, 2, 3)}
    norm = lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
    theirs = torch.cat([aux[i] for i in (1, 2, 3)], dim=-1)
    if "norm_before_fc" in norms:
        theirs = norm(theirs, tensors["input_norm.weight"])
        assert "fc_norm.0.weight" not in tensors
    else:
        theirs = torch.cat([norm(aux[i], tensors[f"fc_norm.{j}.weight"]) for j, i in enumerate((1, 2, 3))], dim=-1)
        assert "input_norm.weight" not in tensors
    with torch.no_grad():
        torch.testing.assert_close(theirs @ tensors["fc.weight"].T, head.fuse([aux[i] for i in (3, 1, 2)]))


def test_eagle31_norms_sglang_lacks_or_a_repeated_aux_layer_are_clear_errors(tiny_llama, tmp_path):
    parts = heads.load_target_parts(tiny_llama)
    with pytest.raises(ValueError, match="EAGLE 3.1's norm_output, which sglang's EAGLE-3 layer does not have: "
                                         "export it --format vllm or --format speculators"):
        exporting.export(heads.Eagle3.from_target(parts, norm_output=True), "sglang", tmp_path / "sglang")
    with pytest.raises(ValueError, match="name a layer twice, and with norm_before_fc or fc_norm its norm cannot be merged"):
        exporting.export(heads.Eagle3.from_target(parts, aux_layers=(2, 2, 1), fc_norm=True), "vllm", tmp_path / "vllm")
    assert not any(tmp_path.iterdir())


def test_exporting_for_vllm_a_head_on_a_target_windowed_everywhere_says_which_window_vllm_runs(tmp_path, capsys):
    """vLLM runs a draft layer that names no window with the target's cache config's (Mistral's): the export says
    so unless the head was trained with that window; gemma-style mixed windows and full attention say nothing."""
    from serving.targets import build_tiny_model

    mistral = build_tiny_model(tmp_path / "mistral", "mistral", sliding_window=16)
    parts = heads.load_target_parts(mistral)
    full = heads.save(heads.Eagle3.from_target(parts, aux_layers=(1, 2, 3)), tmp_path / "full")
    assert cli_main(["export", str(full), "--format", "vllm", "--out", str(tmp_path / "out"),
                     "--target", str(mistral)]) == 0
    assert "note: every layer of the target attends through a sliding window of 16 keys" in capsys.readouterr().out
    windowed = heads.save(heads.Eagle3.from_target(parts, aux_layers=(1, 2, 3), draft_window=16), tmp_path / "windowed")
    assert cli_main(["export", str(windowed), "--format", "speculators", "--out", str(tmp_path / "out2"),
                     "--target", str(mistral)]) == 0
    assert "note:" not in capsys.readouterr().out
