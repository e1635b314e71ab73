"""training/check_causes.py: the causes `draftheads check` names by reading a head's export (as vLLM's model reads
it) against the head and the targets. A healthy export of every kind vLLM serves has none; each seeded breakage is
named: fc's blocks in another order than vLLM captures the layers, a nonzero fc bias vLLM's model has no parameter
for, another rope in the export or in the target vLLM serves; and a head folder whose aux layers differ from those
its fit trained on."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import heads
from heads.token_map import lm_head_rows
from training import export as exporting
from training.check_causes import export_causes, head_causes, target_causes

from test_import import perturbed, target_parts


def bound(head, parts):
    if head.token_map is not None:
        parts.lm_head = lm_head_rows(parts.lm_head, head.token_map)
    return head.bind_target(parts)


def healthy(kind: str, target):
    """A perturbed head of `kind` bound to the target, with its fused layers out of order where it has them (the
    export must reorder them as vLLM captures), and the format vLLM serves it from."""
    parts = target_parts(target)
    ids = torch.arange(1, parts.vocab_size, 3)
    if kind == "eagle3":
        head = heads.Eagle3.from_target(parts, draft_token_ids=ids, aux_layers=(3, 1, 2), norm_before_fc=True)
    elif kind == "peagle":
        head = heads.Peagle.from_target(parts, draft_token_ids=ids, aux_layers=(3, 1, 2), mask_token_id=7)
    elif kind == "eagle":
        head = heads.Eagle.from_target(parts, fc_bias=False)
    elif kind == "dflash":
        head = heads.DFlash.from_target(parts, target_layers=(1, 3), block_size=5, mask_token_id=9)
    else:
        head = heads.Medusa.from_target(parts, num_heads=3)
    return bound(perturbed(head, 3), target_parts(target)), "speculators" if kind in ("peagle", "dflash") else "vllm"


def exported(head, layout, target, folder):
    return exporting.export(head, layout, folder, verifier=target)


def rewrite(folder, config=None, tensors=None):
    """Edit an export in place: config.json's fields and the weights' tensors (None: delete)."""
    if config:
        data = json.loads((folder / "config.json").read_text())
        data.update(config)
        (folder / "config.json").write_text(json.dumps(data))
    if tensors:
        weights = load_file(str(folder / "model.safetensors"))
        weights.update(tensors)
        save_file({name: t.contiguous() for name, t in weights.items() if t is not None}, str(folder / "model.safetensors"),
                  {"format": "pt"})


@pytest.mark.parametrize("kind", ["eagle3", "peagle", "eagle", "dflash", "medusa"])
def test_a_healthy_export_shows_no_cause(kind, tiny_llama, tmp_path):
    head, layout = healthy(kind, tiny_llama)
    assert export_causes(head, exported(head, layout, tiny_llama, tmp_path / "out"), tiny_llama, tiny_llama) == []


def test_fc_blocks_in_another_order_than_vllm_captures_are_named(tiny_llama, tmp_path):
    """vLLM captures the listed aux layers ascending whatever their order: listing them reversed is harmless, fc's
    blocks reversed with them (an exporter that keeps the head's order for a head trained on 3, 2, 1) is not."""
    parts = target_parts(tiny_llama)
    head = bound(perturbed(heads.Eagle3.from_target(parts, aux_layers=(1, 2, 3)), 4), parts)
    folder = exported(head, "vllm", tiny_llama, tmp_path / "out")
    reversed_ids = {"eagle_aux_hidden_state_layer_ids": [3, 2, 1],
                    "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [3, 2, 1]}}
    rewrite(folder, reversed_ids)
    assert export_causes(head, folder, tiny_llama, tiny_llama) == []
    fc = load_file(str(folder / "model.safetensors"))["fc.weight"]
    rewrite(folder, tensors={"fc.weight": torch.cat(fc.chunk(3, dim=1)[::-1], dim=1)})
    [cause] = export_causes(head, folder, tiny_llama, tiny_llama)
    assert cause.startswith("aux layer order: vLLM captures the export's layer ids [3, 2, 1] ascending ([1, 2, 3])")
    assert "the block trained on layer 3 reads layer 1" in cause and "layer 2" not in cause.split("but")[1]


def test_a_nonzero_fc_bias_vllm_has_no_parameter_for_is_named(tiny_llama, tmp_path):
    """EAGLE-1 with fc's bias (the EAGLE repository's, SGLang's): vLLM's EagleLlamaForCausalLM has none and its
    loader drops the tensor. The head's nonzero bias is named as lost whether the file holds it, a zero one, or
    none; a zero bias in the head changes nothing and is not named."""
    parts = target_parts(tiny_llama)
    biased = bound(perturbed(heads.Eagle.from_target(parts, fc_bias=True), 5), parts)
    plain = heads.Eagle.from_target(parts, fc_bias=False)
    plain.load_state_dict({n: t for n, t in biased.state_dict().items() if n != "fc.bias"})
    folder = exported(bound(plain, target_parts(tiny_llama)), "vllm", tiny_llama, tmp_path / "out")
    zero = bound(heads.Eagle.from_target(parts, fc_bias=True), target_parts(tiny_llama))
    zero.load_state_dict({**plain.state_dict(), "fc.bias": torch.zeros_like(biased.fc.bias)})
    rewrite(folder, tensors={"fc.bias": torch.zeros_like(biased.fc.bias)})
    assert export_causes(zero, folder, tiny_llama, tiny_llama) == []
    for bias in (torch.zeros_like(biased.fc.bias), biased.fc.bias.detach()):  # the head's is lost either way
        rewrite(folder, tensors={"fc.bias": bias})
        [cause] = export_causes(biased, folder, tiny_llama, tiny_llama)
        assert cause.startswith("the export holds fc.bias, which vLLM's EagleLlamaForCausalLM has no parameter for: "
                                "vLLM's weight loader drops an unexpected bias silently")
    rewrite(folder, tensors={"fc.bias": None})
    [missing] = export_causes(biased, folder, tiny_llama, tiny_llama)
    assert missing == "the head's fc.bias (nonzero) is not in the export: vLLM drafts without it"


def test_rope_settings_of_the_export_or_of_the_served_target_are_named(tiny_llama, tmp_path):
    head, layout = healthy("eagle3", tiny_llama)
    folder = exported(head, layout, tiny_llama, tmp_path / "out")
    rewrite(folder, {"rope_theta": 500000.0})
    [cause] = export_causes(head, folder, tiny_llama, tiny_llama)
    assert cause.startswith("the export's rope_theta 500000 against the head's rope_theta 10000")
    served = tmp_path / "served-target"
    shutil.copytree(tiny_llama, served)
    config = json.loads((served / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = 100.0
    (served / "config.json").write_text(json.dumps(config))
    assert target_causes(tiny_llama, tiny_llama) == []
    [cause] = target_causes(tiny_llama, served)
    assert cause.startswith(f"vLLM serves the target {served} with rope_theta 100, the engine ran {tiny_llama} with "
                            "rope_theta 10000")


def test_head_folder_aux_layers_other_than_the_fit_trained_on_are_named(tiny_llama):
    trained = {"kind": "eagle3", "aux_layers": [1, 2, 3], "norm_before_fc": False, "rope_theta": 10000.0,
               "rope_scaling": None, "metadata": {"training": {"hparams": {
                   "aux_layers": [1, 2, 3], "norm_before_fc": False, "learning_rate": 0.01, "intermediate_size": None}}}}
    assert head_causes(trained, tiny_llama) == []
    [cause] = head_causes({**trained, "aux_layers": [3, 2, 1]}, tiny_llama)
    assert cause.startswith("the head's config.json fuses aux_layers [3, 2, 1], its fit trained on [1, 2, 3]")
    [cause] = head_causes({**trained, "norm_before_fc": True}, tiny_llama)
    assert cause == "the head's config.json says norm_before_fc: True, its fit trained with False"
