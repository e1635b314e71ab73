"""DSpark in other layouts: speculators' (DSparkSpeculator: DFlash's fields and tensors plus markov_head.* and
confidence_head.proj.*, the fields DSparkSpeculatorConfig names; what vLLM serves as method dspark) and vLLM's own
Qwen3DSparkModel config (target_layer_ids one lower). Every export imports back into the same head, with and without
the confidence head, in both slot layouts, over a token map (markov_w2's rows go out ascending, as d2t); a Markov
head vLLM has no kernel for is a clear error."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import heads
from heads.token_map import lm_head_rows
from serving import targets
from training.cli import main as cli_main
from training.export import export
from training.import_head import import_head

from test_import import assert_same_head, import_args, perturbed, target_parts


def new_dspark(folder, token_map=None, **fields):
    parts = target_parts(folder)
    if token_map is not None:
        parts.lm_head = lm_head_rows(parts.lm_head, token_map)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        head = heads.DSpark.from_target(parts, token_map, num_layers=2, target_layers=(1, 3), block_size=4,
                                        mask_token_id=9, markov_rank=8, **fields)
    return perturbed(head, 7).bind_target(parts)


@pytest.mark.parametrize("layout", ["speculators", "vllm"])
@pytest.mark.parametrize("fields", [{}, dict(sample_from_anchor=False), dict(confidence_head=False),
                                    dict(confidence_with_markov=False)],
                         ids=["defaults", "fill-in", "no-confidence", "confidence-without-markov"])
def test_an_export_imports_back_into_the_same_head(layout, fields, tiny_llama, tmp_path, capsys):
    head = new_dspark(tiny_llama, **fields)
    exported = export(head, layout, tmp_path / "exported", verifier=tiny_llama)
    assert cli_main(import_args(exported, "dspark", tiny_llama, tmp_path / "back")) == 0
    assert f"wrote the {layout} dspark head" in capsys.readouterr().out
    assert_same_head(heads.load(tmp_path / "back", targets.fingerprint(tiny_llama)), head)


def test_the_layouts_name_what_speculators_and_vllm_read(tiny_llama, tmp_path):
    head = new_dspark(tiny_llama)
    spec = export(head, "speculators", tmp_path / "spec", verifier=tiny_llama)
    config = json.loads((spec / "config.json").read_text())
    assert config["speculators_model_type"] == "dspark" and config["architectures"] == ["DSparkSpeculator"]
    assert config["speculators_config"]["algorithm"] == "dspark"
    assert config["aux_hidden_state_layer_ids"] == [1, 3] and config["mask_token_id"] == 9 and config["block_size"] == 4
    assert (config["markov_rank"], config["markov_head_type"], config["sample_from_anchor"]) == (8, "vanilla", True)
    assert config["enable_confidence_head"] is True and config["confidence_head_with_markov"] is True
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4  # B drafts from the anchor
    stored = load_file(str(spec / "model.safetensors"))
    assert stored["markov_head.markov_w1.weight"].shape == (head.config.vocab_size, 8)
    assert stored["markov_head.markov_w2.weight"].shape == (head.config.vocab_size, 8)
    assert stored["confidence_head.proj.weight"].shape == (1, 64 + 8) and stored["confidence_head.proj.bias"].shape == (1,)
    torch.testing.assert_close(stored["embed_tokens.weight"], head.target.embed.weight)
    native = export(head, "vllm", tmp_path / "native")
    config = json.loads((native / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["model_type"] == "qwen3"
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3] and config["target_layer_ids"] == [0, 2]
    assert config["dspark_bonus_anchor"] is False and config["markov_rank"] == 8
    assert not any(name.startswith(("embed_tokens", "lm_head")) for name in load_file(str(native / "model.safetensors")))


def test_vllms_config_naming_only_target_layer_ids_imports(tiny_llama, tmp_path):
    head = new_dspark(tiny_llama)
    native = export(head, "vllm", tmp_path / "native")
    config = json.loads((native / "config.json").read_text())
    del config["eagle_aux_hidden_state_layer_ids"], config["draftheads"]
    (native / "config.json").write_text(json.dumps(config))
    imported, _ = import_head(native, "dspark", tiny_llama)
    assert imported.config.target_layers == (1, 3)


@pytest.mark.parametrize("layout", ["speculators", "vllm"])
def test_a_head_over_a_token_map_exports_markov_rows_as_the_draft_vocabulary(layout, tiny_llama, tmp_path):
    """vLLM adds W2's bias in draft-vocabulary space and scatters by d2t: the export's markov_w2 rows follow d2t's
    ascending ids, so the draft vLLM takes is the head's; it imports back into a head that drafts the same."""
    vocab = target_parts(tiny_llama).vocab_size
    token_map = torch.randperm(vocab, generator=torch.Generator().manual_seed(2))[:50]
    head = new_dspark(tiny_llama, token_map)
    out = export(head, layout, tmp_path / "out", verifier=tiny_llama)
    stored = load_file(str(out / "model.safetensors"))
    targets_of = torch.arange(50) + stored["d2t"]
    assert torch.equal(targets_of, token_map.sort().values)
    rows = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    previous = torch.tensor([4, 77, 200])
    with torch.no_grad():
        embed = head.markov_embed(previous)
        ours = head.markov_logits(rows, embed)  # [3, 50] in the map's order
        theirs = torch.full((3, vocab), float("-inf"))
        theirs[:, targets_of] = (head.norm(rows) @ stored["lm_head.weight"].T
                                 + stored["markov_head.markov_w1.weight"][previous] @ stored["markov_head.markov_w2.weight"].T)
        assert torch.equal(theirs.argmax(-1), token_map[ours.argmax(-1)])
        back, _ = import_head(out, "dspark", tiny_llama)
        full = target_parts(tiny_llama)
        full.lm_head = lm_head_rows(full.lm_head, back.token_map)
        back.bind_target(full)
        torch.testing.assert_close(back.markov_logits(rows, back.markov_embed(previous)), ours[:, token_map.argsort()])


@pytest.mark.parametrize("change, message", [
    (dict(markov_head_type="gated"), r"markov_head_type is 'gated', but this project's DSpark \(and vLLM's\) has the "
                                     r"vanilla first-order Markov head only"),
    (dict(markov_rank=0), r"markov_rank is 0 \(no Markov head\): a DFlash drafter, import it with --format dflash"),
])
def test_a_markov_head_we_cannot_run_is_a_clear_error(change, message, tiny_llama, tmp_path):
    exported = export(new_dspark(tiny_llama), "speculators", tmp_path / "exported", verifier=tiny_llama)
    config = json.loads((exported / "config.json").read_text())
    (exported / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=message):
        import_head(exported, "dspark", tiny_llama)


def test_a_format_without_dspark_names_the_ones_with_it(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match=r"cannot export a dspark head for z-lab: vLLM serves DSpark from the "
                                         r"speculators format or its own Qwen3DSparkModel config"):
        export(new_dspark(tiny_llama), "z-lab", tmp_path / "out")
